"""`stemdeck-watch models` for the RoFormer checkpoints: listed with their published scores
and test sets, pulled from a loopback mirror (resumed), verified and imported against the
catalogue's pins only, and said to be unchecked for an entry nobody has pinned.

The mirror serves the tests' small random-weight checkpoints, which the real pins refuse:
where a test needs them taken, the CLI runs with the catalogue's entry pinned to them (or
unpinned), patched in the CLI's own process (`models_as`)."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

from stemdeck_watch.util.safefile import sha256_of, temp_name
from stemdeck_watch.workers import download
from stemdeck_watch.workers.roformer import catalogue, store
from stemdeck_watch.workers.roformer.store import RoformerStore

from support.helpers import write_config
from support.modelhub import ModelHub
from test_models import env_for, models

NAME = "bs_roformer_viperx_1297"
ENTRY = catalogue.KNOWN[NAME]


def pins_of(mirror: Path) -> dict[str, object]:
    """The catalogue's pins for the mirror's (random-weight) files."""
    checkpoint = mirror / ENTRY.checkpoint_file
    return {
        "config_sha256": sha256_of(mirror / ENTRY.config_file),
        "checkpoint_sha256": sha256_of(checkpoint),
        "checkpoint_bytes": checkpoint.stat().st_size,
    }


def models_as(pins: dict[str, object], config: Path, *args: str) -> subprocess.CompletedProcess:
    """`stemdeck-watch models ARGS` with the catalogue's entry for NAME pinned as `pins` say."""
    code = (
        "import dataclasses, sys\n"
        "from stemdeck_watch.workers.roformer import catalogue, store\n"
        f"catalogue.KNOWN[{NAME!r}] = dataclasses.replace(catalogue.KNOWN[{NAME!r}], **{pins!r})\n"
        "store.KNOWN = catalogue.KNOWN\n"
        "from stemdeck_watch.cli.main import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code, "--config", str(config), "models", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env_for(config.parent),
    )


UNPINNED = {"config_sha256": None, "checkpoint_sha256": None, "checkpoint_bytes": None}


@pytest.fixture
def mirror(tmp_path: Path, recipe_repo: Path) -> Path:
    """A mirror of the model hub holding the checkpoint under `roformer/`, as published."""
    folder = tmp_path / "mirror" / "roformer"
    folder.mkdir(parents=True)
    for name in (ENTRY.config_file, ENTRY.checkpoint_file):
        shutil.copy(recipe_repo / name, folder / name)
    return folder


@pytest.fixture
def hub(mirror: Path) -> Iterator[ModelHub]:
    with ModelHub(mirror.parent) as hub:
        yield hub


@pytest.fixture
def config(tmp_path: Path, model_repo: Path, hub: ModelHub) -> Path:
    return write_config(
        tmp_path,
        model_repo,
        separation={"model_repo": "", "model_hub": hub.url, "recipe": "best"},
    )


def test_list_shows_each_checkpoints_published_scores_with_their_test_sets(
    config: Path, hub: ModelHub
) -> None:
    listed = models(config, "list", "--json")
    assert listed.returncode == 0, listed.stderr
    data = json.loads(listed.stdout)
    assert [r["name"] for r in data["roformer"]] == [e.name for e in catalogue.CATALOGUE]
    first = data["roformer"][0]
    assert first["size_mb"] == 639 and first["licence"] is None
    assert (
        first["checkpoint_sha256"] == ENTRY.checkpoint_sha256 and len(ENTRY.checkpoint_sha256) == 64
    )
    assert first["source"] == ENTRY.checkpoint_url
    assert {"stem": "vocals", "sdr": 10.87, "test_set": catalogue.MULTISONG} in [
        {k: s[k] for k in ("stem", "sdr", "test_set")} for s in first["scores"]
    ]
    assert data["recipe"] == "best"
    assert data["recipes"][0] == {
        "name": "best",
        "vocals": NAME,
        "rest": "htdemucs_ft",
        "about": data["recipes"][0]["about"],
    }
    table = models(config, "list").stdout
    assert f"{NAME}  bs_roformer" in table and "sha256: pinned" in table
    assert f"10.87  {catalogue.MULTISONG}" in table and "best *:" in table
    assert hub.requests == []


def test_pull_resumes_and_checks_every_byte_against_the_catalogues_pins(
    config: Path, hub: ModelHub, mirror: Path, tmp_path: Path
) -> None:
    cache = tmp_path / "torch" / "hub" / "checkpoints" / store.FOLDER
    cache.mkdir(parents=True)
    data = (mirror / ENTRY.checkpoint_file).read_bytes()
    partial = cache / temp_name(ENTRY.checkpoint_file, download.PARTIAL)
    partial.write_bytes(data[:100_000])  # a pull cut off before
    result = models_as(pins_of(mirror), config, "pull", NAME)
    assert result.returncode == 0, result.stderr
    assert [g.range for g in hub.gets(".ckpt")] == ["bytes=100000-"]
    assert (cache / ENTRY.checkpoint_file).read_bytes() == data
    assert f"{NAME}: ready, 2 file(s)" in result.stdout
    assert "verified: each file's sha256 equals the one the catalogue pins" in result.stdout
    assert "unchecked" not in result.stdout
    checked = models_as(pins_of(mirror), config, "verify")
    assert checked.returncode == 0 and "unpinned" not in checked.stdout


