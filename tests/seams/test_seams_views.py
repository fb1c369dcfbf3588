"""The seams test's own views of the folders (tests/seams/seams_folders.py) race the service
that changes them: a folder listed a moment ago may be gone when it is looked into. These
check the views against folders that go between two looks, without a service."""

from __future__ import annotations

from pathlib import Path

import pytest

import seams_folders
from seams_folders import PRESET, STAGING, scan_outbox


@pytest.fixture
def outbox(tmp_path: Path) -> Path:
    folder = tmp_path / "outbox"
    folder.mkdir()
    return folder


def test_folders_listed_then_removed_are_left_out(
    outbox: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the outbox's listing names the staging folder, a song folder and the preset's folder,
    # all removed by the service before the view looks into them
    monkeypatch.setattr(seams_folders, "outbox_entries", lambda _outbox: {STAGING, "gone", PRESET})
    assert scan_outbox(outbox) == ({}, [], [])


def test_a_song_folder_removed_inside_the_preset_folder_is_no_half_folder(
    outbox: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (outbox / PRESET).mkdir()
    real = seams_folders.listing

    def listing(folder: Path) -> list[Path]:
        return real(folder) + ([folder / "gone"] if folder.name == PRESET else [])

    monkeypatch.setattr(seams_folders, "listing", listing)
    assert scan_outbox(outbox) == ({}, [], [])


def test_a_half_folder_that_stays_is_reported(outbox: Path) -> None:
    (outbox / "song").mkdir()
    (outbox / "song" / "vocals.flac").write_bytes(b"half")
    assert scan_outbox(outbox) == ({"song": None}, [], [])


MUTANTS = Path(__file__).parent / "mutants"


@pytest.mark.parametrize("patch", sorted(MUTANTS.glob("*.patch")), ids=lambda p: p.stem)
def test_each_known_defect_still_applies_to_the_code_as_it_is(patch: Path) -> None:
    """`make mutants` measures the net by putting these defects back: one whose code has
    moved on since would measure nothing, so it is caught here, where it costs no service."""
    import subprocess

    root = Path(__file__).resolve().parents[2]
    if not (root / ".git").exists():
        pytest.skip("not a git checkout: `git apply --check` needs one")
    checked = subprocess.run(
        ["git", "apply", "--check", str(patch)],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert checked.returncode == 0, f"{patch.name} no longer applies: {checked.stderr}"
