"""`kvsieve calibrate auto --model DIR`: measure the quality-vs-KV curves that
`kv_policy: {"name": "auto", ...}` chooses from (service/auto_policy.py),
and store them as the ("auto", model) calibration artifact.

It runs the accuracy grid of bench/eval (a small one by default: a few math
problems, needles and delayed associations, every compressing policy at
budget_ratio 0.1, 0.25 and 0.5, every prompt compressed) through a real
`kvsieve serve` on DIR (or the server at --url), with a progress bar and a
resumable results file, then keeps one point per (policy, budget). The
harness lives in the source checkout (bench/eval), not in the installed
package: run this from a checkout (`pip install -e .`, as scripts/setup.sh does).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

DEFAULT_BUDGETS = "r0.1,r0.25,r0.5"


def add_parser(kinds) -> None:
    a = kinds.add_parser("auto", help='the curves of kv_policy {"name": "auto"}: a small accuracy grid per policy '
                                      'and budget, stored as ("auto", model)')
    a.add_argument("--model", help="local HF checkpoint directory (default: the embedded SmolLM2-135M-Instruct)")
    a.add_argument("--name", help="model id to store it under (default: the id `kvsieve serve` gives it)")
    a.add_argument("--url", help="measure on this running kvsieve server (serving --model) instead of starting one")
    a.add_argument("--policies", default="all", help="comma list (default: every compressing policy)")
    a.add_argument("--budgets", default=DEFAULT_BUDGETS,
                   help=f"comma list of N (tokens) or rX (budget_ratio) (default {DEFAULT_BUDGETS})")
    a.add_argument("--tasks", default="math,needle,da")
    a.add_argument("--math", type=int, default=6, help="math problems (default 6)")
    a.add_argument("--math-max-tokens", type=int, default=256)
    a.add_argument("--needle-lengths", default="1024", help="filler tokens, comma list (default 1024)")
    a.add_argument("--needle-depths", default="0.25,0.75")
    a.add_argument("--da-distances", default="1024")
    a.add_argument("--da-samples", type=int, default=1)
    a.add_argument("--concurrency", type=int, default=4, help="requests in flight (default 4)")
    a.add_argument("--results", help="the grid's results file, resumed when it exists "
                                     "(default: ~/.cache/kvsieve/auto-<name>.json)")
    a.add_argument("--from-results", metavar="FILE",
                   help="build the points from this accuracy-grid results file (python -m bench.eval run) "
                        "instead of running a grid; its budgets N and rX become points")
    a.add_argument("--artifact-out", metavar="PATH",
                   help="also write the artifact to this JSON file (e.g. service/calibrations/auto/<model>.json, "
                        "which kvsieve ships: a server without a store artifact for the model reads it)")
    a.add_argument("--config", help="YAML settings file (store.url)")


def _harness():
    """bench.eval from the source checkout this package was installed from."""
    try:
        import bench.eval.__main__ as harness  # run from the checkout's root
        return harness
    except ImportError:
        pass
    import kvsieve

    root = Path(kvsieve.__file__).resolve().parent.parent
    if not (root / "bench" / "eval" / "runner.py").exists():
        return None
    sys.path.insert(0, str(root))
    import bench.eval.__main__ as harness

    return harness


def run(args, open_store) -> int:
    harness = _harness()
    if harness is None:
        print("kvsieve calibrate auto: the accuracy harness (bench/eval) is not here: run it from a kvsieve "
              "source checkout", file=sys.stderr)
        return 2
    from kvsieve.policies import get_policy, policy_names

    from bench.eval.curves import QUALITY_DEFINITION, points
    from bench.eval.runner import machine, parse_budget

    from .auto_policy import ARTIFACT_VERSION
    from .default_model import DEFAULT_MODEL_NAME, cache_dir, ensure_default_model

    for b in args.budgets.split(","):
        try:
            kind, _ = parse_budget(b.strip())
        except ValueError as exc:
            print(f"kvsieve calibrate auto: --budgets: {exc}", file=sys.stderr)
            return 2
        if kind not in ("abs", "ratio"):
            print(f"kvsieve calibrate auto: --budgets: {b!r}: a point needs a budget a request can carry "
                  f"(N tokens or rX)", file=sys.stderr)
            return 2
    model_dir = str(Path(args.model).resolve()) if args.model else str(ensure_default_model())
    name = args.name or (Path(model_dir).name if args.model else DEFAULT_MODEL_NAME)
    if args.from_results:
        return _from_results(args, name, open_store)
    policies = [p for p in policy_names() if get_policy(p).compresses] if args.policies == "all" else \
        [p.strip() for p in args.policies.split(",") if p.strip()]
    results = Path(args.results) if args.results else cache_dir() / f"auto-{name}.json"
    results.parent.mkdir(parents=True, exist_ok=True)
    argv = ["run", "--out", str(results), "--model", model_dir, "--tasks", args.tasks,
            "--policies", ",".join(policies), "--budgets", args.budgets, "--math", str(args.math),
            "--math-max-tokens", str(args.math_max_tokens), "--needle-lengths", args.needle_lengths,
            "--needle-depths", args.needle_depths, "--da-distances", args.da_distances,
            "--da-samples", str(args.da_samples), "--concurrency", str(args.concurrency),
            "--compress-prompt", "always"]
    if args.url:
        argv += ["--url", args.url]
    print(f"auto calibration of {name}: {len(policies)} policies x {args.budgets} on {args.tasks} "
          f"(results: {results})", file=sys.stderr)
    code = harness.main(argv)
    if code:
        return code
    data = json.loads(results.read_text())
    pts = points(data, compress_prompt=True)
    artifact = {
        "model": name, "version": ARTIFACT_VERSION, "created": time.time(), "machine": machine(),
        "quality": QUALITY_DEFINITION, "kv_fraction": "KV held at the end of a request over the full run's",
        "tasks_config": data["meta"].get("tasks_config"), "policies": policies, "budgets": args.budgets,
        "points": pts,
    }
    return _store(args, name, artifact, open_store)


def _store(args, name: str, artifact: dict, open_store) -> int:
    from .auto_policy import ARTIFACT_KIND, check_artifact

    check_artifact(artifact)
    open_store().put_artifact(ARTIFACT_KIND, name, artifact)
    pts = artifact["points"]
    print(f"auto calibration of {name}: {len(pts)} points stored as ({ARTIFACT_KIND!r}, {name!r})")
    if args.artifact_out:
        out = Path(args.artifact_out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(artifact, indent=1) + "\n")
        print(f"auto calibration of {name}: artifact written to {out}")
    for p in sorted(pts, key=lambda p: p["kv_fraction"]):
        print(f"  {json.dumps(p['kv_policy'])}: kv {p['kv_fraction']:.3f}, quality {p['quality']:.3f}")
    return 0


def _from_results(args, name: str, open_store) -> int:
    """The artifact from a grid that already ran. A point is one kv_policy
    object for every task, so every task of the file must have had its
    prompt compressed the same way (--compress-prompt always, or only the
    needle and DA tasks, which the harness always compresses)."""
    if _harness() is None:
        print("kvsieve calibrate auto: the accuracy harness (bench/eval) is not here: run it from a kvsieve "
              "source checkout", file=sys.stderr)
        return 2
    from bench.eval.curves import QUALITY_DEFINITION, points
    from bench.eval.runner import machine
    from bench.eval.tasks import COMPRESS_PROMPT

    from .auto_policy import ARTIFACT_VERSION

    path = Path(args.from_results)
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        print(f"kvsieve calibrate auto: --from-results: {exc}", file=sys.stderr)
        return 2
    tasks = sorted(data.get("items", {}))
    mode = data.get("meta", {}).get("tasks_config", {}).get("compress_prompt", "task")
    flags = {True} if mode == "always" else {COMPRESS_PROMPT.get(t) for t in tasks}
    if len(flags) != 1 or None in flags:
        print(f"kvsieve calibrate auto: --from-results: {path} mixes tasks whose prompts were compressed and "
              f"tasks that followed each policy's default ({', '.join(tasks)}); a point needs one kv_policy for "
              f"every task: run the grid with --compress-prompt always, or on needle,da only", file=sys.stderr)
        return 2
    pts = points(data, compress_prompt=flags.pop())
    meta = data.get("meta", {})
    artifact = {
        "model": name, "version": ARTIFACT_VERSION, "created": time.time(), "machine": meta.get("machine", machine()),
        "quality": QUALITY_DEFINITION, "kv_fraction": "KV held at the end of a request over the full run's",
        "tasks_config": meta.get("tasks_config"), "tasks": tasks, "from_results": str(path),
        "grid_commands": [r.get("command") for r in meta.get("runs", [])],
        "policies": sorted({p["kv_policy"]["name"] for p in pts}),
        "budgets": ",".join(sorted({str(p["kv_policy"].get("budget", p["kv_policy"].get("budget_ratio")))
                                    for p in pts if p["kv_policy"]["name"] != "full"})),
        "points": pts,
    }
    return _store(args, name, artifact, open_store)
