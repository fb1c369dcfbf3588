"""The job record every part of the service talks about.

A Job is a plain value: the registry stores it, the queue orders its id, the pipeline moves it
through the states below, and `status --json` prints it.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import uuid
from typing import Any


class JobState(str, enum.Enum):
    """Where a job is in its life; the values are the strings `status --json` prints."""

    QUEUED = "queued"
    DOWNLOADING = "downloading"
    DECODING = "decoding"
    SEPARATING = "separating"
    PUBLISHING = "publishing"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def is_final(self) -> bool:
        return self in (JobState.DONE, JobState.FAILED, JobState.CANCELLED)

    @property
    def is_running(self) -> bool:
        return self in RUNNING_STATES


RUNNING_STATES = frozenset(
    {JobState.DOWNLOADING, JobState.DECODING, JobState.SEPARATING, JobState.PUBLISHING}
)
ACTIVE_STATES = RUNNING_STATES | {JobState.QUEUED}


class JobKind(str, enum.Enum):
    FILE = "file"
    LINK = "link"


@dataclasses.dataclass(frozen=True)
class PlaylistRef:
    """Which playlist a job belongs to (`links.playlists = true`).

    A playlist link's own job carries `entry = 0` and the number of entries it was expanded
    into; each entry's job carries its 1-based place in the playlist and, where the playlist
    said, its length (checked against `links.max_duration` before anything is downloaded).
    """

    id: str  # the playlist link's job
    name: str
    entry: int
    entries: int
    duration: float | None = None
    listed: int = 0  # the link's job: entries the playlist listed (more when cut at max_entries)

    @property
    def is_link(self) -> bool:
        return self.entry == 0

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | None) -> PlaylistRef | None:
        return cls(**json.loads(text)) if text else None

    def to_status(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "name": self.name,
            "entry": self.entry or None,
            "entries": self.entries,
            "listed": self.listed or None,
        }


@dataclasses.dataclass(frozen=True)
class Fault:
    """One attempt at a song that the machine cut off, not the song: the worker process or
    actor died, its machine left, it stalled, or it ran out of memory. The song goes back to
    the head of the queue for another attempt; its faults travel with the job (the registry,
    `status`, the page, the manifest, `error.txt`)."""

    kind: str  # "died", "stalled" or "memory"
    reason: str  # the error as a person reads it
    worker: str = ""  # which worker: "the local worker (pid 123)", "ray worker 1 on host (ip)"
    at: float = 0.0  # when (Unix time)
    # what the attempt ran with, where a memory fault changed it: window and segment
    # (seconds) and the device
    plan: str = ""
    device: str = ""  # a memory fault: whose memory ran out ("cuda", "mps", "cpu")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> Fault:
        fields = {f.name for f in dataclasses.fields(cls)}
        if not isinstance(data, dict):
            return cls("died", str(data))
        return cls(**{k: v for k, v in data.items() if k in fields})

    @staticmethod
    def to_json(faults: tuple[Fault, ...]) -> str | None:
        return json.dumps([f.to_dict() for f in faults], separators=(",", ":")) if faults else None

    @classmethod
    def from_json(cls, text: str | None) -> tuple[Fault, ...]:
        """The faults as the registry holds them; a torn record reads as none."""
        if not text:
            return ()
        try:
            data = json.loads(text)
        except ValueError:
            return ()
        return tuple(cls.from_dict(item) for item in data) if isinstance(data, list) else ()


@dataclasses.dataclass(frozen=True, eq=False)
class FileSignature:
    """What "the same file" means: unchanged size, modification time and inode.

    An inode of 0 is "not known": a network share (sshfs, SMB) numbers files per mount, so
    the same file has another inode once the share was mounted again; there a job keeps its
    input's signature without the inode (`without_inode`) and the file is told by its size
    and time, which the share keeps."""

    size: int
    mtime_ns: int
    inode: int

    @classmethod
    def of(cls, stat_result: Any) -> FileSignature:
        return cls(stat_result.st_size, stat_result.st_mtime_ns, stat_result.st_ino)

    def without_inode(self) -> FileSignature:
        return dataclasses.replace(self, inode=0)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, FileSignature):
            return NotImplemented
        return (self.size, self.mtime_ns) == (other.size, other.mtime_ns) and (
            not self.inode or not other.inode or self.inode == other.inode
        )

    def __hash__(self) -> int:
        return hash((self.size, self.mtime_ns))


@dataclasses.dataclass(frozen=True)
class Job:
    id: str
    name: str
    kind: JobKind
    state: JobState
    source: str
    rel_path: str
    preset: str | None = None
    progress: float = 0.0
    output: str | None = None
    error: str | None = None
    stage: str | None = None
    signature: FileSignature | None = None
    attempts: int = 0
    created_at: float = 0.0
    updated_at: float = 0.0
    finished_at: float | None = None
    version: int = 0
    sha256: str | None = None  # of the input, once read: duplicates are found by it
    settings_key: str | None = None  # the separation and output settings, hashed
    playlist: PlaylistRef | None = None  # the playlist link or entry this job is
    # the attempts the machine cut off (worker died, stalled, out of memory), oldest first
    faults: tuple[Fault, ...] = ()
    # which model makes (made) which stem, (stem, model) in the model's order: from when it
    # separates; a recipe's are two models
    made_by: tuple[tuple[str, str], ...] = ()

    def to_status(self) -> dict[str, Any]:
        """The job object of `status --json`."""
        return {
            "id": self.id,
            "name": self.name,
            "kind": self.kind.value,
            "state": self.state.value,
            "progress": round(self.progress, 3),
            "source": self.source,
            "output": self.output,
            "error": self.error,
            "preset": self.preset,
            "created_at": self.created_at,
            "finished_at": self.finished_at,
            "playlist": self.playlist.to_status() if self.playlist else None,
            # attempts the machine cut off (the worker died, stalled, ran out of memory);
            # the song was tried again after each
            "faults": [fault.to_dict() for fault in self.faults],
            # stem → the model that makes it (null: not separating yet)
            "made_by": dict(self.made_by) or None,
        }


def made_by_json(made_by: Any) -> str | None:
    """The registry's text of `Job.made_by` (a mapping or pairs), or None for none."""
    pairs = list(made_by.items()) if isinstance(made_by, dict) else list(made_by or ())
    return json.dumps(pairs) if pairs else None


def made_by_of(text: str | None) -> tuple[tuple[str, str], ...]:
    """`Job.made_by` from the registry's text; unreadable text is none (it only informs)."""
    try:
        pairs = json.loads(text) if text else []
        return tuple((str(stem), str(model)) for stem, model in pairs)
    except (ValueError, TypeError):
        return ()


def made_by_words(made_by: dict[str, str] | None) -> str:
    """ "vocals: bs_roformer_viperx_1297; drums, bass, other: htdemucs_ft" where more than
    one model makes a song's stems; "" where one does (the worker's model says it)."""
    by_model: dict[str, list[str]] = {}
    for stem, model in (made_by or {}).items():
        by_model.setdefault(model, []).append(stem)
    if len(by_model) < 2:
        return ""
    return "; ".join(f"{', '.join(stems)}: {model}" for model, stems in by_model.items())


ID_PREFIX_MIN = 6  # a shorter ref is a name only: "5" or "bad" must not pick a stranger's id


def new_job_id() -> str:
    return uuid.uuid4().hex[:12]


def settings_key_of(settings: dict[str, Any] | None) -> str | None:
    """A short hash of a song's separation and output settings (as its manifest records them):
    the same content with the same key gives the same stems, which is how a duplicate is told."""
    if not settings:
        return None
    text = json.dumps(settings, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]
