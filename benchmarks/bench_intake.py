"""Intake at scale: how fast a dropped file becomes a job, and a 10,000-song library at once.

Default watch settings unless given, the resident worker idle with the tiny model, the queue
paused so nothing separates:

(1) latency, file closed -> job queued (a real Service in this process): 20 files written
    one at a time (open, write, close), native and polling; p95 targets: native <= settle +
    0.3 s, polling <= poll_interval + settle + 0.3 s (a close event on Linux shortens the
    settle to 1 s, never below it).
(2) 10,000 small files renamed into the inbox within a second, a service running in a
    process of its own (`stemdeck-watch run`, the code of this checkout or of `--before`),
    measured from the outside: the time until every one is accounted for (a queued job or
    waiting, as the registry says; `--pending` raises queue.max_pending_files so that every
    file becomes a queued job), the service's CPU seconds meanwhile, its peak RSS (and that
    of the service with its worker), every `stemdeck-watch status --json` run back to back
    meanwhile (a real CLI process, timed), and the service's CPU use once everything is in.

    python benchmarks/bench_intake.py [--files 10000] [--latency 20] [--modes native]
        [--runs 3] [--before /tmp/before] [--pending 10000] [--py-spy FOLDER]

`--before` takes a checkout of an earlier commit (`git worktree add /tmp/before COMMIT`):
the runs alternate between the two, which one goes first alternating too, so a busy spell
of a shared machine falls on both; compare medians.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import tomli_w

from harness import (
    ROOT,
    machine,
    median,
    p95,
    parser as bench_parser,
    tiny_model,
    wait_until,
    write_results,
)
from support.helpers import config_data

from stemdeck_watch.core.config import load_settings
from stemdeck_watch.core.events import JobChanged
from stemdeck_watch.core.jobs import JobState
from stemdeck_watch.service import Service


def start(root: Path, repo: Path, mode: str) -> tuple[Service, Path]:
    data = config_data(root, repo, watch={"mode": mode})
    data["watch"].pop("settle_seconds")  # the default
    data["api"]["enabled"] = False
    data["tray"]["enabled"] = False
    config = root / "stemdeck.toml"
    root.mkdir(parents=True, exist_ok=True)
    config.write_text(tomli_w.dumps(data))
    service = Service(load_settings(config))
    service.start()
    service.scheduler.pause("user")
    return service, config


def latency(root: Path, repo: Path, mode: str, count: int) -> list[float]:
    service, _ = start(root, repo, mode)
    queued: dict[str, float] = {}
    service.bus.subscribe(
        JobChanged,
        lambda e: (
            queued.setdefault(e.job.source, time.monotonic())
            if e.job.state is JobState.QUEUED
            else None
        ),
    )
    pace = threading.Event()
    delays = []
    try:
        for i in range(count):
            path = service.settings.paths.inbox / f"late{i:03}.wav"
            with open(path, "wb") as handle:
                handle.write(b"RIFF" + os.urandom(4096))
            closed = time.monotonic()
            deadline = closed + 30
            while str(path) not in queued and time.monotonic() < deadline:
                pace.wait(0.005)
            delays.append(queued.get(str(path), float("inf")) - closed)
    finally:
        service.shutdown()
    return delays


def library(root: Path, repo: Path, mode: str, files: int, args: Any, tree: Path) -> dict[str, Any]:
    """10,000 files renamed into the inbox of a service running in a process of its own (the
    code of `tree`), measured from the outside: the registry's queued jobs and waiting files
    counted every 50 ms, `status --json` run back to back and timed, the service's peak RSS
    (VmHWM) and its CPU once everything is in."""
    root.mkdir(parents=True)
    config = root / "stemdeck.toml"
    env = {**os.environ, "PYTHONPATH": str(tree)}
    # the tree's own test config (a config of a newer tree may hold keys an older one refuses)
    subprocess.run(
        [
            sys.executable,
            "-c",
            WRITE_CONFIG,
            str(tree),
            str(root),
            str(repo),
            mode,
            str(args.pending),
            str(config),
        ],
        check=True,
        env=env,
        cwd=root,  # a `-c` or `-m` puts its working folder first on sys.path
    )
    cli = [sys.executable, "-m", "stemdeck_watch", "--config", str(config)]
    stage = root / "library"
    stage.mkdir()
    for i in range(files):
        (stage / f"song{i:05}.wav").write_bytes(b"RIFF" + os.urandom(32))
    log = open(root / "service.log", "wb")
    service = subprocess.Popen(
        [*cli, "run", "--no-tray"], env=env, cwd=root, stdout=log, stderr=subprocess.STDOUT
    )
    registry = root / "state" / "registry.sqlite3"
    pace = threading.Event()
    stop = threading.Event()
    status_times: list[float] = []

    def status(starting: bool = False) -> dict[str, Any]:
        """`status --json`, timed; while the service starts (`starting`) a failure is "not yet"."""
        out = root / "status.json"
        with open(out, "wb") as handle:
            began = time.monotonic()
            done = subprocess.run(
                [*cli, "status", "--json"],
                stdout=handle,
                stderr=subprocess.PIPE if starting else None,
                env=env,
                cwd=root,
                check=not starting,
            )
            took = time.monotonic() - began
        if done.returncode:
            return {}
        data = json.loads(out.read_bytes())  # a complete, valid object every time
        data["_took"] = took
        return data

    def poll_status() -> None:
        # the output goes to a file, as a terminal takes it
        while not stop.is_set():
            status_times.append(status()["_took"])
            stop.wait(0.2)

    def accounted() -> tuple[int, int]:
        try:
            db = sqlite3.connect(f"file:{registry}?mode=ro", uri=True, timeout=5)
            try:
                queued = db.execute("SELECT count(*) FROM jobs WHERE state = 'queued'")
                waiting = db.execute("SELECT count(*) FROM waiting")
                return queued.fetchone()[0], waiting.fetchone()[0]
            finally:
                db.close()
        except sqlite3.Error:
            return 0, 0

    poller = threading.Thread(target=poll_status)
    try:
        wait_until(lambda: status(starting=True).get("worker"), 120, "the service's worker")
        subprocess.run([*cli, "pause"], env=env, cwd=root, check=True, stdout=subprocess.DEVNULL)
        wait_until(lambda: status().get("paused"), 30, "the queue paused")
        wait_until(lambda: _cpu(service.pid, 1.0) < 0.05, 60, "a quiet service", interval=0)
        inbox = root / "inbox"
        spy = _py_spy(service.pid, args.py_spy, root.name) if args.py_spy else None
        began, cpu_before = time.monotonic(), _proc_stat(service.pid)
        poller.start()
        for i in range(files):
            os.rename(stage / f"song{i:05}.wav", inbox / f"song{i:05}.wav")
        renamed = time.monotonic() - began
        counts, tree_mb = (0, 0), 0.0
        while sum(counts) < files and time.monotonic() - began < 300:
            pace.wait(0.05)
            counts = accounted()
            tree_mb = max(tree_mb, _tree_rss_mb(service.pid))
        took = time.monotonic() - began
        cpu = _proc_stat(service.pid) - cpu_before
        if spy is not None:
            spy.send_signal(signal.SIGINT)
            spy.wait(timeout=60)
        # a few more status calls after the last file, while the estimate catches up
        pace.wait(1.0)
        stop.set()
        poller.join(timeout=60)
        peak = _peak_rss_mb(service.pid)
        idle = _cpu(service.pid, args.idle) if args.idle > 0 else None
        last = status()
        return {
            "tree": str(tree),
            "mode": mode,
            "files": files,
            "renamed_s": renamed,
            "queued": counts[0],
            "waiting": counts[1],
            "seconds": took,
            "service_cpu_s": cpu,
            "peak_rss_mb": peak,
            # the service with its worker (and the zygote it was forked from), sampled (PSS)
            "tree_rss_mb": tree_mb,
            "status_calls": len(status_times),
            "slowest_status_s": max(status_times, default=0.0),
            "median_status_s": median(status_times) if status_times else 0.0,
            "idle_cpu": idle,
            "eta_songs": (last.get("eta") or {}).get("songs"),
        }
    finally:
        stop.set()
        service.send_signal(signal.SIGTERM)
        try:
            service.wait(timeout=60)
        except subprocess.TimeoutExpired:
            service.kill()
            service.wait(timeout=10)
        log.close()


WRITE_CONFIG = """
import sys, tomli_w
from pathlib import Path
tree, root, repo, mode, pending, out = sys.argv[1:]
sys.path[:0] = [tree, tree + "/tests"]
from support.helpers import config_data
data = config_data(Path(root), Path(repo), watch={"mode": mode})
data["watch"].pop("settle_seconds")  # the default
data["tray"]["enabled"] = False
if int(pending):
    data["queue"]["max_pending_files"] = int(pending)