def test_the_real_pins_refuse_a_mirror_serving_other_files(
    config: Path, hub: ModelHub, tmp_path: Path
) -> None:
    result = models(config, "pull", NAME)  # the catalogue as shipped
    assert result.returncode != 0
    # the mirror's configuration is a shrunk copy of the published one: refused first
    assert ENTRY.config_file in result.stderr and str(ENTRY.config_sha256) in result.stderr
    assert "nothing was kept" in result.stderr
    cache = tmp_path / "torch" / "hub" / "checkpoints" / store.FOLDER
    assert [p.name for p in cache.iterdir() if not p.name.endswith(".lock")] == []


def test_an_unpinned_entry_is_said_to_be_unchecked_with_its_sha256(
    config: Path, hub: ModelHub, mirror: Path
) -> None:
    result = models_as(UNPINNED, config, "pull", NAME)
    assert result.returncode == 0, result.stderr
    assert f"{NAME}: ready, 2 file(s)" in result.stdout and "unchecked" in result.stdout
    assert sha256_of(mirror / ENTRY.checkpoint_file) in result.stdout
    assert "verified" not in result.stdout  # nothing was checked against a pinned sum
    checked = models_as(UNPINNED, config, "verify")
    assert checked.returncode == 0
    assert f"unpinned {ENTRY.checkpoint_file}: no sha256 is pinned" in checked.stdout


def test_a_pinned_size_caps_the_download(
    tmp_path: Path, mirror: Path, hub: ModelHub, monkeypatch: pytest.MonkeyPatch
) -> None:
    small = dataclasses.replace(ENTRY, **{**UNPINNED, "checkpoint_bytes": 50_000})
    monkeypatch.setitem(catalogue.KNOWN, NAME, small)
    monkeypatch.setattr(store, "KNOWN", catalogue.KNOWN)
    roformers = RoformerStore(tmp_path / "cache", hub.url)
    with pytest.raises(download.TooLarge):
        roformers.pull(NAME)
    assert not (roformers.folder / ENTRY.checkpoint_file).exists()
    assert sum(g.sent for g in hub.gets(".ckpt")) <= 50_000 + (1 << 20)


def test_the_pins_refuse_a_different_file_on_import(tmp_path: Path, mirror: Path) -> None:
    roformers = RoformerStore(tmp_path / "cache")
    imported, refused, notes = roformers.import_folder(mirror)
    assert imported == [] and notes == []
    assert sorted(path.name for path, _why in refused) == sorted(
        [ENTRY.config_file, ENTRY.checkpoint_file]
    )
    assert all("not" in why for _path, why in refused)
    assert str(ENTRY.checkpoint_sha256) in dict(refused)[mirror / ENTRY.checkpoint_file]


def test_import_takes_the_catalogues_pins_and_never_the_folders_checksums(
    config: Path, mirror: Path, tmp_path: Path
) -> None:
    (mirror / "SHA256SUMS").write_text(f"{'0' * 64}  {ENTRY.checkpoint_file}\n")
    (mirror / "other.ckpt").write_bytes(b"not in the catalogue")
    result = models_as(pins_of(mirror), config, "import", str(mirror))
    assert result.returncode == 0, result.stderr
    cache = tmp_path / "torch" / "hub" / "checkpoints" / store.FOLDER
    assert sorted(p.name for p in cache.iterdir()) == sorted(
        [ENTRY.config_file, ENTRY.checkpoint_file]
    )
    assert f"imported {ENTRY.checkpoint_file}" in result.stdout
    assert "unchecked" not in result.stdout


def test_doctor_says_a_recipes_roformer_is_missing_and_where_it_is_found(
    tmp_path: Path, model_repo: Path, recipe_repo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from stemdeck_watch.cli.doctor import check_recipes
    from stemdeck_watch.core.config import settings_from_dict

    from support.helpers import config_data

    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    data = config_data(tmp_path, model_repo, separation={"model_repo": "", "recipe": "best"})
    data["presets"] = {"offline": {"model_repo": str(recipe_repo)}}
    [cached, offline] = check_recipes(settings_from_dict(data))
    assert not cached.ok and f"models pull {NAME}" in cached.detail
    assert ENTRY.checkpoint_file in cached.detail
    assert offline.ok and offline.title == "recipe best (preset offline)"
    assert str(recipe_repo) in offline.detail
