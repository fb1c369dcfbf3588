"""The resident separation worker: `python -m stemdeck_watch.workers.worker`.

Importing torch and demucs costs seconds, and loading a model more, so one worker process
loads the model once and serves every job. Protocol (one JSON object per line):

stdin, requests (each may carry "req": N, which its reply echoes):
    {"op": "load", "model": NAME, "repo": PATH|null,
     "precision": "auto"|"float32"|"bfloat16"|"float16", "decided": CHOICE|null,
     "compile": {"setting": "auto"|"on"|"off", "cache": DIR, "cap_mb": F}|null}
    {"op": "separate", "id": JOB, "model": NAME, "repo": PATH|null, "input": NPY,
     "output": DIR, "shifts": N, "overlap": F, "segment": F|null,
     "precision": P, "mean": F, "std": F, "window": F, "shrink": N,
     "lead": {"engine": "roformer", "model": NAME, "batch_size": N|null,
              "num_overlap": N|null, "precision": P},
     "compile": {...}|null}  (the last seven optional; "lead": a recipe's model first,
     workers/recipe.py; "compile", with a lead, as in a load: for the lead's compiled model)
stdout, replies (nothing else is ever written to stdout):
    {"event": "ready", "pid": N, "device": D, "threads": N, "versions": {...}}   once, at start
    {"op": "load", "ok": true, "model": NAME, "samplerate": N, "audio_channels": N,
     "sources": [...], "precision": CHOICE, "compiled": COMPILED}
    {"op": "separate", "id": JOB, "ok": true, "stems": {STEM: NPY}, "seconds": F,
     "window": F, "segment": F|null, "device": D, "shrink": N, "compiled": BOOL,
     "made_by": {STEM: MODEL}, "lead_compiled": COMPILED + {"precision": P, "used": BOOL}|null}
    {"op": ..., "ok": false, "kind": "model"|"memory"|"error", "error": TEXT,
     "traceback": TEXT, "device": "cuda"|"mps"|"cpu"|null}   ("memory": whose ran out)
stderr: `@@progress {"id": JOB, "value": F}` lines (with "id": "@load" after each step of a
load: read, placed on the device, warmed up, precision chosen, compiled model looked for; the
service's watch on a load hears them as it hears a song's), `@@download {"model": NAME, "done": BYTES,
"total": BYTES|null}` lines while a model is downloaded, and anything torch or demucs print.

A pretrained model (no "repo") comes from the cache (torch.hub's checkpoints folder); one not
there yet is downloaded from $STEMDECK_MODEL_HUB (separation.model_hub) first: see
workers/demucs/models.py and workers/download.py.

A song is separated window by window (workers/demucs/chunked.py: `window` seconds of output at a
time; default 30, or $STEMDECK_WINDOW_SECONDS), read from the input file and appended to one
`<stem>.npy` per stem in "output", so memory does not grow with the song; the samples are
those of one whole-song `apply_model`. "mean"/"std" are demucs's normalisation statistics of
the mono mix (decode accumulates them); without them the worker computes them with one
streamed pass. A song of at most one window is read whole and normalised exactly as before.
"shrink": N (after the memory ran out under the song) halves the window and the segment N
times (the model's own segment when none is given).

After loading a model the worker chooses its precision (workers/demucs/precision.py): with
"auto" it calibrates once per model load, unless the client passes "decided" (a choice this
machine measured before, e.g. for a worker restarted after a cancel). CHOICE is
`precision.Choice.to_dict()`: the precision in use, why, and the measured figures.
COMPILED is `compiled.CompiledSlot.to_dict()`: whether the compiled model is used, why, and
its figures; "building" asks the service to build it in the background (compiled/build.py), and
a later load request adopts it once built. "compiled" in a separate reply: whether this song
ran the compiled code. A recipe's RoFormer has a compiled model of its own, asked for by the
separate request's "compile" and reported in its reply ("lead_compiled": "building" asks for
the build, the next song with that lead adopts it before it starts; "used": this song ran it).
`--threads N` sets torch's thread count (0: one per physical core).

The worker exits when stdin closes or its parent dies, so a killed service never leaves a
process holding gigabytes of model behind.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Iterator, TextIO

from stemdeck_watch.util.validators import MODEL_NAME
from stemdeck_watch.workers import heap
from stemdeck_watch.workers.demucs import inverse
from stemdeck_watch.workers.compiled.cache import CompileCache
from stemdeck_watch.workers.compiled.model import CompiledSlot, members, using
from stemdeck_watch.workers.demucs.precision import Choice, autocast, choose, run_once, threads_for

PROGRESS_PREFIX = "@@progress "
LOAD_BEAT = "@load"  # the "id" of the progress a load reports
DOWNLOAD_PREFIX = "@@download "
DOWNLOAD_EVERY = 0.25  # seconds between two download progress lines at most
WINDOW_ENV = "STEMDECK_WINDOW_SECONDS"  # the worker's default window (tests, benchmarks)
MIN_WINDOW, MIN_SEGMENT = 1.0, 1.0  # seconds: the smallest a memory fault halves them to
# "0" turns oneDNN off in the worker: its first call of each convolution compiles kernels,
# about 2 s per worker start, which is nothing beside a real model's minutes of separation
# but most of the test suite's time (it starts a worker ~150 times, with a tiny model)
ONEDNN_ENV = "STEMDECK_ONEDNN"

log = logging.getLogger("stemdeck_watch.worker.process")


class ModelUnavailable(Exception):
    """The model cannot be had; the message says how to get it."""


def _reply(out: TextIO, message: dict[str, Any]) -> None:
    out.write(json.dumps(message) + "\n")
    out.flush()


def _progress(job_id: str, value: float) -> None:
    sys.stderr.write(PROGRESS_PREFIX + json.dumps({"id": job_id, "value": round(value, 4)}) + "\n")
    sys.stderr.flush()


def watch_parent(parent: int | None = None) -> None:
    """Exit when the process that started this one is gone (a killed service). `parent`: its
    pid as it said when it started this one; one killed before this process got here is
    noticed at once (this process already has another parent then)."""
    parent = parent or os.getppid()
    while True:
        if os.getppid() != parent:
            os._exit(0)
        time.sleep(1.0)


class _DownloadReport:
    """Reports a model's download on stderr (`@@download {"model", "done", "total"}`): the
    latest figures every DOWNLOAD_EVERY seconds while they change (also while the transfer
    stalls), and the last ones at the end. The service shows them in status, the page and
    the tray."""

    def __init__(self, name: str):
        self.name = name
        self._latest: tuple[int, int | None] | None = None
        self._sent: tuple[int, int | None] | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="download-report", daemon=True)

    def __enter__(self) -> _DownloadReport:
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._emit()

    def __call__(self, done: int, total: int | None) -> None:
        with self._lock:
            self._latest = (done, total)

    def _run(self) -> None:
        while not self._stop.wait(DOWNLOAD_EVERY):
            self._emit()

    def _emit(self) -> None:
        with self._lock:
            if self._latest is None or self._latest == self._sent:
                return
            self._sent = done_total = self._latest
        sys.stderr.write(
            DOWNLOAD_PREFIX
            + json.dumps({"model": self.name, "done": done_total[0], "total": done_total[1]})
            + "\n"
        )
        sys.stderr.flush()


def load_model(name: str, repo: str | None) -> Any:
    """Load a model the way demucs does, failing fast and clearly when it cannot be had.

    Only a plain model name is ever handed to demucs, whoever asked: demucs fetches an
    `hf://` name from HuggingFace before it looks at any repo, and a model file is code."""
    if not MODEL_NAME.fullmatch(name) or ".." in name:
        raise ModelUnavailable(
            f"could not load model {name!r}: not a model name (a URL, a scheme such as "
            f"hf:// or a path is never loaded); name a model demucs defines, or one in "
            f"separation.model_repo"
        )
    from demucs.pretrained import get_model

    if repo:
        folder = Path(repo)
        if not folder.is_dir():
            raise ModelUnavailable(
                f"could not load model {name!r}: separation.model_repo = {repo!r} is not a "
                f"folder; point it at the folder holding {name}.th or {name}.yaml"
            )
        try:
            return get_model(name, repo=folder)
        except Exception as exc:  # a missing name, a bad checksum, a corrupt or foreign pickle
            present = sorted(p.name for p in folder.iterdir() if p.suffix in (".th", ".yaml"))
            raise ModelUnavailable(
                f"could not load model {name!r} from {folder} (separation.model_repo): "
                f"{exc or type(exc).__name__}; model files there: "
                f"{', '.join(present) or 'none'}"
            ) from None
    return _from_cache(name)


def _from_cache(name: str) -> Any:
    """A pretrained model from the cache, downloaded from separation.model_hub first if it is
    not there (verified, resumable; progress on stderr)."""
    from stemdeck_watch.util.redact import redact_url
    from stemdeck_watch.workers.download import DownloadError
    from stemdeck_watch.workers.demucs.models import (
        DEFAULT_HUB,
        ModelStore,
        ModelStoreError,
        NotCached,
        UnknownModel,
        hf_cached,
    )

    store = ModelStore()
    how = (
        f"run `stemdeck-watch models pull {name}` where {redact_url(store.hub)} can be reached, "
        f"`stemdeck-watch models import FOLDER` from an offline copy, or set "
        f"separation.model_repo to a folder of model files"
    )
    try:
        store.pull(name, fetch=False)
        return _built(store, name)
    except UnknownModel as exc:
        if store.hub == DEFAULT_HUB:
            raise ModelUnavailable(f"could not load model {name!r}: {exc}") from None
    except NotCached:
        pass
    except ModelStoreError as exc:  # lists that cannot be read
        raise ModelUnavailable(f"could not load model {name!r}: {exc}") from None
    if hf_cached(name):  # downloaded by demucs from HuggingFace (earlier versions did)
        from demucs.pretrained import get_model

        os.environ["HF_HUB_OFFLINE"] = "1"
        return get_model(name)
    if os.environ.get("HF_HUB_OFFLINE") == "1":
        raise ModelUnavailable(
            f"could not load model {name!r}: it is not downloaded yet and "
            f"downloads are off (HF_HUB_OFFLINE=1); {how}"
        )
    try:
        with _DownloadReport(name) as report:
            store.pull(name, report)
    except (DownloadError, ModelStoreError) as exc:
        raise ModelUnavailable(f"could not download model {name!r}: {exc}; {how}") from None
    return _built(store, name)


def _built(store: Any, name: str) -> Any:
    try:
        return store.load(name)
    except ImportError as exc:  # the quantized models need diffq
        raise ModelUnavailable(
            f"model {name!r} needs a package that is not installed: {exc} "
            f"(`pip install diffq` for the quantized mdx_q and "
            f"mdx_extra_q)"
        ) from None


def set_backends() -> None:
    """Set torch's backends for separating: in the worker, a Ray actor's worker and the
    background compile, which must build what the worker runs.

    Attention goes through `scaled_dot_product_attention`, never `nn.MultiheadAttention`'s
    "fast path": on a CPU that path computes HTDemucs's self-attention as explicit matrix
    products and a softmax, and a full-size model separated 1.21× slower with it in float32
    (docs/benchmarks.md). The two compute the same attention; torch.compile never takes the
    fast path either. oneDNN is turned off where $STEMDECK_ONEDNN says so (tests)."""
    import torch

    torch.backends.mha.set_fastpath_enabled(False)
    if os.environ.get(ONEDNN_ENV) == "0":
        torch.backends.mkldnn.enabled = False


class Worker:
    def __init__(self, device: str, out: TextIO, beat: Callable[[], None] | None = None):
        set_backends()
        # called after each step of a load (the process's own worker reports it on stderr)
        self.beat: Callable[[], None] = beat or (lambda: None)
        heap.hold_for_separation()  # what a segment frees, the next one reuses
        self.device = device
        self.out = out
        self._models: dict[tuple[str, str | None], Any] = {}
        self._choices: dict[tuple[str, str | None, str], Choice] = {}
        self._compiled: dict[tuple[str, str | None, str], CompiledSlot] = {}
        self.ran_compiled = False  # the latest separation ran the compiled model throughout
        self._leads: dict[tuple[str, str | None], Any] = {}  # a recipe's RoFormer (one)
        self._lead_compiled: dict[tuple[str, str | None, str], CompiledSlot] = {}  # its compiled
        self.made_by: dict[str, str] = {}  # the latest separation's stem → model
        # the latest separation's lead: its compiled model's state, and whether it ran
        self.lead_ran: dict[str, Any] | None = None

    def lead(self, name: str, repo: str | None) -> Any:
        """A recipe's RoFormer, loaded on its first song and kept (one at a time)."""
        from stemdeck_watch.workers.recipe import LeadUnavailable, load_lead

        key = (name, repo)
        if key not in self._leads:
            self._leads.clear()
            self._lead_compiled.clear()
            try:
                self._leads[key] = load_lead(name, repo, self.device)
            except LeadUnavailable as exc:
                raise ModelUnavailable(str(exc)) from None
        return self._leads[key]

    def model(self, name: str, repo: str | None) -> Any:
        key = (name, repo)
        if key not in self._models:
            self._models.clear()  # one model resident at a time: memory matters more
            self._choices.clear()  # a fresh load is measured afresh
            if self._compiled:
                from stemdeck_watch.workers.compiled.graph import release

                release()  # the routed modules of the model let go
            self._compiled.clear()
            from stemdeck_watch.workers.faultseam import loading

            loading()  # faults on purpose, where tests ask for them
            model = load_model(name, repo)
            self.beat()
            model.to(self.device)
            inverse.route(members(model))
            self.beat()
            _warm_up(model, self.device)
            heap.give_back()  # the warm-up's tensors: an idle worker holds the model, no more
            self.beat()
            self._models[key] = model
        return self._models[key]

    def precision(
        self, name: str, repo: str | None, setting: str, decided: dict[str, Any] | None = None
    ) -> Choice:
        """The precision for the loaded model under `setting`: measured once per load."""
        model = self.model(name, repo)
        key = (name, repo, setting)
        if key not in self._choices:
            # a choice the service kept from an earlier worker, if made on this device
            if decided and (decided.get("setting"), decided.get("device")) == (
                setting,
                self.device,
            ):
                choice = Choice.from_dict(decided)
            else:
                choice = choose(setting, self.device, model, self._beating)
                log.info("precision for %s: %s (%s)", name, choice.precision, choice.reason)
            self._choices[key] = choice
        return self._choices[key]

    def _beating(self, model: Any, device: str, precision: str, signal: Any) -> tuple[float, Any]:
        """One calibration pass (precision.run_once), reported as a step of the load: a
        calibration takes a few passes of a segment each."""
        measured = run_once(model, device, precision, signal)
        self.beat()
        return measured

    def compiled(
        self, name: str, repo: str | None, precision: str, wanted: dict[str, Any] | None
    ) -> CompiledSlot:
        """The compiled model for the loaded model in `precision`, as `wanted` (the load
        request's "compile") asks: adopted from the cache once it is built there."""
        model = self.model(name, repo)
        slot = self._slot(self._compiled, (name, repo, precision), wanted)
        slot.refresh(model, name, precision, self.beat)
        if not any(other.active for other in self._compiled.values()):
            # loading a compiled model routes the model's position embedding, for every
            # precision alike: the eager model gets its own methods back once none is in use
            from stemdeck_watch.workers.compiled.graph import release

            release()
        return slot

    def lead_compiled(
        self,
        name: str,
        repo: str | None,
        precision: str,
        wanted: dict[str, Any] | None,
        beat: Callable[[], None],
    ) -> CompiledSlot:
        """The compiled model for a recipe's RoFormer in `precision`, as `wanted` (the
        separate request's "compile") asks: adopted from the cache once it is built there,
        before the song, which the measure of a new one delays (a watch hears each pass)."""
        lead = self.lead(name, repo)
        slot = self._slot(self._lead_compiled, (name, repo, precision), wanted)
        slot.refresh(lead.module, name, precision, beat)
        return slot

    def _slot(
        self,
        slots: dict[tuple[str, str | None, str], CompiledSlot],
        key: tuple[str, str | None, str],
        wanted: dict[str, Any] | None,
    ) -> CompiledSlot:
        """The slot for `key` in `slots`, made anew when the setting changed."""
        slot = slots.get(key)
        setting = str((wanted or {}).get("setting") or "off")
        if slot is None or slot.setting != setting:
            cache = None
            if wanted and wanted.get("cache"):
                cache = CompileCache(Path(wanted["cache"]), float(wanted.get("cap_mb") or 2048))
            slot = slots[key] = CompiledSlot(setting, cache, self.device)
        return slot

    def handle(self, request: dict[str, Any]) -> dict[str, Any]:
        op = request.get("op")
        if op == "load":
            model = self.model(request["model"], request.get("repo"))
            choice = self.precision(
                request["model"],
                request.get("repo"),
                request.get("precision") or "float32",
                request.get("decided"),
            )
            self.beat()
            slot = self.compiled(
                request["model"], request.get("repo"), choice.precision, request.get("compile")
            )
            self.beat()
            return {
                "op": "load",
                "ok": True,
                "model": request["model"],
                "samplerate": int(model.samplerate),
                "audio_channels": int(model.audio_channels),
                "sources": list(model.sources),
                "precision": choice.to_dict(),
                "compiled": slot.to_dict(),
            }
        if op == "separate":
            return self.separate(request)
        raise ValueError(f"unknown request {op!r}")

    def separate(self, request: dict[str, Any]) -> dict[str, Any]:
        job_id = request["id"]
        started = time.monotonic()
        paths = self.separate_files(
            request,
            Path(request["input"]),
            Path(request["output"]),
            lambda value: _progress(job_id, value),
        )
        model = self.model(request["model"], request.get("repo"))
        return {
            "op": "separate",
            "id": job_id,
            "ok": True,
            "compiled": self.ran_compiled,
            "stems": {name: str(path) for name, path in paths.items()},
            "samplerate": int(model.samplerate),
            "seconds": time.monotonic() - started,
            "precision": request.get("precision") or "float32",
            **self.sizes(request, model),
            "made_by": self.made_by,
            "lead_compiled": self.lead_ran,
        }

    def _compiled_for(self, request: dict[str, Any]) -> CompiledSlot | None:
        """The compiled model in use for this request's model and precision, unless the
        request runs another input shape than it was built for (its own segment, or the
        window and segment shrunk after the memory ran out)."""
        key = (request["model"], request.get("repo"), request.get("precision") or "float32")
        slot = self._compiled.get(key)
        if slot is None or not slot.active or request.get("segment") or request.get("shrink"):
            return None
        return slot

    def sizes(self, request: dict[str, Any], model: Any) -> dict[str, Any]:
        """The window and segment (seconds) a separate request runs with: as asked, or
        halved `shrink` times after the memory ran out (a segment of the model's own length
        when none was asked for); and the device."""
        shrink = int(request.get("shrink") or 0)
        window = window_seconds(request)
        segment = request.get("segment") or None
        if shrink:
            window = max(MIN_WINDOW, window / 2**shrink)
            segment = max(MIN_SEGMENT, float(segment or own_segment(model)) / 2**shrink)
        return {"window": window, "segment": segment, "device": self.device, "shrink": shrink}

    def separate_files(
        self,
        request: dict[str, Any],
        input_path: Path,
        output_dir: Path,
        on_progress: Callable[[float], None],
        arm: bool = True,
    ) -> dict[str, Path]:
        """Separate the decoded song at `input_path` into `output_dir` as a separate request
        asks (model, shifts, overlap, segment, precision, window, shrink, the input's
        statistics; a recipe's "lead" model first: workers/recipe.py): the one reading of a
        request, for this process's pipe and for a Ray actor."""
        from stemdeck_watch.workers.demucs.chunked import separate_to_files
        from stemdeck_watch.workers.faultseam import armed

        beat = on_progress  # alive, no progress: not a point where a fault is due
        if arm:
            on_progress = armed(on_progress)  # faults on purpose, where tests ask for them
        model = self.model(request["model"], request.get("repo"))
        self.made_by = {str(stem): request["model"] for stem in model.sources}
        self.lead_ran = None
        if request.get("lead"):
            return self._separate_led(
                request, model, input_path, output_dir, on_progress, lambda: beat(0.0)
            )
        stats = None
        if request.get("mean") is not None and request.get("std") is not None:
            stats = (float(request["mean"]), float(request["std"]))
        sizes = self.sizes(request, model)
        slot = self._compiled_for(request)
        self.ran_compiled = False
        with (
            autocast(self.device, request.get("precision") or "float32"),
            segments_of(model, sizes["segment"] if sizes["shrink"] else None),
            using(slot.pairs) if slot is not None else contextlib.nullcontext() as calls,
        ):
            paths = separate_to_files(
                model,
                input_path,
                output_dir,
                shifts=int(request.get("shifts", 1)),
                overlap=float(request.get("overlap", 0.25)),
                segment=sizes["segment"],
                device=self.device,
                stats=stats,
                window=sizes["window"],
                on_progress=on_progress,
            )
        self.ran_compiled = calls is not None and calls.all_compiled
        return paths

    def _separate_led(
        self,
        request: dict[str, Any],
        model: Any,
        input_path: Path,
        output_dir: Path,
        on_progress: Callable[[float], None],
        beat: Callable[[], None],
    ) -> dict[str, Path]:
        """A recipe's song (workers/recipe.py): its RoFormer, compiled where a compiled
        model was built and pays, then the request's Demucs model on what it leaves.
        `beat`: while the compiled RoFormer is adopted, before the song starts."""
        from stemdeck_watch.workers.recipe import lead_batch, lead_precision, separate_led

        step = request["lead"]
        lead = self.lead(str(step["model"]), request.get("repo"))
        if (lead.samplerate, lead.channels) != (model.samplerate, model.audio_channels):
            raise ModelUnavailable(
                f"the RoFormer {step['model']!r} takes {lead.channels} "
                f"channel(s) at {lead.samplerate} Hz, the model {request['model']!r} "
                f"{model.audio_channels} at {model.samplerate} Hz: a recipe needs both alike"
            )
        precision = lead_precision(step.get("precision"), self.device)
        slot = self.lead_compiled(
            str(step["model"]),
            request.get("repo"),
            precision,
            request.get("compile"),
            beat,
        )
        # built for one chunk at a time (a CPU's batch): another batch runs it eager
        one = lead_batch(step.get("batch_size"), lead.config.batch_size, self.device, request)
        compiled = slot.active and one == 1
        with using(slot.pairs) if compiled else contextlib.nullcontext() as calls:
            paths, self.made_by = separate_led(
                lead,
                request,
                input_path,
                output_dir,
                on_progress,
                lambda rest, source, into, report: self.separate_files(
                    rest, source, into, report, arm=False
                ),
            )
        if slot.setting != "off":
            ran = bool(calls and calls.all_compiled)
            self.lead_ran = {**slot.to_dict(), "precision": precision, "used": ran}
        return paths


