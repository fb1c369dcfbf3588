"""Checks on published song folders shared by the kill and fault-injection tests."""

from __future__ import annotations

from pathlib import Path

from stemdeck_watch.stages.manifest import read_manifest


def damaged_stems(folder: Path) -> list[str]:
    """Stems of a published song that do not hold what its manifest says (frames, channels):
    a write error swallowed on the way would show here."""
    import soundfile

    manifest = read_manifest(folder) or {}
    bad = []
    for entry in manifest.get("stems", []):
        try:
            info = soundfile.info(str(folder / entry["file"]))
        except (RuntimeError, OSError) as exc:
            bad.append(f"{entry['file']} is unreadable: {exc}")
            continue
        expected = (entry.get("frames", info.frames), entry.get("channels", info.channels))
        if (info.frames, info.channels) != expected:
            bad.append(
                f"{entry['file']} holds {info.frames} frames x {info.channels}, the "
                f"manifest says {expected[0]} x {expected[1]}"
            )
    return bad
