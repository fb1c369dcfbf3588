"""The compiled-model cache in the state folder: what was built, for what, and whether it paid.

A `torch.compile` of a full-size model costs minutes of CPU, so it is built once per machine
and model and kept: `<state>/compiled/<key>/` holds the compiled parts of one (model,
precision, device, torch, OpenVINO, Python, CPU) (`network-<i>.<part>.bin`, compiled/graph.py;
a transformer converted for OpenVINO: `network-<i>.<part>.openvino.xml` and `.bin`,
compiled/openvinograph.py), the code Inductor generated for them, and `entry.json`, which names that
key and every file with its size and SHA-256. A build happens in a folder with a random name
and becomes an entry by one rename after `entry.json` is written and read back, so a cancel, a
restart or a killed build never leaves a half entry that looks whole. An entry whose
`entry.json` names another key (copied from elsewhere), or whose files do not match it (one
missing, changed, or a part not named in it), is removed and built again.

Whether the compiled model is worth using is measured once by the worker that adopts it and
kept beside the entry (`<key>.verdict.json`), so a compile that did not pay is not tried again
until torch, the model or the CPU changes (each changes the key). The folder keeps under a
size cap: the entries used longest ago go first.

Pure Python (no torch): the service side reads it too.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import secrets
import shutil
import time
from pathlib import Path
from typing import Any

from stemdeck_watch.util.safefile import read_json, write_replacing

log = logging.getLogger(__name__)

ENTRY = "entry.json"
INDUCTOR = "inductor"  # TORCHINDUCTOR_CACHE_DIR of an entry
BUILD_PREFIX = ".build-"
VERDICT_SUFFIX = ".verdict.json"
PART_SUFFIX = ".bin"  # a compiled part, saved by compiled/graph.py
CONVERTED_SUFFIX = (
    ".xml"  # a part converted for OpenVINO, compiled/openvinograph.py (weights: .bin)
)
JSON_LIMIT = 16 << 20  # bytes: an entry's list of files is a few hundred lines
# how the model is prepared for the compiler (workers/compiled/graph.py): a change of it makes
# every entry foreign
RECIPE = 4


@dataclasses.dataclass(frozen=True)
class CompileKey:
    """Everything a compiled model depends on: a change of any of them needs a new build."""

    model: str
    fingerprint: str  # of the model's class, arguments and weights
    precision: str
    device: str
    torch: str
    python: str
    cpu: str  # a digest of the CPU's model name and feature flags
    # torch's thread count: a saved graph refuses to run under another (its guards check it)
    threads: int = 0
    openvino: str = ""  # its version; "" without it (the transformer then goes to Inductor)
    recipe: int = RECIPE

    def digest(self) -> str:
        text = json.dumps(dataclasses.asdict(self), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:20]

    @classmethod
    def from_dict(cls, data: Any) -> CompileKey | None:
        try:
            return cls(**data)
        except TypeError:
            return None


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What the adopting worker measured: whether the compiled model is used, and why."""

    use: bool
    reason: str
    speedup: float | None = None  # eager seconds / compiled seconds, same precision
    worst_snr_db: float | None = None  # compiled against float32, the worst stem
    measured: float = 0.0  # time.time()
    finite: bool = True  # False: the compiled stems had NaN or infinite samples

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> Verdict | None:
        names = {f.name for f in dataclasses.fields(cls)}
        try:
            return cls(**{k: v for k, v in data.items() if k in names})
        except (TypeError, AttributeError):
            return None