Path(out).write_text(tomli_w.dumps(data))
"""


def _py_spy(pid: int, folder: Path, name: str) -> subprocess.Popen[bytes]:
    """py-spy sampling the service (all threads, collapsed stacks) until sent SIGINT."""
    folder.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(
        [
            str(Path(sys.executable).parent / "py-spy"),
            "record",
            "--pid",
            str(pid),
            "--rate",
            "200",
            "--format",
            "raw",
            "--threads",
            "-o",
            str(folder / f"{name}.txt"),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def _proc_stat(pid: int) -> float:
    """CPU seconds of a process (user + system)."""
    parts = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(parts[11]) + int(parts[12])) / os.sysconf("SC_CLK_TCK")


def _cpu(pid: int, seconds: float) -> float:
    """The share of one core a process used over `seconds`."""
    before, wall = _proc_stat(pid), time.monotonic()
    threading.Event().wait(seconds)
    return (_proc_stat(pid) - before) / (time.monotonic() - wall)


def _tree_rss_mb(pid: int) -> float:
    """The memory of a process and every process below it, now: their proportional set
    sizes (a worker forked from the zygote shares most of its pages with it; summing their
    RSS would count those twice)."""
    total, todo = 0, [pid]
    while todo:
        proc = Path(f"/proc/{todo.pop()}")
        try:
            for line in (proc / "smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1])
            for task in (proc / "task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, ValueError):
            continue  # it ended meanwhile
    return total / 1024


def _peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__, "intake")
    parser.add_argument("--files", type=int, default=10_000)
    parser.add_argument("--latency", type=int, default=20, help="files for (1); 0: skip it")
    parser.add_argument("--modes", default="native,polling", help="watch modes of (2)")
    parser.add_argument("--runs", type=int, default=1, help="runs of (2) per mode and tree")
    parser.add_argument(
        "--pending",
        type=int,
        default=0,
        help="queue.max_pending_files for (2); 0: the default (the rest wait in the inbox)",
    )
    parser.add_argument("--idle", type=float, default=10.0, help="seconds of idle CPU measured")
    parser.add_argument(
        "--py-spy",
        type=Path,
        metavar="FOLDER",
        help="sample the service with py-spy while the files arrive (collapsed stacks here)",
    )
    parser.add_argument(
        "--before",
        type=Path,
        help="a checkout of an earlier commit: (2) runs its code too, alternating with this one",
    )
    args = parser.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    trees = [ROOT] + ([args.before.resolve()] if args.before else [])
    results: dict[str, Any] = {"machine": machine(), "latency": {}, "library": []}
    with tempfile.TemporaryDirectory(prefix="stemdeck-bench-intake-") as tmp:
        work = Path(tmp)
        repo = work / "models"
        tiny_model(repo)
        for mode in modes if args.latency > 0 else []:
            delays = latency(work / f"latency-{mode}", repo, mode, args.latency)
            results["latency"][mode] = delays
            print(
                f"latency {mode:<8} median {sorted(delays)[len(delays) // 2]:.2f} s  "
                f"p95 {p95(delays):.2f} s  max {max(delays):.2f} s",
                flush=True,
            )
        for run in range(args.runs):
            for mode in modes:
                # alternate which tree goes first, so a busy spell of the machine falls on both
                for tree in trees if run % 2 == 0 else trees[::-1]:
                    name = "this" if tree == ROOT else "before"
                    row = library(
                        work / f"library-{mode}-{name}-{run}", repo, mode, args.files, args, tree
                    )
                    row["load"] = os.getloadavg()[0]
                    results["library"].append(row)
                    idle = f"{row['idle_cpu'] * 100:.1f} %" if row["idle_cpu"] is not None else "-"
                    print(
                        f"{name:<6} {args.files} files {mode:<8} accounted in "
                        f"{row['seconds']:.1f} s ({row['queued']} queued, {row['waiting']} "
                        f"waiting, service CPU {row['service_cpu_s']:.1f} s)  peak RSS {row['peak_rss_mb']:.0f} MB (with its worker {row['tree_rss_mb']:.0f} MB)  status slowest "
                        f"{row['slowest_status_s']:.2f} s (median {row['median_status_s']:.2f}, "
                        f"{row['status_calls']} calls)  idle CPU {idle}  load {row['load']:.1f}",
                        flush=True,
                    )
    for mode in modes:
        for tree in trees:
            rows = [r for r in results["library"] if r["mode"] == mode and r["tree"] == str(tree)]
            if len(rows) > 1:
                print(
                    f"median {'this' if tree == ROOT else 'before':<6} {mode:<8} "
                    f"{median([r['seconds'] for r in rows]):.1f} s  "
                    f"{median([r['peak_rss_mb'] for r in rows]):.0f} MB  status slowest "
                    f"{median([r['slowest_status_s'] for r in rows]):.2f} s",
                    flush=True,
                )
    write_results(args.out, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
