"""A song folder's `stemdeck.json`: written last, it names the job and lists every file.

A folder whose manifest is complete (every file it lists there, at its size) is a published
song: that is how a restart tells "published, then crashed" from "crashed while writing", and
whose folder it is (`publisher_of`) when a duplicate or `remove` asks. The sha256 of every
file lets a person, `doctor` and restore tell an undamaged folder from a damaged one. The
outbox is shared: a manifest is read only from a regular file of bounded size, never through
a link.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
from pathlib import Path
from typing import Any

from stemdeck_watch import __version__
from stemdeck_watch.core.choices import ANY
from stemdeck_watch.core.paths import fsync_dir
from stemdeck_watch.util.safefile import open_new, read_json, sha256_of

MANIFEST = "stemdeck.json"
MAX_MANIFEST = 16 << 20  # a song's manifest is a few KB; a bigger stemdeck.json is not one


def write_manifest(staging: Path, manifest: dict[str, Any]) -> None:
    """Write `stemdeck.json` last: it lists every file already in the folder with its size
    and sha256, so a person (and restore) can tell a complete folder from a damaged one."""
    manifest = {
        "stemdeck_watch": __version__,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        **manifest,
        "files": list_files(staging),
    }
    path = staging / MANIFEST
    with open_new(path, "w", encoding="utf-8") as handle:
        json.dump(manifest, handle, indent=2, ensure_ascii=False)
        handle.write("\n")
        handle.flush()
        os.fsync(handle.fileno())
    fsync_dir(staging)


def read_manifest(folder: Path) -> dict[str, Any] | None:
    """The manifest of a song folder if it is complete (every file it lists exists). Only a
    plain file is read: the outbox is shared, and a link to a FIFO would block for ever."""
    try:
        manifest = read_json(folder / MANIFEST, MAX_MANIFEST)
    except (OSError, ValueError):
        return None
    stems = manifest.get("stems") if isinstance(manifest, dict) else None
    if not isinstance(stems, list):
        return None
    files = [entry.get("file") if isinstance(entry, dict) else None for entry in stems]
    if not files or not all(isinstance(f, str) and (folder / f).is_file() for f in files):
        return None
    listed = manifest.get("files", [])
    for entry in listed if isinstance(listed, list) else [{}]:  # sizes only (verify hashes)
        try:
            if (folder / entry["file"]).stat().st_size != entry["bytes"]:
                return None
        except (OSError, KeyError, TypeError):
            return None
    return manifest


def publisher_of(folder: Path) -> str | None:
    """The job id a song folder's manifest names, complete or not: whose folder it is. Read
    only from a regular file of bounded size, never through a link (anyone who can write the
    outbox could plant one)."""
    try:
        manifest = read_json(folder / MANIFEST, MAX_MANIFEST)
    except (OSError, ValueError):
        return None
    job_id = manifest.get("job_id") if isinstance(manifest, dict) else None
    return job_id if isinstance(job_id, str) else None


def list_files(folder: Path) -> list[dict[str, Any]]:
    """Every file under `folder` but the manifest: relative name, bytes, sha256."""
    paths = sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)
    return [
        {
            "file": p.relative_to(folder).as_posix(),
            "bytes": p.stat().st_size,
            "sha256": sha256_of(p),
        }
        for p in paths
    ]


def verify_folder(folder: Path) -> list[str]:
    """What is wrong with a published song folder, by its manifest's sha256 sums: missing,
    changed or unlisted files; an empty list for a complete, undamaged folder."""
    try:
        listed = {e["file"]: e for e in read_json(folder / MANIFEST, MAX_MANIFEST).get("files", [])}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        return [f"could not read {folder / MANIFEST}: {exc}"]
    present = {e["file"]: e for e in list_files(folder)}
    problems = [f"{name} is missing" for name in listed if name not in present]
    problems += [f"{name} is not in the manifest" for name in present if name not in listed]
    problems += [
        f"{name} has changed (sha256 differs)"
        for name, e in present.items()
        if name in listed and listed[name].get("sha256") != e["sha256"]
    ]
    return problems


def recorded_sidecar(folder: Path | None, job_id: str) -> Any:
    """The sha256 of the sidecar the song's manifest says it was separated with, None where
    it had none; ANY (core.choices) where the manifest cannot say: not this job's (a
    duplicate's is the first copy's), unreadable, or written before manifests recorded it
    (then a sidecar that chose a setting was the one)."""
    try:
        manifest = read_json(folder / MANIFEST, MAX_MANIFEST) if folder else None
    except (OSError, ValueError):
        return ANY
    if not isinstance(manifest, dict) or manifest.get("job_id") != job_id:
        return ANY
    if "sidecar" in manifest:
        found = manifest["sidecar"]
        return found.get("sha256") if isinstance(found, dict) else None
    origins = manifest.get("settings_from")
    chosen = isinstance(origins, dict) and any(
        str(origin).startswith("sidecar ") for origin in origins.values()
    )
    return ANY if chosen else None
