"""Errors that say what could not be done, to what, and what to do about it.

The message of every error here is written for the person reading a tray notification or a
`<song>.error.txt`: a verb, the paths involved, the cause, and where possible a fix.
"""

from __future__ import annotations

import os
from pathlib import Path


class StemdeckError(Exception):
    """Base for errors whose message is fit to show a user as it is."""


class ConfigError(StemdeckError):
    """Bad configuration: the CLI exits with status 2."""


class FilesystemError(StemdeckError):
    """A file operation failed: "could not move X to Y: reason"."""

    def __init__(self, verb: str, *paths: os.PathLike[str] | str, reason: BaseException | str):
        self.verb = verb
        self.paths = tuple(Path(p) for p in paths)
        self.reason = reason
        text = str(reason.strerror or reason) if isinstance(reason, OSError) else str(reason)
        if len(self.paths) == 2:
            where = f"{self.paths[0]} to {self.paths[1]}"
        else:
            where = " ".join(str(p) for p in self.paths)
        super().__init__(f"could not {verb} {where}: {text}")


class StageError(StemdeckError):
    """A job failed in one pipeline stage; `stage` goes into the diagnosis."""

    stage = "pipeline"

    def __init__(self, message: str, *, details: str = ""):
        super().__init__(message)
        self.details = details


class DecodeError(StageError):
    stage = "decoding"


class SeparationError(StageError):
    stage = "separating"


class ModelError(SeparationError):
    """The model could not be loaded; the message says how to get it."""


class WorkerDied(SeparationError):
    """A machine fault: the worker process or actor died in the middle of a request, or its
    machine left the cluster. The song was not at fault, so it is tried again
    (`queue.worker_retries`). `worker` names the worker, `kind` the fault."""

    kind = "died"

    def __init__(self, message: str, *, details: str = "", worker: str = "", device: str = ""):
        super().__init__(message, details=details)
        self.worker = worker
        self.device = device  # whose memory ran out ("cuda", "mps", "cpu"), where known
        self.plan = ""  # what the attempt ran with, where a memory fault changed it


class WorkerStalled(WorkerDied):
    """The worker reported no progress for `separation.stall_seconds` and was killed."""

    kind = "stalled"


class OutOfMemory(WorkerDied):
    """The worker ran out of memory (`device`: "cuda", "mps", or "cpu" for the computer's):
    tried again with a smaller window and segment, then on the CPU
    (`separation.fallback_device`)."""

    kind = "memory"


class DownloadError(StageError):
    stage = "downloading"


class PublishError(StageError):
    stage = "publishing"


SHUTDOWN = "the service is stopping"


class Cancelled(Exception):
    """The job was cancelled (or the service is stopping); not a failure."""

    def __init__(self, reason: str = "cancelled"):
        super().__init__(reason)
        self.reason = reason


class ControlError(StemdeckError):
    """A control request (CLI, API, tray, page) that cannot be carried out; `status` is the
    HTTP status the API answers with, and nothing in the queue has changed."""

    status = 400


class JobNotFound(ControlError):
    status = 404


class AmbiguousJob(ControlError):
    status = 400


class Conflict(ControlError):
    """The job is in a state where the request makes no sense (moving the running job,
    cancelling a finished one, retrying one that did not fail)."""

    status = 409
