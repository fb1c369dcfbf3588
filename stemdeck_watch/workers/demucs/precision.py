"""Which precision the resident worker separates in, decided by measuring, never assumed.

bfloat16 autocast makes a full-size HTDemucs about 1.7× faster on a CPU with native bf16
(avx512_bf16/AMX) and is a loss on CPUs that emulate it; float16/bfloat16 autocast on a GPU
is usually faster still. So with `separation.precision = "auto"` the worker, right after it
loads a model, runs a few seconds of a built-in synthetic signal through it in float32 and in
each candidate precision, and keeps a candidate only if it is at least MIN_SPEEDUP× faster
**and** every stem matches float32 to at least MIN_SNR_DB; otherwise float32. A resident
worker pays this once per model load; the tiny demo model (where nothing can pay) is skipped.

On a CPU a candidate is first tried on one convolution (`probe_convolution`, milliseconds):
where a CPU has no kernels for it, torch runs a reference loop instead, and a full-size model
took over three minutes per segment in bfloat16 on an AVX2 CPU, so measuring the model in it
would hold the first song up for minutes at every start. A candidate whose convolution runs
PROBE_MAX_SLOWDOWN× slower than float32 or worse is recorded as measured by the probe and not
run on the model.

The rule (`decide`) is a pure function of the measured figures, and `calibrate` takes the
measuring step as a parameter, so tests inject results instead of needing a big model.
This module imports torch only inside functions: the service side reads its constants.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
import os
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

log = logging.getLogger(__name__)

SETTINGS = ("auto", "float32", "bfloat16", "float16")
MIN_SPEEDUP = 1.2
MIN_SNR_DB = 35.0
SMALL_MODEL_PARAMETERS = 2_000_000  # below this calibration cannot pay for itself
CALIBRATION_SECONDS = 4.0  # of synthetic signal (HTDemucs pads it to one segment)
CALIBRATE_ENV = "STEMDECK_CALIBRATE"  # "always": calibrate small models too (tests, benches)
PROBE_MAX_SLOWDOWN = 4.0  # convolutions are about a third of the model's time: no gain left
CPUINFO = "/proc/cpuinfo"  # Linux: the CPU's model and features
CPU_SYSFS = "/sys/devices/system/cpu"  # Linux: each CPU's core and package


@dataclasses.dataclass(frozen=True)
class Measurement:
    """One candidate against float32 on the calibration signal."""

    precision: str
    speedup: float  # float32 seconds / candidate seconds
    worst_snr_db: float  # the lowest SNR of any stem, candidate vs float32
    seconds_float32: float
    seconds: float
    probed: bool = False  # by the convolution probe only: the model was not run in it


@dataclasses.dataclass(frozen=True)
class Choice:
    """The precision in use and why: logged, in the worker's status, in every manifest."""

    setting: str  # what the config asked for
    precision: str  # what the worker uses
    reason: str
    device: str = "cpu"
    speedup: float | None = None  # of the chosen (or best rejected) candidate
    worst_snr_db: float | None = None
    calibration_seconds: float | None = None
    probed: bool = False  # the figures are the convolution probe's: the model was not run

    def to_dict(self) -> dict[str, Any]:
        # an identical output has infinite SNR: JSON has no infinity, so it is written null
        return {
            k: ((round(v, 3) if math.isfinite(v) else None) if isinstance(v, float) else v)
            for k, v in dataclasses.asdict(self).items()
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Choice:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


def decide(
    setting: str,
    device: str,
    measurements: Sequence[Measurement],
    calibration_seconds: float | None = None,
) -> Choice:
    """The measured rule: the fastest candidate that is ≥ MIN_SPEEDUP× faster and ≥ MIN_SNR_DB
    on every stem; float32 otherwise. The reason names the figures either way."""
    good = [m for m in measurements if m.speedup >= MIN_SPEEDUP and m.worst_snr_db >= MIN_SNR_DB]
    if good:
        best = max(good, key=lambda m: m.speedup)
        return Choice(
            setting,
            best.precision,
            f"{best.precision} is {best.speedup:.2f}× faster than float32 and matches "
            f"it to {best.worst_snr_db:.1f} dB SNR or better on every stem",
            device,
            best.speedup,
            best.worst_snr_db,
            calibration_seconds,
        )
    if not measurements:
        return Choice(
            setting,
            "float32",
            f"no reduced precision to try on {device}",
            device,
            calibration_seconds=calibration_seconds,
        )
    best = max(measurements, key=lambda m: m.speedup)
    why = []
    if best.probed:
        why.append(
            f"only {best.speedup:.2f}× as fast in a convolution probe: this {device} has no "
            f"fast {best.precision} kernels, so the model was not run in it"
        )
    elif best.speedup < MIN_SPEEDUP:
        why.append(f"only {best.speedup:.2f}× as fast (needs {MIN_SPEEDUP}×)")
    if best.worst_snr_db < MIN_SNR_DB:
        why.append(f"{best.worst_snr_db:.1f} dB SNR on its worst stem (needs {MIN_SNR_DB:.0f} dB)")
    return Choice(
        setting,
        "float32",
        f"{best.precision} was {' and '.join(why)}",
        device,
        best.speedup,
        None if best.probed else best.worst_snr_db,
        calibration_seconds,
        best.probed,
    )


def candidates(device: str) -> list[str]:
    """Reduced precisions worth measuring on `device` (autocast dtypes torch supports there)."""
    import torch

    kind = device.split(":")[0]
    if kind == "cpu":
        return ["bfloat16"]
    if kind == "cuda":  # untested here (no GPU): kept behind the same measured rule
        bf16 = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
        return ["float16", "bfloat16"] if bf16 else ["float16"]
    return []


@contextlib.contextmanager
def autocast(device: str, precision: str) -> Iterator[None]:
    """Run the model in `precision` (autocast; float32 is plain)."""
    if precision == "float32":
        yield
        return
    import torch

    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}[precision]
    with torch.autocast(device_type=device.split(":")[0], dtype=dtype):
        yield


