"""Notifications: how soon a finished song is announced, and what a dead target costs.

Real components in this process: the Service (watcher, registry, resident worker with the tiny
model on the CPU), its Notifier with apprise posting `json://127.0.0.1:PORT/` to a loopback HTTP
receiver (tests/support/notify_receiver.py), and a closed port as the dead target.

(1) publish -> notification, target p95 <= 0.5 s:
    (a) through the service: each trial a fresh service and one 5 s song (a service announces
        the first song of a kind at once and coalesces the rest of that minute, by design, so
        each trial measures an announced-at-once song); from the JobChanged(done) event — the
        moment the pipeline recorded the published song folder — until the receiver holds the
        POST. `--trials` trials.
    (b) the notifier alone, as a steady stream: 200 JobChanged(done) events 20 ms apart into
        the real Notifier with coalescing off (window 0), the same target; event -> arrival.
(2) a dead target's cost to throughput: 10 songs (5 s each) renamed into the inbox at once,
    notify.urls = [receiver] against [closed port, receiver], alternating, `--runs` runs of
    each; from the last rename to the last song done. Target: no measurable difference.

Other processes' CPU use is measured as in bench_throughput.py, and each measure waits a
bounded time for a quiet machine. Raw numbers: benchmarks/results/notify.json.

    python benchmarks/bench_notify.py [--trials 10] [--runs 3] [--songs 10]
"""

from __future__ import annotations

import logging
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from harness import (
    cpu_snapshot,
    machine,
    other_cores,
    parser as bench_parser,
    percentile,
    tiny_model,
    wait_quiet,
    write_results,
)
from support.notify_receiver import Receiver, closed_port

SETTLE = 0.5


def settings_for(root: Path, repo: Path, urls: list[str]) -> Any:
    from stemdeck_watch.core.config import default_toml, settings_from_dict

    data = default_toml()
    data["folders"] = {
        n: str(root / n) for n in ("inbox", "outbox", "processed", "failed", "state")
    }
    data["separation"].update(model="tiny", model_repo=str(repo), device="cpu")
    data["watch"]["settle_seconds"] = SETTLE
    data["notify"]["urls"] = urls
    data["tray"]["enabled"] = False
    return settings_from_dict(data, source=root / "stemdeck.toml")


def timed_bus() -> Any:
    """The service's event bus, timing how long each publish spends in the notifier's listener
    (the only moment a notification touches the publisher's thread — often the pipeline's)."""
    from stemdeck_watch.core.events import EventBus

    class TimedBus(EventBus):
        def __init__(self) -> None:
            super().__init__()
            self.notifier_seconds: list[float] = []

        def publish(self, event: Any) -> None:
            with self._lock:
                listeners = [fn for kind, fn in self._listeners if isinstance(event, kind)]
            for listener in listeners:
                started = time.perf_counter()
                try:
                    listener(event)
                except Exception:
                    logging.exception("listener failed")
                if type(getattr(listener, "__self__", None)).__name__ == "Notifier":
                    self.notifier_seconds.append(time.perf_counter() - started)

    return TimedBus()


