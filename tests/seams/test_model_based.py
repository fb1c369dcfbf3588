"""The seams net: a model-based, stateful test of the whole service.

Hypothesis drives the real service — `stemdeck-watch run` as a process (watcher, registry,
worker with the tiny model), with decode ahead and publish behind on (`queue.work_beside =
"on"`) — through random sequences of what people do: drop a song (new bytes or the bytes of
another one) into the inbox or a preset folder, replace it (an editor's atomic save, a rewrite
in place, `cp -p`'s same size and mtime), delete it or move it out, save and edit a link to a
loopback server, take a stems folder out of the outbox, cancel / move / retry / remove through
the API, pause and start, restart cleanly, SIGKILL, SIGKILL the worker process mid-song or the
zygote it was forked from at any time, fill and free a small disk (root only).

A plain reference model (tests/seams_model.py) says what must hold after every step: every
outbox folder holds the stems of a version of the song its manifest names; no folder
disappears but the one a removed job published, or one the test took away; a cancel that came
in time is never published; no half folder; nothing the test dropped is lost; a song whose
worker died under it once is not failed for it. At quiet points
(`wait(until="quiet")`, and the end of every example) the queue must finish, and every done job's
folder must hold the stems of its own input; after a restart or a kill the queue keeps its order.

Seeded and replayable: `make test` runs the short profile, derandomized (the same examples every
run); `STEMDECK_MODEL_SEED=N` replays seed N, `STEMDECK_MODEL_BLOB=…` the blob a failure prints;
`make soak` (`STEMDECK_SOAK=1`) runs the long profile with a new seed per round for
`STEMDECK_SOAK_SECONDS` (an hour).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import os
import shutil
import signal
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
from hypothesis import HealthCheck, Phase, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from stemdeck_watch.stages.manifest import MANIFEST
from stemdeck_watch.workers.compiled.cache import BUILD_PREFIX, ENTRY, CompileCache, CompileKey

from seams_folders import (
    LINK_SLOT,
    SLOTS,
    PLANTED,
    STAGING,
    Hands,
    link_text,
    scan_outbox,
    write_example_config,
)
from seams_model import Model, order_kept, outstanding, wait_quiet
from seams_run import World, make_world, run_profiles
from seams_service import RegistryView, ServiceProcess, SmallDisk, read_registry
from support.compiled import BuiltCompile

pytestmark = pytest.mark.slow

SONGS = 4  # distinct songs, all 1.2 s: the same size, so `cp -p` can keep size and mtime
SOAK = os.environ.get("STEMDECK_SOAK") == "1"
SOAK_SECONDS = float(os.environ.get("STEMDECK_SOAK_SECONDS") or 3600)
HEALTH = [HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large]
COMMON = settings(
    deadline=None,
    database=None,
    print_blob=True,
    suppress_health_check=HEALTH,
    phases=(Phase.explicit, Phase.generate, Phase.shrink),
)
settings.register_profile(
    "seams-short", COMMON, max_examples=6, stateful_step_count=14, derandomize=True
)
settings.register_profile(
    "seams-soak", COMMON, max_examples=10, stateful_step_count=40, derandomize=False
)
FINAL = ("done", "failed", "cancelled")
_numbers = itertools.count()


def guarded(step: Callable[..., None]) -> Callable[..., None]:
    """The first failure of an example is kept and raised by its teardown; the steps after
    it only draw their arguments. When a check sees a race one step earlier or later on a
    replay, the example still draws the same data, which Hypothesis needs to shrink it."""

    @functools.wraps(step)
    def run(self: SeamsMachine, *args: Any, **kwargs: Any) -> None:
        if self.failure is not None:
            return
        if step.__name__ not in ("always", "finish"):
            shown = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
            self.steps.append(f"{step.__name__}({shown})")
        try:
            step(self, *args, **kwargs)
        except Exception as exc:
            exc.add_note(
                f"seen in {step.__name__} after step {len(self.steps)}, "
                f"{self.steps[-1] if self.steps else '-'}; the service's logs: "
                f"{self.root / 'logs' if self.root else '-'}"
            )
            self.failure = exc

    return run


class SeamsMachine(RuleBasedStateMachine):
    def __init__(self, world: World):
        super().__init__()
        self.world = world
        self.failure: Exception | None = None  # the first one; the teardown raises it
        self.steps: list[str] = []  # the rules run so far, for the failure's note
        self.counted: set[str] = set()  # jobs already in the world's tally
        self.root: Path | None = None
        self.service: ServiceProcess | None = None
        self.disk: SmallDisk | None = None
        self.dropped: list[int] = []  # the songs dropped, in order

    # ------------------------------------------------------------ setup and teardown

    @initialize(
        small=st.booleans(),
        first=st.lists(st.integers(0, SONGS - 1), max_size=2),
        compiled=st.sampled_from(["cached", "cached", "building"]),
    )
    @guarded
    def begin(self, small: bool, first: list[int], compiled: str) -> None:
        """A service on fresh folders (the outbox on a small disk, where one can be had),
        with up to two songs dropped at once (the same one twice, at times). The worker runs
        the compiled model: found in the cache (loaded before the first song), or not built
        yet (built in the background while the example runs, and stopped with it)."""
        self.root = root = Path(tempfile.mkdtemp(prefix="ex-", dir=self.world.tmp)).resolve()
        for name in ("inbox", "processed", "failed", "state", "trash", "away"):
            (root / name).mkdir()
        outbox = root / "outbox"
        if small and self.world.small_disk is None:
            self.disk = SmallDisk(root / "vol", root / "state" / "scratch")
            outbox = root / "vol" / "outbox"
        outbox.mkdir(parents=True, exist_ok=True)
        self.taken = outbox.parent / "taken"  # on the outbox's filesystem: a rename
        self.taken.mkdir()
        config = write_example_config(root, outbox, self.world.model_repo)
        if compiled == "cached":
            self.world.compiled.copy_to(root / "state")
        self.world.tally[f"compiled model {compiled}"] += 1
        self.hands = Hands(root / "inbox", root / "trash", root / "away")
        self.model = Model(root, outbox, self.world.songs)
        self.service = ServiceProcess(config, root / "state", root / "logs")
        self.service.start()
        for slot, song in zip(SLOTS, first):
            self._put(slot, song, "atomic")

    def teardown(self) -> None:
        try:
            self.finish()
        finally:
            if self.service is not None:
                self.service.force()
            if self.disk is not None:
                self.disk.close()
            if self.root is not None and self.failure is None:
                shutil.rmtree(self.root, ignore_errors=True)
        if self.failure is not None:
            raise self.failure

    @guarded
    def finish(self) -> None:
        """The end of every example: with the disk freed and the queue started, everything
        must finish, every invariant hold, and the service stop cleanly."""
        if self.service is None:
            return
        if self.disk is not None:
            self.disk.free()
            self.model.disk_tight = False
        if self.model.paused:
            self.post("/api/queue/start")
            self.model.paused = False
        self.quiet()
        self.service.stop()

    # ------------------------------------------------------------ helpers

    def view(self) -> RegistryView:
        assert self.root is not None
        return read_registry(self.root / "state")

    def post(self, path: str, body: dict[str, Any] | None = None) -> tuple[int, dict[str, Any]]:
        assert self.service is not None
        status, reply = self.service.api("POST", path, body)
        self.world.tally[f"{path.rsplit('/', 1)[-1]} {status}"] += 1
        if status >= 500 or status in (400, 401):
            raise AssertionError(
                f"POST {path} {body or ''} → {status} {reply}\n{self.service.tail()}"
            )
        return status, reply

    def pick(self, phase: str, pick: int) -> str | None:
        """A job in `phase`; while the service is busy, up to a minute for one to get there
        (a cancel aimed at a song being published waits for one)."""
        deadline = time.monotonic() + 60.0
        while True:
            view = self.view()
            jobs = sorted(view.jobs.values(), key=lambda j: j.created_at)
            if phase == "queued":
                found = [j.id for j in jobs if j.id in view.order]
            elif phase == "publishing":
                found = [j.id for j in jobs if j.state == "publishing"]
            elif phase == "next":  # the head of the queue, while a song separates
                found = view.order[:1] if any(j.state == "separating" for j in jobs) else []
            elif phase == "separating":
                found = [j.id for j in jobs if j.state in ("downloading", "decoding", "separating")]
            else:
                found = [j.id for j in jobs if j.state not in FINAL] or [j.id for j in jobs]
            busy = self.model.pending(view)
            if found or not busy or time.monotonic() > deadline:
                return found[pick % len(found)] if found else None
            time.sleep(0.02)

    def quiet(self) -> None:
        """Wait until the service has nothing left to do (or is paused with it), then check
        everything that needs quiet."""
        assert self.service is not None and self.root is not None
        view = wait_quiet(self.service, self.model, self.root / "state")
        for job in view.jobs.values():
            if job.state in FINAL and job.id not in self.counted:
                self.counted.add(job.id)
                dup = job.error is not None and job.error.startswith("already separated")
                self.world.tally[f"{job.kind} {job.state}{' (a duplicate)' if dup else ''}"] += 1
        self.check(self.model.check_step(view) + self.model.check_quiet(view))

    def check(self, problems: list[str]) -> None:
        problems = outstanding(problems)
        if problems:
            assert self.service is not None
            raise AssertionError(
                "\n".join(problems) + f"\nthe service's log ends:\n{self.service.tail(40)}"
            )

    # ------------------------------------------------------------ the inbox and the outbox

    @rule(
        slot=st.sampled_from(SLOTS),
        song=st.integers(0, SONGS - 1),
        how=st.sampled_from(["atomic", "atomic", "inplace", "stamp"]),
    )
    @guarded
    def drop(self, slot: str, song: int, how: str) -> None:
        """A song dropped (or dropped again, or the file replaced by another song)."""
        self._put(slot, song, how)

    @rule(again=st.integers(0, 3 * 8 - 1))
    @guarded
    def drop_again(self, again: int) -> None:
        """The same bytes as a song dropped before (the most recent one, mostly) into one of
        the slots (the first song, if none was dropped yet)."""
        back, slot = divmod(again, len(SLOTS))
        song = self.dropped[-1 - back % len(self.dropped)] if self.dropped else 0
        self._put(SLOTS[slot], song, "atomic")

    def _put(self, slot: str, song: int, how: str) -> None:
        self.model.touching(self.view(), slot)
        data = self.world.songs[song]
        self.dropped.append(song)
        self.hands.place(slot, data, how)
        self.model.placed_version(slot, data)

    @rule(slot=st.sampled_from(SLOTS + (LINK_SLOT,)), how=st.sampled_from(["unlink", "move"]))
    @guarded
    def delete(self, slot: str, how: str) -> None:
        self.model.touching(self.view(), slot)
        self.hands.remove(slot, how)

    @rule(song=st.integers(0, SONGS - 1), how=st.sampled_from(["atomic", "inplace"]))
    @guarded
    def link(self, song: int, how: str) -> None:
        """A link saved into the inbox, or the saved link edited to point elsewhere."""
        self._link(song, how)

    @rule(
        song=st.integers(0, SONGS - 1),
        how=st.sampled_from(["stamp", "inplace", "atomic"]),
        after=st.sampled_from([0.3, 0.0]),
    )
    @guarded
    def replace_next(self, song: int, how: str, after: float) -> None:
        """The next song in the queue replaced `after` s into the separation of the one
        before it (its decode or download prepared ahead by then): by another song, a link by
        another URL."""
        job_id = self.pick("next", 0)
        if job_id is not None:
            time.sleep(after)
            rel = self.view().jobs[job_id].rel_path
            if rel == LINK_SLOT:
                self._link(song, "inplace" if how == "inplace" else "atomic")
            elif rel in SLOTS:
                self._put(rel, song, how)
            self.world.tally["next song replaced"] += 1

    def _link(self, song: int, how: str) -> None:
        self.model.touching(self.view(), LINK_SLOT)
        url = self.world.media.url(song)
        data = link_text(url)
        self.hands.place(LINK_SLOT, data, how)
        self.model.placed_version(LINK_SLOT, data, url)

    @rule(pick=st.integers(0, 7))
    @guarded
    def take_away(self, pick: int) -> None:
        """A person moves a stems folder out of the outbox (into their music library)."""
        folders = sorted(rel for rel, m in scan_outbox(self.model.outbox)[0].items() if m)
        if folders:
            rel = folders[pick % len(folders)]
            os.rename(self.model.outbox / rel, self.taken / f"{next(_numbers)}-{Path(rel).name}")
            self.model.took_away(rel)
            self.world.tally["stems folder taken away"] += 1

    # ------------------------------------------------------------ the API

    @rule(
        phase=st.sampled_from(["queued", "separating", "publishing", "any"]), pick=st.integers(0, 7)
    )
    @guarded
    def cancel(self, phase: str, pick: int) -> None:
        job_id = self.pick(phase, pick)
        if job_id is None:
            return
        status, _ = self.post(f"/api/jobs/{job_id}/cancel")
        if status != 200:
            return
        job = self.view().jobs.get(job_id)
        staging = self.model.outbox / STAGING / job_id
        if job is not None and job.state in ("queued", "downloading", "decoding", "separating"):
            self.model.must_cancel[job_id] = f"{job.state} when the cancel was answered"
            self.world.tally[f"cancel in time ({job.state})"] += 1
        elif (
            job is not None
            and job.state == "publishing"
            and staging.is_dir()
            and not (staging / MANIFEST).exists()
        ):
            self.model.must_cancel[job_id] = "its stems were still being written"
            self.world.tally["cancel in time (publishing)"] += 1

    @rule(pick=st.integers(0, 7), other=st.integers(0, 7), first=st.booleans())
    @guarded
    def move(self, pick: int, other: int, first: bool) -> None:
        order = self.view().order
        if order:
            job_id, after = order[pick % len(order)], order[other % len(order)]
            body = {"first": True} if first or after == job_id else {"after": after}
            self.post(f"/api/jobs/{job_id}/move", body)

    @rule(pick=st.integers(0, 7))
    @guarded
    def retry(self, pick: int) -> None:
        jobs = sorted(
            (j for j in self.view().jobs.values() if j.state in FINAL[1:]),
            key=lambda j: -j.created_at,
        )  # the latest first
        if jobs:
            self.post(f"/api/jobs/{jobs[pick % len(jobs)].id}/retry")

    @rule(pick=st.integers(0, 7))
    @guarded
    def remove(self, pick: int) -> None:
        jobs = sorted(
            (j for j in self.view().jobs.values() if j.state in FINAL), key=lambda j: -j.created_at
        )
        if jobs:
            job = jobs[pick % len(jobs)]
            status, _ = self.post(f"/api/jobs/{job.id}/remove")
            if status == 200:
                self.model.removed_job(job.id, job.output)

    @rule(pause=st.booleans())
    @guarded
    def pause_or_start(self, pause: bool) -> None:
        self.post(f"/api/queue/{'pause' if pause else 'start'}")
        self.model.paused = pause

    # ------------------------------------------------------------ the service's life

    @rule(how=st.sampled_from(["not now", "clean", "kill"]))
    @guarded
    def restart(self, how: str) -> None:
        """Stop the service cleanly, or SIGKILL it, and start it again on the same folders
        ("not now" keeps these slow steps rarer, and the simplest example cheap)."""
        assert self.service is not None
        if how == "not now":
            return
        before = self.view()
        self.world.tally[f"restart ({how})"] += 1
        if how == "kill":
            self.service.kill()
        else:
            self.service.stop()
        self.service.start()
        self.check(
            order_kept(
                before, self.view(), "clean restart" if how == "clean" else "SIGKILL and restart"
            )
        )

    @rule(when=st.sampled_from(["not now", "not now", "mid-song"]))
    @guarded
    def kill_worker(self, when: str) -> None:
        """The separation worker process is SIGKILLed in the middle of a song (as the
        kernel's OOM killer does): the song is tried again, never failed for it ("not now"
        keeps this slow step rarer)."""
        assert self.service is not None
        if when == "not now" or self.pick("separating", 0) is None:
            return
        pid = self.service.worker_pid()
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            self.world.tally["worker killed mid-song"] += 1

    @rule(when=st.sampled_from(["not now", "now"]))
    @guarded
    def kill_zygote(self, when: str) -> None:
        """The zygote the workers are forked from is SIGKILLed (the OOM killer may pick it
        too), and its worker ends with it, idle or in the middle of a song: a song under way
        is tried again, never failed for it, and the next song gets a new zygote and worker
        ("not now" keeps this step rarer)."""
        assert self.service is not None
        pid = self.service.zygote_pid() if when == "now" else None
        if pid is not None:
            busy = self.pick("separating", 0) is not None
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            self.world.tally[f"zygote killed {'mid-song' if busy else 'between songs'}"] += 1

    @precondition(lambda self: self.disk is not None)
    @rule(fill=st.booleans())
    @guarded
    def fill_disk(self, fill: bool) -> None:
        """Fill the small disk to below the disk check's margin, or free it again."""
        assert self.disk is not None
        if fill:
            self.disk.fill()
            self.world.tally["disk filled"] += 1
        else:
            self.disk.free()
        self.model.disk_tight = fill

    @rule(where=st.sampled_from(PLANTED))
    @guarded
    def plant_link(self, where: str) -> None:
        """A peer who can write the shared outbox plants a link where the service makes a
        folder, while nothing is there: at its hidden staging folder (the next song written
        removes it) or at the preset's folder of songs (its next song goes to `duo (2)`, past
        it); songs are published as ever, and nothing lands where the link points."""
        assert self.root is not None
        folder = self.model.outbox / where
        (self.root / "elsewhere").mkdir(exist_ok=True)
        if os.path.lexists(folder):
            return  # a song is being written there, or the folder is made already
        with contextlib.suppress(FileExistsError):  # the service made it meanwhile
            folder.symlink_to(self.root / "elsewhere")
            self.world.tally[f"link planted at {where}"] += 1

    @rule(until=st.sampled_from(["quiet", "0.3 s", "1 s", "2.5 s"]))
    @guarded
    def wait(self, until: str) -> None:
        """Let the service work: until it is quiet (then check everything that needs quiet),
        or a moment."""
        if until == "quiet":
            self.quiet()
        else:
            time.sleep(float(until.split()[0]))

    @invariant()
    @guarded
    def always(self) -> None:
        if self.service is not None:
            if not self.service.alive():
                raise AssertionError(f"the service exited:\n{self.service.tail()}")
            self.check(self.model.check_step(self.view()))
            assert self.root is not None
            self.check(whole_compiles(self.root / "state" / "compiled"))
            elsewhere = self.root / "elsewhere"
            if elsewhere.is_dir() and any(elsewhere.iterdir()):
                self.check([f"[link] the service wrote through a planted link: {elsewhere}"])


