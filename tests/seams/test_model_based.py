"""The seams net: a model-based, stateful test of the whole service.

Hypothesis drives the real service — `stemdeck-watch run` as a process (watcher, registry,
worker with the tiny model), with decode ahead and publish behind on (`queue.work_beside =
"on"`) — through random sequences of what people do: drop a song (new bytes or the bytes of
another one) into the inbox or a preset folder, replace it (an editor's atomic save, a rewrite
in place, `cp -p`'s same size and mtime), delete it or move it out, save and edit a link to a
loopback server, take a stems folder out of the outbox, cancel / move / retry / remove through
the API, pause and start, restart cleanly, SIGKILL, SIGKILL the worker process mid-song or the
zygote it was forked from at any time, hold either stopped (SIGSTOP), fill and free a small
disk (root only), plant links where the service writes, write sidecars (good, misspelt,
hostile, late), upload songs through the API. Swarm testing: each example draws only some
families of rules (FAMILIES). Written sequences (seams_scripts.py) run first and reach the
seams where defects were found before; `make mutants` measures what the whole net catches.

A plain reference model (tests/seams_model.py) says what must hold after every step: every
outbox folder holds the stems of a version of the song its manifest names; no folder
disappears but the one a removed job published, or one the test took away; a cancel that came
in time is never published; no half folder; nothing the test dropped is lost; a song whose
worker died under it once is not failed for it; no model a drop named is loaded; nothing is
written through a planted link or outside the service's folders. At quiet points
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
import re
import shutil
import signal
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
from hypothesis import HealthCheck, Phase, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from stemdeck_watch.core.choices import SIDECAR_SUFFIX
from stemdeck_watch.engine.shares import MARKER as OWNERSHIP_MARKER
from stemdeck_watch.ui.folder import STATUS_FILE
from stemdeck_watch.workers.compiled.cache import BUILD_PREFIX, ENTRY, CompileCache, CompileKey

from seams_folders import (
    LINK_SLOT,
    SLOTS,
    PLANTED,
    PRESET,
    UPLOAD_PRESET,
    STATUS_TEMP,
    VICTIM,
    Hands,
    link_text,
    listing,
    scan_outbox,
    write_example_config,
)
from seams_model import KNOWN, Model, order_kept, outstanding, wait_quiet
from seams_run import World, make_world, run_profiles
from seams_scripts import EXTRA, run_scripts
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
    "seams-short", COMMON, max_examples=4, stateful_step_count=14, derandomize=True
)
settings.register_profile(
    "seams-soak", COMMON, max_examples=10, stateful_step_count=40, derandomize=False
)
FINAL = ("done", "failed", "cancelled")
# a sidecar's kind -> (the tag that looks past it, its text)
SIDECARS = {
    "good": ("sidecar", 'format = "flac"\ntwo_stems = "bass"\n'),
    "misspelt": ("sidecar", 'modle = "htdemucs_6s"\n'),
    "model by URL": ("sidecar-model", 'model = "hf://evil/x"\n'),
    "segment of an hour": ("sidecar-bounds", "segment = 3600\n"),
    "7000 speeds": (
        "sidecar-bounds",
        "practice = true\npractice_speeds = [" + ", ".join(["0.5"] * 7000) + "]\n",
    ),
    "nested 3000 deep": ("sidecar-bounds", "x = " + "[" * 3000 + "]" * 3000 + "\n"),
}
INBOX_PLANT = f"inbox/{UPLOAD_PRESET}"  # plant_link's one place in the inbox
# families of rules that swarm testing switches on and off per example (dropping, deleting,
# replacing, taking a folder away and waiting are always on)
FAMILIES = frozenset(
    {"links", "api", "life", "disk", "plant", "sidecar", "upload", "sigstop", "share"}
)
POLL = 0.05  # seconds between looks while the test waits on the service
# a cancel is answered at once; a loaded CI machine gets room past the service's 2 s
CANCEL_BOUND = 5.0
# the share watch looks every second; a loaded CI machine gets room past it
SHARE_BOUND = 10.0
UNMOUNTED = "-unmounted"  # where share_away puts a folder while its share is away
CUT_OFF_WAIT = 20.0  # seconds a stop's first cut-off is waited for while the worker is held
ETA_PER_SONG = 20.0  # seconds: the most a quiet queue may estimate for one of its songs
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
        # where the service's log was when the test filled the disk (a decision to prepare
        # a song ahead taken a moment before is logged within microseconds of it)
        self.full_since: int | None = None
        self.frozen: list[int] = []  # the processes the test holds stopped (SIGSTOP)
        self.swarm: frozenset[str] = FAMILIES  # the families of rules this example draws

    # ------------------------------------------------------------ setup and teardown

    @initialize(
        small=st.booleans(),
        first=st.lists(st.integers(0, SONGS - 1), max_size=2),
        compiled=st.sampled_from(["cached", "cached", "building"]),
        swarm=st.frozensets(st.sampled_from(sorted(FAMILIES))),
    )
    @guarded
    def begin(
        self, small: bool, first: list[int], compiled: str, swarm: frozenset[str] = FAMILIES
    ) -> None:
        """A service on fresh folders (the outbox on a small disk, where one can be had),
        with up to two songs dropped at once (the same one twice, at times). The worker runs
        the compiled model: found in the cache (loaded before the first song), or not built
        yet (built in the background while the example runs, and stopped with it).

        Swarm testing: each example switches on some families of rules (`swarm`) and never
        draws the others, so that a few steps go deep into what they have on (many API
        calls, or many kills) instead of a little of everything."""
        self.swarm = swarm
        self.world.tally[f"families on: {len(swarm)}"] += 1
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
            self.thaw()
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
        self.thaw()
        if self.disk is not None:
            self.disk.free()
            self.model.disk_tight = False
            self.full_since = None
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
        self.check(self.idle_eta())

    def idle_eta(self) -> list[str]:
        """[eta] the estimate of an idle queue is never larger than the work it holds: each
        song here is 1.2 s of audio, which the tiny model separates in about a second (a
        wait, a failed attempt or an outage is no work)."""
        assert self.service is not None
        status, reply = self.service.api("GET", "/api/queue")
        eta = reply.get("eta") if status == 200 else None
        if not eta or eta.get("seconds") is None:
            return []
        bound = ETA_PER_SONG * eta["songs"]
        if eta["seconds"] > bound:
            return [
                f"[eta] the idle queue's estimate is {eta['seconds']:.0f} s for "
                f"{eta['songs']} song(s) of 1.2 s (at most {bound:.0f} s): {eta}"
            ]
        return []

    def check(self, problems: list[str]) -> None:
        problems = outstanding(problems)
        if problems:
            assert self.service is not None
            raise AssertionError(
                "\n".join(problems) + f"\nthe service's log ends:\n{self.service.tail(40)}"
            )

    @contextlib.contextmanager
    def frozen_worker(self) -> Iterator[None]:
        """The separation worker held stopped (SIGSTOP) for a moment: the song it separates
        stays separating while the test acts around it (well within the stall limit)."""
        self.hold_worker()
        try:
            yield
        finally:
            self.thaw()

    def thaw_once_cut_off(self) -> None:
        """During a stop with the worker and its zygote held: let them go on once the song
        publishing was cut off (so the one at the worker is cut off after it), or after a
        moment."""
        assert self.service is not None
        deadline = time.monotonic() + CUT_OFF_WAIT
        while "cut off by shutdown" not in self.service.output():
            if time.monotonic() > deadline:
                break
            time.sleep(POLL)
        self.thaw()

    def hold_worker(self) -> None:
        assert self.service is not None
        pid = self.service.worker_pid()
        if pid is not None and pid not in self.frozen:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
                self.frozen.append(pid)

    def thaw(self) -> None:
        for pid in self.frozen:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        self.frozen = []

    def prepared(self, job_id: str, limit: float = 5.0) -> None:
        """Wait until the work prepared ahead for `job_id` is there (its scratch folder
        holds files that stopped growing), or `limit` s."""
        scratch = self.model.scratch / job_id
        deadline = time.monotonic() + limit
        last = -1
        while time.monotonic() < deadline:
            size = sum(p.stat().st_size for p in listing(scratch) if p.is_file())
            if size and size == last:
                return
            last = size
            time.sleep(POLL * 6)

    def until_separating(self, limit: float = 180.0) -> bool:
        """Wait until a song is at the worker (separating, not only decoding: the worker may
        still be starting), or `limit` s; whether one is."""
        deadline = time.monotonic() + limit
        while not any(j.state == "separating" for j in self.view().jobs.values()):
            if time.monotonic() > deadline:
                return False
            time.sleep(POLL)
        return True

    def until_queued(self, count: int, limit: float = 30.0) -> None:
        """Wait until `count` jobs are queued (a script's songs, dropped while paused)."""
        deadline = time.monotonic() + limit
        while len(self.view().order) < count:
            if time.monotonic() > deadline:
                raise AssertionError(f"{count} jobs were not queued within {limit:.0f} s")
            time.sleep(POLL)

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

    @precondition(lambda self: "links" in self.swarm)
    @rule(song=st.integers(0, SONGS - 1), how=st.sampled_from(["atomic", "inplace"]))
    @guarded
    def link(self, song: int, how: str) -> None:
        """A link saved into the inbox, or the saved link edited to point elsewhere."""
        self._link(song, how)

    @rule(
        song=st.integers(0, SONGS - 1),
        how=st.sampled_from(["stamp", "inplace", "atomic", "cp -p onto"]),
        after=st.sampled_from([0.3, 0.0, "prepared", "taken"]),
    )
    @guarded
    def replace_next(self, song: int, how: str, after: float | str) -> None:
        """The next song in the queue replaced `after` s into the separation of the one
        before it (its decode or download prepared ahead by then), or once its work ahead
        is there ("prepared": the worker held stopped meanwhile, so the song before it is
        still separating), or as it is taken ("taken": then the song before it cancelled at
        once, so the dispatcher takes the next job before the intake could see the change):
        by another song, a link by another URL."""
        job_id = self.pick("next", 0)
        if job_id is not None:
            held = after in ("prepared", "taken")
            with self.frozen_worker() if held else contextlib.nullcontext():
                if held:
                    self.prepared(job_id)
                else:
                    time.sleep(float(after))
                self._replace(job_id, song, how)
                if after == "taken":
                    self.cancel(phase="separating", pick=0)

    def _replace(self, job_id: str, song: int, how: str) -> None:
        rel = self.view().jobs[job_id].rel_path
        if rel == LINK_SLOT:
            # "cp -p onto": the link's size and time kept (a URL of the same length), so
            # only the URL in it tells that it changed
            self._link(song, how if how in ("inplace", "cp -p onto") else "atomic")
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

    @precondition(lambda self: "api" in self.swarm)
    @rule(
        phase=st.sampled_from(["queued", "separating", "publishing", "any"]), pick=st.integers(0, 7)
    )
    @guarded
    def cancel(self, phase: str, pick: int) -> None:
        """A cancel through the API: one answered "cancelled" (200) must end cancelled and
        never be published (a song whose stems are already going out is refused with a
        409), and it is answered within CANCEL_BOUND."""
        job_id = self.pick(phase, pick)
        if job_id is None:
            return
        before = self.view().jobs.get(job_id)
        asked = time.monotonic()
        status, _ = self.post(f"/api/jobs/{job_id}/cancel")
        took = time.monotonic() - asked
        if took > CANCEL_BOUND:
            self.check([f"[slow-cancel] the cancel of {job_id} took {took:.1f} s"])
        if status != 200:
            return
        state = before.state if before is not None else "unknown"
        self.model.must_cancel[job_id] = f"answered cancelled while it was {state}"
        self.world.tally[f"cancel answered ({state})"] += 1

    @precondition(lambda self: "api" in self.swarm)
    @rule(pick=st.integers(0, 7), other=st.integers(0, 7), first=st.booleans())
    @guarded
    def move(self, pick: int, other: int, first: bool) -> None:
        order = self.view().order
        if order:
            job_id, after = order[pick % len(order)], order[other % len(order)]
            body = {"first": True} if first or after == job_id else {"after": after}
            self.post(f"/api/jobs/{job_id}/move", body)

    @precondition(lambda self: "api" in self.swarm)
    @rule(pick=st.integers(0, 7))
    @guarded
    def retry(self, pick: int) -> None:
        jobs = sorted(
            (j for j in self.view().jobs.values() if j.state in FINAL[1:]),
            key=lambda j: -j.created_at,
        )  # the latest first
        if jobs:
            self.post(f"/api/jobs/{jobs[pick % len(jobs)].id}/retry")

    @precondition(lambda self: "api" in self.swarm)
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

    @precondition(lambda self: "api" in self.swarm)
    @rule(pause=st.booleans())
    @guarded
    def pause_or_start(self, pause: bool) -> None:
        self.post(f"/api/queue/{'pause' if pause else 'start'}")
        self.model.paused = pause

    # ------------------------------------------------------------ shares that come and go

    @precondition(lambda self: "share" in self.swarm)
    @rule(
        role=st.sampled_from(["inbox", "outbox"]),
        how=st.sampled_from(["missing", "emptied"]),
        seconds=st.sampled_from([0.0, 2.0]),
        deleted=st.booleans(),
    )
    @guarded
    def share_away(self, role: str, how: str, seconds: float, deleted: bool = False) -> None:
        """The share under the inbox or the outbox goes away and answers again `seconds`
        after the service saw it: its folder is missing (the mount below it dropped), or,
        for the inbox, an empty local folder (the mount point without its mount: every
        entry leaves at once, the service's `.stemdeck` marker first). The queue pauses for
        it within SHARE_BOUND (a pause the person chose stays theirs), no job ends because
        its input seemed deleted (a watcher that reports every file gone is not believed),
        and once it is back the queue is no longer paused for it. What was in flight waits
        and goes on (checked at the next quiet point: nothing lost, nothing left in
        scratch). `deleted`: a song of the inbox is deleted meanwhile (a peer cleaning up
        on the NAS), unheard: once the share answers its job must not stay queued."""
        folder = self.model.inbox if role == "inbox" else self.model.outbox
        aside = folder.with_name(f"{role}{UNMOUNTED}")  # on the folder's own filesystem
        emptied = how == "emptied" and role == "inbox"
        running = {j.id for j in self.view().jobs.values() if j.state not in FINAL}
        theirs = "user" if self.model.paused else None
        removed: str | None = None
        assert self.service is not None
        said = f"the {role} is away"
        answered = re.compile(rf"the {role} .* answers again after")
        before = self.service.output().count(said)
        back_before = len(answered.findall(self.service.output()))
        if emptied:
            aside.mkdir()
            entries = sorted(os.listdir(folder), key=lambda name: name != OWNERSHIP_MARKER)
            for name in entries:
                os.rename(folder / name, aside / name)
        else:
            os.rename(folder, aside)
        try:
            deadline = time.monotonic() + SHARE_BOUND
            while self.service.output().count(said) <= before:
                if time.monotonic() > deadline:
                    self.check([f"[share] the {role}'s share was away {SHARE_BOUND:.0f} s unseen"])
                time.sleep(POLL)
            if not self.until_paused_for(lambda reason: reason == (theirs or role)):
                self.check(
                    [
                        f"[share] the queue was not paused for {theirs or role} within "
                        f"{SHARE_BOUND:.0f} s while the {role}'s share was away"
                    ]
                )
            removed = self.delete_while_away(aside) if deleted and role == "inbox" else None
            time.sleep(seconds)
        finally:
            if emptied:
                for name in entries[::-1]:  # the marker last: the share answers whole
                    with contextlib.suppress(FileNotFoundError):  # deleted meanwhile
                        os.rename(aside / name, folder / name)
                aside.rmdir()
            else:
                os.rename(aside, folder)
        # the service sees it back (a pause the person chose hides that from the queue's
        # pause reason, and a share taken away again unseen would never be seen away again)
        deadline = time.monotonic() + SHARE_BOUND
        while len(answered.findall(self.service.output())) <= back_before:
            if time.monotonic() > deadline:
                self.check(
                    [f"[share] the {role}'s share answered again {SHARE_BOUND:.0f} s unseen"]
                )
            time.sleep(POLL)
        if not self.until_paused_for(lambda reason: reason == theirs if theirs else reason != role):
            self.check(
                [
                    f"[share] the queue's pause was not back to {theirs or 'none'} within "
                    f"{SHARE_BOUND:.0f} s after the {role}'s share answered again"
                ]
            )
        ended = [
            f"[share] {j.rel_path} ({j.id}) ended while the {role}'s share was away: {j.error}"
            for j in self.view().jobs.values()
            if j.id in running
            and j.rel_path != removed
            and j.state in FINAL[1:]
            and "removed" in (j.error or "")
        ]
        self.check(ended)
        if removed is not None:
            deadline = time.monotonic() + SHARE_BOUND
            while stuck := [
                j for j in self.view().order if self.view().jobs[j].rel_path == removed
            ]:
                if time.monotonic() > deadline:
                    self.check(
                        [
                            f"[share] {removed} was deleted while the inbox was away, and its "
                            f"job {stuck[0]} is still queued {SHARE_BOUND:.0f} s after the "
                            f"share answered"
                        ]
                    )
                    break
                time.sleep(POLL * 4)
        self.world.tally[f"{role} share away and back ({how if emptied else 'missing'})"] += 1

    def delete_while_away(self, aside: Path) -> str | None:
        """Delete the first song there is in the inbox's share while it is away (its bytes
        kept in trash/, as every delete of the test's); its slot, or None."""
        gone = Hands(aside, self.hands.trash, self.hands.away)
        for slot in SLOTS:
            if gone.remove(slot, "unlink"):
                self.world.tally["song deleted while the inbox was away"] += 1
                return slot
        return None

    def until_paused_for(self, wanted: Callable[[str | None], bool]) -> bool:
        """Wait until the queue's pause reason is `wanted` (None: not paused), or
        SHARE_BOUND s; whether it got there."""
        assert self.service is not None
        deadline = time.monotonic() + SHARE_BOUND
        while time.monotonic() < deadline:
            status, reply = self.service.api("GET", "/api/queue")
            if status == 200 and wanted(reply.get("pause_reason") if reply.get("paused") else None):
                return True
            time.sleep(POLL * 4)
        return False

    # ------------------------------------------------------------ the service's life

    @precondition(lambda self: "life" in self.swarm)
    @rule(
        how=st.sampled_from(
            ["not now", "clean", "kill", "clean while publishing", "clean while held"]
        )
    )
    @guarded
    def restart(self, how: str) -> None:
        """Stop the service cleanly, or SIGKILL it, and start it again on the same folders
        ("not now" keeps these slow steps rarer, and the simplest example cheap); "clean
        while publishing" waits for a song written out behind the next one, and stops the
        service then (both are cut off, and must come back in their order); "clean while
        held" holds the worker and its zygote stopped meanwhile, until the one publishing was
        cut off, so that the song at the worker is cut off after it."""
        assert self.service is not None
        if how == "not now":
            return
        between: Callable[[], None] | None = None
        if how in ("clean while publishing", "clean while held"):
            if self.pick("publishing", 0) is not None and how == "clean while held":
                self.hold_worker()
                zygote = self.service.zygote_pid()
                if zygote is not None and self.frozen:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(zygote, signal.SIGSTOP)
                        self.frozen.append(zygote)
                between = self.thaw_once_cut_off
            how = "clean"
        else:
            self.thaw()
        before = self.view()
        self.world.tally[f"restart ({how})"] += 1
        if how == "kill":
            self.service.kill()
        else:
            self.service.stop(between)
        self.frozen = []  # what was held stopped ended with its service
        self.service.start()
        if self.full_since is not None:
            self.full_since = 0  # a new life, a new log
        self.check(
            order_kept(
                before, self.view(), "clean restart" if how == "clean" else "SIGKILL and restart"
            )
        )

    @precondition(lambda self: "life" in self.swarm)
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

    @precondition(lambda self: "life" in self.swarm)
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

    @precondition(lambda self: self.disk is not None and "disk" in self.swarm)
    @rule(fill=st.booleans())
    @guarded
    def fill_disk(self, fill: bool) -> None:
        """Fill the small disk to below the disk check's margin, or free it again."""
        assert self.disk is not None
        if fill:
            self.disk.fill()
            self.world.tally["disk filled"] += 1
            if self.full_since is None:
                assert self.service is not None
                self.full_since = len(self.service.output())
        else:
            self.disk.free()
            self.full_since = None
        self.model.disk_tight = fill

    @precondition(lambda self: "plant" in self.swarm)
    @rule(where=st.sampled_from(PLANTED + (INBOX_PLANT,)))
    @guarded
    def plant_link(self, where: str) -> None:
        """A peer who can write the shared outbox plants a link where the service makes a
        folder, while nothing is there: at its hidden staging folder (the next song written
        removes it) or at the preset's folder of songs (its next song goes to `duo (2)`, past
        it), or at a guessable temporary name of STATUS.txt, pointing at a file of the
        user's; songs are published as ever, and nothing changes where the link points."""
        assert self.root is not None
        if where == INBOX_PLANT:
            self.plant_in_inbox()
            return
        place = self.model.outbox / where
        elsewhere = self.root / "elsewhere"
        elsewhere.mkdir(exist_ok=True)
        (elsewhere / "victim.txt").write_bytes(VICTIM)
        if os.path.lexists(place):
            return  # a song is being written there, or the folder is made already
        with contextlib.suppress(FileExistsError):  # the service made it meanwhile
            place.symlink_to(elsewhere / "victim.txt" if where == STATUS_TEMP else elsewhere)
            self.world.tally[f"link planted at {where}"] += 1

    # ------------------------------------------------------------ what a drop may choose

    @precondition(lambda self: "sidecar" in self.swarm)
    @rule(
        slot=st.sampled_from(SLOTS),
        song=st.integers(0, SONGS - 1),
        kind=st.sampled_from(sorted(SIDECARS)),
        late=st.sampled_from([False, False, True]),
    )
    @guarded
    def sidecar(self, slot: str, song: int, kind: str, late: bool) -> None:
        """A sidecar with a song's own choices (good, a misspelt key, or a hostile value: a
        model named by URL, a segment of an hour, 7,000 practice speeds, TOML nested 3,000
        deep), written with its song, or late: after the song in that slot was taken. A
        kind whose tag is in STEMDECK_MODEL_KNOWN is written as a good one."""
        tag, text = SIDECARS[kind]
        if tag in KNOWN:
            kind, (tag, text) = "good", SIDECARS["good"]
        name = slot + SIDECAR_SUFFIX
        if late:
            job = self.view().latest_for(str(self.model.inbox / slot))
            if job is None or job.state in FINAL or "late" in KNOWN:
                return
            self.hands.place(name, text.encode(), "atomic")
            self.model.late_sidecar(slot, text.encode())
            self.world.tally[f"late sidecar ({job.state})"] += 1
            return
        self.hands.place(name, text.encode(), "atomic")
        self._put(slot, song, "atomic")
        self.model.sidecar_with(slot, kind)
        self.world.tally[f"sidecar {kind}"] += 1

    @precondition(lambda self: "upload" in self.swarm)
    @rule(song=st.integers(0, SONGS - 1), preset=st.sampled_from(["", PRESET, UPLOAD_PRESET]))
    @guarded
    def upload(self, song: int, preset: str) -> None:
        """A song added through the API (the page's drop), into the inbox or a preset's
        folder (UPLOAD_PRESET's may be a link a peer planted: nothing lands where it
        points)."""
        assert self.service is not None
        data = self.world.songs[song]
        query = "name=up.wav" + (f"&preset={preset}" if preset else "")
        status, reply = self.service.api("POST", f"/api/uploads?{query}", upload=data)
        self.world.tally[f"upload {status}"] += 1
        if status == 200:
            self.dropped.append(song)
            self.model.placed_version(str(reply["file"]), data)
        elif (status >= 500 and status != 507) or status in (400, 401):
            raise AssertionError(f"upload {query} → {status} {reply}\n{self.service.tail()}")

    # ------------------------------------------------------------ a stuck machine

    @precondition(lambda self: "sigstop" in self.swarm)
    @rule(which=st.sampled_from(["worker", "zygote"]), then=st.sampled_from(["cancel", "drop"]))
    @guarded
    def hold_stopped(self, which: str, then: str) -> None:
        """The worker or the zygote it was forked from held stopped (SIGSTOP: a debugger, a
        machine swapping) while the test cancels the song in flight, or drops a song; then
        it goes on (SIGCONT). A cancel is answered within its bound, the service stays
        responsive, and nothing is lost (tag: sigstop)."""
        assert self.service is not None
        if "sigstop" in KNOWN:
            return
        pid = self.service.worker_pid() if which == "worker" else self.service.zygote_pid()
        if pid is None or self.frozen:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGSTOP)
            self.frozen.append(pid)
            self.world.tally[f"{which} held stopped"] += 1
        try:
            if then == "cancel":
                self.cancel("separating", 0)
            else:
                song = len(self.dropped) % SONGS
                self._put(SLOTS[len(self.dropped) % len(SLOTS)], song, "atomic")
        finally:
            self.thaw()

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
            self.check(self.written_elsewhere() + self.outside_folders())
            self.check(self.model.check_jobs(self.view()))
            self.check(self.ahead_on_a_full_disk())

    def plant_in_inbox(self) -> None:
        """A link planted in the inbox where the uploads' preset folder goes: an upload to
        that preset never lands where it points (tag: upload-link)."""
        assert self.root is not None
        place = self.model.inbox / UPLOAD_PRESET
        if "upload-link" in KNOWN or os.path.lexists(place):
            return
        (self.root / "elsewhere-inbox").mkdir(exist_ok=True)
        with contextlib.suppress(FileExistsError):
            place.symlink_to(self.root / "elsewhere-inbox")
            self.world.tally["link planted at the inbox's preset folder"] += 1

    def written_elsewhere(self) -> list[str]:
        """[link] where the test's planted links point, only what the test put there."""
        assert self.root is not None
        elsewhere = self.root / "elsewhere"
        found = {p.name for p in listing(elsewhere)}
        victim = elsewhere / "victim.txt"
        if found - {"victim.txt"} or (victim.exists() and victim.read_bytes() != VICTIM):
            return [f"[link] the service wrote through a planted link: {sorted(found)}"]
        if listing(self.root / "elsewhere-inbox"):
            return ["[upload-link] an upload went through a link planted in the inbox"]
        status = self.model.outbox / STATUS_FILE
        if status.is_symlink():
            return [f"[link] {STATUS_FILE} is a link the service renamed into place"]
        return []

    def outside_folders(self) -> list[str]:
        """[outside] nothing the service writes lies outside its folders: the example's
        folder holds what the test made, and the service's own folders."""
        assert self.root is not None
        known = {"inbox", "processed", "failed", "state", "trash", "away", "outbox", "vol"}
        known |= {"logs", "elsewhere", "elsewhere-inbox", "taken", "stemdeck.toml"}
        known |= {f"{role}{UNMOUNTED}" for role in ("inbox", "outbox")}
        return [
            f"[outside] {p} is outside every folder"
            for p in listing(self.root)
            if p.name not in known
        ]

    def ahead_on_a_full_disk(self) -> list[str]:
        """[ahead] no song is prepared ahead once the disk has no room for it (the test
        filled it below the disk check's margin: nothing fits beside the song in flight)."""
        assert self.service is not None
        if self.full_since is None:
            return []
        return [
            f"[ahead] the disk is full, yet {line.split('INFO', 1)[-1].strip()}"
            for line in self.service.output()[self.full_since :].splitlines()
            if " ahead while " in line
        ]

    def looked_ahead(self, limit: float = 5.0) -> None:
        """Wait until the service decided whether to prepare the next song ahead since the
        disk was filled (it says so either way), or `limit` s."""
        deadline = time.monotonic() + limit
        offset = self.full_since or 0
        while time.monotonic() < deadline:
            if " ahead" in self.service.output()[offset:]:
                return
            time.sleep(POLL)


