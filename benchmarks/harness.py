"""What every benchmark shares: the machine it ran on, a wait for a quiet machine, percentiles,
the tiny model, common options and the results file.

The machine may be shared (CI runners, a laptop with a browser open): the CPU time other
processes use is measured from /proc around each measure (`cpu_snapshot`, `other_cores`), and
a benchmark waits a bounded time for a quiet machine before each run (`wait_quiet`). Raw
numbers go to `benchmarks/results/NAME.json` (gitignored); docs/benchmarks.md holds the
current tables.

Importing this module puts the repository and `tests/` (for `support`) on `sys.path`, so a
benchmark runs as `python benchmarks/bench_x.py` from a checkout.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"
LOAD_SAMPLE_SECONDS = 2.0

for _path in (ROOT / "tests", ROOT):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))


# ------------------------------------------------------------------ the machine


def machine() -> dict[str, Any]:
    """The facts a result needs beside it: cores, CPU model, platform, versions."""
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    return {
        "nproc": len(os.sched_getaffinity(0)),
        "cpu": cpu,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "executable": sys.executable,
        "torch": metadata.version("torch"),
        "demucs": metadata.version("demucs"),
    }


def cpu_snapshot() -> tuple[float, float]:
    """(busy CPU seconds of the whole machine, CPU seconds of this process, its reaped children
    and its live children); other users of the machine = the difference of the deltas."""
    tick = os.sysconf("SC_CLK_TCK")
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    busy = sum(int(fields[i]) for i in (0, 1, 2, 5, 6, 7)) / tick
    t, me = os.times(), str(os.getpid())
    ours = t.user + t.system + t.children_user + t.children_system
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parts = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if parts[1] == me:
            ours += (int(parts[11]) + int(parts[12])) / tick
    return busy, ours


def other_cores(before: tuple[float, float], wall: float) -> float:
    """Cores that processes outside this benchmark kept busy, on average, since `before`."""
    after = cpu_snapshot()
    return max(0.0, (after[0] - before[0]) - (after[1] - before[1])) / wall


def wait_quiet(limit: float, patience: float) -> float | None:
    """Wait (at most `patience` s) until other processes use under `limit` cores, measured over
    LOAD_SAMPLE_SECONDS. Returns the last measurement; None (no wait) when `limit` is 0."""
    if limit <= 0:
        return None
    deadline = time.monotonic() + patience
    while True:
        before = cpu_snapshot()
        time.sleep(LOAD_SAMPLE_SECONDS)  # the measurement window, not a wait for a condition
        other = other_cores(before, LOAD_SAMPLE_SECONDS)
        if other < limit or time.monotonic() > deadline:
            return other


def wait_until(
    predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.1
) -> float:
    """Poll `predicate` until it is true; the seconds it took. RuntimeError after `timeout`
    seconds, naming `what` was awaited."""
    started = time.monotonic()
    while not predicate():
        if time.monotonic() - started > timeout:
            raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)
    return time.monotonic() - started


def with_load(fn: Callable[..., Any], *args: Any) -> tuple[Any, float]:
    """fn(*args) and the cores other processes kept busy meanwhile."""
    t, cpu = time.monotonic(), cpu_snapshot()
    result = fn(*args)
    return result, other_cores(cpu, time.monotonic() - t)


# ------------------------------------------------------------------ figures


def percentile(values: list[float], pct: float) -> float:
    """Nearest rank: the value that `pct` % of the trials do not exceed (p95 of 20 trials is
    the 19th)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(pct / 100 * len(ordered)) - 1)]


def p95(values: list[float]) -> float:
    return percentile(values, 95)


def median(values: list[float]) -> float:
    return statistics.median(values)


def summary(values: list[float]) -> dict[str, float]:
    """n, median, p95, min and max of one measure."""
    return {
        "n": len(values),
        "median": statistics.median(values),
        "p95": p95(values),
        "min": min(values),
        "max": max(values),
    }


# ------------------------------------------------------------------ set-up and results


def tiny_model(repo: Path, name: str = "tiny") -> Path:
    """The tiny untrained model in `repo`, built in a child process (no torch here)."""
    subprocess.run(
        [sys.executable, "-m", "stemdeck_watch.workers.tinymodel", str(repo), "--name", name],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    return repo


def parser(
    doc: str | None, name: str, *, quiet: bool = False, patience: float = 120.0
) -> argparse.ArgumentParser:
    """An argument parser with the options every benchmark has: `--out` (the results file,
    default benchmarks/results/NAME.json) and, with `quiet`, `--quiet` and `--patience` (the
    wait for a quiet machine before each measure)."""
    parser = argparse.ArgumentParser(description=(doc or "").split("\n\n")[0])
    parser.add_argument(
        "--out", type=Path, default=RESULTS / f"{name}.json", help="raw results (JSON)"
    )
    if quiet:
        parser.add_argument(
            "--quiet",
            type=float,
            default=0.3,
            metavar="CORES",
            help="before each measure wait until other processes use fewer cores (0: never wait)",
        )
        parser.add_argument("--patience", type=float, default=patience, help="longest such wait, s")
    return parser


def write_results(path: Path, results: dict[str, Any]) -> Path:
    """The raw results as indented JSON (the folder made if needed; what JSON cannot hold,
    such as a path, as its text)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2, default=str) + "\n")
    return path
