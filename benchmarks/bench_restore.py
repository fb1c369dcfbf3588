"""Start-up restore with a big registry, the cost of one state transition, kill-test totals.

(1) Restore at start-up. A registry of 10,000 done jobs and 1,000 queued ones, built with
    `stemdeck_watch.store.registry.Registry` directly: every done job has its song folder in the
    outbox (a complete `stemdeck.json` and four 1-byte stems: what orphan adoption reads), every
    queued job its input in the inbox (1,000 tiny files). Two measures, each on a fresh copy of
    the registry file, with the page cache warm (the first run reads the files once):
      (a) `recovery.restore` + `recovery.adopt_orphans` on a Scheduler over that registry,
          timed directly (7 runs);
      (b) a real `Service(settings).start()` (tiny model; the queue comes up paused, as after
          every restore): from calling start() until restore and orphan adoption have
          returned inside it (they are wrapped to take the time), and until start() returns
          (3 runs).
    Target: (b) ≤ 2 s.
(2) One state transition: `Registry.update` as the pipeline calls it (state, stage, progress;
    `done` with its output and finish time), on the same 11,000-job registry opened as the
    service opens it (WAL, synchronous=FULL: every transition is on disk before it is
    announced). 500 updates: 125 queued jobs each through decoding → separating → publishing →
    done. Median and p99 (the 495th of 500).
(3) Kill-test totals: runs tests/service/test_kill.py::test_kill_at_random_points (20 SIGKILLs of a
    10-job run, restarting each time, invariants checked after every restart) with
    STEMDECK_KILL_SUMMARY=1, which writes benchmarks/results/kill.json; `--no-kill-test`
    reports an existing kill.json instead.

Raw numbers: benchmarks/results/restore.json. Exit status 1 if a target is missed, the kill
test fails, or it reports a violation.

    python benchmarks/bench_restore.py [--done 10000] [--queued 1000] [--updates 500]
                                       [--no-kill-test] [--kill-seed N]
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

from harness import (
    RESULTS,
    ROOT as REPO,
    machine,
    parser as bench_parser,
    percentile,
    tiny_model,
    write_results,
)

from stemdeck_watch.engine import recovery
from stemdeck_watch import service as service_module
from stemdeck_watch.core.config import Settings, default_toml, settings_from_dict
from stemdeck_watch.core.events import EventBus
from stemdeck_watch.store.jobqueue import JobQueue
from stemdeck_watch.core.jobs import FileSignature, Job, JobKind, JobState
from stemdeck_watch.core.paths import filesystem_type
from stemdeck_watch.stages.manifest import MANIFEST
from stemdeck_watch.engine.pipeline import Pipeline
from stemdeck_watch.workers.local import WorkerClient
from stemdeck_watch.store.registry import REGISTRY_FILE, Registry
from stemdeck_watch.engine.scheduler import Scheduler

KILL_SUMMARY = RESULTS / "kill.json"
RESTORE_TARGET = 2.0  # seconds, (1b)
STEMS = ("drums", "bass", "other", "vocals")
FOLDERS = ("inbox", "outbox", "processed", "failed", "state")


def settings_for(root: Path, model_repo: Path | None = None) -> Settings:
    data = default_toml()
    data["folders"] = {name: str(root / name) for name in FOLDERS}
    if model_repo is not None:
        data["separation"].update(model="tiny", model_repo=str(model_repo), device="cpu")
    data["api"]["enabled"] = False
    return settings_from_dict(data, source=root / "stemdeck.toml")


def build(root: Path, done: int, queued: int) -> Path:
    """The registry, the outbox and the inbox of a service that ran for a long time; returns
    the pristine registry file (copied into place before every measured run)."""
    for name in FOLDERS:
        (root / name).mkdir(parents=True, exist_ok=True)
    registry = Registry.open(root / "state" / REGISTRY_FILE)
    outbox, inbox, processed = root / "outbox", root / "inbox", root / "processed"
    t0 = 1.7e9
    with registry._lock, registry._transaction():  # one transaction: building, not measuring
        for i in range(done):
            name = f"song-{i:05d}"
            folder = outbox / name
            folder.mkdir()
            for stem in STEMS:
                (folder / f"{stem}.wav").write_bytes(b"x")
            digest = f"{i:064x}"
            (folder / MANIFEST).write_text(
                json.dumps(
                    {
                        "stemdeck_watch": "bench",
                        "job_id": f"done{i:08d}",
                        "input": {
                            "name": f"{name}.wav",
                            "rel_path": f"{name}.wav",
                            "sha256": digest,
                        },
                        "stems": [{"name": s, "file": f"{s}.wav"} for s in STEMS],
                        "settings": {"separation": {"model": "tiny"}, "output": {}},
                    }
                )
            )
            registry.add(
                Job(
                    id=f"done{i:08d}",
                    name=name,
                    kind=JobKind.FILE,
                    state=JobState.DONE,
                    source=str(processed / f"{name}.wav"),
                    rel_path=f"{name}.wav",
                    progress=1.0,
                    output=str(folder),
                    created_at=t0 + i,
                    finished_at=t0 + i + 1,
                    sha256=digest,
                    settings_key="bench",
                )
            )
        for i in range(queued):
            name = f"queued-{i:04d}"
            source = inbox / f"{name}.wav"
            source.write_bytes(b"RIFF....WAVE" + name.encode())
            registry.add(
                Job(
                    id=f"queued{i:06d}",
                    name=name,
                    kind=JobKind.FILE,
                    state=JobState.QUEUED,
                    source=str(source),
                    rel_path=source.name,
                    signature=FileSignature.of(source.stat()),
                    created_at=t0 + done + i,
                )
            )
    registry.save_order([f"queued{i:06d}" for i in range(queued)])
    registry._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    registry.close()
    pristine = root / "pristine.sqlite3"
    shutil.copy2(root / "state" / REGISTRY_FILE, pristine)
    return pristine


def fresh_registry(root: Path, pristine: Path) -> None:
    state = root / "state"
    for suffix in ("", "-wal", "-shm"):
        Path(str(state / REGISTRY_FILE) + suffix).unlink(missing_ok=True)
    shutil.copy2(pristine, state / REGISTRY_FILE)


def restore_direct(root: Path, pristine: Path, queued: int) -> float:
    """(1a): restore + adopt_orphans on a Scheduler; seconds."""
    fresh_registry(root, pristine)
    settings = settings_for(root)
    registry = Registry.open(root / "state" / REGISTRY_FILE)
    scheduler = Scheduler(registry, JobQueue(), EventBus(), settings)
    pipeline = Pipeline(settings, WorkerClient(), scheduler.bus, scheduler.update)
    try:
        t = time.perf_counter()
        restored = recovery.restore(scheduler, settings, pipeline.file_input)
        adopted = recovery.adopt_orphans(scheduler, settings)
        seconds = time.perf_counter() - t
    finally:
        registry.close()
    assert (restored, adopted) == (queued, 0), (restored, adopted)
    return seconds


@contextlib.contextmanager
def timed_restore(marks: dict[str, float]) -> Iterator[None]:
    """Wrap the service's restore and adopt_orphans to note when they return."""
    real_restore, real_adopt = service_module.restore, service_module.adopt_orphans

    def restore(*args: Any, **kwargs: Any) -> int:
        marks["restore_called"] = time.perf_counter()
        result = real_restore(*args, **kwargs)
        marks["restored"] = time.perf_counter()
        return result

    def adopt(*args: Any, **kwargs: Any) -> int:
        result = real_adopt(*args, **kwargs)
        marks["adopted"] = time.perf_counter()
        return result

    service_module.restore, service_module.adopt_orphans = restore, adopt
    try:
        yield
    finally:
        service_module.restore, service_module.adopt_orphans = real_restore, real_adopt