def service_run(root: Path, repo: Path, urls: list[str], clips: list[Path]) -> dict[str, Any]:
    """A fresh service; `clips` renamed into the inbox at once; until all are done. Returns the
    wall time from the last rename to the last done, when each song was done, and the time the
    publishers spent in the notifier's listener."""
    from stemdeck_watch.core.events import JobChanged
    from stemdeck_watch.core.jobs import JobState
    from stemdeck_watch.service import Service

    settings = settings_for(root, repo, urls)
    bus, lock, finished = timed_bus(), threading.Lock(), threading.Event()
    done: dict[str, float] = {}
    failed: list[str] = []

    def on_change(event: JobChanged) -> None:
        now, job = time.monotonic(), event.job
        with lock:
            if job.state is JobState.DONE:
                done.setdefault(job.name, now)
            elif job.state.is_final:
                failed.append(f"{job.name}: {job.error}")
            if len(done) + len(failed) >= len(clips):
                finished.set()

    bus.subscribe(JobChanged, on_change)  # before the notifier's: its time counts
    service = Service(settings, bus=bus)
    service.start()
    try:
        service.client.ensure_model("tiny", str(settings.model_repo))  # warm, as in (a) of
        drop = root / "drop"  # bench_throughput
        drop.mkdir()
        for clip in clips:
            shutil.copyfile(clip, drop / clip.name)
        for clip in clips:
            os.replace(drop / clip.name, settings.paths.inbox / clip.name)
        t0, cpu0 = time.monotonic(), cpu_snapshot()
        if not finished.wait(600):
            raise RuntimeError(f"timed out: {len(done)} of {len(clips)} done")
        seconds = max(done.values()) - t0
        other = other_cores(cpu0, time.monotonic() - t0)
        channels = [(c.target.label, c.sent, c.failed) for c in service.notifier.channels]
    finally:
        service.shutdown()
    if failed:
        raise RuntimeError(f"jobs failed: {failed}")
    spent = bus.notifier_seconds
    return {
        "seconds": seconds,
        "done_at": done,
        "other_cores": other,
        "channels": channels,
        "listener_events": len(spent),
        "listener_total_s": sum(spent),
        "listener_max_s": max(spent, default=0.0),
    }


def latency_service(
    work: Path, repo: Path, clip: Path, trials: int, quiet: float, patience: float
) -> list[float]:
    latencies = []
    for n in range(trials):
        wait_quiet(quiet, patience)
        with Receiver() as receiver:
            run = service_run(work / f"lat{n}", repo, [receiver.url], [clip])
            got = receiver.wait(1, timeout=10)
        name = clip.stem
        message = next(m for m in got if m["title"] == f"Stems ready: {name}")
        latencies.append(message["received_at"] - run["done_at"][name])
        print(
            f"(1a) trial {n + 1}/{trials}: {latencies[-1] * 1000:.1f} ms",
            file=sys.stderr,
            flush=True,
        )
        shutil.rmtree(work / f"lat{n}", ignore_errors=True)
    return latencies


def latency_notifier(work: Path, events: int, spacing: float) -> list[float]:
    from stemdeck_watch.ui.desktop.notify import Notifier
    from stemdeck_watch.core.events import EventBus, JobChanged
    from stemdeck_watch.core.jobs import Job, JobKind, JobState

    with Receiver() as receiver:
        settings = settings_for(work / "stream", work, [receiver.url])
        bus = EventBus()
        notifier = Notifier(bus, settings, window=0)
        notifier.start()
        sent: dict[str, float] = {}
        pace = threading.Event()
        try:
            start = time.monotonic()
            for i in range(events):
                pace.wait(max(0.0, start + i * spacing - time.monotonic()))  # the schedule
                name = f"song {i:03d}"
                sent[name] = time.monotonic()
                bus.publish(
                    JobChanged(
                        Job(
                            id=f"j{i}",
                            name=name,
                            kind=JobKind.FILE,
                            state=JobState.DONE,
                            source="/x",
                            rel_path="x",
                            output=f"/out/{name}",
                        )
                    )
                )
            got = receiver.wait(events, timeout=60)
        finally:
            notifier.stop()
    return [m["received_at"] - sent[m["title"].removeprefix("Stems ready: ")] for m in got]


