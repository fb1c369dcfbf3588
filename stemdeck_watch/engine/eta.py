"""When the queue will be done: each song's expected start and finish, from what this service
has measured.

Per model and precision, from every song published: its separation seconds against its length
(fitted as a fixed part per song plus seconds per second of audio: a model separates in
segments of a few seconds, so a short song costs a whole one), and the seconds the worker's
lane was busy with it besides separating (decoding, writing stems, the beat grid). The busy
time is measured from when the song started, or from when the song before it finished if it
started earlier (decoded ahead, or separating while the one before was written out): so a busy
queue is measured at the pace it really moves. Only work counts: the time a song waited while
the queue was paused for what holds a running song too (the inbox's or the outbox's share
away, the stems waiting in scratch; the cluster not answering) is taken out, and a song put
back in the queue (a machine fault, no room on the disk, a stop) is timed afresh when it
starts again, so one outage or stalled attempt never makes every later song look slower. A
pause a person chose lets the running song finish: its time is work.
The first songs count equally, later ones with a
fixed weight, so the figures follow a machine that got busier without forgetting at once; they
are kept in the registry and survive a restart.

A song's length comes from its header (`probe_duration`, under a millisecond), read once per
job; a link not downloaded yet counts as the mean length measured. Without a measurement for a
song's model there is no finish time: the estimate says so (`measured: false`) rather than
guess. A paused queue says how long its songs will take, not when they will be done; an idle
one is never said to need longer than the work it holds (`over_work`).

The estimate is part of every snapshot (`GET /api/queue`, the page, the tray) and is written to
the registry when it changes, for `status` (which reads the registry, not the service).
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import logging
import os
import stat
import threading
import time
from pathlib import Path
from typing import Any, Callable

from stemdeck_watch.core.config import Settings
from stemdeck_watch.core.events import EventBus, JobChanged, QueueChanged
from stemdeck_watch.core.jobs import Job, JobKind, JobState

log = logging.getLogger(__name__)

RATES_META = "eta_rates"  # registry meta: what was measured, per model and precision
ETA_META = "eta"  # registry meta: the last estimate, for `status`
WEIGHT = 0.1  # a new song's weight once EQUAL songs are measured
EQUAL = 10  # songs that count equally at first
SPREAD = 0.2  # lengths this varied (relative to their mean) allow fitting a fixed part
MAX_TOOK = 200  # finished songs whose time is kept
PROBES_PER_ESTIMATE = 16  # lengths read per estimate at most: a snapshot stays quick
REFRESH_DEBOUNCE = 0.3  # seconds: a burst of changes makes one registry write
REFRESH_SPACING = 9.0  # at least this many times its own duration between two refreshes
# pause reasons that hold the running song as well as the queue: its time is a wait, not work
# (a person's pause lets the song finish). The scheduler's PAUSE_INBOX and PAUSE_OUTBOX and
# the cluster watch's PAUSE_CLUSTER, by value: importing the scheduler would load numpy into
# `status`
HOLDING = frozenset({"inbox", "outbox", "cluster"})


@dataclasses.dataclass(frozen=True)
class Rate:
    """Measured for one model and precision: weighted sums of (length, separation seconds)
    pairs, from which separation = fixed + rate × length is fitted (least squares), and the
    lane's time per song besides separation."""

    songs: int
    w: float = 0.0  # sum of weights
    x: float = 0.0  # of weight × length
    xx: float = 0.0  # of weight × length²
    y: float = 0.0  # of weight × separation seconds
    xy: float = 0.0  # of weight × length × separation seconds
    overhead: float = 0.0  # seconds per song besides separation (moving average)

    def fit(self) -> tuple[float, float]:
        """(fixed seconds per song, seconds per second of audio). A model separates in
        segments of a few seconds, so a short song costs a whole one: with songs of
        different lengths measured, the fixed part is fitted too; otherwise (or if the fit
        makes no sense) the time is taken as proportional to the length."""
        spread = self.w * self.xx - self.x * self.x  # weight² × variance of the lengths
        if self.songs >= 3 and spread > (SPREAD * self.x) ** 2:
            rate = (self.w * self.xy - self.x * self.y) / spread
            fixed = (self.y - rate * self.x) / self.w
            if rate > 0 and fixed >= 0:
                return fixed, rate
        return 0.0, self.y / self.x if self.x > 0 else 0.0

    @property
    def length(self) -> float:
        """The mean length measured: the guess for a song whose length is not known yet."""
        return self.x / self.w if self.w > 0 else 0.0

    def expect(self, length: float) -> float:
        fixed, rate = self.fit()
        return fixed + self.overhead + rate * length

    def add(self, length: float, separate: float, overhead: float) -> Rate:
        """With one more song: the first EQUAL songs count equally, later ones with a fixed
        weight, so the fit follows a machine that got busier without forgetting at once."""
        keep = 1.0 - WEIGHT if self.songs >= EQUAL else 1.0
        share = WEIGHT if self.songs >= EQUAL else 1.0 / (self.songs + 1)
        return Rate(
            self.songs + 1,
            keep * self.w + 1.0,
            keep * self.x + length,
            keep * self.xx + length * length,
            keep * self.y + separate,
            keep * self.xy + length * separate,
            self.overhead + share * (overhead - self.overhead),
        )