# ---------------------------------------------------------------- running it


def whole_compiles(root: Path) -> list[str]:
    """[compiled] every compiled model in the cache is whole: what the build wrote is what
    its entry lists (a kill, a restart, a worker loading it never leave half of one)."""
    problems = []
    for folder in listing(root):  # a build renamed into place meanwhile is seen next step
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
def world(tmp_path: Path, recipe_repo: Path, compiled_tiny: BuiltCompile) -> Iterator[World]:
    # the tiny model, and what the recipe `best` needs (a tiny RoFormer, htdemucs_ft)
    with make_world(tmp_path, recipe_repo, SONGS + EXTRA, compiled_tiny) as made:
        yield made


@pytest.mark.timeout(SOAK_SECONDS + 3600 if SOAK else 1200)
def test_the_seams_hold_whatever_people_do(world: World) -> None:
    if world.small_disk:
        print(f"the disk rules are left out: {world.small_disk}")
    # the written sequences first (seams_scripts.py): STEMDECK_MODEL_SCRIPTS=0 leaves them
    # out, =NAME,NAME runs those alone; a replay of a seed or blob leaves them out
    chosen = os.environ.get("STEMDECK_MODEL_SCRIPTS")
    replay = os.environ.get("STEMDECK_MODEL_SEED") or os.environ.get("STEMDECK_MODEL_BLOB")
    if chosen and chosen != "0":
        run_scripts(lambda: SeamsMachine(world), chosen.replace("_", " ").split(","))
        return
    if chosen is None and not replay:
        run_scripts(lambda: SeamsMachine(world))
    run_profiles(lambda: SeamsMachine(world), SOAK, SOAK_SECONDS, world.tally)
