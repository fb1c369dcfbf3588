"""Work beside the worker: the same ten clips through the service with
`queue.work_beside = "on"` (decode ahead and publish behind), `"auto"` (on a CPU the worker
fills: "on" without the beat grid, "off" with it) and `"off"`, in turns whose order
alternates, so that a slow spell of a shared machine hits every setting alike. With the
output steps on, one untimed run first loads librosa (3-9 s once per process, which would
otherwise land on the first turn's first setting).

Reported per setting (medians over the runs): (a) as in bench_throughput (last rename into
the inbox to the last song published, settle wait included), the worker's separation seconds
summed over the clips (from the manifests), and the worker's idle fraction between its first
and last separation. With "on" the worker should hardly ever wait (target <= 3 % idle); whether
that makes the service faster depends on a free core and on the beat grid (its tracker is
the heaviest work beside the worker).

    python benchmarks/bench_work_beside.py [--turns 5] [--clips 10] [--seconds 10]
"""

from __future__ import annotations

import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_throughput import run_service, tiny_model_and_clips
from harness import machine, parser as bench_parser, wait_quiet, write_results

MODES = ("on", "auto", "off")


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__, "work_beside", quiet=True, patience=120)
    parser.add_argument("--turns", type=int, default=5, help="turns of the three settings")
    parser.add_argument("--clips", type=int, default=10)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--settle", type=float, default=1.0)
    parser.add_argument(
        "--output-steps",
        action="store_true",
        help="beat grid, preview and tags on (the defaults), as a user runs it",
    )
    args = parser.parse_args(argv)
    began = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="stemdeck-beside-"))
    runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
    try:
        repo, clips = tiny_model_and_clips(work, args.clips, args.seconds)
        if args.output_steps:  # a service that has published a song before: librosa loaded
            run_service(clips[:1], repo, work / "warm-up", args.settle, "off", True)
            shutil.rmtree(work / "warm-up", ignore_errors=True)
        for n in range(args.turns):
            for mode in MODES if n % 2 == 0 else MODES[::-1]:  # turns: on auto off off auto on
                quiet = wait_quiet(args.quiet, args.patience)
                a = run_service(
                    clips, repo, work / f"{mode}{n}", args.settle, mode, args.output_steps
                )
                runs[mode].append(
                    {
                        "a": a["seconds"],
                        "separate": a["stage_sums"]["separate"],
                        "idle": a["worker_idle"]["fraction"],
                        "other_cores": a["other_cores"],
                        "quiet_before": quiet,
                    }
                )
                print(
                    f"turn {n + 1}/{args.turns} {mode}: a {a['seconds']:.2f} s, separate "
                    f"{a['stage_sums']['separate']:.2f} s, worker idle "
                    f"{100 * a['worker_idle']['fraction']:.1f} %",
                    file=sys.stderr,
                    flush=True,
                )
                shutil.rmtree(work / f"{mode}{n}", ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    def median(mode: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[mode])

    info = machine()
    print(
        f"Work beside the worker: {args.clips} clips x {args.seconds:g} s, tiny model, CPU, "
        f"{args.turns} turns (order alternating), output steps "
        f"{'on' if args.output_steps else 'off'}; {info['nproc']} cores ({info['cpu']}), "
        f"torch {info['torch']}\n"
    )
    print(
        "| `queue.work_beside` | (a) median s | separate, s (summed) | worker idle | "
        "other procs, cores |"
    )
    print("|---|---:|---:|---:|---:|")
    for mode in MODES:
        print(
            f"| `{mode}` | {median(mode, 'a'):.2f} | {median(mode, 'separate'):.2f} | "
            f"{100 * median(mode, 'idle'):.1f} % | {median(mode, 'other_cores'):.2f} |"
        )
    ratio = {mode: median(mode, "a") / median("off", "a") for mode in MODES}
    print(
        f"\n(a) on / off = {ratio['on']:.3f}; auto / off = {ratio['auto']:.3f}; separation "
        f"on / off = {median('on', 'separate') / median('off', 'separate'):.3f}"
    )
    total = time.monotonic() - began
    print(f"total benchmark time {total:.0f} s")
    results = args.out.with_name("work_beside_output_steps.json") if args.output_steps else args.out
    write_results(
        results,
        {
            "machine": info,
            "args": vars(args),
            "runs": runs,
            "a_ratio_to_off": ratio,
            "total_seconds": total,
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