def restore_service(root: Path, pristine: Path, model_repo: Path, queued: int) -> dict[str, float]:
    """(1b): Service.start() on the big registry; seconds to restore+adopt and to return."""
    fresh_registry(root, pristine)
    marks: dict[str, float] = {}
    service = service_module.Service(settings_for(root, model_repo))
    with timed_restore(marks):
        t = time.perf_counter()
        service.start()
        returned = time.perf_counter()
    try:
        assert len(service.queue.order()) == queued and service.queue.pause_reason == "restore"
    finally:
        service.shutdown()
    return {
        "to_restore_done": marks["adopted"] - t,
        "start_returned": returned - t,
        "restore": marks["restored"] - marks["restore_called"],
        "adopt": marks["adopted"] - marks["restored"],
    }


def transitions(root: Path, pristine: Path, updates: int) -> list[float]:
    """(2): seconds of each Registry.update, as the pipeline makes them."""
    fresh_registry(root, pristine)
    registry = Registry.open(root / "state" / REGISTRY_FILE)
    sync = registry._db.execute("PRAGMA synchronous").fetchone()[0]
    mode = registry._db.execute("PRAGMA journal_mode").fetchone()[0]
    assert (sync, mode) == (2, "wal"), (sync, mode)  # FULL, WAL: as the service opens it
    steps: list[dict[str, Any]] = [
        {"state": JobState.DECODING, "stage": "decoding", "progress": 0.0},
        {"state": JobState.SEPARATING, "stage": "separating", "progress": 0.05},
        {"state": JobState.PUBLISHING, "stage": "publishing", "progress": 0.95},
        {"state": JobState.DONE, "progress": 1.0, "stage": None, "error": None},
    ]
    seconds = []
    try:
        for n in range(updates):
            job_id = f"queued{n // len(steps):06d}"
            fields = dict(steps[n % len(steps)])
            if fields["state"] is JobState.DONE:
                fields.update(output=str(root / "outbox" / job_id), finished_at=time.time())
            t = time.perf_counter()
            registry.update(job_id, **fields)
            seconds.append(time.perf_counter() - t)
    finally:
        registry.close()
    return seconds


