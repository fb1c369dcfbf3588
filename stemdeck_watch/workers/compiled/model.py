"""The compiled model, on the worker's side: load it from the cache, measure it, use it.

`torch.compile` (Inductor) makes a full-size HTDemucs 1.2–1.3× faster on a CPU in float32 (less
where the CPU runs bfloat16 natively), but building it costs minutes, so it never happens in
the worker: a background process at idle priority builds it into the compiled-model cache
(compiled/build.py, compiled/cache.py) while the worker goes on separating with the eager model.
Each part of each network (its encoder and decoder layers, its transformer) is compiled ahead
of time as one graph and saved with its guards (compiled/graph.py), so loading it traces nothing
and takes seconds; where OpenVINO is installed the transformer is converted for it instead
(compiled/openvinograph.py), which on a CPU with bfloat16 in hardware is where the gain is. Once a
build is there the worker loads it between two songs, measures it once on the built-in
synthetic song exactly as the precision choice measures (demucs/precision.py), and uses it only if
it is at least MIN_SPEEDUP× faster than the eager model in the same precision and every stem
matches float32 to MIN_SNR_DB. The verdict is kept in the cache, so a
later worker loads a compile that paid without measuring it again (before its first song), and
never tries one that did not until torch, the model or the CPU changes.

The network's own forward around the parts (its STFTs) and the transformer's position
embedding stay eager: why, and why parts rather than whole networks, in compiled/graph.py.

A recipe's RoFormer is compiled the same way, as a model of its own (the worker keeps a slot
for it beside the Demucs model's): its parts are its transformers, band split and mask
estimators, built for one chunk, and it is measured on one chunk of the synthetic song.

The compiled code shares the eager model's weights (no second copy in memory) and is used
only for the input shapes and modes it was built for: a request with its own segment, or one
shrunk after the memory ran out, runs the eager model (worker.py), and a call the parts' guards
refuse runs that part eager, counted. A compiled model that cannot be loaded is recorded as
failed, so later workers do not try it again, with the file to delete to build it anew.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import math
import os
import platform
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from stemdeck_watch.workers.compiled.cache import (
    INDUCTOR,
    CompileCache,
    CompileKey,
    Verdict,
    cpu_identity,
)
from stemdeck_watch.workers.demucs.precision import (
    CALIBRATE_ENV,
    MIN_SNR_DB,
    SMALL_MODEL_PARAMETERS,
    parameter_count,
    run_once,
    snr_db,
    synthetic_signal,
)

log = logging.getLogger(__name__)

MIN_SPEEDUP = 1.15


def cxx_compiler() -> str | None:
    """The C++ compiler Inductor would use on a CPU ($CXX, else g++; clang++ on macOS), if it
    is installed."""
    name = os.environ.get("CXX") or ("clang++" if sys.platform == "darwin" else "g++")
    return shutil.which(name)


def members(model: Any) -> list[Any]:
    """The networks of a model or of a bag of models."""
    return list(getattr(model, "models", None) or [model])


def fingerprint(model: Any) -> str:
    """A digest of the model's classes, sizes and weights: what the compile and its verdict
    were made for."""
    import torch

    digest = hashlib.sha256()
    for member in members(model):
        digest.update(type(member).__qualname__.encode())
        for name, tensor in sorted(member.state_dict().items()):
            data = tensor.detach().cpu().contiguous()
            digest.update(f"{name}{tuple(data.shape)}{data.dtype}".encode())
            digest.update(data.view(-1).view(dtype=torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:24]


def key_for(model: Any, name: str, precision: str, device: str) -> CompileKey:
    import torch

    from stemdeck_watch.workers.compiled.openvinograph import version as openvino_version

    return CompileKey(
        model=name,
        fingerprint=fingerprint(model),
        precision=precision,
        device=device.split(":")[0],
        torch=torch.__version__,
        python=f"{platform.python_implementation()}-{sys.version_info[0]}.{sys.version_info[1]}",
        cpu=cpu_identity(),
        threads=torch.get_num_threads(),
        openvino=openvino_version(),
    )


def use_inductor_cache(folder: Path) -> None:
    """Have Inductor read and write its caches in `folder` from now on in this process."""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder)
    with contextlib.suppress(ImportError, AttributeError):
        from torch._inductor.utils import clear_caches

        clear_caches()  # paths it worked out for an earlier folder


@contextlib.contextmanager
def using(pairs: list[tuple[Any, Any]]) -> Iterator[Calls]:
    """While inside, the networks run their compiled code, and the calls are counted. A call
    its guards refuse (another shape, another mode than it was built for) runs eager, counted
    as such, and the first is logged with the reason. The compiled code stands in for each
    part's `forward`, so the part's hooks still run around it (a RoFormer's progress and
    cancel within a chunk are hooks on its transformers: workers/roformer/inference.py)."""
    calls = Calls()
    for member, compiled in pairs:
        member.forward = calls.guarded(member, compiled)
    try:
        yield calls
    finally:
        for member, _ in pairs:
            vars(member).pop("forward", None)


class Calls:
    """How many calls of a part ran compiled, and how many eager because the guards refused
    them."""

    def __init__(self) -> None:
        self.compiled = 0
        self.eager = 0
        self.refused = ""  # the guard that refused the first call, if one did

    @property
    def all_compiled(self) -> bool:
        return self.compiled > 0 and self.eager == 0

    def require_all(self, what: str) -> None:
        """Raise unless every call ran compiled: a measure or warm-up of `what` that ran
        eager would time or check the eager model in its place."""
        if not self.all_compiled:
            raise ValueError(f"the guards of a compiled part refused {what}: {self.refused}")

    def guarded(self, member: Any, compiled: Any) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                out = compiled(*args, **kwargs)
            except RuntimeError as exc:
                from stemdeck_watch.workers.compiled.graph import GUARDS_REFUSED

                if GUARDS_REFUSED not in str(exc):
                    raise
                if not self.eager:
                    part = f"{compiled.__name__} ({type(member).__name__})"
                    self.refused = f"{part}: {refusal(str(exc))}"
                    log.warning("a part ran eager: %s", self.refused)
                self.eager += 1
                return type(member).forward(member, *args, **kwargs)
            self.compiled += 1
            return out

        return call


def refusal(message: str) -> str:
    """The guard that refused a call, from the message torch raises (the whole debug dump
    when it names none)."""
    lines = [line.strip() for line in message.splitlines()]
    return next((line for line in lines if line.startswith("verbose_code_parts")), message)


def open_compiled(model: Any, folder: Path, device: str, precision: str) -> list[tuple[Any, Any]]:
    """The compiled parts saved in `folder` (an entry, or a build), loaded: (part, compiled
    call) pairs for `using`. Inductor's code is read from the entry's own cache."""
    from stemdeck_watch.workers.compiled.graph import load

    use_inductor_cache(folder / INDUCTOR)
    return load(members(model), folder, device, precision)


def warm(model: Any, pairs: list[tuple[Any, Any]], device: str, precision: str) -> bool:
    """Run each network once on a segment of silence, made and run as separation makes and
    runs its input, with its compiled parts: their guards must take it (a refusal raises).
    Whether every output was finite."""
    import torch

    from stemdeck_watch.workers.compiled.graph import modes, segment_input

    finite = True
    for network in members(model):
        silence = segment_input(network, device)
        with using(pairs) as calls, modes(device, precision):
            finite = bool(torch.isfinite(network(silence)).all()) and finite
        calls.require_all("a segment")
    return finite


@dataclasses.dataclass(frozen=True)
class Measured:
    speedup: float  # eager seconds / compiled seconds, in the same precision
    worst_snr_db: float  # compiled against float32
    seconds_eager: float
    seconds_compiled: float


Pass = Callable[[str], tuple[float, Any]]  # precision → seconds and stems of one pass


def one_pass(model: Any, device: str) -> Pass:
    """One pass of the built-in synthetic song through `model` in a precision, timed, as
    separation runs it: the Demucs model's song split into its segments, a RoFormer's one
    chunk (of a full-size one, tens of seconds on a CPU)."""
    chunk = getattr(model, "chunk_size", None)
    if chunk is None:
        signal = synthetic_signal(int(model.samplerate), int(model.audio_channels))
        return lambda precision: run_once(model, device, precision, signal)
    from stemdeck_watch.workers.compiled.graph import modes

    seconds = chunk / int(model.samplerate) + 1.0
    signal = synthetic_signal(int(model.samplerate), int(model.audio_channels), seconds)
    signal = signal[..., :chunk].contiguous().to(device)

    def run(precision: str) -> tuple[float, Any]:
        started = time.perf_counter()
        with modes(device, precision):
            out = model(signal)
        return time.perf_counter() - started, out[0].float().cpu()

    return run


@contextlib.contextmanager
def beating(pairs: list[tuple[Any, Any]], beat: Callable[[], None]) -> Iterator[None]:
    """While inside, `beat` after each call of a compiled part's module, eager or compiled:
    a watch on the worker hears it is alive while a compiled model is warmed up or measured
    (a pass of a full-size RoFormer takes tens of seconds on a CPU, more than a stall allows
    on a slow one)."""
    with contextlib.ExitStack() as hooks:
        for part, _ in pairs:
            hooks.callback(part.register_forward_hook(lambda *_: beat()).remove)
        yield


def measure(model: Any, pairs: list[tuple[Any, Any]], device: str, precision: str) -> Measured:
    """The compiled model against the eager one in `precision` on the synthetic song, and its
    stems against float32. Eager and compiled runs alternate (twice each, the faster of each
    kept), so a burst of other work on the machine hits both alike."""
    run = one_pass(model, device)
    eager, compiled = [], []
    out = reference = None
    for _ in range(2):
        seconds, reference = run(precision)
        eager.append(seconds)
        with using(pairs) as calls:
            seconds, out = run(precision)
        calls.require_all("the song")
        compiled.append(seconds)
    if precision != "float32":
        _, reference = run("float32")
    return Measured(
        min(eager) / max(min(compiled), 1e-9), snr_db(reference, out), min(eager), min(compiled)
    )


def decide(setting: str, measured: Measured) -> Verdict:
    """The measured rule: used if ≥ MIN_SPEEDUP× faster and ≥ MIN_SNR_DB on every stem
    (`on`: whatever its speed, never less accurate). Stems with NaN in them score -inf."""
    fast = measured.speedup >= MIN_SPEEDUP
    accurate = measured.worst_snr_db >= MIN_SNR_DB
    finite = measured.worst_snr_db != -math.inf
    if math.isinf(measured.worst_snr_db):
        snr = "identical" if finite else "not finite (NaN)"
    else:
        snr = f"{measured.worst_snr_db:.1f} dB"
    figures = f"{measured.speedup:.2f}× the eager model's speed, worst stem {snr} against float32"
    use = accurate and (fast or setting == "on")
    why = []
    if not fast:
        why.append(f"needs {MIN_SPEEDUP}×")
    if not accurate:
        why.append(f"needs {MIN_SNR_DB:.0f} dB")
    return Verdict(
        use,
        f"compiled: {figures}" if use else f"not worth it: {figures} ({', '.join(why)})",
        measured.speedup,
        measured.worst_snr_db if math.isfinite(measured.worst_snr_db) else None,
        time.time(),
        finite,
    )


def remeasured(verdict: Verdict) -> Measured:
    """A verdict's figures, to decide again under another setting's rule."""
    if not verdict.finite:
        snr = -math.inf
    else:
        snr = math.inf if verdict.worst_snr_db is None else verdict.worst_snr_db
    return Measured(verdict.speedup or 0.0, snr, 0.0, 0.0)


class CompiledSlot:
    """The compiled model for the model a worker holds (or its recipe's RoFormer), in one
    precision: its state (off, unavailable, building, used, not used, failed), why, and its
    figures, as the load reply reports them (`status --json`'s worker.compiled, doctor, every
    manifest; a RoFormer's in the separate reply: worker.lead_compiled, the manifest's
    recipe)."""

    def __init__(self, setting: str, cache: CompileCache | None, device: str):
        self.setting = setting
        self.cache = cache
        self.device = device
        self.state = "off"
        self.reason = "separation.compile is off"
        self.key: CompileKey | None = None
        self.pairs: list[tuple[Any, Any]] = []
        self.figures: dict[str, Any] = {}

    @property
    def active(self) -> bool:
        return self.state == "used"

    def to_dict(self) -> dict[str, Any]:
        return {
            "setting": self.setting,
            "state": self.state,
            "reason": self.reason,
            "key": self.key.digest() if self.key else None,
            **self.figures,
        }

    def refresh(
        self, model: Any, name: str, precision: str, beat: Callable[[], None] = lambda: None
    ) -> dict[str, Any]:
        """Where the compiled model stands now; adopts a build that has appeared since
        (`beat`: while it warms it up or measures it, see `beating`)."""
        if self.setting == "off" or self.cache is None:
            return self.to_dict()
        if self.state in ("used", "unavailable", "failed", "not used"):
            return self.to_dict()
        if not self.device.startswith("cpu"):
            self.state, self.reason = "unavailable", f"compiling is for the CPU, not {self.device}"
            return self.to_dict()
        from stemdeck_watch.workers.compiled.graph import available, unsupported

        unavailable = unsupported(members(model)) or available()
        if unavailable is not None:
            self.state, self.reason = (
                "unavailable",
                f"{unavailable}; separating with the eager model",
            )
            log.warning("compiled model: %s", self.reason)
            return self.to_dict()
        if cxx_compiler() is None:
            self.state = "unavailable"
            self.reason = (
                "no C++ compiler (Inductor needs one on a CPU: install g++, or set $CXX); "
                "separating with the eager model"
            )
            log.warning("compiled model: %s", self.reason)
            return self.to_dict()
        params = parameter_count(model)
        if (
            self.setting == "auto"
            and params < SMALL_MODEL_PARAMETERS
            and os.environ.get(CALIBRATE_ENV) != "always"
        ):
            self.state = "not used"
            self.reason = f"a small model ({params:,} parameters) cannot pay for a compile"
            return self.to_dict()
        if self.key is None:
            self.key = key_for(model, name, precision, self.device)
        verdict = self.cache.verdict(self.key)
        if verdict is not None and verdict.speedup is not None:  # this setting's rule, again
            verdict = decide(self.setting, remeasured(verdict))
        if verdict is not None and not verdict.use:  # under this setting's rule: never again
            self.state = "not used" if verdict.speedup is not None else "failed"
            self.reason = verdict.reason
            self.figures = {"speedup": verdict.speedup, "worst_snr_db": verdict.worst_snr_db}
            return self.to_dict()
        entry = self.cache.entry(self.key)
        if entry is None:
            self.state = "building"
            self.reason = "being built in the background; separating with the eager model"
            return self.to_dict()
        self._adopt(model, precision, entry, verdict, beat)
        return self.to_dict()

    def _adopt(
        self,
        model: Any,
        precision: str,
        entry: dict[str, Any],
        verdict: Verdict | None,
        beat: Callable[[], None],
    ) -> None:
        """Load the compiled model from its entry (seconds); measure it unless a verdict says
        whether it pays. The worker calls this between two songs (a recipe's RoFormer: as the
        next song with it starts, before the song's own work), so nothing else runs on the
        model meanwhile and the measure has the machine to itself. Loading routes the
        model's position embedding (graph.py: prepare), which every slot of the model
        shares: the worker lets go of it once no slot is in use."""
        from stemdeck_watch.workers.compiled.openvinograph import runs_here

        assert self.cache is not None and self.key is not None
        started = time.monotonic()
        interrupted: list[BaseException] = []

        def heard() -> None:
            try:
                beat()
            except BaseException as exc:  # a cancel said through it: not the compile's fault
                interrupted.append(exc)
                raise

        try:
            pairs = open_compiled(model, self.cache.entry_dir(self.key), self.device, precision)
            with beating(pairs, heard):
                if verdict is not None and verdict.use:
                    if not warm(model, pairs, self.device, precision):
                        raise ValueError("the compiled model's output is not finite")
                load_seconds = time.monotonic() - started
                if verdict is None:
                    verdict = decide(self.setting, measure(model, pairs, self.device, precision))
                    self.cache.record_verdict(self.key, verdict)
        except Exception as exc:  # a compile that fails is never worth a failed song
            if interrupted:
                raise
            log.exception("compiled model could not be loaded; separating with the eager model")
            self.state, self.pairs = "failed", []
            self.reason = (
                f"could not be loaded: {exc}; not tried again until torch, the model, the "
                f"threads or the CPU change (delete {self.cache.verdict_path(self.key)} to build "
                f"it anew)"
            )
            self.cache.record_verdict(self.key, Verdict(False, self.reason, measured=time.time()))
            return
        self.cache.touch(self.key)
        self.figures = {
            "speedup": verdict.speedup,
            "worst_snr_db": verdict.worst_snr_db,
            "load_seconds": round(load_seconds, 2),
            "compile_seconds": entry.get("compile_seconds"),
            # the OpenVINO that runs its transformer, if a part went to it
            "openvino": self.key.openvino if any(runs_here(call) for _, call in pairs) else None,
        }
        self.pairs = pairs if verdict.use else []
        self.reason = verdict.reason
        self.state = "used" if verdict.use else "not used"
        log.info(
            "compiled model for %s: %s (loaded in %.1f s)",
            self.key.model,
            self.reason,
            load_seconds,
        )
