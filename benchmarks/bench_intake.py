"""Intake at scale: how fast a dropped file becomes a job, and a 10,000-song library at once.

One real Service in this process (real watchdog observer, SQLite registry, the resident
worker idle with the tiny model; the queue paused so nothing separates), default watch
settings unless given:

(1) latency, file closed -> job queued: 20 files written one at a time (open, write, close),
    native and polling; p95 targets: native <= settle + 0.3 s, polling <= poll_interval +
    settle + 0.3 s (a close event on Linux shortens the settle to 1 s, never below it).
(2) 10,000 small files renamed into the inbox at once, native and polling: time until every
    one is accounted for (queued or waiting), the process's peak RSS, the slowest
    `stemdeck-watch status --json` (a real CLI process) meanwhile, and the service's CPU use
    over 10 s once everything is in (idle).

    python benchmarks/bench_intake.py [--files 10000] [--latency 20]
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import tomli_w

from harness import machine, p95, parser as bench_parser, tiny_model, write_results
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


def library(root: Path, repo: Path, mode: str, files: int) -> dict[str, Any]:
    service, config = start(root, repo, mode)
    stage = root / "library"
    stage.mkdir()
    for i in range(files):
        (stage / f"song{i:05}.wav").write_bytes(b"RIFF" + os.urandom(32))
    slowest = [0.0]
    stop = threading.Event()

    def poll_status() -> None:
        # the output goes to a file, as to a terminal: read back through a pipe it would be
        # read by this process, which shares its interpreter lock with the service under test
        out = root / "status.json"
        while not stop.is_set():
            with open(out, "wb") as handle:
                began = time.monotonic()
                subprocess.run(
                    [
                        sys.executable,
                        "-m",
                        "stemdeck_watch",
                        "--config",
                        str(config),
                        "status",
                        "--json",
                    ],
                    stdout=handle,
                    stderr=subprocess.DEVNULL,
                    check=True,
                )
                slowest[0] = max(slowest[0], time.monotonic() - began)
            json.loads(out.read_bytes())  # a complete, valid object every time
            stop.wait(0.2)

    def accounted() -> int:
        return len(service.queue.order()) + len(service.scheduler.waiting())

    poller = threading.Thread(target=poll_status)
    pace = threading.Event()
    try:
        began = time.monotonic()
        poller.start()
        for i in range(files):
            os.rename(stage / f"song{i:05}.wav", service.settings.paths.inbox / f"song{i:05}.wav")
        while accounted() < files and time.monotonic() - began < 300:
            pace.wait(0.05)
        took = time.monotonic() - began
        stop.set()
        poller.join()
        rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        cpu_before, wall_before = sum(os.times()[:2]), time.monotonic()
        pace.wait(10)
        idle = (sum(os.times()[:2]) - cpu_before) / (time.monotonic() - wall_before)
        return {
            "mode": mode,
            "files": files,
            "accounted": accounted(),
            "seconds": took,
            "peak_rss_mb": rss_mb,
            "slowest_status_s": slowest[0],
            "idle_cpu": idle,
        }
    finally:
        stop.set()
        service.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__, "intake")
    parser.add_argument("--files", type=int, default=10_000)
    parser.add_argument("--latency", type=int, default=20)
    args = parser.parse_args(argv)
    results: dict[str, Any] = {"machine": machine(), "latency": {}, "library": []}
    with tempfile.TemporaryDirectory(prefix="stemdeck-bench-intake-") as tmp:
        work = Path(tmp)
        repo = work / "models"
        tiny_model(repo)
        for mode in ("native", "polling"):
            delays = latency(work / f"latency-{mode}", repo, mode, args.latency)
            results["latency"][mode] = delays
            print(
                f"latency {mode:<8} median {sorted(delays)[len(delays) // 2]:.2f} s  "
                f"p95 {p95(delays):.2f} s  max {max(delays):.2f} s",
                flush=True,
            )
        # each library run in a fresh process would be cleaner for RSS; run polling after
        # native in this process and report ru_maxrss (the peak so far) honestly as such
        for mode in ("native", "polling"):
            row = library(work / f"library-{mode}", repo, mode, args.files)
            results["library"].append(row)
            print(
                f"{args.files} files {mode:<8} accounted in {row['seconds']:.1f} s  "
                f"peak RSS {row['peak_rss_mb']:.0f} MB  slowest status {row['slowest_status_s']:.2f} s  "
                f"idle CPU {row['idle_cpu'] * 100:.1f} %",
                flush=True,
            )
    write_results(args.out, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