def parameter_count(model: Any) -> int:
    """Parameters of a model or a bag of models."""
    return sum(p.numel() for p in model.parameters())


def synthetic_signal(samplerate: int, channels: int, seconds: float = CALIBRATION_SECONDS) -> Any:
    """The built-in calibration signal as a (1, channels, frames) float32 tensor, normalised
    the way demucs normalises a song."""
    import numpy as np
    import torch

    from stemdeck_watch.util.synth import song

    audio = song(seconds, samplerate, seed=7).T  # (2, frames)
    audio = np.resize(audio, (channels, audio.shape[1])) if channels != 2 else audio
    mix = torch.from_numpy(np.ascontiguousarray(audio, dtype=np.float32))
    ref = mix.mean(0)
    return ((mix - ref.mean()) / ref.std())[None]


Measure = Callable[[Any, str, str, Any], tuple[float, Any]]
Probe = Callable[[str, str], float]


def probe_convolution(device: str, precision: str) -> float:
    """float32 seconds / `precision` seconds of one convolution shaped like an HTDemucs
    layer's (about 0.15 GFLOP), each the better of two runs after an untimed one."""
    import torch

    conv = torch.nn.Conv1d(48, 96, kernel_size=8, stride=4).to(device)
    signal = torch.randn(1, 48, 8192, generator=torch.Generator().manual_seed(0)).to(device)

    def best(dtype: str) -> float:
        times = []
        with torch.inference_mode(), autocast(device, dtype):
            for _ in range(3):
                started = time.perf_counter()
                conv(signal)
                times.append(time.perf_counter() - started)
        return min(times[1:])

    return best("float32") / max(best(precision), 1e-9)


def screen(device: str, precisions: Sequence[str], probe: Probe) -> list[Measurement]:
    """The candidates the convolution probe finds hopeless on a CPU, as their measurements."""
    if device.split(":")[0] != "cpu":
        return []
    hopeless = []
    for precision in precisions:
        speedup = probe(device, precision)
        if speedup < 1 / PROBE_MAX_SLOWDOWN:
            hopeless.append(Measurement(precision, speedup, math.nan, math.nan, math.nan, True))
    return hopeless


def run_once(model: Any, device: str, precision: str, signal: Any) -> tuple[float, Any]:
    """Seconds and stems (float32, (sources, channels, frames)) of one pass of `signal`."""
    import torch
    from demucs.apply import apply_model

    started = time.perf_counter()
    with torch.inference_mode(), autocast(device, precision):
        out = apply_model(
            model, signal, shifts=0, split=True, overlap=0.25, progress=False, device=device
        )
    return time.perf_counter() - started, out[0].float().cpu()


def snr_db(reference: Any, estimate: Any) -> float:
    """Worst per-stem SNR (dB) of `estimate` against `reference`, both (sources, ...); a stem
    that is not finite (NaN, infinity) is -inf, never a pass."""
    worst = math.inf
    for ref, est in zip(reference, estimate):
        signal = float((ref.double() ** 2).sum())
        noise = float(((ref.double() - est.double()) ** 2).sum())
        if not math.isfinite(noise):
            return -math.inf
        if noise == 0.0:
            continue
        worst = min(worst, 10 * math.log10(max(signal, 1e-30) / noise))
    return worst


