"""Fault injection: an I/O error at the N-th call of one kind while a job runs, then a restart.

A wrapper in the tests (monkeypatched, never a production code path) makes the N-th call of
one kind, made by any of the service's threads while one job goes through an in-process
service, fail — N = 1, 2, … for each kind:

  open      opening a file for writing            OSError ENOSPC / EIO
  write     write() on a file opened for writing  OSError ENOSPC / EIO
  fsync     os.fsync                              OSError EIO / ENOSPC
  rename    os.rename (the publish rename)        OSError EIO
  replace   os.replace (STATUS.txt)               OSError EIO
  link      os.link (moving the input)            OSError EIO
  unlink    os.unlink (scratch, moving the input) OSError EIO
  commit    a registry commit                     sqlite3.OperationalError "disk I/O error" /
            (an autocommit write, or COMMIT:      "database or disk is full" — what SQLite
            the transaction is rolled back)       raises for EIO / ENOSPC
  unlink-input  the unlink that finishes moving the input out of the inbox (OSError ENOSPC)
  commit-done   the commit that stores `done`       (sqlite3.OperationalError, as above)

The jobs of one group (GROUPS) share a service (each with its own song and its own armed fault; a job
that does not reach a final state restarts the service at once); then the service is
restarted and, straight after its restore, checked: every input is in the inbox, processed/ or
failed/ — exactly one of them, never deleted; no partial folder and nothing hidden in the
outbox; every job is in exactly one final state or queued again; a song folder belongs to a
done job and a done job has its song folder. Then the requeued jobs run and everything is
checked once more, with every job final.
"""

from __future__ import annotations

import builtins
import collections
import errno
import io
import os
import sqlite3
import threading
import time
import zlib
from pathlib import Path
from typing import Any, Callable

import pytest

from stemdeck_watch.core.config import Settings
from stemdeck_watch.core.jobs import Job, JobState
from stemdeck_watch.core.paths import report_path
from stemdeck_watch.stages.manifest import read_manifest
from stemdeck_watch.util.synth import write_song

from support.helpers import outbox_entries
from support.published_checks import damaged_stems

pytestmark = pytest.mark.slow

# N = 1..k for each kind: k covers every call one job makes of the rarer kinds, and the
# first calls (decode, the first stems, the first registry writes) of the frequent ones. The
# commit that stores `done` comes last in a job, after a varying number of progress writes,
# and the unlink that finishes moving the input comes after the scratch files' unlinks: each
# is aimed at by a kind of its own. The kinds of a group share one service.
GROUPS: dict[str, list[tuple[str, int]]] = {
    "open-write": [("open", n) for n in (1, 2, 3)] + [("write", n) for n in (1, 2, 3, 4, 5, 6)],
    "fsync-rename-replace-link-unlink": [("fsync", n) for n in (1, 2, 3, 4, 5)]
    + [("rename", 1), ("replace", 1), ("replace", 2), ("link", 1)]
    + [("unlink", n) for n in (1, 2)],  # scratch files (the later ones alike)
    "commit": [("commit", n) for n in (1, 2, 3, 4, 5, 6)],
    "unlink-input": [("unlink-input", 1)],
    "commit-done": [("commit-done", 1)],
}
KNOWN_DEFECTS: dict[str, str] = {}  # fixed; kept for the next one found
SETTLE = 2.0  # a job whose fault fired and that shows no change for this long has settled


