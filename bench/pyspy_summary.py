"""Where a scheduler's host time goes, from py-spy's collapsed stacks
(`py-spy record --format raw --idle`): the share of samples in each
function (inclusive: the function or anything it called), and where the
leaf frames are, grouped so that a host wait on the GPU shows by name.

    python bench/pyspy_summary.py RAW.txt [--top 40] [--out summary.json]

Each line of RAW.txt is `frame;frame;...;frame COUNT`, outermost first
(py-spy's raw format). A frame reads `function (file:line)`; the summary
keys functions by `function (dir/file)`, lines dropped, so a loop's many lines
count once; the leaves keep their lines. Only the scheduler's main thread matters for a forward's host
time: pass --thread to keep the stacks whose first frame names it (py-spy
puts `thread (0x...)` first with --threads).

Used by bench/host_probe.sh and bench/step_profile.py --pyspy (issue #29:
a mixed batch's ~10 ms of host time a step with the GPU idle).
"""

from __future__ import annotations

import argparse
import collections
import json
import re

FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^():]+)(?::(?P<line>\d+))?\)$")

#: Frames at a stack's end (its last three) that mean the host waits for
#: the GPU (or for anything).
WAITS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize", "cuStreamSynchronize",
         "cuEventSynchronize", "cudaMemcpy", "_local_scalar_dense", "item", "tolist", "synchronize",
         "poll", "select", "epoll_wait", "recv", "sleep", "wait")


def frame_key(frame: str, line: bool = False) -> str:
    """`function (dir/file)` of a py-spy frame; with `line`, its line too
    (a leaf: which statement of the function the samples are in)."""
    m = FRAME.match(frame.strip())
    if not m:
        return frame.strip()
    short = "/".join(m.group("file").split("/")[-2:])
    at = f":{m.group('line')}" if line and m.group("line") else ""
    return f"{m.group('func')} ({short}{at})"


def call_name(key: str) -> str:
    """The bare name a frame calls: `Event.synchronize` -> `synchronize`,
    `at::native::_local_scalar_dense` -> `_local_scalar_dense`. WAITS match
    it whole: a substring match counted `_select_prompt` as a `select`."""
    func = key.split(" (")[0]
    return func.split("::")[-1].split(".")[-1]


def read(path: str, thread: str | None = None) -> list[tuple[list[str], int]]:
    stacks = []
    with open(path) as f:
        for line in f:
            line = line.rstrip("\n")
            if not line:
                continue
            frames, _, count = line.rpartition(" ")
            if not count.isdigit():
                continue
            parts = frames.split(";")
            if thread is not None and (not parts or thread not in parts[0]):
                continue
            stacks.append((parts, int(count)))
    return stacks


def summarize(stacks: list[tuple[list[str], int]], top: int = 40) -> dict:
    total = sum(n for _, n in stacks) or 1
    inclusive: collections.Counter = collections.Counter()
    leaves: collections.Counter = collections.Counter()
    waits: collections.Counter = collections.Counter()
    for frames, n in stacks:
        keys = [frame_key(f) for f in frames]
        for key in set(keys):  # a recursive function counts once per sample
            inclusive[key] += n
        leaf = keys[-1] if keys else "?"
        leaves[frame_key(frames[-1], line=True) if frames else "?"] += n
        wait = next((w for w in WAITS if any(w == call_name(k) for k in keys[-3:])), None)
        if wait:
            # The innermost kvsieve or sglang frame above the wait: who waits.
            owner = next((k for k in reversed(keys) if "kvsieve" in k or "radix_ext" in k or "policies" in k
                          or "sglang" in k or "srt/" in k), leaf)
            waits[f"{wait} <- {owner}"] += n

    def share(counter):
        return [{"name": k, "share": round(v / total, 4), "samples": v} for k, v in counter.most_common(top)]
    return {"samples": total, "inclusive": share(inclusive), "leaves": share(leaves), "waits": share(waits)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("raw")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--thread", default=None, help="keep stacks whose first frame contains this")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    result = summarize(read(args.raw, args.thread), args.top)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    print(f"{result['samples']} samples")
    for part in ("inclusive", "waits", "leaves"):
        print(f"-- {part}")
        for row in result[part][:args.top]:
            print(f"{100 * row['share']:6.1f}%  {row['name']}")


if __name__ == "__main__":
    main()
