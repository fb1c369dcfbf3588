"""The one interface to a separation worker, whatever runs it.

The pipeline, the dispatcher and the executor speak only `Separator`: the local
`WorkerClient` (local.py: one resident subprocess on this machine) and the `RayWorkerClient`
(ray/client.py: one resident actor on a Ray cluster) both implement it, so neither the
pipeline nor the queue can tell them apart. A client serves one request at a time; the job's `JobControl` reaches a
request in flight, so a cancel stops the worker at once. Both wait on their worker in the
same loop (waiting.py), so a cancel, a death, a stall and a start that takes too long are
told apart by the same rules wherever the worker runs.
"""

from __future__ import annotations

import collections
import dataclasses
from pathlib import Path
from typing import Any, Callable, Protocol

from stemdeck_watch.store.jobqueue import JobControl


@dataclasses.dataclass(frozen=True)
class ModelInfo:
    """The model a worker holds, and the precision it separates in."""

    name: str
    repo: str | None
    samplerate: int
    audio_channels: int
    sources: tuple[str, ...]
    # demucs/precision.py's Choice as a dict: the precision in use, why, measured figures
    precision: dict[str, Any] = dataclasses.field(default_factory=dict, compare=False)
    # compiled/model.py's CompiledSlot as a dict: whether the compiled model is used, why, figures
    compiled: dict[str, Any] = dataclasses.field(default_factory=dict, compare=False)

    @property
    def dtype(self) -> str:
        """The precision the worker separates this model in."""
        return str(self.precision.get("precision", "float32"))

    def serves(self, name: str, repo: str | None, setting: str) -> bool:
        """Whether this loaded model answers a request for `name` from `repo` under the
        precision `setting` (a changed setting loads again: it may decide differently)."""
        return (self.name, self.repo) == (name, repo) and self.precision.get("setting") == setting

    @classmethod
    def loaded(cls, name: str, repo: str | None, reply: dict[str, Any]) -> ModelInfo:
        """From a worker's (local or Ray) reply to a load request."""
        return cls(
            name,
            repo,
            reply["samplerate"],
            reply["audio_channels"],
            tuple(reply["sources"]),
            dict(reply.get("precision") or {}),
            dict(reply.get("compiled") or {}),
        )


@dataclasses.dataclass(frozen=True)
class DemucsSettings:
    """The Demucs model's own settings for one song (`separation.shifts`, `overlap`,
    `segment`) and the mix's statistics it normalises by; a recipe's lead model has its own
    (`Lead`). The worker-wide ones (precision, window, device) are `separate`'s."""

    shifts: int = 1
    overlap: float = 0.25
    segment: float | None = None  # seconds; None: the model's own
    # the mean and std of the mono mix, as decode accumulated them (DecodedAudio.stats);
    # without them the worker makes one extra streamed pass over the input
    stats: tuple[float, float] | None = None

    def to_request(self) -> dict[str, Any]:
        request: dict[str, Any] = {
            "shifts": self.shifts,
            "overlap": self.overlap,
            "segment": self.segment,
        }
        if self.stats is not None:
            request["mean"], request["std"] = float(self.stats[0]), float(self.stats[1])
        return request


DEMUCS_DEFAULTS = DemucsSettings()


