"""Kill the service at random points and at exact ones; after every restart nothing is lost.

Real processes throughout: `python -m stemdeck_watch run --no-tray` in a session of its own,
killed with SIGKILL (its separation worker is let go: it exits by itself once its parent is
gone, and the test waits for that), then started again. After every restart the registry (read
straight from the SQLite file, read-only) and the folders are checked:

- no job lost: every input is queued (or not yet seen), in processed/ or in failed/ — here
  never in failed/ — and in exactly one of those places;
- no outbox folder without its complete stems and manifest, nothing hidden in the outbox but
  an empty staging folder (and the service's own STATUS.txt temp file);
- no job separated twice: one manifest per input at most; the attempt count goes up by
  exactly one for the job a kill cut off, by nothing for any other, and never above
  `queue.resume_attempts`;
- the queue order kept: jobs queued before a kill keep their relative order after it, and the
  job the kill cut off is at the head.

`STEMDECK_KILL_SEED=N` replays a run (the kill instants and phases; the service's own timing
varies a little), `STEMDECK_KILLS=N` changes the number of kills (8 in `make test`, 20 in
`make soak`), and
`STEMDECK_KILL_SUMMARY=1` writes the totals to benchmarks/results/kill.json.

The deterministic windows run the service under tests/support/crash_seam.py, which SIGKILLs the
process at one exact point (published but `done` not stored; hard-linked into processed/ but
not unlinked; moved but `done` not stored; `done` stored; half-copied and fully copied across
filesystems; the head of the queue taken but not started).
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import random
import re
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from stemdeck_watch.ui.folder import STATUS_FILE, is_status_temp
from stemdeck_watch.stages.manifest import read_manifest
from stemdeck_watch.store.registry import REGISTRY_FILE
from stemdeck_watch.util.synth import write_song

from support.helpers import REPO, processes, write_config
from support.published_checks import damaged_stems

pytestmark = pytest.mark.slow

RUNNING = ("downloading", "decoding", "separating", "publishing")
SONGS = 10
STARTED = "stemdeck-watch is running"
SUMMARY = REPO / "benchmarks" / "results" / "kill.json"
STAGING = ".stemdeck-staging"


# ---------------------------------------------------------------- reading what is on disk


class Snapshot:
    """The registry as a restart would find it: every job, and the queued order."""

    def __init__(self, jobs: dict[str, dict[str, Any]], order: list[str]):
        self.jobs = jobs
        self.order = order

    @classmethod
    def read(cls, state: Path) -> Snapshot:
        path = state / REGISTRY_FILE
        if not path.exists():
            return cls({}, [])
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=10, isolation_level=None)
        try:
            db.execute("BEGIN")  # one read transaction: the jobs and the order agree
            rows = db.execute(
                "SELECT id, name, state, source, rel_path, attempts, position, "
                "output, sha256, error, created_at FROM jobs"
            ).fetchall()
            order = [
                r[0]
                for r in db.execute(
                    "SELECT id FROM jobs WHERE state = 'queued' "
                    "ORDER BY position IS NULL, position, created_at, rowid"
                )
            ]
        except sqlite3.OperationalError as exc:
            if "no such table" in str(exc):
                return cls({}, [])
            raise
        finally:
            db.close()
        keys = (
            "id",
            "name",
            "state",
            "source",
            "rel_path",
            "attempts",
            "position",
            "output",
            "sha256",
            "error",
            "created_at",
        )
        return cls({r[0]: dict(zip(keys, r)) for r in rows}, order)

    def running(self) -> list[str]:
        return [i for i, j in self.jobs.items() if j["state"] in RUNNING]

    def by_name(self, name: str) -> list[dict[str, Any]]:
        """The jobs of one input (by its song name), newest first."""
        return sorted(
            (j for j in self.jobs.values() if j["name"] == name),
            key=lambda j: j["created_at"],
            reverse=True,
        )


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def descendants(pid: int) -> set[int]:
    """The live children of `pid`, their children… (the worker runs in a session of its own,
    so the service's process group does not hold it)."""
    table = processes()
    found, frontier = set(), {pid}
    while frontier:
        frontier = {
            p for p, (parent, state) in table.items() if parent in frontier and state != "Z"
        } - found
        found |= frontier
    return found


def alive(pids: set[int]) -> set[int]:
    table = processes()
    return {p for p in pids if p in table and table[p][1] != "Z"}


class Life:
    """One run of the service as a subprocess, in a session of its own (its worker too)."""

    def __init__(
        self, config: Path, log: Path, seam: str | None = None, env: dict[str, str] | None = None
    ):
        self.log_path = log
        self._log = open(log, "w")
        prefix = (
            [str(REPO / "tests" / "support" / "crash_seam.py"), seam]
            if seam
            else ["-m", "stemdeck_watch"]
        )
        self.proc = subprocess.Popen(
            [sys.executable, *prefix, "run", "--no-tray", "--config", str(config)],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, **(env or {})},
        )
        self.started_at = time.monotonic()
        self.tracked: set[int] = set()  # the processes it started (its worker)

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def started(self) -> bool:
        return STARTED in self.output()

    def wait_started(self, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        while not self.started():
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"the service exited ({self.proc.returncode}) before it "
                    f"started:\n{self.output()[-3000:]}"
                )
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"the service did not start within {timeout:.0f} s:\n{self.output()[-3000:]}"
                )
            time.sleep(0.02)

    def kill(self) -> float:
        """SIGKILL the service alone; returns how long its worker took to go by itself."""
        if self.proc.poll() is None:
            self.tracked |= descendants(self.proc.pid)
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self.tracked |= self.worker_pids()
        return self.wait_children_gone()

    def worker_pids(self) -> set[int]:
        return {int(p) for p in re.findall(r"started separation worker (\d+)", self.output())}

    def wait_children_gone(self, timeout: float = 15.0) -> float:
        start = time.monotonic()
        while alive(self.tracked):
            if time.monotonic() - start > timeout:
                left = alive(self.tracked)
                self.force()
                raise AssertionError(
                    f"processes {sorted(left)} outlived the killed service by {timeout:.0f} s"
                )
            time.sleep(0.02)
        self._log.close()
        return time.monotonic() - start

    def stop(self, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.tracked |= descendants(self.proc.pid)
            self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(timeout)
        self.wait_children_gone()
        return code

    def force(self) -> None:
        """Whatever happened, leave nothing running: the service and the processes it
        started, each by its id."""
        if self.proc.poll() is None:
            self.tracked |= descendants(self.proc.pid)
            self.proc.kill()
        self.proc.wait()
        for pid in alive(self.tracked):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self._log.close()


# ---------------------------------------------------------------- the invariants


class Invariants:
    """Checks the folders and the registry; counts every check and keeps every violation."""

    def __init__(
        self, root: Path, songs: dict[str, str], resume_attempts: int, processed: Path | None = None
    ):
        self.inbox, self.outbox = root / "inbox", root / "outbox"
        self.processed, self.failed = processed or root / "processed", root / "failed"
        self.state = root / "state"
        self.songs = songs  # file name -> sha256
        self.resume_attempts = resume_attempts
        self.checks = 0
        self.violations: list[str] = []
        self.notes: collections.Counter[str] = collections.Counter()
        self.context = ""

    def expect(self, ok: bool, message: str) -> None:
        self.checks += 1
        if not ok:
            self.violations.append(f"{self.context}: {message}")

    # -- after every restart, once restore and orphan adoption are over
    def after_restart(self, before: Snapshot, seen_order: list[str], after: Snapshot) -> None:
        self.folders(after)
        self.jobs(before, after)
        self.order(before, seen_order, after)

    def folders(self, now: Snapshot) -> None:
        outputs = {j["output"]: j for j in now.jobs.values() if j["state"] == "done"}
        by_sha: collections.Counter[str] = collections.Counter()
        by_job: collections.Counter[str] = collections.Counter()
        for entry in sorted(self.outbox.iterdir()):
            if entry.name == STATUS_FILE:
                continue
            if entry.name == STAGING:
                inside = [p.name for p in entry.iterdir()]
                publishing = {i for i, j in now.jobs.items() if j["state"] == "publishing"}
                self.expect(
                    set(inside) <= publishing,
                    f"the staging folder holds {inside} after the restore",
                )
                if not inside:
                    self.notes["an empty .stemdeck-staging folder in the outbox"] += 1
                continue
            if is_status_temp(entry.name):
                self.notes["a killed STATUS.txt rewrite left its temporary copy"] += 1
                continue
            self.expect(not entry.name.startswith("."), f"hidden {entry.name} in the outbox")
            self.expect(entry.is_dir(), f"a stray file {entry.name} in the outbox")
            if not entry.is_dir():
                continue
            manifest = read_manifest(entry)
            self.expect(
                manifest is not None,
                f"outbox folder {entry.name} lacks complete stems and manifest",
            )
            if manifest is None:
                continue
            for bad in damaged_stems(entry):
                self.expect(False, f"outbox/{entry.name}: {bad}")
            by_sha[manifest["input"]["sha256"]] += 1
            by_job[manifest["job_id"]] += 1
            job = outputs.get(str(entry))
            self.expect(
                job is not None and job["id"] == manifest["job_id"],
                f"outbox folder {entry.name} is not the output of its done job",
            )
        for sha, count in by_sha.items():
            self.expect(count == 1, f"{count} song folders for one input ({sha[:12]})")
        for job_id, count in by_job.items():
            self.expect(count == 1, f"{count} song folders for job {job_id}")
        for folder in (self.processed, self.failed):
            hidden = [p.name for p in folder.iterdir() if p.name.startswith(".")]
            self.expect(not hidden, f"hidden leftovers in {folder.name}/: {hidden}")

        for name, digest in self.songs.items():
            stem = Path(name).stem
            places = [
                folder.name
                for folder in (self.inbox, self.processed, self.failed)
                if (folder / name).exists()
            ]
            copies = [p.name for p in self.processed.glob(f"{stem} (*)*")]
            self.expect(len(places) == 1, f"{name} is in {places or 'no folder'}")
            self.expect(not copies, f"{name} was moved to processed/ twice: {copies}")
            self.expect("failed" not in places, f"{name} is in failed/")
            jobs = now.by_name(stem)
            latest = jobs[0] if jobs else None
            if "processed" in places:
                self.expect(
                    sha256(self.processed / name) == digest,
                    f"processed/{name} is not the input it was",
                )
                self.expect(
                    latest is not None and latest["state"] == "done",
                    f"{name} is in processed/ but its job is {latest and latest['state']}",
                )
            if "inbox" in places:
                self.expect(
                    latest is None or latest["state"] in ("queued", *RUNNING),
                    f"{name} is in the inbox but its job is {latest and latest['state']}",
                )
            if latest is not None and latest["state"] == "done":
                self.expect(
                    latest["source"] == str(self.processed / name),
                    f"done job of {name} says its input is at {latest['source']}, "
                    f"not {self.processed / name}",
                )
                manifest = read_manifest(Path(latest["output"] or "/nonexistent"))
                self.expect(
                    manifest is not None and manifest["input"]["sha256"] == digest,
                    f"the done job of {name} has no complete output folder",
                )
        states = collections.Counter(j["state"] for j in now.jobs.values())
        self.expect(
            not (states["failed"] or states["cancelled"]),
            f"jobs failed or cancelled: {dict(states)}",
        )
        self.expect(sum(states[s] for s in RUNNING) <= 1, f"two jobs running: {dict(states)}")
        self.expect(
            len(now.jobs) == len({j["name"] for j in now.jobs.values()}),
            f"an input has two jobs: {sorted(j['name'] for j in now.jobs.values())}",
        )

    def jobs(self, before: Snapshot, after: Snapshot) -> None:
        cut_off = set(before.running())
        for job_id, old in before.jobs.items():
            new = after.jobs.get(job_id)
            self.expect(new is not None, f"job {job_id} ({old['name']}) vanished")
            if new is None:
                continue
            if job_id in cut_off:
                if new["state"] == "done" and new["attempts"] == old["attempts"]:
                    self.notes["cut off after publishing: done without a new attempt"] += 1
                else:
                    self.expect(
                        new["attempts"] == old["attempts"] + 1,
                        f"{old['name']} was cut off {old['state']}: attempts "
                        f"{old['attempts']} -> {new['attempts']}",
                    )
            else:
                self.expect(
                    new["attempts"] == old["attempts"],
                    f"{old['name']} ({old['state']}) was not running, yet attempts "
                    f"{old['attempts']} -> {new['attempts']}",
                )
            self.expect(
                new["attempts"] <= self.resume_attempts,
                f"{old['name']}: attempts {new['attempts']} > resume_attempts",
            )
        for job_id, new in after.jobs.items():
            if job_id not in before.jobs:
                self.expect(new["attempts"] == 0, f"new job {new['name']} has attempts")

    def order(self, before: Snapshot, seen: list[str], after: Snapshot) -> None:
        queued = after.order
        # A queued job without a position in the registry was taken by the dispatcher (the
        # head) and not yet started when the kill hit (see test_window_taken): it must be
        # restored at the head, not behind the others.
        taken = [
            j
            for j in seen
            if j in before.jobs
            and before.jobs[j]["state"] == "queued"
            and before.jobs[j]["position"] is None
        ]
        rest = [j for j in seen if j not in taken]
        kept = [j for j in queued if j in rest]
        self.expect(
            kept == [j for j in rest if j in kept],
            f"queue order not kept: before the kill {self.names(seen, before)}, "
            f"after the restart {self.names(queued, after)}",
        )
        for job_id in taken:
            ahead = [j for j in queued if j in rest][:1]
            if job_id in queued and ahead and queued.index(job_id) > queued.index(ahead[0]):
                self.expect(
                    False,
                    f"the head of the queue ({before.jobs[job_id]['name']}), "
                    f"taken but not started when the kill hit, was restored "
                    f"behind {self.names(queued, after)}",
                )
        # two jobs can be cut off at once (one publishing behind the next one's
        # separation): together they head the restored queue
        cut_off = [j for j in before.running() if j in queued]
        for job_id in cut_off:
            if job_id in queued:
                self.expect(
                    queued.index(job_id) < len(cut_off),
                    f"the job cut off ({before.jobs[job_id]['name']}) is not at the head"
                    f" of the restored queue {self.names(queued, after)}",
                )
        old = [j for j in queued if j in before.jobs]
        new = [j for j in queued if j not in before.jobs]
        self.expect(
            queued == old + new,
            f"a job queued after the restart is ahead of older ones: {self.names(queued, after)}",
        )

    @staticmethod
    def names(order: list[str], snap: Snapshot) -> list[str]:
        return [snap.jobs[j]["name"] if j in snap.jobs else j for j in order]

    # -- at the very end
    def all_done_once(self, now: Snapshot) -> None:
        self.context = "end"
        self.folders(now)
        stems = sorted(Path(n).stem for n in self.songs)
        done = sorted(j["name"] for j in now.jobs.values() if j["state"] == "done")
        self.expect(done == stems, f"done: {done}")
        self.expect(
            sorted(p.name for p in self.processed.iterdir()) == sorted(self.songs),
            f"processed/ holds {sorted(p.name for p in self.processed.iterdir())}",
        )
        self.expect(
            sorted(p.name for p in self.outbox.iterdir() if p.is_dir() and p.name != STAGING)
            == stems,
            f"the outbox holds {sorted(p.name for p in self.outbox.iterdir())}",
        )
        self.expect(
            not [p for p in self.inbox.iterdir() if p.is_file()],
            f"the inbox still holds {sorted(p.name for p in self.inbox.iterdir())}",
        )


# ---------------------------------------------------------------- kill at random points


def make_songs(folder: Path, count: int = SONGS) -> dict[str, Path]:
    """Short songs with distinct seeds (1.2 to 2 s), written outside the inbox."""
    folder.mkdir(parents=True, exist_ok=True)
    return {
        f"song{i:02d}.wav": write_song(
            folder / f"song{i:02d}.wav", 1.2 + 0.8 * i / max(1, count - 1), seed=1000 + i
        )
        for i in range(count)
    }


def watch(
    life: Life,
    state: Path,
    deadline: float,
    changes: int | None = None,
    known: set[str] | None = None,
) -> list[str]:
    """Poll the registry until `deadline` or, with `changes`, until that many job state
    changes were seen; returns the last queue order seen — what "before the kill" means for
    the order check. `known` collects the jobs seen queued with a place in the order: one
    that loses its place while still `queued` was taken by the dispatcher (the head), and
    counts as first, not last as the registry lists it."""
    seen: list[str] = []
    states: dict[str, str] = {}
    known = set() if known is None else known
    count = 0
    while time.monotonic() < deadline and life.proc.poll() is None:
        try:
            snap = Snapshot.read(state)
        except sqlite3.Error:
            snap = None  # created this instant, or locked for a moment: look again
        if snap is not None:
            placed = {i for i in snap.order if snap.jobs[i]["position"] is not None}
            taken = [i for i in snap.order if i not in placed and i in known]
            seen = taken + [i for i in snap.order if i not in taken]
            known |= placed
            now = {i: j["state"] for i, j in snap.jobs.items()}
            count += sum(1 for i, s in now.items() if i in states and states[i] != s)
            states = now
            if changes is not None and count >= changes:
                break
            if (
                changes is not None
                and len(snap.jobs) == SONGS
                and not snap.order
                and not snap.running()
            ):
                break  # nothing left to do: no change will come
        time.sleep(0.01)
    return seen


def run_kill_test(root: Path, model_repo: Path, seed: int, kills: int) -> dict[str, Any]:
    """The whole random kill run; returns its totals (raises on a violation)."""
    rng = random.Random(seed)
    resume_attempts = kills  # a job hit by every kill still must not fail here
    config = write_config(
        root,
        model_repo,
        queue={"start_paused_after_restore": False, "resume_attempts": resume_attempts},
    )
    state = root / "state"
    for name in ("inbox", "outbox", "processed", "failed", "state"):
        (root / name).mkdir(exist_ok=True)
    songs = make_songs(root / "songs")
    for name, path in songs.items():
        os.replace(path, root / "inbox" / name)
    checks = Invariants(root, {n: sha256(root / "inbox" / n) for n in songs}, resume_attempts)
    phases: collections.Counter[str] = collections.Counter()
    worker_exit: list[float] = []
    started = time.monotonic()
    before: Snapshot | None = None
    seen: list[str] = []
    for life_no in range(kills + 1):
        life = Life(config, root / f"life-{life_no:02d}.log")
        try:
            if before is not None:
                life.wait_started()
                checks.context = f"restart {life_no} (seed {seed})"
                checks.after_restart(before, seen, Snapshot.read(state))
                assert not checks.violations, "\n".join(checks.violations)
            if life_no == kills:
                break
            known: set[str] = set()
            if rng.random() < 0.15:  # anywhere: start-up, restore, the worker's warm-up
                seen = watch(life, state, life.started_at + rng.uniform(0.0, 3.0), None, known)
            else:
                # mostly while jobs run: after a random number of job state changes (each
                # job makes four: decoding, separating, publishing, done), then at once (in
                # that state, mostly), a moment later, or a while later
                changes = rng.randint(1, 4)
                delay = rng.choice([0.0, rng.uniform(0.0, 0.05), rng.uniform(0.0, 0.4)])
                seen = watch(life, state, time.monotonic() + 60, changes, known)
                seen = watch(life, state, time.monotonic() + delay, None, known) or seen
            worker_exit.append(life.kill())
        except BaseException:
            life.force()
            raise
        before = Snapshot.read(state)
        cut = before.running()
        phase = (
            before.jobs[cut[0]]["state"]
            if cut
            else "start-up"
            if not before.jobs
            else "between jobs"
        )
        phases[phase] += 1
        done = sum(j["state"] == "done" for j in before.jobs.values())
        print(
            f"kill {life_no + 1:2d}: {before.jobs[cut[0]]['name'] if cut else '-':7s} "
            f"{phase:12s} done {done}/{len(songs)}"
        )
    try:
        deadline = time.monotonic() + 120
        while True:
            snap = Snapshot.read(state)
            if sum(j["state"] == "done" for j in snap.jobs.values()) == len(songs):
                break
            assert time.monotonic() < deadline, f"not all done: {snap.jobs}"
            assert life.proc.poll() is None, life.output()[-3000:]
            time.sleep(0.05)
        assert life.stop() == 0, life.output()[-3000:]
    finally:
        life.force()
    checks.all_done_once(Snapshot.read(state))
    assert not checks.violations, "\n".join(checks.violations)
    final = Snapshot.read(state)
    return {
        "seed": seed,
        "runs": kills + 1,
        "kills": kills,
        "jobs": len(songs),
        "invariant_checks": checks.checks,
        "violations": len(checks.violations),
        "kill_phases": dict(phases),
        "notes": dict(checks.notes),
        "attempts_total": sum(j["attempts"] for j in final.jobs.values()),
        "separations_at_most": sum(j["attempts"] + 1 for j in final.jobs.values()),
        "worker_gone_after_kill_s_max": round(max(worker_exit, default=0.0), 3),
        "seconds": round(time.monotonic() - started, 1),
    }


@pytest.mark.timeout(600)
def test_kill_at_random_points(tmp_path: Path, model_repo: Path) -> None:
    seed = int(os.environ.get("STEMDECK_KILL_SEED") or random.SystemRandom().randrange(10**6))
    kills = int(os.environ.get("STEMDECK_KILLS") or 8)
    print(f"\nkill test: seed {seed}, {kills} kills (STEMDECK_KILL_SEED={seed} replays it)")
    summary = run_kill_test(tmp_path, model_repo, seed, kills)
    print(json.dumps(summary, indent=2))
    if os.environ.get("STEMDECK_KILL_SUMMARY"):
        SUMMARY.parent.mkdir(parents=True, exist_ok=True)
        SUMMARY.write_text(json.dumps(summary, indent=2) + "\n")


# ---------------------------------------------------------------- deterministic windows


@pytest.fixture
def other_filesystem(tmp_path: Path) -> Iterator[Path | None]:
    """A folder on another filesystem than tmp_path (/dev/shm), or None where there is none."""
    folder = None
    try:
        folder = Path(tempfile.mkdtemp(prefix="stemdeck-kill-", dir="/dev/shm"))
    except OSError:
        pass
    if folder is not None and folder.stat().st_dev == tmp_path.stat().st_dev:
        folder.rmdir()
        folder = None
    try:
        yield folder
    finally:
        if folder is not None:
            subprocess.run(["rm", "-rf", "--", str(folder)], check=False)


def crash_in(
    window: str,
    root: Path,
    model_repo: Path,
    names: list[str],
    processed: Path | None = None,
    **queue: Any,
) -> tuple[Path, dict[str, str], dict[str, str]]:
    """Drop songs, run the service under the crash seam until it kills itself in `window`;
    returns the config and the environment a restart needs, and the songs' sha256."""
    folders = {"processed": str(processed)} if processed else {}
    config = write_config(root, model_repo, folders=folders, queue=queue)
    processed = processed or root / "processed"
    # no second filesystem at hand: the seam makes links and renames into processed/ fail
    # with EXDEV, as they do across filesystems
    fake = window in ("copying", "copied") and processed.parent.stat().st_dev == root.stat().st_dev
    env = {
        "STEMDECK_SEAM_PROCESSED": str(processed),
        "STEMDECK_SEAM_FAKE_EXDEV": "1" if fake else "0",
    }
    (root / "inbox").mkdir(exist_ok=True)
    digests = {}
    for i, name in enumerate(names):
        song = write_song(root / "songs" / name, 1.2, seed=50 + i)
        digests[name] = sha256(song)
        os.replace(song, root / "inbox" / name)
    life = Life(config, root / f"crash-{window}.log", seam=window, env=env)
    try:
        code = life.proc.wait(120)
        life.tracked |= life.worker_pids()
        life.wait_children_gone()
    finally:
        life.force()
    assert code == -signal.SIGKILL and "crash seam: SIGKILL" in life.output(), (
        f"the seam did not fire (exit {code}):\n{life.output()[-3000:]}"
    )
    return config, env, digests


def restart_until_done(root: Path, config: Path, env: dict[str, str], count: int) -> Snapshot:
    life = Life(config, root / "restart.log", seam="none", env=env)
    try:
        life.wait_started()
        deadline = time.monotonic() + 90
        while True:
            snap = Snapshot.read(root / "state")
            if sum(j["state"] == "done" for j in snap.jobs.values()) >= count:
                break
            assert time.monotonic() < deadline, f"not done after the restart: {snap.jobs}"
            time.sleep(0.05)
        assert life.stop() == 0, life.output()[-3000:]
    finally:
        life.force()
    return Snapshot.read(root / "state")


WINDOW_STATE = {
    # what the crash left, checked before the restart so that a seam which fires elsewhere
    # cannot pass for the window it names: (state of the job, where the input is)
    "published": ("publishing", {"inbox"}),
    "linked": ("publishing", {"inbox", "processed"}),
    "moved": ("publishing", {"processed"}),
    "done": ("done", {"processed"}),
    "copying": ("publishing", {"inbox"}),
    "copied": ("publishing", {"inbox", "processed"}),
}


@pytest.mark.parametrize("window", list(WINDOW_STATE))
def test_window(
    window: str, tmp_path: Path, model_repo: Path, other_filesystem: Path | None
) -> None:
    """A kill at one exact point of a job's end, then a restart: the song is done exactly
    once, its input in processed/ (once, no hidden partial copy), one song folder."""
    processed = None
    if window in ("copying", "copied") and other_filesystem is not None:
        processed = other_filesystem / "processed"  # a real move across filesystems
    config, env, digests = crash_in(
        window, tmp_path, model_repo, ["song.wav"], processed, start_paused_after_restore=False
    )
    processed = processed or tmp_path / "processed"
    crash = Snapshot.read(tmp_path / "state")
    (job,) = crash.jobs.values()
    state, places = WINDOW_STATE[window]
    found = {
        f
        for f, folder in (("inbox", tmp_path / "inbox"), ("processed", processed))
        if (folder / "song.wav").exists()
    }
    assert (job["state"], found) == (state, places), (job, found)
    assert read_manifest(tmp_path / "outbox" / "song") is not None  # published in every window
    if window == "copying":
        (partial,) = processed.glob(".song.wav.*.stemdeck-tmp")
        assert 0 < partial.stat().st_size < (tmp_path / "inbox" / "song.wav").stat().st_size

    after = restart_until_done(tmp_path, config, env, 1)
    checks = Invariants(tmp_path, digests, 1, processed)
    checks.context = f"window {window}"
    checks.jobs(crash, after)
    checks.all_done_once(after)
    assert after.jobs[job["id"]]["attempts"] == 0  # published before the kill: not run again
    assert not checks.violations, "\n".join(checks.violations)


def test_window_taken(tmp_path: Path, model_repo: Path) -> None:
    """Killed just after the dispatcher took the head of the queue, before the job's first
    stage was written: after the restart that job is still at the head."""
    names = ["a.wav", "b.wav", "c.wav"]
    config, env, _ = crash_in("taken", tmp_path, model_repo, names)  # restored paused
    crash = Snapshot.read(tmp_path / "state")
    assert sorted(j["state"] for j in crash.jobs.values()) == ["queued"] * 3
    # the head, taken but not started, keeps its place on record (it once lost it)
    assert all(j["position"] is not None for j in crash.jobs.values()), crash.jobs
    expected = crash.order
    life = Life(config, tmp_path / "restart.log", seam="none", env=env)
    try:
        life.wait_started()
        restored = Snapshot.read(tmp_path / "state")
        assert life.stop() == 0
    finally:
        life.force()
    assert all(j["attempts"] == 0 for j in restored.jobs.values())  # it never ran
    assert Invariants.names(restored.order, restored) == Invariants.names(expected, crash)