def kill_test(seed: int | None) -> tuple[dict[str, Any] | None, int]:
    env = {"STEMDECK_KILLS": "20", **os.environ, "STEMDECK_KILL_SUMMARY": "1"}
    if seed is not None:
        env["STEMDECK_KILL_SEED"] = str(seed)
    KILL_SUMMARY.unlink(missing_ok=True)
    print("running the kill test (tests/service/test_kill.py, about 2–3 minutes)…", flush=True)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-s",
            "-p",
            "no:cacheprovider",
            "tests/service/test_kill.py::test_kill_at_random_points",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        print(proc.stdout[-4000:], proc.stderr[-2000:], sep="\n")
    summary = json.loads(KILL_SUMMARY.read_text()) if KILL_SUMMARY.exists() else None
    return summary, proc.returncode


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__, "restore")
    parser.add_argument("--done", type=int, default=10_000)
    parser.add_argument("--queued", type=int, default=1_000)
    parser.add_argument("--updates", type=int, default=500)
    parser.add_argument("--direct-runs", type=int, default=7)
    parser.add_argument("--service-runs", type=int, default=3)
    parser.add_argument("--no-kill-test", action="store_true")
    parser.add_argument("--kill-seed", type=int)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    ok = True
    with tempfile.TemporaryDirectory(prefix="stemdeck-bench-restore-") as tmp:
        root = Path(tmp) / "run"
        t = time.perf_counter()
        pristine = build(root, args.done, args.queued)
        built = time.perf_counter() - t
        print(
            f"built {args.done:,} done + {args.queued:,} queued jobs, "
            f"{args.done:,} song folders, {args.queued:,} inputs in {built:.1f} s "
            f"({filesystem_type(root)})",
            flush=True,
        )
        model_repo = tiny_model(Path(tmp) / "models")
        direct = [restore_direct(root, pristine, args.queued) for _ in range(args.direct_runs)]
        print(
            f"(1a) restore + adopt_orphans: {', '.join(f'{v:.3f}' for v in direct)} s", flush=True
        )
        via_service = [
            restore_service(root, pristine, model_repo, args.queued)
            for _ in range(args.service_runs)
        ]
        shown = ", ".join(f"{r['to_restore_done']:.3f}" for r in via_service)
        print(f"(1b) Service.start() to restore + adopt done: {shown} s", flush=True)
        updates = transitions(root, pristine, args.updates)
        registry_mb = pristine.stat().st_size / 1e6
        fs = filesystem_type(root)

    kill, kill_rc = (None, 0)
    if args.no_kill_test:
        kill = json.loads(KILL_SUMMARY.read_text()) if KILL_SUMMARY.exists() else None
    else:
        kill, kill_rc = kill_test(args.kill_seed)

    to_restore = [r["to_restore_done"] for r in via_service]
    result: dict[str, Any] = {
        "machine": machine(),
        "filesystem": fs,
        "registry_mb": round(registry_mb, 2),
        "jobs": {"done": args.done, "queued": args.queued},
        "build_seconds": round(built, 1),
        "restore_direct_s": [round(v, 4) for v in direct],
        "restore_service": [{k: round(v, 4) for k, v in r.items()} for r in via_service],
        "transition_ms": {
            "n": len(updates),
            "median": round(statistics.median(updates) * 1e3, 3),
            "p99": round(percentile(updates, 99) * 1e3, 3),
            "min": round(min(updates) * 1e3, 3),
            "max": round(max(updates) * 1e3, 3),
        },
        "kill_test": kill,
        "kill_test_exit": kill_rc,
    }
    lines = [
        "| measure | n | median | p99 / max | target | |",
        "|---|---:|---:|---:|---:|---|",
        f"| (1a) restore + adopt_orphans on a Scheduler ({args.done:,} done, {args.queued:,} "
        f"queued) | {len(direct)} | {statistics.median(direct):.3f} s | max "
        f"{max(direct):.3f} s | – | |",
    ]
    passed = statistics.median(to_restore) <= RESTORE_TARGET
    ok &= passed
    lines.append(
        f"| (1b) Service.start() → restore + adopt_orphans done | {len(to_restore)} | "
        f"{statistics.median(to_restore):.3f} s | max {max(to_restore):.3f} s | ≤ "
        f"{RESTORE_TARGET:.0f} s | {'pass' if passed else 'FAIL'} |"
    )
    lines.append(
        f"| (1b) Service.start() → returns | {len(via_service)} | "
        f"{statistics.median(r['start_returned'] for r in via_service):.3f} s | max "
        f"{max(r['start_returned'] for r in via_service):.3f} s | – | |"
    )
    tm = result["transition_ms"]
    lines.append(
        f"| (2) one state transition (Registry.update, WAL, synchronous=FULL) | "
        f"{tm['n']} | {tm['median']:.2f} ms | {tm['p99']:.2f} ms | – | |"
    )
    if kill is not None:
        clean = kill.get("violations") == 0 and kill_rc == 0
        ok &= clean
        lines.append(
            f"| (3) kill test: {kill['runs']} runs, {kill['kills']} kills, {kill['jobs']} jobs, "
            f"{kill['invariant_checks']:,} invariant checks | – | – | – | violations 0 | "
            f"{kill['violations']} violations, {'pass' if clean else 'FAIL'} |"
        )
    elif not args.no_kill_test:
        ok = False
        lines.append("| (3) kill test | – | – | – | – | FAIL: no summary |")
    print("\n".join(lines))
    print(
        f"(1b) split, medians: restore {statistics.median(r['restore'] for r in via_service):.3f}"
        f" s, adopt_orphans {statistics.median(r['adopt'] for r in via_service):.3f} s; "
        f"registry {registry_mb:.1f} MB on {fs}"
    )
    if kill is not None:
        print(
            f"kill test: seed {kill['seed']}, phases {kill['kill_phases']}, notes "
            f"{kill['notes']}, {kill['seconds']} s"
        )
    write_results(args.out, result)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