@dataclasses.dataclass(frozen=True)
class Lead:
    """A model a recipe runs on the mix before the Demucs model (workers/recipe.py): which
    engine, which checkpoint, and that engine's own settings (a RoFormer's: chunks per batch,
    how many chunks cover each sample, the precision), apart from Demucs's shifts, overlap
    and segment. The Demucs model separates what it leaves."""

    model: str
    engine: str = "roformer"
    batch_size: int | None = None  # None: the configuration's own on a GPU, one on a CPU
    num_overlap: int | None = None  # None: the checkpoint configuration's own
    # "auto": float16 on a CUDA GPU, float32 elsewhere, as measured (recipe.lead_precision)
    precision: str = "auto"

    def to_request(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Separation:
    """What a separate request made: one `<stem>.npy` per stem, by whom, how long it took,
    and with what window and segment (seconds; None: the model's own) on which device."""

    stems: dict[str, Path]
    worker_pid: int
    seconds: float
    window: float | None = None
    segment: float | None = None
    device: str | None = None
    compiled: bool = False  # the compiled model separated it
    made_by: dict[str, str] = dataclasses.field(default_factory=dict)  # stem → model
    # a recipe's lead: where its compiled model stands, and whether it ran ("used")
    lead_compiled: dict[str, Any] | None = None

    def sizes(self) -> dict[str, Any]:
        """The window, segment and device, for the manifest."""
        return {"device": self.device, "window": self.window, "segment": self.segment}

    @staticmethod
    def from_reply(reply: dict[str, Any]) -> dict[str, Any]:
        """The window, segment, device, compiled, made-by and lead's compiled fields of a
        worker's (local or Ray) answer."""
        return {
            "window": reply.get("window"),
            "segment": reply.get("segment"),
            "device": reply.get("device"),
            "compiled": bool(reply.get("compiled")),
            "made_by": {str(k): str(v) for k, v in (reply.get("made_by") or {}).items()},
            "lead_compiled": dict(reply["lead_compiled"]) if reply.get("lead_compiled") else None,
        }


def separate_request(
    model: str,
    repo: str | None,
    *,
    demucs: DemucsSettings,
    lead: Lead | None,
    precision: str,
    window: float | None,
    shrink: int,
) -> dict[str, Any]:
    """A separate request's settings as every worker reads them (worker.py's protocol; the
    Ray actor reads the same)."""
    request: dict[str, Any] = {"model": model, "repo": repo, "precision": precision}
    request.update(demucs.to_request())
    if window is not None:
        request["window"] = float(window)
    if shrink:
        request["shrink"] = int(shrink)
    if lead is not None:
        request["lead"] = lead.to_request()
    return request


class Separator(Protocol):
    """The service's side of one resident worker."""

    # every worker process started, in order (diagnostics, tests)
    pids: list[int]
    # (start, end) of the latest separate requests, time.monotonic(): how busy the worker is
    # kept (the throughput benchmarks' idle fraction)
    busy: collections.deque[tuple[float, float]]

    @property
    def pid(self) -> int | None:
        """The live worker's process id, if one runs."""

    @property
    def versions(self) -> dict[str, str]:
        """The worker's library versions (torch, demucs, …) for the manifest."""

    @property
    def model_info(self) -> ModelInfo | None:
        """The model the live worker holds, without waiting for the worker (which may be
        separating): what decoding ahead needs to know."""

    def stderr_tail(self) -> str:
        """The last lines the worker wrote, for a failed job's report."""

    def info(self) -> dict[str, Any]:
        """This worker for `status --json` and `doctor`: where it runs, on what, its model."""

    def leaves_room(self) -> bool:
        """Whether work beside a separation (decoding ahead, publishing behind) costs the
        separation nothing."""

    def ensure_model(
        self,
        name: str,
        repo: str | None,
        control: JobControl | None = None,
        precision: str | None = None,
        device: str | None = None,
    ) -> ModelInfo:
        """Start the worker if needed and have it load `name` and choose its precision
        (`precision`: the setting, default the client's); cached while the worker lives.
        `device`: run on this one instead of the client's (the CPU after a GPU ran out of
        memory under a song): the worker is started again there, and back on the client's
        own for the next request that does not ask."""

    def separate(
        self,
        job_id: str,
        model: str,
        repo: str | None,
        input_path: Path,
        output_dir: Path,
        *,
        control: JobControl,
        on_progress: Callable[[float], None],
        demucs: DemucsSettings = DEMUCS_DEFAULTS,
        lead: Lead | None = None,
        window: float | None = None,
        precision: str = "float32",
        stall_seconds: float = 0.0,
        shrink: int = 0,
        device: str | None = None,
    ) -> Separation:
        """Separate the decoded song at `input_path` into `output_dir/<stem>.npy`.

        Each engine's settings are its own: `demucs` the Demucs model's (`DemucsSettings`),
        `lead` a recipe's model run on the mix first (`Lead`), whose stems replace the Demucs
        model's (`Separation.made_by` says which model made which); the rest hold for both.

        `window`: seconds of output separated at a time (memory grows with it, never with
        the song). `precision`: the one to run in (`ModelInfo.dtype`). `stall_seconds`:
        a worker silent this long is stopped (`WorkerStalled`); 0 = derived from the time
        per segment measured on it (workers/pace.py). `shrink`: the window and segment
        halved that many times (the memory ran out under the song before); `device`: as
        for `ensure_model`.

        A machine fault ends it in `WorkerDied` (or a kind of it): the worker died, its
        machine left, it stalled, it ran out of memory."""

    def stop(self) -> None:
        """Stop the worker now (a cancel); the next request gets a fresh one. Any thread."""

    def shutdown(self) -> None:
        """Start no new request: the service is stopping."""

    def close(self) -> None:
        """Stop the worker for good (the service stopped)."""
