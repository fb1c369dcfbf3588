"""The reference model of the seams test (tests/test_model_based.py): what the test did to
the folders — every version of every input it placed, every outbox folder it took away or
had removed, every cancel that came in time — and therefore what must hold.

"Nothing is lost" is a plain count, as the test's hands keep every byte they replace or
delete (tests/seams_folders.py): every version the test placed is, byte for byte, in the
inbox, processed/, failed/ or the test's trash/ and away/.
"""

from __future__ import annotations

import collections
import os
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from stemdeck_watch.core.choices import SIDECAR_SUFFIX
from stemdeck_watch.core.jobs import settings_key_of
from stemdeck_watch.stages.manifest import MANIFEST, read_manifest

from seams_folders import RECIPE_SLOT, RECIPE_VOCALS, Hashes, listing, scan_outbox, sha_of, url_in
from seams_service import JobRow, RegistryView, ServiceProcess, read_registry

# kinds of problem (the tag each message starts with) to look past: defects known and not fixed
# yet, so that a soak can go on looking for others, e.g. STEMDECK_MODEL_KNOWN=twice,stall
KNOWN = frozenset(filter(None, os.environ.get("STEMDECK_MODEL_KNOWN", "").split(",")))
STALL = 90.0  # seconds without any change before a queue that should finish counts as stuck
DISK_STALL = 15.0
RETRIES = 2  # queue.worker_retries: a song whose worker died this often is not failed
FINAL = ("done", "failed", "cancelled")
# the most a recipe's stems may miss their mix by (the manifest's residual): float rounding
# and the stems' 16-bit samples, far below a stem left out or made twice
RESIDUAL_DB = -60.0


