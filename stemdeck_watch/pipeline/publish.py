"""Turn separated stems into a finished song folder, all or nothing.

Everything for one song — stems, mixes, `stemdeck.json` — is written into a hidden staging
folder inside the outbox (same filesystem), flushed, and renamed into `outbox/<name>/` in one
step, so a sync client never uploads half a result. The manifest is written last and names the
job: a folder with a complete manifest is a published song, which is how a restart tells
"published, then crashed" from "crashed while writing".
"""
from __future__ import annotations

import datetime as _dt
import hashlib
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from stemdeck_watch import __version__
from stemdeck_watch.config import OutputSettings, SeparationSettings
from stemdeck_watch.errors import FilesystemError, PublishError
from stemdeck_watch.paths import fsync_dir, unique_path

log = logging.getLogger(__name__)

MANIFEST = "stemdeck.json"
EXTENSIONS = {"wav": "wav", "flac": "flac", "mp3": "mp3"}


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def plan_outputs(stems: dict[str, Path], sep: SeparationSettings,
                 out: OutputSettings) -> dict[str, tuple[str, list[str]]]:
    """Which files to write: output name → (kind, stems summed into it)."""
    sources = list(stems)
    if sep.two_stems:
        if sep.two_stems not in sources:
            raise PublishError(
                f"could not make two stems: separation.two_stems = {sep.two_stems!r}, but the "
                f"model {sep.model!r} separates {', '.join(sources)}; choose one of those")
        outputs = {sep.two_stems: ("stem", [sep.two_stems]),
                   f"no_{sep.two_stems}": ("stem", [s for s in sources if s != sep.two_stems])}
    else:
        outputs = {s: ("stem", [s]) for s in sources}
    for mix, members in out.mixes.items():
        missing = [m for m in members if m not in sources]
        if missing:
            raise PublishError(
                f"could not make mix {mix!r}: output.mixes.{mix} names {', '.join(missing)}, but "
                f"the model {sep.model!r} separates {', '.join(sources)}")
        outputs[mix] = ("mix", list(members))
    return outputs


def write_song(staging: Path, stems: dict[str, Path], samplerate: int, name: str,
               sep: SeparationSettings, out: OutputSettings) -> list[dict[str, Any]]:
    """Write every stem and mix into `staging`; returns the manifest's file entries."""
    staging.mkdir(parents=True, exist_ok=True)
    loaded = {stem: np.load(path, mmap_mode="r") for stem, path in stems.items()}
    entries = []
    for output, (kind, members) in plan_outputs(stems, sep, out).items():
        audio = np.array(loaded[members[0]], dtype=np.float32)
        for member in members[1:]:
            audio += loaded[member]
        filename = out.layout.format(stem=output, name=name, ext=EXTENSIONS[out.format],
                                     model=sep.model)
        path = staging / filename
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            _write_audio(path, _prevent_clip(audio, out), samplerate, out)
        except OSError as exc:
            raise PublishError(str(FilesystemError("write", path, reason=exc))) from exc
        if path.parent != staging:
            fsync_dir(path.parent)  # a song subfolder made by output.layout
        entries.append({"name": output, "kind": kind, "file": filename, "sources": members,
                        "samplerate": samplerate, "channels": int(audio.shape[0]),
                        "frames": int(audio.shape[1]),
                        "duration": round(audio.shape[1] / samplerate, 6)})
    return entries


def _prevent_clip(audio: np.ndarray, out: OutputSettings) -> np.ndarray:
    if out.format == "wav" and out.bit_depth == 32:
        return audio  # float samples hold values beyond ±1 without damage
    if out.clip == "clamp":
        return np.clip(audio, -1.0, 1.0)
    peak = float(np.abs(audio).max()) if audio.size else 0.0
    return audio / max(1.01 * peak, 1.0)


def _write_audio(path: Path, audio: np.ndarray, samplerate: int, out: OutputSettings) -> None:
    if out.format == "mp3":
        import lameenc

        encoder = lameenc.Encoder()
        encoder.set_bit_rate(out.mp3_bitrate)
        encoder.set_in_sample_rate(samplerate)
        encoder.set_channels(audio.shape[0])
        encoder.set_quality(2)
        pcm = (np.clip(audio.T, -1, 1) * 32767).astype("<i2").tobytes()
        data = encoder.encode(pcm) + encoder.flush()
        with open(path, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        return
    import soundfile

    subtype = {16: "PCM_16", 24: "PCM_24", 32: "FLOAT"}[out.bit_depth]
    with open(path, "wb") as handle:
        soundfile.write(handle, audio.T, samplerate, subtype=subtype,
                        format=out.format.upper())
        handle.flush()
        os.fsync(handle.fileno())


def write_manifest(staging: Path, manifest: dict[str, Any]) -> None:
    manifest = {"stemdeck_watch": __version__,
                "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                **manifest}
    path = staging / MANIFEST
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(manifest, handle, indent=2, ensure_ascii=False)
        handle.write("\n")
        handle.flush()
        os.fsync(handle.fileno())
    fsync_dir(staging)


def read_manifest(folder: Path) -> dict[str, Any] | None:
    """The manifest of a song folder if it is complete (every file it lists exists)."""
    try:
        with open(folder / MANIFEST, encoding="utf-8") as handle:
            manifest = json.load(handle)
    except (OSError, ValueError):
        return None
    files = [entry.get("file") for entry in manifest.get("stems", [])]
    if not files or not all(isinstance(f, str) and (folder / f).is_file() for f in files):
        return None
    return manifest


def publish_folder(staging: Path, target: Path) -> Path:
    """Rename the finished staging folder to `target` (or `target (2)`…); never overwrites."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        while True:
            candidate = unique_path(target, keep_suffix=False)
            try:
                os.rename(staging, candidate)
            except OSError as exc:
                if candidate.exists():  # someone took the name between check and rename
                    continue
                raise exc
            break
    except OSError as exc:
        raise PublishError(str(FilesystemError("move", staging, target, reason=exc))) from exc
    fsync_dir(candidate.parent)
    return candidate


def remove_tree(path: Path) -> None:
    """Remove a staging or scratch folder; a leftover is logged, never fatal."""
    if path.exists():
        shutil.rmtree(path, ignore_errors=True)
        if path.exists():
            log.warning("could not remove %s completely", path)


def remove_if_empty(path: Path) -> None:
    """Drop the hidden staging folder between songs, so the outbox shows only songs."""
    try:
        path.rmdir()
    except OSError:
        pass