def summary(values: list[float]) -> dict[str, float]:
    return {
        "n": len(values),
        "p50": statistics.median(values),
        "p95": percentile(values, 95),
        "max": max(values),
    }


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__, "notify", quiet=True, patience=120)
    parser.add_argument("--trials", type=int, default=10, help="(1a) fresh services")
    parser.add_argument("--events", type=int, default=200, help="(1b) events")
    parser.add_argument("--runs", type=int, default=3, help="(2) runs with and without")
    parser.add_argument("--songs", type=int, default=10)
    parser.add_argument("--seconds", type=float, default=5.0, help="length of each song")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from stemdeck_watch.util.synth import write_song

    work = Path(tempfile.mkdtemp(prefix="stemdeck-bench-notify-"))
    try:
        repo = work / "models"
        tiny_model(repo)
        clips = [
            write_song(work / "clips" / f"song{i:02d}.wav", args.seconds, seed=i)
            for i in range(args.songs)
        ]
        lat_a = latency_service(work, repo, clips[0], args.trials, args.quiet, args.patience)
        wait_quiet(args.quiet, args.patience)
        lat_b = latency_notifier(work, args.events, 0.02)
        runs: dict[str, list[dict[str, Any]]] = {"without": [], "with": []}
        for n in range(args.runs):
            for label in ("without", "with"):
                wait_quiet(args.quiet, args.patience)
                with Receiver() as receiver:
                    urls = ([f"json://127.0.0.1:{closed_port()}/"] if label == "with" else []) + [
                        receiver.url
                    ]
                    run = service_run(work / f"{label}{n}", repo, urls, clips)
                    run["received"] = len(receiver.snapshot())
                run.pop("done_at")
                runs[label].append(run)
                print(
                    f"(2) run {n + 1}/{args.runs} {label} dead target: "
                    f"{run['seconds']:.2f} s (other processes: {run['other_cores']:.2f} "
                    f"cores), notifier {run['channels']}, in its listener "
                    f"{run['listener_total_s'] * 1000:.2f} ms over {run['listener_events']} "
                    f"events",
                    file=sys.stderr,
                    flush=True,
                )
                shutil.rmtree(work / f"{label}{n}", ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    a, b = summary(lat_a) if lat_a else None, summary(lat_b)
    without = [r["seconds"] for r in runs["without"]]
    with_dead = [r["seconds"] for r in runs["with"]]
    info = machine()
    print(f"\nNotifications; {info['nproc']} cores ({info['cpu']}), Python {info['python']}\n")
    print("| measure | n | p50 | p95 | max | target |")
    print("|---|---:|---:|---:|---:|---|")
    for name, s in (
        ("(1a) song published -> notification at the receiver (service)", a),
        ("(1b) done event -> notification, steady stream (notifier alone)", b),
    ):
        if s is None:
            continue
        verdict = "pass" if s["p95"] <= 0.5 else "FAIL"
        print(
            f"| {name} | {s['n']} | {s['p50'] * 1000:.1f} ms | {s['p95'] * 1000:.1f} ms | "
            f"{s['max'] * 1000:.1f} ms | p95 <= 500 ms: {verdict} |"
        )
    print(f"\n| {args.songs} songs x {args.seconds:g} s | median s | min-max s |")
    print("|---|---:|---:|")
    for name, values in (
        ("live receiver only", without),
        ("+ a dead target (closed port)", with_dead),
    ):
        print(f"| {name} | {statistics.median(values):.2f} | {min(values):.2f}-{max(values):.2f} |")
    for label, key in (("live receiver only", "without"), ("+ a dead target", "with")):
        total = [r["listener_total_s"] * 1000 for r in runs[key]]
        worst = max(r["listener_max_s"] * 1e6 for r in runs[key])
        events = sum(r["listener_events"] for r in runs[key]) / len(runs[key])
        print(
            f"| {label}: publishers' time in the notifier's listener per run | "
            f"{statistics.median(total):.2f} ms (~{events:.0f} events, max {worst:.0f} us "
            f"per event) | |"
        )
    diff = statistics.median(with_dead) - statistics.median(without)
    spread = max(max(without) - min(without), max(with_dead) - min(with_dead))
    print(
        f"\nmedian difference {diff:+.2f} s; run-to-run spread up to {spread:.2f} s "
        f"({'within the noise' if abs(diff) <= spread else 'OUTSIDE the noise'})"
    )
    write_results(
        args.out,
        {
            "machine": info,
            "latency_service": lat_a,
            "latency_notifier": lat_b,
            "summary": {
                "service": a,
                "notifier": b,
                "median_without": statistics.median(without),
                "median_with_dead": statistics.median(with_dead),
                "difference": diff,
                "spread": spread,
            },
            "runs": runs,
            "args": vars(args),
        },
    )
    print(f"raw numbers: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