class Model:
    def __init__(self, root: Path, outbox: Path, songs: list[bytes]):
        self.root, self.outbox = root, outbox
        self.inbox, self.processed = root / "inbox", root / "processed"
        self.failed = root / "failed"
        self.trash, self.away = root / "trash", root / "away"
        self.scratch = root / "state" / "scratch"
        self.songs = {sha_of(data): f"c{i}" for i, data in enumerate(songs)}
        self.hashes = Hashes()
        self.placed: collections.Counter[str] = collections.Counter()  # versions, by sha
        self.names: dict[str, str] = dict(self.songs)  # sha -> what to call it in messages
        self.history: dict[str, set[str]] = collections.defaultdict(set)  # rel -> shas
        self.urls: dict[str, set[str]] = collections.defaultdict(set)  # link rel -> URL paths
        self.paused = False
        self.disk_tight = False
        self.seen: dict[str, str] = {}  # outbox folder -> job id of its manifest, last step
        self.taken: dict[str, float] = {}  # outbox folder -> when the test last took it away
        self.removed: dict[str, float] = {}  # job id -> when the test removed it
        self.removed_outputs: dict[str, float] = {}  # output path -> when its job was removed
        self.must_cancel: dict[str, str] = {}  # job id -> why the cancel surely came in time
        self.excused: set[str] = set()  # jobs whose input the test rewrote while it was read
        # sidecars written with a song: (inbox rel path, when, kind); written late: (rel, when,
        # sha of its bytes)
        self.sidecars: list[tuple[str, float, str]] = []
        self.late: list[tuple[str, float, str]] = []

    # ------------------------------------------------------------ what the test did

    def placed_version(self, rel: str, data: bytes, url: str | None = None) -> None:
        sha = sha_of(data)
        self.placed[sha] += 1
        if url is None:
            self.history[rel].add(sha)
        else:
            self.urls[rel].add(urlsplit(url).path)
            self.names[sha] = f"link to {urlsplit(url).path}"

    def touching(self, view: RegistryView, rel: str) -> None:
        """The test is about to change inbox/`rel`: a job reading it (decoding) or moving it
        (publishing) right now may see a torn file; its content checks are waived."""
        job = view.latest_for(str(self.inbox / rel))
        if job is not None and job.state in ("downloading", "decoding", "publishing"):
            self.excused.add(job.id)

    def sidecar_with(self, rel: str, kind: str) -> None:
        self.sidecars.append((rel, time.time(), kind))

    def late_sidecar(self, rel: str, data: bytes) -> None:
        self.late.append((rel, time.time(), sha_of(data)))

    def took_away(self, rel: str) -> None:
        self.taken[rel] = time.time()
        self.seen.pop(rel, None)

    def removed_job(self, job_id: str, output: str | None) -> None:
        self.removed[job_id] = time.time()
        if output:
            self.removed_outputs[output] = time.time()

    def name(self, sha: str | None) -> str:
        return "nothing" if sha is None else self.names.get(sha, sha[:12])

    # ------------------------------------------------------------ after every step

    def check_step(self, view: RegistryView) -> list[str]:
        folders, _stray, _staging = scan_outbox(self.outbox)
        problems = [
            f"[half] outbox/{rel} is a half folder: no complete {MANIFEST}"
            for rel, manifest in folders.items()
            if manifest is None
        ]
        now = {rel: str(m.get("job_id")) for rel, m in folders.items() if m is not None}
        for rel, job_id in self.seen.items():
            if now.get(rel) != job_id and job_id not in self.removed:
                what = "deleted" if rel not in now else f"replaced by job {now[rel]}'s"
                removed = sorted(self.removed) or "none"
                problems.append(
                    f"[deleted] outbox/{rel} (the stems of job {job_id}) was {what}, "
                    f"yet the test removed only jobs {removed} and did not move "
                    f"that folder"
                )
        self.seen = now
        for rel, job_id in now.items():
            job = view.jobs.get(job_id)
            if job_id in self.must_cancel:
                problems.append(
                    f"[cancel] outbox/{rel} holds the stems of job {job_id}, "
                    f"cancelled in time ({self.must_cancel[job_id]})"
                )
            elif job is not None and job.state == "cancelled":
                problems.append(
                    f"[cancel] outbox/{rel} holds the stems of job {job_id}, which is "
                    f"cancelled ({job.error})"
                )
        twins: dict[tuple[str, Any], list[str]] = collections.defaultdict(list)
        for rel, manifest in folders.items():
            if manifest is None:
                continue
            problems += self._holds_its_song(rel, manifest)
            # the same settings: its preset's, and a sidecar's or a tag's on top
            key = (manifest.get("preset"), settings_key_of(manifest.get("settings")))
            twins[(manifest["input"]["sha256"], key)].append(rel)
        problems += [
            f"[twice] {self.name(sha)} was separated {len(rels)} times with the same "
            f"settings (on_duplicate = skip): {sorted(rels)}"
            for (sha, _preset), rels in twins.items()
            if len(rels) > 1
        ]
        return problems + self._nothing_lost()

    def check_jobs(self, view: RegistryView) -> list[str]:
        """[sha] a manifest and the job it names agree on the input's sha256 (the job's
        record is what a duplicate is matched by). [tombstone] a job removed stays removed:
        no job in flight is for the version of a file a tombstone keeps out."""
        problems = []
        folders, _stray, _staging = scan_outbox(self.outbox)
        for rel, manifest in folders.items():
            job = view.jobs.get(str((manifest or {}).get("job_id")))
            if manifest is None or job is None or job.id in self.excused:
                continue
            got = manifest["input"]["sha256"]
            if job.state == "done" and job.sha256 and job.sha256 != got:
                problems.append(
                    f"[sha] outbox/{rel} holds the stems of {self.name(got)}, but job "
                    f"{job.id} ({job.rel_path}) that it names recorded {self.name(job.sha256)}"
                )
        for job in view.jobs.values():
            error = job.error or ""
            if "could not load model" in error and "evil" in error:
                problems.append(
                    f"[model] {job.rel_path} ({job.id}): a worker was asked to load a model a "
                    f"drop named, outside the catalogue and the owner's repo: {error}"
                )
            kept_out = view.tombstones.get(job.source, "none")
            if job.state not in FINAL and kept_out == job.signature and job.signature:
                problems.append(
                    f"[tombstone] {job.rel_path} ({job.id}) is {job.state}, though its "
                    f"version was removed (a tombstone keeps it out)"
                )
        return problems

    def _holds_its_song(self, rel: str, manifest: dict[str, Any]) -> list[str]:
        """The manifest's input is a version the test placed where the manifest says."""
        source, job_id = manifest["input"], str(manifest.get("job_id"))
        if job_id in self.excused:
            return []
        sha, where = source["sha256"], source["rel_path"]
        if "link" in manifest:
            path = urlsplit(manifest["link"]["url"]).path
            problems = (
                []
                if path in self.urls[where]
                else [
                    f"[foreign] outbox/{rel} was downloaded from {path}, never named by inbox/{where}"
                ]
            )
            if self.songs.get(sha) != path.strip("/").removesuffix(".wav"):
                problems.append(
                    f"[foreign] outbox/{rel} says it was downloaded from {path} but "
                    f"holds the stems of {self.name(sha)}"
                )
            return problems
        if sha not in self.history[where]:
            return [
                f"[foreign] outbox/{rel} holds the stems of {self.name(sha)}, which was "
                f"never at inbox/{where} (versions there: "
                f"{sorted(self.name(s) for s in self.history[where])})"
            ]
        return []

    def _nothing_lost(self) -> list[str]:
        found: collections.Counter[str] = collections.Counter()
        for folder in (self.inbox, self.processed, self.failed, self.trash, self.away):
            for dirpath, dirs, files in os.walk(folder):
                dirs[:] = [d for d in dirs if not d.startswith(".")]
                for name in files:
                    sha = self.hashes.of(Path(dirpath) / name)
                    if sha is not None:
                        found[sha] += 1
        return [
            f"[lost] {self.name(sha)}: {count} version(s) placed in the inbox, only "
            f"{found[sha]} found in the inbox, processed/ and failed/ (and the test's trash)"
            for sha, count in self.placed.items()
            if found[sha] < count
        ]

    # ------------------------------------------------------------ once the queue is quiet

    def pending(self, view: RegistryView) -> list[str]:
        """Why the service is not quiet yet (empty: it is)."""
        why = [f"{job.rel_path} ({job.id}) is {job.state}" for job in view.running()]
        held = self.paused or (self.disk_tight and view.pause_reason == "disk")
        if view.order and not held:
            why.append(
                f"{len(view.order)} job(s) queued "
                f"({view.pause_reason or 'not paused'}): {view.names(view.order)}"
            )
        why += [f"{source} waits (queue full)" for source in view.waiting]
        for path, sig in self.inbox_files():
            jobs = [j for j in view.jobs.values() if j.source == str(path)]
            if not any(j.signature == sig for j in jobs) and view.tombstones.get(str(path)) != sig:
                latest = max(jobs, key=lambda j: j.created_at) if jobs else None
                why.append(
                    f"inbox/{path.relative_to(self.inbox)} has no job for its content"
                    + (
                        f" (its last job {latest.id} is {latest.state}: {latest.error})"
                        if latest
                        else ""
                    )
                )
        return why

    def inbox_files(self) -> list[tuple[Path, tuple[int, int, int]]]:
        files = []
        for dirpath, dirs, names in os.walk(self.inbox):
            dirs[:] = [d for d in dirs if not d.startswith(".")]
            for name in names:
                if not name.startswith(".") and not name.endswith(SIDECAR_SUFFIX):
                    try:
                        st = os.stat(Path(dirpath) / name)
                    except FileNotFoundError:
                        continue
                    files.append((Path(dirpath) / name, (st.st_size, st.st_mtime_ns, st.st_ino)))
        return files

    def check_quiet(self, view: RegistryView) -> list[str]:
        folders, stray, staging = scan_outbox(self.outbox)
        problems = [f"[leftover] a leftover in the outbox: {name}" for name in stray]
        problems += [
            f"[leftover] a leftover in the outbox's staging folder: {name}" for name in staging
        ]
        for folder in (self.processed, self.failed):
            for _dirpath, dirs, files in os.walk(folder):  # what goes meanwhile is skipped
                problems += [
                    f"[leftover] a hidden leftover in {folder.name}/: {name}"
                    for name in dirs + files
                    if name.startswith(".")
                ]
        if not view.order:
            problems += [
                f"[leftover] a scratch leftover with an empty queue: {p.name}"
                for p in listing(self.scratch)
            ]
        for rel, manifest in folders.items():
            job_id = str((manifest or {}).get("job_id"))
            job = view.jobs.get(job_id)
            if manifest is None or job_id in self.removed:
                continue
            if job is None or job.state != "done" or job.output != str(self.outbox / rel):
                what = (
                    f"{job.state} with its stems at {job.output}"
                    if job
                    else "unknown to the registry"
                )
                problems.append(
                    f"[orphan] outbox/{rel} holds the stems of job {job_id}, which is {what}"
                )
        for job in view.jobs.values():
            if job.state == "done":
                problems += self._done_job(job)
        for job_id, why in self.must_cancel.items():
            job = view.jobs.get(job_id)
            if job is not None and job.state != "cancelled":
                problems.append(
                    f"[cancel] {job.rel_path} ({job_id}) was cancelled in time "
                    f"({why}), yet it is {job.state}"
                )
        for job in view.jobs.values():
            # an attempt after a fault reads the song's choices afresh: one the test wrote
            # meanwhile may fail it, naming itself (its sidecar's own check above)
            own = SIDECAR_SUFFIX in (job.error or "")
            if job.state == "failed" and 0 < job.faults <= RETRIES and not own:
                problems.append(
                    f"[machine] {job.rel_path} ({job.id}) failed after the "
                    f"machine cut off only {job.faults} attempt(s) (the worker "
                    f"died under it; {RETRIES} more are allowed): {job.error}"
                )
        problems += self._sidecars(view)
        if self.paused and view.pause_reason not in ("user", "disk"):
            now = f"paused for {view.pause_reason}" if view.pause_reason else "running"
            problems.append(f"[pause] the test paused the queue, and it is {now}")
        return problems

    def _sidecars(self, view: RegistryView) -> list[str]:
        """[sidecar] a song whose sidecar it cannot take fails naming the sidecar, never as
        an unexpected error; one whose sidecar holds a misspelt key or names a model outside
        the catalogue and the owner's repo is not separated. [late] a sidecar written after
        its song was taken is never moved beside it as if it had been used, without a word."""
        problems = []
        for rel, when, kind in self.sidecars:
            later = [j for j in view.jobs.values() if j.rel_path == rel and j.created_at >= when]
            job = min(later, key=lambda j: j.created_at) if later else None
            if job is None or job.id in self.excused:
                continue
            error = job.error or ""
            unnamed = "sidecar" not in error and SIDECAR_SUFFIX not in error
            if job.state == "failed" and (
                "unexpected error" in error or (kind != "good" and unnamed)
            ):
                problems.append(
                    f"[sidecar] {rel} ({job.id}) with a sidecar ({kind}) failed without "
                    f"naming it: {error}"
                )
            if job.state == "done" and kind in ("misspelt", "model by URL"):
                problems.append(
                    f"[sidecar] {rel} ({job.id}) was separated though its sidecar was {kind}"
                )
        logs = "".join(
            p.read_text(errors="replace") for p in listing(self.root / "logs") if p.is_file()
        )
        for rel, _when, sha in self.late:
            name = Path(rel).name + SIDECAR_SUFFIX
            moved = [
                Path(dirpath) / file
                for folder in (self.processed, self.failed)
                for dirpath, _dirs, files in os.walk(folder)
                for file in files
                if SIDECAR_SUFFIX[:-5] in file and self.hashes.of(Path(dirpath) / file) == sha
            ]
            if moved and name not in logs:
                problems.append(
                    f"[late] the sidecar of {rel}, written after its song was taken, was moved "
                    f"to {moved[0].relative_to(self.root)} without a word in the log"
                )
        return problems

    def _by_recipe(self, job: JobRow, rel: str, manifest: dict[str, Any]) -> list[str]:
        """[recipe] a song whose name chose the recipe is published with it: the vocals
        the RoFormer's, the rest the Demucs model's, stems that add up to the mix."""
        if manifest.get("job_id") != job.id or Path(job.rel_path).name != RECIPE_SLOT:
            return []
        return [
            f"[recipe] {job.rel_path} ({job.id}) in outbox/{rel}: {wrong}"
            for wrong in _stems_of_recipe(manifest)
        ]

    def _done_job(self, job: JobRow) -> list[str]:
        """A done job's stems folder holds the stems of the input it took (unless the test
        moved that folder away, or removed the job that published it, since)."""
        output = job.output
        if not output:
            return [f"[wrong] {job.rel_path} ({job.id}) is done without a stems folder"]
        rel = os.path.relpath(output, self.outbox)
        moved = max(self.taken.get(rel, 0.0), self.removed_outputs.get(output, 0.0))
        if moved >= job.created_at or job.id in self.excused:
            return []
        manifest = read_manifest(Path(output))
        if manifest is None:
            return [
                f"[wrong] {job.rel_path} ({job.id}) is done, but its stems folder outbox/{rel} "
                f"{'is incomplete' if os.path.isdir(output) else 'does not exist'} (the "
                f"test never moved it)"
            ]
        problems = self._by_recipe(job, rel, manifest)
        if manifest.get("preset") != job.preset:
            problems.append(
                f"[wrong] {job.rel_path} ({job.id}, preset {job.preset}) points at "
                f"outbox/{rel}, separated with preset {manifest.get('preset')}"
            )
        source = Path(job.source)
        if self.processed not in source.parents or not source.is_file():
            return problems  # still in the inbox (changed meanwhile): checked when it runs
        url = url_in(source) if job.kind == "link" else None
        expected = (
            next(
                (s for s, n in self.songs.items() if url and urlsplit(url).path == f"/{n}.wav"),
                None,
            )
            if job.kind == "link"
            else self.hashes.of(source)
        )
        got = manifest["input"]["sha256"]
        if expected is not None and got != expected:
            what = f"a link to {self.name(expected)}" if url else self.name(expected)
            problems.append(
                f"[wrong] {job.rel_path} ({job.id}) is done with its input "
                f"{os.path.relpath(source, self.root)} = {what}, but "
                f"its stems folder outbox/{rel} (job {manifest.get('job_id')}) "
                f"holds the stems of {self.name(got)}"
            )
        if (
            url
            and manifest.get("job_id") == job.id
            and "link" in manifest
            and urlsplit(manifest["link"]["url"]).path != urlsplit(url).path
        ):
            problems.append(
                f"[wrong] the link {job.rel_path} ({job.id}) now names "
                f"{urlsplit(url).path}, but its stems were downloaded from "
                f"{urlsplit(manifest['link']['url']).path}"
            )
        return problems