def cpu_identity() -> str:
    """A digest of this CPU's model name and feature flags (Linux /proc/cpuinfo; the platform
    string elsewhere): compiled kernels use the features they were built for."""
    import platform

    text = platform.machine() + platform.processor()
    try:
        info = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        info = ""
    wanted = ("model name", "flags", "Features", "CPU implementer", "CPU part")
    lines = {
        line.split(":", 1)[0].strip(): line.split(":", 1)[1].strip()
        for line in info.splitlines()
        if ":" in line and line.split(":", 1)[0].strip() in wanted
    }
    text += json.dumps(lines, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Write `path` whole or not at all (util/safefile.py: a random name created with
    O_EXCL|O_NOFOLLOW, fsync, rename), then read it back: a cache entry is only ever
    trusted as written."""
    write_replacing(path, json.dumps(data, indent=1, sort_keys=True))
    if _read_json(path) != json.loads(json.dumps(data)):
        raise OSError(f"{path} did not read back as written")


def _read_json(path: Path) -> Any:
    try:
        return read_json(path, JSON_LIMIT)
    except (OSError, ValueError):
        return None


def file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def manifest(folder: Path) -> dict[str, list[Any]]:
    """Every regular file under `folder` (links are not followed): relative path → [size,
    SHA-256]. Lock files are left out: Inductor makes and removes them as it runs."""
    files: dict[str, list[Any]] = {}
    for path in sorted(folder.rglob("*")):
        if path.is_symlink() or not path.is_file() or path.suffix == ".lock":
            continue
        files[path.relative_to(folder).as_posix()] = [path.stat().st_size, file_digest(path)]
    return files


def folder_bytes(folder: Path) -> int:
    total = 0
    for path in folder.rglob("*"):
        try:
            if not path.is_symlink() and path.is_file():
                total += path.stat().st_size
        except OSError:
            pass
    return total


@dataclasses.dataclass(frozen=True)
class CompileSettings:
    """separation.compile and where its cache lives, as the local worker client gets them."""

    setting: str  # "auto", "on" or "off"
    cache: Path  # <state>/compiled
    cap_mb: float = 2048.0

    def request(self) -> dict[str, Any]:
        """The "compile" field of a worker's load request (and of a separate request with a
        recipe's RoFormer, for its own compiled model)."""
        return {"setting": self.setting, "cache": str(self.cache), "cap_mb": self.cap_mb}


class CompileCache:
    """`<state>/compiled`: entries by key, their verdicts, builds in progress, the size cap."""

    def __init__(self, root: Path, cap_mb: float = 2048.0):
        self.root = root
        self.cap_bytes = int(cap_mb * 1024 * 1024)

    def entry_dir(self, key: CompileKey) -> Path:
        return self.root / key.digest()

    def verdict_path(self, key: CompileKey) -> Path:
        return self.root / f"{key.digest()}{VERDICT_SUFFIX}"

    def entry(self, key: CompileKey) -> dict[str, Any] | None:
        """The entry built for `key`, checked file by file; a foreign or damaged one is
        removed (and so built again) and None returned."""
        folder = self.entry_dir(key)
        if not folder.is_dir() or folder.is_symlink():
            return None
        problem, data = self._check(key)
        if problem:
            log.warning("compiled-model cache %s is not usable (%s): removed", folder, problem)
            shutil.rmtree(folder, ignore_errors=True)
            return None
        return data

    def problem(self, key: CompileKey) -> str | None:
        """What is wrong with the entry for `key` (None: it is whole and names `key`)."""
        return self._check(key)[0]

    def _check(self, key: CompileKey) -> tuple[str | None, dict[str, Any]]:
        """What is wrong with the entry for `key`, if anything, and its entry.json."""
        folder = self.entry_dir(key)
        if not folder.is_dir() or folder.is_symlink():
            return "there is no entry", {}
        data = _read_json(folder / ENTRY)
        if not isinstance(data, dict) or CompileKey.from_dict(data.get("key")) != key:
            return "it was built for something else", {}
        files = dict(data.get("files") or {})
        # a saved part is code the worker loads: one the build did not write is never loaded
        # (Inductor may add to its own cache folder as it is used, so only the parts count)
        parts = [*folder.glob(f"*{PART_SUFFIX}"), *folder.glob(f"*{CONVERTED_SUFFIX}")]
        for path in parts:
            if path.name not in files:
                return f"{path.name} is not named in {ENTRY}", data
        for name, (size, digest) in files.items():
            path = folder / name
            try:
                if path.is_symlink() or path.stat().st_size != size:
                    return f"{name} changed", data
                if file_digest(path) != digest:
                    return f"{name} is damaged", data
            except OSError:
                return f"{name} is missing", data
        return None, data

    def verdict(self, key: CompileKey) -> Verdict | None:
        data = _read_json(self.verdict_path(key))
        if not isinstance(data, dict) or CompileKey.from_dict(data.get("key")) != key:
            return None
        return Verdict.from_dict(data.get("verdict"))

    def record_verdict(self, key: CompileKey, verdict: Verdict) -> None:
        """Keep what was measured; a compile not used gives its space back."""
        self.root.mkdir(parents=True, exist_ok=True)
        write_json(
            self.verdict_path(key),
            {"key": dataclasses.asdict(key), "verdict": verdict.to_dict()},
        )
        if not verdict.use:
            shutil.rmtree(self.entry_dir(key), ignore_errors=True)

    def touch(self, key: CompileKey) -> None:
        """Mark an entry used now (the size cap removes those used longest ago first)."""
        try:
            os.utime(self.entry_dir(key) / ENTRY)
        except OSError:
            pass

    # ------------------------------------------------------------ building

    def new_build(self, key: CompileKey) -> Path:
        """A fresh folder with a random name to build `key` in."""
        self.root.mkdir(parents=True, exist_ok=True)
        folder = self.root / f"{BUILD_PREFIX}{key.digest()}-{secrets.token_hex(6)}"
        folder.mkdir(mode=0o700)
        return folder

    def commit(self, build: Path, key: CompileKey, figures: dict[str, Any]) -> Path:
        """Make the finished `build` the entry for `key`: its manifest written and read back,
        then one rename. Returns the entry's folder."""
        data = {"key": dataclasses.asdict(key), "built": time.time(), **figures}
        data["files"] = manifest(build)
        write_json(build / ENTRY, data)
        target = self.entry_dir(key)
        if target.exists():
            shutil.rmtree(target, ignore_errors=True)
        os.replace(build, target)
        self.trim(keep=key)
        return target

    def remove_builds(self) -> None:
        """Builds left by a stopped or killed builder: never entries, so they go."""
        for folder in self.root.glob(f"{BUILD_PREFIX}*"):
            shutil.rmtree(folder, ignore_errors=True)

    def trim(self, keep: CompileKey | None = None) -> list[Path]:
        """Remove the entries used longest ago until the cache is under its cap; an entry
        over the cap on its own is not kept either. Returns what was removed."""
        entries = []
        for folder in self.root.iterdir() if self.root.is_dir() else []:
            if folder.is_dir() and not folder.name.startswith(BUILD_PREFIX):
                try:
                    used = (folder / ENTRY).stat().st_mtime
                except OSError:
                    used = 0.0
                entries.append((used, folder, folder_bytes(folder)))
        total = sum(size for _, _, size in entries)
        removed = []
        kept = keep.digest() if keep else None
        for _, folder, size in sorted(entries, key=lambda e: (e[1].name == kept, e[0])):
            if total <= self.cap_bytes:
                break
            log.info(
                "compiled-model cache over its cap (%.0f MB > %.0f MB): removed %s",
                total / 2**20,
                self.cap_bytes / 2**20,
                folder.name,
            )
            shutil.rmtree(folder, ignore_errors=True)
            total -= size
            removed.append(folder)
        return removed