def rate_key(model: str, precision: str | None) -> str:
    return f"{model}/{precision or 'float32'}"


class Estimator:
    """Learns from finished songs (events) and estimates the queue (snapshots)."""

    def __init__(
        self,
        registry: Any,
        settings: Settings,
        bus: EventBus,
        *,
        lanes: int = 1,
        clock: Callable[[], float] = time.time,
        probe: Callable[[Path], float | None] | None = None,
    ):
        self.registry, self.settings, self.lanes = registry, settings, max(1, lanes)
        self._clock = clock
        self._probe = probe or _probe_duration
        self._lock = threading.Lock()
        self.rates: dict[str, Rate] = {}
        self.took: dict[str, float] = {}
        self._load()
        self._lengths: dict[str, float | None] = {}
        self._presets: dict[str | None, Any] = {}
        self._started: dict[str, float] = {}
        self._last_final: float | None = None
        self._held_since: float | None = None  # while a pause holds the running song: since
        self._holds: list[tuple[float, float]] = []  # those since the oldest song began
        self._dirty = threading.Event()
        self._learnt = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._written: str | None = None
        self._snapshot: Callable[[], dict[str, Any]] | None = None
        bus.subscribe(JobChanged, self._on_change)
        bus.subscribe(QueueChanged, self._on_queue)

    # ------------------------------------------------------------ learning

    def _load(self) -> None:
        try:
            stored = json.loads(self.registry.get_meta(RATES_META) or "{}")
            self.rates = {key: Rate(**value) for key, value in stored.get("rates", {}).items()}
            if any(rate.songs < 0 or rate.w < 0 for rate in self.rates.values()):
                raise ValueError("negative counts")
            self.took = {str(k): float(v) for k, v in stored.get("took", {}).items()}
        except (ValueError, TypeError, AttributeError) as exc:
            log.warning(
                "the measured separation rates in the registry are unreadable (%s); "
                "measuring again",
                exc,
            )
            self.rates, self.took = {}, {}

    def _on_change(self, event: JobChanged) -> None:
        """Called on the thread that changed the job, often: cheap unless the state moved."""
        job = event.job
        if job.state.is_running:
            if job.id not in self._started:
                with self._lock:
                    self._started.setdefault(job.id, self._clock())
                self._dirty.set()
        elif job.state.is_final:
            if job.id not in self._started and job.id not in self._lengths:
                return
            with self._lock:
                started = self._started.pop(job.id, None)
                self._lengths.pop(job.id, None)
                previous = self._last_final
                if started is not None:  # the lane was busy with it until now
                    self._last_final = job.finished_at or self._clock()
            if job.state is JobState.DONE and started is not None:
                self._learn(job, started, previous)
            self._dirty.set()
        elif job.state is JobState.QUEUED:
            if job.id in self._started:  # back in the queue: its next start is timed afresh
                with self._lock:
                    self._started.pop(job.id, None)
                self._dirty.set()
            elif job.id not in self._lengths:
                self._dirty.set()

    def _on_queue(self, event: QueueChanged) -> None:
        """The queue paused or started: a pause that holds the running song (HOLDING) is
        time its work is not measured in."""
        held = event.paused and event.pause_reason in HOLDING
        with self._lock:
            now = self._clock()
            if held and self._held_since is None:
                self._held_since = now
            elif not held and self._held_since is not None:
                self._holds.append((self._held_since, now))
                self._held_since = None
                oldest = min([*self._started.values(), self._last_final or now, now])
                self._holds = [span for span in self._holds if span[1] > oldest]

    def _held_within(self, begin: float, end: float) -> float:
        """Seconds a pause held the running song between `begin` and `end` (under the
        lock)."""
        spans = [*self._holds]
        if self._held_since is not None:
            spans.append((self._held_since, end))
        return sum(max(0.0, min(end, b) - max(begin, a)) for a, b in spans)

    def _learn(self, job: Job, started: float, previous: float | None) -> None:
        from stemdeck_watch.stages.manifest import read_manifest

        manifest = read_manifest(Path(job.output)) if job.output else None
        if not manifest or manifest.get("job_id") != job.id:
            return  # a duplicate: nothing was separated
        try:
            length = float(manifest["input"]["duration"])
            separate = float(manifest["timings"]["separate"])
            key = rate_key(manifest["model"]["name"], manifest["precision"].get("precision"))
        except (KeyError, TypeError, ValueError, AttributeError):
            return
        if length <= 0:
            return
        finished = job.finished_at or self._clock()
        begin = max(started, previous if previous and self.lanes == 1 else started)
        with self._lock:
            busy = finished - begin - self._held_within(begin, finished)
            old = self.rates.pop(key, None) or Rate(0)
            self.rates[key] = old.add(length, separate, max(0.0, busy - separate))
            self.took[job.id] = round(finished - started, 3)
            while len(self.took) > MAX_TOOK:
                del self.took[next(iter(self.took))]
            self._learnt = True
        log.debug(
            "%s: %.1f s of audio, separated in %.1f s, lane busy %.1f s -> %s",
            job.name,
            length,
            separate,
            busy,
            self.rates[key],
        )

    # ------------------------------------------------------------ estimating

    def estimate(
        self,
        running: list[Job],
        queued: list[Job],
        shown: list[Job],
        worker: dict[str, Any] | None,
        paused: bool = False,
        probe: bool = True,
    ) -> dict[str, Any]:
        """The `eta` of a snapshot: its running jobs, its queued ones in order, and the time
        each of the `shown` finished ones took. A paused queue starts nothing: its songs say
        how long they will take, not when they will be done. `probe` False: no song's header
        is read now (the inbox's share is away: a read could hang), lengths known are used."""
        now = self._clock()
        budget = [PROBES_PER_ESTIMATE if probe else 0]
        with self._lock:
            started = dict(self._started)
            last_final = self._last_final if self.lanes == 1 else None
        if last_final is not None:  # never later than now (a clock set back meanwhile)
            last_final = min(last_final, now)
        ordered = sorted(running, key=lambda j: started.get(j.id, now))
        ends: list[float | None] = [last_final] * self.lanes
        entries: dict[str, dict[str, Any]] = {}
        known, work = True, 0.0
        for index, job in enumerate(ordered + queued):
            length, guessed, rate = self._figures(job, worker, budget)
            entry: dict[str, Any] = {
                "length": round(length, 3) if length is not None else None,
                "guessed": guessed,
                "seconds": None,
                "start": None,
                "finish": None,
            }
            entries[job.id] = entry
            if rate is None or length is None:
                known = False
                continue
            expected = rate.expect(length)
            entry["seconds"] = round(expected, 1)
            if paused and index >= len(ordered):
                work += expected
                continue
            if index < len(ordered):  # measured as it was learnt: from its start, or from
                lane = index % self.lanes  # when the lane's song before it finished
                begin = max(started.get(job.id, now), ends[lane] or 0.0)
                finish = begin + expected
                if finish <= now:  # slower than measured: what its progress says is left
                    finish = now + expected * (1.0 - job.progress)
            else:
                lane = min(range(self.lanes), key=lambda i: max(now, ends[i] or now))
                begin = max(now, ends[lane] or now)
                finish = begin + expected
            ends[lane] = finish
            work += max(0.0, finish - now) if index < len(ordered) else expected
            entry["start"], entry["finish"] = round(begin, 1), round(finish, 1)
        finishes = [e["finish"] for e in entries.values() if e["finish"] is not None]
        default = self._rate_for(
            self.settings.separation.model, self.settings.separation.precision, worker
        )
        with self._lock:
            took = {job.id: self.took[job.id] for job in shown if job.id in self.took}
        done = max(finishes) if known and finishes and not (paused and queued) else None
        return {
            "songs": len(entries),
            "seconds": (
                round(max(0.0, done - now), 1) if done else round(work, 1) if known else None
            ),
            "finish": done,
            "paused": paused,
            "measured": known,
            "rate": _rate_json(*default) if default else None,
            "jobs": entries,
            "took": took,
        }

    def _figures(
        self, job: Job, worker: dict[str, Any] | None, budget: list[int]
    ) -> tuple[float | None, bool, Rate | None]:
        """A job's length (and whether it is a guess) and the rate its model runs at."""
        sep = self._separation(job.preset)
        found = self._rate_for(sep.model, sep.precision, worker)
        rate = found[1] if found else None
        length = self._length(job, budget)
        if length is None and rate is not None:
            return rate.length, True, rate
        return length, False, rate

    def _separation(self, preset: str | None) -> Any:
        """A preset's separation settings (the settings never change while the service runs;
        a snapshot asks for each queued song's)."""
        found = self._presets.get(preset)
        if found is None:
            found = self._presets[preset] = self.settings.for_preset(preset)[0]
        return found

    def _rate_for(
        self, model: str, setting: str, worker: dict[str, Any] | None
    ) -> tuple[str, Rate] | None:
        """The measurement for `model` under the precision `setting`: at the precision the
        worker chose for it (only where the worker runs this model under this setting: a
        preset's own precision may differ), else the one the setting names, else the one
        measured last."""
        with self._lock:
            if worker and worker.get("model") == model:
                decided = worker.get("precision") or {}
                chosen = decided.get("precision")
                key = rate_key(model, chosen)
                if chosen and decided.get("setting") == setting and key in self.rates:
                    return key, self.rates[key]
            if setting != "auto" and rate_key(model, setting) in self.rates:
                return rate_key(model, setting), self.rates[rate_key(model, setting)]
            for key in reversed(self.rates):
                if key.startswith(f"{model}/"):
                    return key, self.rates[key]
        return None

    def _length(self, job: Job, budget: list[int]) -> float | None:
        """From the file's header, once per job; a playlist entry's from its playlist; None
        for a link not downloaded yet (or a file whose header says nothing)."""
        with self._lock:
            if job.id in self._lengths:
                return self._lengths[job.id]
        if job.kind is JobKind.FILE:
            if budget[0] <= 0:
                return None  # the next estimate reads it
            budget[0] -= 1
            length = self._probe(Path(job.source))
        elif job.playlist is not None and job.playlist.duration:
            length = float(job.playlist.duration)
        else:
            return None
        with self._lock:
            self._lengths[job.id] = length
        return length

    # ------------------------------------------------------------ kept for `status`

    def start(self, snapshot: Callable[[], dict[str, Any]]) -> None:
        """Keep the registry's copy current: after changes, in a thread of its own (never on
        the pipeline's thread: a registry write between two songs is worker idle time)."""
        self._snapshot = snapshot
        self._stop.clear()
        self._dirty.set()
        self._thread = threading.Thread(target=self._keep, name="stemdeck-eta", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._dirty.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _keep(self) -> None:
        pause = REFRESH_DEBOUNCE
        while not self._stop.is_set():
            self._dirty.wait(60.0)
            if self._stop.wait(pause):
                break
            self._dirty.clear()
            began = time.monotonic()
            try:
                self.write(self._snapshot() if self._snapshot else None)
            except Exception:
                log.exception("could not keep the queue's estimate for status; going on")
            # a long queue (a library dropped at once) takes a while to estimate: refreshed
            # while it keeps changing, it would take a core from the intake
            pause = max(REFRESH_DEBOUNCE, REFRESH_SPACING * (time.monotonic() - began))

    def write(self, snapshot: dict[str, Any] | None) -> None:
        """Store what was learnt, and the snapshot's estimate if it changed."""
        with self._lock:
            learnt, self._learnt = self._learnt, False
            rates = {
                "rates": {k: dataclasses.asdict(v) for k, v in self.rates.items()},
                "took": dict(self.took),
            }
        if learnt:
            self.registry.set_meta(RATES_META, json.dumps(rates))
        eta = (snapshot or {}).get("eta")
        if eta is not None:
            text = json.dumps({k: v for k, v in eta.items() if k != "took"})
            if text != self._written:
                self.registry.set_meta(ETA_META, text)
                self._written = text


def work_held(eta: dict[str, Any]) -> float | None:
    """The seconds of work an estimate's songs hold: each song's own `seconds`, summed; None
    where a song's time is not measured."""
    seconds = [entry.get("seconds") for entry in (eta.get("jobs") or {}).values()]
    if any(s is None for s in seconds):
        return None
    return float(sum(seconds))


def over_work(eta: dict[str, Any]) -> float:
    """How many seconds more than the work it holds an estimate says is left (after the
    rounding of its figures to a tenth): never above 0 for an idle queue, where nothing
    waits before its songs but each other. 0 where it says no time or holds an unmeasured
    song."""
    held, said = work_held(eta), eta.get("seconds")
    if held is None or said is None:
        return 0.0
    return float(said) - held - 0.05 * (len(eta.get("jobs") or {}) + 1)


def _rate_json(key: str, rate: Rate) -> dict[str, Any]:
    model, _, precision = key.partition("/")
    fixed, per_second = rate.fit()
    return {
        "model": model,
        "precision": precision,
        "seconds_per_second": round(per_second, 4),
        "per_song": round(fixed, 3),
        "overhead": round(rate.overhead, 3),
        "songs": rate.songs,
    }


def _probe_duration(path: Path) -> float | None:
    """The length in a song's header; only a regular file is opened (a FIFO planted in the
    shared inbox under a queued song's name would hold the snapshot until a writer came)."""
    from stemdeck_watch.stages.decode import probe_duration

    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            return None
    except OSError:
        return None
    return probe_duration(path)


def stored(registry: Any, running: bool) -> dict[str, Any] | None:
    """The estimate the service last stored (`status`); without the service running nothing
    is on its way, so only the work left is said, not when it would be done."""
    try:
        eta = json.loads(registry.get_meta(ETA_META) or "null")
    except ValueError:
        return None
    if not isinstance(eta, dict):
        return None
    if not running:
        eta["finish"] = None
        for entry in (eta.get("jobs") or {}).values():
            if isinstance(entry, dict):
                entry["start"] = entry["finish"] = None
    return eta


def eta_words(eta: dict[str, Any] | None, clock_format: str = "%H:%M") -> str:
    """ "3 songs, done around 14:20" (the tray and `status`); "" with nothing left."""
    if not eta or not eta.get("songs"):
        return ""
    songs = f"{eta['songs']} song{'s' if eta['songs'] != 1 else ''}"
    if eta.get("finish"):
        when = _dt.datetime.fromtimestamp(eta["finish"])
        day = "" if when.date() == _dt.date.today() else when.strftime("%a ")
        return f"{songs}, done around {day}{when.strftime(clock_format)}"
    if eta.get("seconds"):
        return f"{songs}, about {_duration(eta['seconds'])} of work"
    if eta.get("measured"):
        return songs
    return f"{songs}, time not measured yet (the first song measures it)"


def _duration(seconds: float) -> str:
    minutes = round(seconds / 60)
    if minutes < 1:
        return f"{round(seconds)} s"
    return f"{minutes} min" if minutes < 60 else f"{minutes // 60} h {minutes % 60:02d} min"