def _stems_of_recipe(manifest: dict[str, Any]) -> list[str]:
    """What is wrong with a recipe song's manifest: not the recipe, a stem by a model the
    recipe does not name, the vocals not the RoFormer's, stems that do not add up (whether
    its RoFormer ran compiled or not), a compiled RoFormer run that was not in use."""
    recipe = manifest.get("recipe") or {}
    made_by = (manifest.get("model") or {}).get("made_by") or {}
    wrong = []
    if recipe.get("name") != "best":
        wrong.append(f"its recipe is {recipe or None}")
    if set(made_by.values()) - {RECIPE_VOCALS, "htdemucs_ft"}:
        wrong.append(f"its stems are made by {made_by}")
    if "vocals" in made_by and made_by["vocals"] != RECIPE_VOCALS:
        wrong.append(f"its vocals are made by {made_by['vocals']}")
    residual = (manifest.get("levels") or {}).get("residual_db")
    if residual is not None and residual > RESIDUAL_DB:
        wrong.append(f"its stems miss the mix by {residual:.1f} dB")
    compiled = recipe.get("compiled") or {}  # the RoFormer's compiled model ("on" here)
    if compiled.get("used") and compiled.get("state") != "used":
        wrong.append(f"its RoFormer ran a compiled model that is {compiled.get('state')}")
    return wrong