def own_segment(model: Any) -> float:
    """The segment (seconds) the model separates in when none is asked for."""
    found = [float(m.segment) for m in members(model) if getattr(m, "segment", None)]
    return min(found) if found else 10.0


@contextlib.contextmanager
def segments_of(model: Any, segment: float | None) -> Iterator[None]:
    """While inside, a Transformer member of `model` runs `segment`-long inputs (shorter
    than it was trained on: less memory), instead of padding them back to its training
    length, as demucs's BagOfModels(segment=…) sets it; restored on the way out."""
    from demucs.htdemucs import HTDemucs

    changed = [
        (m, m.segment)
        for m in members(model)
        if segment is not None and isinstance(m, HTDemucs) and segment < m.segment
    ]
    for member, _ in changed:
        member.segment = segment
    try:
        yield
    finally:
        for member, original in changed:
            member.segment = original


def release_memory() -> None:
    """Give back what a failed attempt held: its tensors (once their traceback is gone),
    torch's cached GPU blocks, and the C heap's free pages (glibc keeps them otherwise)."""
    import gc

    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()
    if (
        torch is not None
        and getattr(torch.backends, "mps", None)
        and torch.backends.mps.is_available()
    ):
        torch.mps.empty_cache()
    heap.give_back()


def memory_error(exc: BaseException) -> str | None:
    """Whose memory ran out, if `exc` says memory ran out: "cuda" or "mps" (a GPU's), "cpu"
    (the computer's: a failed allocation, the rlimit); None for any other error."""
    torch = sys.modules.get("torch")
    oom = getattr(torch, "OutOfMemoryError", None) if torch is not None else None
    if oom is not None and isinstance(exc, oom):
        return "cuda"  # torch's CUDA caching allocator raises this type
    if isinstance(exc, MemoryError):
        return "cpu"
    text = str(exc)
    if not isinstance(exc, RuntimeError):
        return None
    if "MPS backend out of memory" in text:
        return "mps"
    if "CUDA out of memory" in text or "CUDA error: out of memory" in text:
        return "cuda"
    if "can't allocate memory" in text or "not enough memory" in text:
        return "cpu"  # torch's DefaultCPUAllocator (Linux, macOS / Windows)
    return None