def calibrate(
    model: Any,
    device: str,
    precisions: Sequence[str],
    measure: Measure = run_once,
    seconds: float = CALIBRATION_SECONDS,
) -> list[Measurement]:
    """Measure each candidate against float32 on the synthetic signal. A candidate's first
    run pays its one-off kernel setup, so it is not timed (its output is compared); float32
    was warmed up by the model load. The timed float32 run sits between the first
    candidate's two runs, so a burst of other work on the machine hits both sides alike:
    one timed run each, three model passes in all for one candidate."""
    signal = synthetic_signal(int(model.samplerate), int(model.audio_channels), seconds)
    results = []
    base_seconds, reference = 0.0, None
    for precision in precisions:
        _setup, out = measure(model, device, precision, signal)
        if reference is None:
            base_seconds, reference = measure(model, device, "float32", signal)
        timed, _ = measure(model, device, precision, signal)
        results.append(
            Measurement(
                precision,
                base_seconds / max(timed, 1e-9),
                snr_db(reference, out),
                base_seconds,
                timed,
            )
        )
    return results


def choose(
    setting: str,
    device: str,
    model: Any,
    measure: Measure = run_once,
    probe: Probe = probe_convolution,
) -> Choice:
    """The precision for `model` on `device` under `setting` (see the module docstring)."""
    if setting != "auto":
        if setting == "float16" and not device.startswith("cuda"):
            raise ValueError(
                f'separation.precision = "float16" needs a CUDA device, '
                f'not {device!r}; use "auto", "float32" or "bfloat16"'
            )
        return Choice(setting, setting, "set in the configuration", device)
    params = parameter_count(model)
    if params < SMALL_MODEL_PARAMETERS and os.environ.get(CALIBRATE_ENV) != "always":
        return Choice(
            setting,
            "float32",
            f"calibration skipped: a small model ({params:,} parameters) cannot pay for it",
            device,
        )
    trying = candidates(device)
    if not trying:
        return decide(setting, device, [])
    started = time.monotonic()
    hopeless = screen(device, trying, probe)
    for m in hopeless:
        log.info(
            "calibration on %s: %s convolutions ran %.2f× float32 speed in the probe: not run "
            "on the model",
            device,
            m.precision,
            m.speedup,
        )
    skip = {m.precision for m in hopeless}
    measured = calibrate(model, device, [p for p in trying if p not in skip], measure)
    choice = decide(setting, device, hopeless + measured, time.monotonic() - started)
    for m in measured:
        log.info(
            "calibration on %s: %s %.2f× float32 speed (%.2f s vs %.2f s), worst stem %.1f dB SNR",
            device,
            m.precision,
            m.speedup,
            m.seconds,
            m.seconds_float32,
            m.worst_snr_db,
        )
    return choice


# ---------------------------------------------------------------- threads


def physical_cores() -> int:
    """Physical cores this process may use (hyper-threads share a core's arithmetic units,
    so more threads than cores only adds contention to separation): the cores of the CPUs
    its affinity allows (a container's cpuset, `taskset`)."""
    usable = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    logical = len(usable) if usable else (os.cpu_count() or 1)
    cores = _linux_physical_cores(tuple(usable) if usable else None)
    if cores is None:
        return logical
    return max(1, min(cores, logical))


@functools.cache
def _linux_physical_cores(cpus: tuple[int, ...] | None) -> int | None:
    """The (package, core) pairs of `cpus` (None: every CPU), from Linux's sysfs."""
    try:
        pairs = set()
        for cpu in Path(CPU_SYSFS).glob("cpu[0-9]*"):
            if cpus is not None and int(cpu.name[3:]) not in cpus:
                continue
            topology = cpu / "topology"
            core = (topology / "core_id").read_text().strip()
            package = (topology / "physical_package_id").read_text().strip()
            pairs.add((package, core))
        return len(pairs) or None
    except (OSError, ValueError):
        return None


def threads_for(setting: int) -> int:
    """`separation.threads`: 0 = one per physical core."""
    return setting if setting > 0 else physical_cores()


def cpu_bf16_flags() -> list[str]:
    """The CPU features that make bf16 fast (Linux /proc/cpuinfo: x86's `flags`, Arm's
    `Features`; [] elsewhere)."""
    try:
        text = Path(CPUINFO).read_text()
    except OSError:
        return []
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            flags = set(line.split(":", 1)[1].split())
            return sorted(flags & {"avx512_bf16", "amx_bf16", "amx_tile", "bf16"})
    return []