def order_kept(before: RegistryView, after: RegistryView, how: str) -> list[str]:
    """Jobs queued or in flight before a stop keep their order after it; those cut off
    (publishing first: it was taken first) head it."""
    ranking = before.ranking()
    now = [job_id for job_id in after.order if job_id in ranking]
    expected = [job_id for job_id in ranking if job_id in now]
    if now == expected:
        return []
    return [
        f"[order] the {how} changed the queue's order: before {before.names(ranking)} "
        f"(states {[before.jobs[i].state for i in ranking]}), after {after.names(after.order)}"
    ]


def fingerprint(view: RegistryView) -> tuple[Any, ...]:
    return (
        tuple(sorted((j.id, j.state, j.signature) for j in view.jobs.values())),
        tuple(view.order),
        view.pause_reason,
    )


def wait_quiet(service: ServiceProcess, model: Model, state: Path) -> RegistryView:
    """The registry once the service has nothing left to do (or is paused with it): nothing
    pending, and the same for three looks in a row. Stuck: nothing changed for STALL s."""
    last: Any = None
    stable = 0
    changed = time.monotonic()
    while True:
        if not service.alive():
            raise AssertionError(f"the service exited:\n{service.tail()}")
        view = read_registry(state)
        why = model.pending(view)
        now = (fingerprint(view), tuple(model.inbox_files()))
        if now != last:
            last, changed, stable = now, time.monotonic(), 0
        elif not why:
            stable += 1
            if stable >= 3:
                return view
        # held for disk with room on the disk: the disk check looks again every few seconds
        limit = DISK_STALL if view.pause_reason == "disk" and not model.disk_tight else STALL
        if why and time.monotonic() - changed > limit:
            if "stall" in KNOWN:
                return view
            raise AssertionError(
                f"[stall] the queue did not finish: nothing changed for {limit:.0f} s while\n  "
                + "\n  ".join(why)
                + f"\nthe service's log ends:\n{service.tail()}"
            )
        time.sleep(0.1)


def outstanding(problems: list[str]) -> list[str]:
    """The problems but those of the kinds in STEMDECK_MODEL_KNOWN."""
    return [p for p in problems if p[1 : p.find("]")] not in KNOWN]
