"""Song faults and machine faults: what becomes of a song whose worker failed under it.

A song fault — the input cannot be decoded, it is over a limit, the model fails on it — fails
the song, as it would fail again. A machine fault — the worker process or actor died, its
machine left the cluster, it stalled, it ran out of memory (`WorkerDied` and its kinds) —
says nothing about the song: the dispatcher puts the song back at the head of the queue for
another attempt, on another worker where there is one. Each attempt cut off is recorded on
the job (`Job.faults`); the song fails only once the faults run past the limits here, with
every attempt's reason in its `error.txt`.

Limits: `queue.worker_retries` attempts after deaths and stalls. Running out of memory is
not retried the same way, which would only run out again: each memory fault takes the
song one step down the memory ladder (`plan_for`): half the window and segment; then, when
a GPU's memory ran out, the CPU (`separation.fallback_device = "cpu"`), else a quarter of
each; then the song fails.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt

from stemdeck_watch.core.config import SeparationSettings, Settings
from stemdeck_watch.core.errors import WorkerDied
from stemdeck_watch.core.jobs import Fault

MEMORY_STEPS = 2  # memory faults after which the song is tried again (down the ladder)
GPUS = ("cuda", "mps")


@dataclasses.dataclass(frozen=True)
class Plan:
    """How an attempt separates: as configured, or (after memory faults) with the window
    and segment halved `shrink` times, on `device` (None: the worker's own)."""

    shrink: int = 0
    device: str | None = None

    @property
    def as_configured(self) -> bool:
        return self.shrink == 0 and self.device is None

    def describe(self) -> str:
        parts = (
            []
            if not self.shrink
            else [f"window and segment {'halved' if self.shrink == 1 else f'1/{2**self.shrink}'}"]
        )
        if self.device is not None:
            parts.append(f"on the {self.device.upper()} (separation.fallback_device)")
        return ", ".join(parts) or "as configured"

    def precision(self, setting: str) -> str:
        """The precision setting the attempt asks for: float16 is for CUDA alone, so on the
        fallback CPU the worker chooses its own (`auto`) rather than refuse the song."""
        if setting == "float16" and self.device is not None and self.device != "cuda":
            return "auto"
        return setting


def plan_for(faults: tuple[Fault, ...], separation: SeparationSettings) -> Plan:
    """The next attempt's plan after `faults`: one step down the memory ladder per memory
    fault. The CPU is the second step where a GPU's memory ran out and the fallback is on;
    a computer whose own memory ran out gains nothing from it, so it halves again."""
    memory = [fault for fault in faults if fault.kind == "memory"]
    if not memory:
        return Plan()
    if len(memory) == 1:
        return Plan(shrink=1)
    if (
        memory[-1].device in GPUS
        and separation.fallback_device == "cpu"
        and separation.device != "cpu"
    ):
        return Plan(shrink=1, device="cpu")
    return Plan(shrink=len(memory))


def fault_of(exc: WorkerDied, worker: str, at: float) -> Fault:
    """The record of one attempt cut off by `exc` on `worker`."""
    return Fault(
        kind=exc.kind,
        reason=str(exc),
        worker=exc.worker or worker,
        at=at,
        plan=exc.plan,
        device=exc.device,
    )


def may_retry(faults: tuple[Fault, ...], settings: Settings) -> bool:
    """Whether a song whose attempts ended in `faults` gets another attempt."""
    memory = sum(1 for fault in faults if fault.kind == "memory")
    return len(faults) - memory <= settings.queue.worker_retries and memory <= MEMORY_STEPS


def failure(faults: tuple[Fault, ...], chosen: str = "") -> tuple[str, str]:
    """(message, details) for a song whose every attempt a machine fault cut off: the
    message names each attempt's reason, the details each attempt's worker and time.
    `chosen`: what the song's own drop chose for its separation (a sidecar's segment,
    shifts, model…), which may be why the machine failed, so the report names it."""
    count = len(faults)
    reasons = "; ".join(f"{n}) {fault.reason}" for n, fault in enumerate(faults, 1))
    own = f"with the song's own choices ({chosen}), which may have caused it" if chosen else ""
    message = (
        f"the worker failed on {'both' if count == 2 else 'all'} {count} attempts, "
        f"{own or 'never because of the song'}: {reasons}"
        if count > 1
        else f"the worker failed{' ' + own if own else ''}: {faults[0].reason}"
        if faults
        else "the worker failed"
    )
    return message, attempts_text(faults)


def attempts_text(faults: tuple[Fault, ...]) -> str:
    """One line per attempt cut off, for `error.txt` and the log."""
    lines = []
    for n, fault in enumerate(faults, 1):
        when = (
            _dt.datetime.fromtimestamp(fault.at).astimezone().isoformat(timespec="seconds")
            if fault.at
            else "?"
        )
        plan = f" [{fault.plan}]" if fault.plan else ""
        lines.append(
            f"attempt {n}, {when}, {fault.worker or 'a worker'}{plan} — "
            f"{fault.kind}: {fault.reason}"
        )
    return "\n".join(lines)