def window_seconds(request: dict[str, Any]) -> float:
    """Seconds of output a separate request is worked through at a time: the request's, the
    environment's (tests), or the default."""
    from stemdeck_watch.workers.demucs.chunked import WINDOW_SECONDS

    return float(request.get("window") or os.environ.get(WINDOW_ENV) or WINDOW_SECONDS)


def _warm_up(model: Any, device: str) -> None:
    """Run one second of silence through the model: the first call pays seconds of one-off
    setup (kernel selection, allocator growth) that would otherwise land on the first song."""
    import torch
    from demucs.apply import apply_model

    silence = torch.zeros(1, int(model.audio_channels), int(model.samplerate), device=device)
    with torch.inference_mode():
        apply_model(
            model, silence, shifts=1, split=True, overlap=0.25, progress=False, device=device
        )


def resolve_device(device: str) -> str:
    import torch

    if device != "auto":
        return device
    if torch.cuda.is_available():
        return "cuda"
    if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
        return "mps"
    return "cpu"


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="stemdeck_watch.workers.worker")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--threads", type=int, default=0, help="0: one per physical core")
    parser.add_argument("--parent", type=int, default=0, help="the pid of who started it")
    args = parser.parse_args(argv)
    # the protocol owns stdout; anything a library prints goes to stderr instead
    protocol = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1, encoding="utf-8")
    sys.stdout = sys.stderr
    threading.Thread(
        target=watch_parent, args=(args.parent,), name="parent-watch", daemon=True
    ).start()

    import demucs
    import torch

    torch.set_num_threads(threads_for(args.threads))
    logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(name)s: %(message)s")
    worker = Worker(resolve_device(args.device), protocol, lambda: _progress(LOAD_BEAT, 0.0))
    _reply(
        protocol,
        {
            "event": "ready",
            "pid": os.getpid(),
            "device": worker.device,
            "threads": torch.get_num_threads(),
            "versions": {
                "torch": torch.__version__,
                "demucs": demucs.__version__,
                "python": sys.version.split()[0],
            },
        },
    )
    for line in sys.stdin:
        if not line.strip():
            continue
        request: dict[str, Any] = {}
        try:
            request = json.loads(line)
            reply = worker.handle(request)
        except ModelUnavailable as exc:
            reply = {
                "op": request.get("op"),
                "id": request.get("id"),
                "ok": False,
                "kind": "model",
                "error": str(exc),
            }
        except Exception as exc:
            memory = memory_error(exc)
            reply = {
                "op": request.get("op"),
                "id": request.get("id"),
                "ok": False,
                "kind": "memory" if memory else "error",
                "device": memory,
                "error": f"{type(exc).__name__}: {exc}",
                "traceback": traceback.format_exc(),
            }
        reply["req"] = request.get("req")  # the client matches replies on it
        _reply(protocol, reply)
        # after the reply, before the next request is read
        if reply.get("kind") == "memory":  # the next attempt needs what this one held
            release_memory()
        elif request.get("op") == "separate":
            heap.give_back()  # the song's tensors, kept for its segments
    return 0


if __name__ == "__main__":
    code = main()
    # everything is sent (replies are flushed as written, the stems are files): skip the
    # interpreter's teardown, which spends ~0.6 s freeing torch's modules on every stop
    logging.shutdown()
    sys.stderr.flush()
    os._exit(code)