class Injector:
    """The armed fault: fails the N-th call of `kind` made by the service's threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.kind: str | None = None
        self.nth = 0
        self.calls = 0
        self.fired: str | None = None
        self.counts: collections.Counter[str] = collections.Counter()  # every call, by kind
        self.inbox: Path | None = None  # for "unlink-input"
        self.handles: list[Any] = []  # the files wrapped for "write"

    def arm(self, kind: str, nth: int) -> None:
        with self._lock:
            self.kind, self.nth, self.calls, self.fired = kind, nth, 0, None
            self.counts.clear()

    def disarm(self) -> None:
        with self._lock:
            self.kind = None

    def hit(self, kind: str, what: str) -> bool:
        """True if this call must fail (it is the armed N-th one)."""
        if threading.current_thread() is threading.main_thread():
            return False  # the test itself
        with self._lock:
            self.counts[kind] += 1
            if kind != self.kind:
                return False
            self.calls += 1
            if self.calls != self.nth or self.fired:
                return False
            self.fired = f"{kind} #{self.nth} on thread {threading.current_thread().name}: {what}"
            return True

    def oserror(self, path: object = None) -> OSError:
        code = errno.ENOSPC if self.nth % 2 else errno.EIO
        return OSError(code, os.strerror(code), None if path is None else str(path))

    def sqlerror(self) -> sqlite3.OperationalError:
        return sqlite3.OperationalError(
            "database or disk is full" if self.nth % 2 else "disk I/O error"
        )


class FaultyFile:
    """A file opened for writing whose write() goes through the injector."""

    def __init__(self, handle: Any, injector: Injector):
        self._handle = handle
        self._injector = injector

    def write(self, data: Any) -> int:
        if self._injector.hit("write", getattr(self._handle, "name", "?")):
            raise self._injector.oserror(getattr(self._handle, "name", None))
        return self._handle.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._handle, name)

    def __enter__(self) -> FaultyFile:
        self._handle.__enter__()
        return self

    def __exit__(self, *exc: Any) -> Any:
        return self._handle.__exit__(*exc)

    def __iter__(self) -> Any:
        return iter(self._handle)


class FaultyConnection:
    """The registry's SQLite connection with its commits going through the injector.

    A commit is an INSERT/UPDATE/DELETE outside an explicit transaction (autocommit) or a
    COMMIT; a failed COMMIT rolls its transaction back, as SQLite does on an I/O error."""

    def __init__(self, db: sqlite3.Connection, injector: Injector):
        self._db = db
        self._injector = injector
        self._in_transaction = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._db, name)

    def _check(self, sql: str, params: Any = ()) -> None:
        verb = sql.split(None, 1)[0].upper()
        if verb == "BEGIN":
            self._in_transaction = True
        elif verb in ("COMMIT", "ROLLBACK"):
            self._in_transaction = False
            if verb == "COMMIT" and self._injector.hit("commit", sql.strip()[:60]):
                self._db.execute("ROLLBACK")
                raise self._injector.sqlerror()
        elif verb in ("INSERT", "UPDATE", "DELETE") and not self._in_transaction:
            what = " ".join(sql.split())[:60]
            stores_done = (
                verb == "UPDATE"
                and isinstance(params, (tuple, list))
                and JobState.DONE.value in params
            )
            if self._injector.hit("commit", what) or (
                stores_done and self._injector.hit("commit-done", what)
            ):
                raise self._injector.sqlerror()

    def execute(self, sql: str, *args: Any) -> sqlite3.Cursor:
        self._check(sql, *args[:1])
        return self._db.execute(sql, *args)

    def executemany(self, sql: str, *args: Any) -> sqlite3.Cursor:
        self._check(sql)
        return self._db.executemany(sql, *args)


@pytest.fixture
def injector(monkeypatch: pytest.MonkeyPatch) -> Injector:
    faults = Injector()
    real_open, real_io_open = builtins.open, io.open

    def opener(real: Callable[..., Any]) -> Callable[..., Any]:
        def open_(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
            writing = any(c in mode for c in "wax+")
            if writing and faults.hit("open", str(file)):
                raise faults.oserror(file)
            handle = real(file, mode, *args, **kwargs)
            if writing and faults.kind == "write":
                faults.handles.append(handle)
                return FaultyFile(handle, faults)
            return handle

        return open_

    monkeypatch.setattr(builtins, "open", opener(real_open))
    monkeypatch.setattr(io, "open", opener(real_io_open))
    for name in ("fsync", "rename", "replace", "link", "unlink"):
        real = getattr(os, name)

        def call(
            *args: Any, _real: Callable[..., Any] = real, _name: str = name, **kwargs: Any
        ) -> Any:
            if faults.hit(_name, " ".join(str(a) for a in args)):
                raise faults.oserror(args[-1] if args else None)
            return _real(*args, **kwargs)

        monkeypatch.setattr(os, name, call)
    real_unlink = os.unlink

    def unlink(path: Any, *args: Any, **kwargs: Any) -> Any:
        inbox = faults.inbox
        if (
            inbox is not None
            and isinstance(path, (str, os.PathLike))
            and Path(path).parent == inbox
            and faults.hit("unlink-input", str(path))
        ):
            raise faults.oserror(path)
        return real_unlink(path, *args, **kwargs)

    monkeypatch.setattr(os, "unlink", unlink)
    return faults


class Run:
    """A service under fault injection, restarted at will; the jobs' songs by name."""

    def __init__(self, settings: Settings, service_factory: Callable[..., Any], faults: Injector):
        self.settings = settings
        self.folders = settings.paths
        self._factory = service_factory
        self.faults = faults
        self.songs: dict[str, bytes] = {}  # inbox file name -> its bytes
        self.fired: dict[str, str | None] = {}
        self.service: Any = None
        faults.inbox = self.folders.inbox
        self.start()

    def start(self, warm: bool = True) -> None:
        self.service, _ = self._factory(self.settings)
        self.service.registry._db = FaultyConnection(self.service.registry._db, self.faults)
        deadline = time.monotonic() + 60
        while warm and not self._warm():  # the worker has the model: a job's calls are its own
            assert time.monotonic() < deadline, "the worker did not load the model"
            time.sleep(0.05)

    def _warm(self) -> bool:
        proc = self.service.client._proc
        return bool(proc is not None and proc.model is not None)

    def restart(self, warm: bool = True) -> None:
        self.service.shutdown()
        self.start(warm)

    def _wait_idle(self, timeout: float = 30.0) -> None:
        """Until the dispatcher is done with the last job (its calls are not the next's)."""
        deadline = time.monotonic() + timeout
        while self.service.pipeline._lock.locked() or self.service.queue.running():
            assert time.monotonic() < deadline, "the service did not come to rest"
            time.sleep(0.02)

    def job_of(self, name: str) -> Job | None:
        jobs = [j for j in self.service.registry.jobs() if Path(j.rel_path).name == name]
        return jobs[0] if jobs else None  # newest first

    def one_job(
        self, kind: str, nth: int, seconds: float = 1.2, stuck_ok: bool = True
    ) -> Job | None:
        """Drop a song with the N-th call of `kind` armed to fail; wait until its job is
        final, or (`stuck_ok`) the fault fired and nothing changed for SETTLE seconds."""
        name = f"{kind}-{nth}.wav"
        song = write_song(
            self.folders.state.parent / "songs" / name, seconds, seed=zlib.crc32(name.encode())
        )
        self.songs[name] = song.read_bytes()
        self._wait_idle()
        self.faults.arm(kind, nth)
        os.replace(song, self.folders.inbox / name)
        deadline = time.monotonic() + 90
        last, since = None, time.monotonic()
        try:
            while True:
                job = self.job_of(name)
                if job is not None and job.state.is_final:
                    break
                busy = self.service.pipeline._lock.locked()  # a job is in the pipeline
                view = (job and (job.state, job.version), self.faults.fired, busy)
                if view != last:
                    last, since = view, time.monotonic()
                elif (
                    stuck_ok
                    and self.faults.fired
                    and not busy
                    and time.monotonic() - since > SETTLE
                ):
                    break  # stuck: the fault stopped it, and no job is running
                assert time.monotonic() < deadline, f"{name}: no end in 90 s ({job})"
                time.sleep(0.05)
        finally:
            self.faults.disarm()
            self.fired[name] = self.faults.fired
        return job

    # ------------------------------------------------------------ the invariants

    def check(self, final: bool) -> list[str]:
        folders = self.folders
        problems: list[str] = []
        jobs = {name: self.job_of(name) for name in self.songs}
        outputs = {}
        for name, job in jobs.items():
            where = [
                f for f in ("inbox", "processed", "failed") if (getattr(folders, f) / name).exists()
            ]
            fired = self.fired.get(name)
            label = f"{name} ({fired or 'no fault fired'})"
            if len(where) != 1:
                problems.append(f"{label}: the input is in {where or 'no folder'}")
            for place in where:
                if (getattr(folders, place) / name).read_bytes() != self.songs[name]:
                    problems.append(f"{label}: {place}/{name} is not the song dropped")
            if job is None:
                if final or where != ["inbox"]:
                    problems.append(f"{label}: no job (input in {where})")
                continue
            allowed = {JobState.DONE, JobState.FAILED} | (set() if final else {JobState.QUEUED})
            if job.state not in allowed:
                problems.append(f"{label}: job is {job.state.value} ({job.error})")
            if job.state is JobState.DONE:
                if job.output is None or read_manifest(Path(job.output)) is None:
                    problems.append(f"{label}: done without a complete song folder")
                else:
                    outputs[job.output] = name
                    problems += [f"{label}: {bad}" for bad in damaged_stems(Path(job.output))]
                if where != ["processed"] and not (where == ["inbox"] and job.error):
                    problems.append(f"{label}: done, the input in {where}, error {job.error}")
            if job.state is JobState.FAILED:
                if where != ["failed"] or not report_path(folders.failed / name).exists():
                    problems.append(
                        f"{label}: failed, the input in {where} (report: "
                        f"{report_path(folders.failed / name).exists()})"
                    )
            if job.state is JobState.CANCELLED:
                problems.append(f"{label}: cancelled, though nobody cancelled it: {job.error}")
        # (without STATUS.txt's temp file: the restarted service may be rewriting it as we
        # list; a failed rewrite removes it, which test_folder_control checks)
        for entry in [folders.outbox / name for name in sorted(outbox_entries(folders.outbox))]:
            if entry.name == ".stemdeck-staging":
                if list(entry.iterdir()):
                    problems.append(f"staging holds {[p.name for p in entry.iterdir()]}")
                continue
            if entry.name.startswith(".") or not entry.is_dir():
                problems.append(f"{entry.name} in the outbox")
                continue
            if read_manifest(entry) is None:
                problems.append(f"outbox/{entry.name} is a partial song folder")
            elif str(entry) not in outputs:
                owner = jobs.get(f"{entry.name}.wav")
                problems.append(
                    f"outbox/{entry.name} is published, but its job is "
                    f"{owner.state.value if owner else 'unknown'} "
                    f"({owner.error if owner else ''})"
                )
        for folder in (folders.processed, folders.failed):
            hidden = [p.name for p in folder.iterdir() if p.name.startswith(".")]
            if hidden:
                problems.append(f"hidden leftovers in {folder.name}/: {hidden}")
        return problems

    def settle_all(self, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            jobs = [self.job_of(name) for name in self.songs]
            if all(j is not None and j.state.is_final for j in jobs):
                return
            assert time.monotonic() < deadline, f"not final after the restart: {jobs}"
            time.sleep(0.05)


def marks(group: str) -> list[pytest.MarkDecorator]:
    found = []
    if group in KNOWN_DEFECTS:
        found.append(pytest.mark.xfail(strict=True, reason=KNOWN_DEFECTS[group]))
    if group == "open-write":
        # WAV/FLAC stems are written by soundfile through a Python file object: an OSError
        # raised by its write() inside soundfile's cffi callbacks is printed as "Exception
        # ignored" (an unraisable exception, a warning under pytest) and surfaces as an
        # AssertionError from soundfile. (A failed header write also leaves scratch's
        # AudioWriter file open; the test closes and names such files.) Neither loses a
        # song, which is what this test checks.
        found.append(pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning"))
    return found


@pytest.mark.timeout(300)
@pytest.mark.parametrize("group", [pytest.param(name, marks=marks(name)) for name in GROUPS])
def test_an_io_error_at_any_call_loses_nothing(
    group: str, make_settings, service_factory, injector: Injector
) -> None:
    settings = make_settings(queue={"start_paused_after_restore": False})
    (settings.paths.state.parent / "songs").mkdir(exist_ok=True)
    run = Run(settings, service_factory, injector)
    outcomes = []
    for kind, n in GROUPS[group]:
        job = run.one_job(kind, n)
        outcomes.append(
            f"{kind} #{n}: {run.fired[f'{kind}-{n}.wav'] or 'not fired'} -> "
            f"{job.state.value if job else 'no job'}"
            f"{' (' + job.error[:100] + ')' if job and job.error else ''}"
        )
        if job is None or not job.state.is_final:
            run.restart()  # at once: what the service left may hold the next job up
    print("\n" + "\n".join(outcomes))
    assert any(run.fired.values()), "no fault fired"
    run.restart(warm=False)  # the checks need the restore, not the worker
    problems = run.check(final=False)
    assert not problems, "after the restart:\n" + "\n".join(problems + ["", *outcomes])
    run.settle_all()
    problems = run.check(final=True)
    left_open = [h.name for h in injector.handles if not h.closed]
    for handle in injector.handles:  # closed here: garbage, they would warn in a later test
        handle.close()
    if left_open:
        print(f"files the service left open after a failed write: {left_open}")
    assert not problems, "once everything ran:\n" + "\n".join(problems + ["", *outcomes])


@pytest.mark.timeout(300)
def test_a_failed_registry_write_holds_no_song_up_until_a_restart(
    make_settings, service_factory, injector: Injector
) -> None:
    """A registry write failing while the service runs — a flaky share, a disk full for a
    moment — must not leave a song stuck (running in the registry, in no queue; or seen by
    the intake but never recorded) until someone restarts the service: every song still
    ends done or failed, in the same run, with the invariants intact."""
    settings = make_settings(queue={"start_paused_after_restore": False})
    (settings.paths.state.parent / "songs").mkdir(exist_ok=True)
    run = Run(settings, service_factory, injector)
    outcomes = []
    for kind, n in [("commit", n) for n in range(1, 7)] + [("commit-done", 1)]:
        job = run.one_job(kind, n, stuck_ok=False)
        outcomes.append(
            f"{kind} #{n}: {run.fired[f'{kind}-{n}.wav'] or 'not fired'} -> "
            f"{job.state.value if job else 'no job'}"
        )
    assert all(run.fired.values()), "\n".join(outcomes)
    problems = run.check(final=True)
    assert not problems, "without a restart:\n" + "\n".join(problems + ["", *outcomes])


def test_an_error_in_the_check_before_a_job_fails_that_song_and_the_queue_goes_on(
    make_settings, service_factory, monkeypatch
) -> None:
    """The dispatcher took the job: an unexpected error before separation ends it (failed,
    with the error), never leaves it taken while the queue goes on without it."""
    service, jobs = service_factory(make_settings())
    guard = service.dispatchers[0].guard
    assert guard is not None
    real_hold = guard.hold

    def hold(job: Job) -> bool:
        if job.name == "bad":
            raise ValueError("cannot convert float NaN to integer")
        return real_hold(job)

    monkeypatch.setattr(guard, "hold", hold)
    staging = service.settings.paths.state / "staging"
    staging.mkdir()
    for name in ("bad", "good"):
        song = write_song(staging / f"{name}.wav", 1.0)
        song.rename(service.settings.paths.inbox / song.name)
    ended = {job.name: job for job in jobs.wait_final(2, timeout=120)}
    assert ended["good"].state is JobState.DONE, ended
    assert ended["bad"].state is JobState.FAILED, ended
    assert "unexpected error: ValueError: cannot convert float NaN" in (ended["bad"].error or "")
