"""The memory ladder's plan for the next attempt (engine/faults.py), on the settings as a
song has them."""

from __future__ import annotations

import pytest

from stemdeck_watch.core.config import SeparationSettings
from stemdeck_watch.core.jobs import Fault
from stemdeck_watch.engine.faults import plan_for
from stemdeck_watch.workers.demucs.precision import choose


def gpu_memory(times: int) -> tuple[Fault, ...]:
    return tuple(Fault("memory", "CUDA out of memory", device="cuda") for _ in range(times))


@pytest.mark.parametrize("precision", ["float16", "auto", "float32", "bfloat16"])
def test_the_fallback_cpu_is_asked_for_a_precision_it_has(precision: str) -> None:
    """float16 runs on CUDA alone: on the CPU it falls back to, the song's attempt asks for
    `auto` (the CPU's own choice) instead of a setting the CPU refuses, which failed the song
    the fallback is there to finish."""
    sep = SeparationSettings(device="cuda", fallback_device="cpu", precision=precision)
    on_the_gpu, on_the_cpu = plan_for(gpu_memory(1), sep), plan_for(gpu_memory(2), sep)
    assert on_the_gpu.device is None and on_the_gpu.precision(precision) == precision
    assert on_the_cpu.device == "cpu"
    asked = on_the_cpu.precision(precision)
    assert asked == ("auto" if precision == "float16" else precision)
    if asked != "auto":  # a setting of its own: the CPU takes it (float16 raised here)
        assert choose(asked, "cpu", None).precision == asked