# ---------------------------------------------------------------- running it


def whole_compiles(root: Path) -> list[str]:
    """[compiled] every compiled model in the cache is whole: what the build wrote is what
    its entry lists (a kill, a restart, a worker loading it never leave half of one)."""
    problems = []
    for folder in root.iterdir() if root.is_dir() else []:
        if not folder.is_dir() or folder.name.startswith(BUILD_PREFIX):
            continue
        try:
            data = json.loads((folder / ENTRY).read_text())
        except (OSError, ValueError) as exc:
            problems.append(f"[compiled] {folder.name} has no readable entry: {exc}")
            continue
        key = CompileKey.from_dict(data.get("key"))
        problem = "it names no key" if key is None else CompileCache(root).problem(key)
        if key is not None and key.digest() != folder.name:
            problem = f"it names {key.digest()}"
        if problem:
            problems.append(f"[compiled] {folder.name} is not whole: {problem}")
    return problems


@pytest.fixture
def world(tmp_path: Path, model_repo: Path, compiled_tiny: BuiltCompile) -> Iterator[World]:
    with make_world(tmp_path, model_repo, SONGS, compiled_tiny) as made:
        yield made


@pytest.mark.timeout(SOAK_SECONDS + 3600 if SOAK else 1200)
def test_the_seams_hold_whatever_people_do(world: World) -> None:
    if world.small_disk:
        print(f"the disk rules are left out: {world.small_disk}")
    run_profiles(lambda: SeamsMachine(world), SOAK, SOAK_SECONDS, world.tally)
