"""`stemdeck-watch models` as a user types it, against a loopback mirror of the model hub
(a tiny model in the hub's real layout, with its real checksum): list, pull — cut off,
interrupted and resumed, damaged — verify and import. No byte comes from the internet."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Iterator

import pytest

from stemdeck_watch.cli.doctor import check_models
from stemdeck_watch.cli.main import main
from stemdeck_watch.core.config import settings_from_dict
from stemdeck_watch.core.errors import ConfigError
from stemdeck_watch.core.jobs import Job, JobKind, JobState
from stemdeck_watch.core import choices
from stemdeck_watch.workers.demucs import catalogue

from stemdeck_watch.workers.demucs.models import ModelStore, ModelStoreError

from support.helpers import config_data, wait_for, write_config
from support.modelhub import ModelHub, build_mirror

KNOWN = (
    "htdemucs",
    "htdemucs_ft",
    "htdemucs_6s",
    "hdemucs_mmi",
    "mdx",
    "mdx_extra",
    "mdx_q",
    "mdx_extra_q",
)
HOLD = 200_000  # where a held transfer waits


@pytest.fixture
def mirror(tmp_path: Path, model_repo: Path) -> Path:
    return build_mirror(tmp_path / "mirror", model_repo / "tiny.th")


@pytest.fixture
def hub(mirror: Path, tmp_path: Path) -> Iterator[ModelHub]:
    with ModelHub(tmp_path / "mirror") as hub:
        yield hub


@pytest.fixture
def config(tmp_path: Path, model_repo: Path, hub: ModelHub) -> Path:
    return write_config(
        tmp_path,
        model_repo,
        separation={"model": "htdemucs", "model_repo": "", "model_hub": hub.url},
    )


@pytest.fixture
def cache(tmp_path: Path) -> Path:
    return tmp_path / "torch" / "hub" / "checkpoints"


def env_for(tmp_path: Path) -> dict[str, str]:
    """torch.hub's cache and HuggingFace's in the test's folder, never the user's."""
    return {**os.environ, "TORCH_HOME": str(tmp_path / "torch"), "HF_HOME": str(tmp_path / "hf")}


def models(config: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "stemdeck_watch", "--config", str(config), "models", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env_for(config.parent),
    )


def model_files(cache: Path) -> set[str]:
    """What a loader would take for a model: `.th` files (not partial downloads)."""
    return {p.name for p in cache.glob("*.th")} if cache.is_dir() else set()


def leftovers(cache: Path) -> set[str]:
    return {p.name for p in cache.glob(".*.partial")} if cache.is_dir() else set()


def test_pull_lists_then_downloads_verified_and_a_dropped_connection_resumes(
    config: Path, hub: ModelHub, mirror: Path, cache: Path
) -> None:
    listed = models(config, "list", "--json")
    assert listed.returncode == 0, listed.stderr
    data = json.loads(listed.stdout)
    assert [m["name"] for m in data["models"]] == list(KNOWN)
    first = data["models"][0]
    assert first["stems"] == ["drums", "bass", "other", "vocals"] and first["size_mb"] == 80
    assert first["good_for"] and not first["cached"]
    assert data["models"][2]["stems"][-2:] == ["guitar", "piano"]
    assert hub.requests == []  # listing asks nobody

    hub.cut_at = 150_000  # the connection drops there, once
    result = models(config, "pull", "htdemucs")
    assert result.returncode == 0, result.stderr
    assert "htdemucs: ready, 1 file(s), 0.5 MB, verified" in result.stdout
    assert "htdemucs: 0.5 / 0.5 MB" in result.stderr and "resuming" in result.stderr
    gets = hub.gets()
    assert [(g.range, g.sent) for g in gets] == [
        (None, 150_000),
        ("bytes=150000-", mirror.stat().st_size - 150_000),
    ]
    assert model_files(cache) == {mirror.name} and leftovers(cache) == set()
    assert (cache / mirror.name).read_bytes() == mirror.read_bytes()

    table = models(config, "list")
    assert table.returncode == 0
    row = next(line for line in table.stdout.splitlines() if line.startswith("htdemucs *"))
    assert row.split()[2:5] == ["4", "≈80", "MB"] and row.split()[5] == "yes"


def test_a_pull_interrupted_by_ctrl_c_resumes_where_it_stopped(
    config: Path, hub: ModelHub, mirror: Path, cache: Path
) -> None:
    hub.hold_at = HOLD
    # Ctrl-C as a terminal delivers it to a command in the foreground: a test runner started
    # in the background (`make test &`) has SIGINT ignored, and its children would inherit that
    foreground = (
        "import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
        "sys.argv[0] = 'stemdeck-watch'; runpy.run_module('stemdeck_watch', run_name='__main__')"
    )
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            foreground,
            "--config",
            str(config),
            "models",
            "pull",
            "htdemucs",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env_for(config.parent),
    )
    try:
        wait_for(hub.held.is_set, 60, "the transfer to reach the held byte")
        partial = wait_for(
            lambda: [p for p in cache.glob(".*.partial") if p.stat().st_size == HOLD],
            30,
            "the partial file",
        )[0]
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=90)  # a loaded CI machine is slow to unwind
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()  # reaped, its pipes closed (left open, a later test sees them)
    assert proc.returncode == 1, out + err
    assert "interrupted at 0.2 / 0.5 MB" in err and "again to resume" in err
    assert model_files(cache) == set()  # a partial download is never a model file
    assert partial.stat().st_size == HOLD
    hub.release()

    result = models(config, "pull", "htdemucs")
    assert result.returncode == 0, result.stderr
    resumed = hub.gets()[-1]
    assert resumed.range == f"bytes={HOLD}-" and resumed.sent == mirror.stat().st_size - HOLD
    assert model_files(cache) == {mirror.name} and leftovers(cache) == set()
    assert (cache / mirror.name).read_bytes() == mirror.read_bytes()


def test_a_damaged_download_is_never_left_as_a_model_file(
    config: Path, hub: ModelHub, cache: Path
) -> None:
    hub.damaged = True
    result = models(config, "pull", "htdemucs")
    assert result.returncode == 1
    assert "is not the file its name promises" in result.stderr
    assert "nothing was kept" in result.stderr
    assert model_files(cache) == set() and leftovers(cache) == set()


def test_verify_finds_a_damaged_cached_file_and_pull_replaces_it(
    config: Path, hub: ModelHub, mirror: Path, cache: Path
) -> None:
    assert models(config, "pull", "htdemucs").returncode == 0
    assert models(config, "verify").returncode == 0
    cached = cache / mirror.name
    data = bytearray(cached.read_bytes())
    data[1000] ^= 0xFF
    cached.write_bytes(bytes(data))
    result = models(config, "verify")
    assert result.returncode == 1
    assert f"DAMAGED  {mirror.name} (htdemucs)" in result.stdout
    assert "`stemdeck-watch models pull htdemucs` downloads it again" in result.stdout
    assert models(config, "pull", "htdemucs").returncode == 0
    assert cached.read_bytes() == mirror.read_bytes()
    assert models(config, "verify").returncode == 0


def test_import_copies_an_offline_copy_verified_and_refuses_a_damaged_file(
    tmp_path: Path, model_repo: Path, cache: Path
) -> None:
    # the default hub (the internet): import must not need it
    config = write_config(tmp_path, model_repo, separation={"model": "htdemucs", "model_repo": ""})
    damaged = tmp_path / "damaged"
    build_mirror(damaged, model_repo / "tiny.th", name="offline")
    served = next((damaged / "hybrid_transformer").glob("*.th"))
    data = bytearray(served.read_bytes())
    data[len(data) // 2] ^= 0xFF
    served.write_bytes(bytes(data))
    result = models(config, "import", str(damaged))
    assert result.returncode == 1
    assert "refused" in result.stderr and "damaged" in result.stderr
    assert model_files(cache) == set() and leftovers(cache) == set()

    offline = build_mirror(tmp_path / "offline", model_repo / "tiny.th", name="offline")
    result = models(config, "import", str(tmp_path / "offline"))
    assert result.returncode == 0, result.stderr
    assert f"imported {offline.name}" in result.stdout
    # what "verified" proves, said where it is said
    assert "verified: each file's sha256 matches the checksum in its name" in result.stdout
    assert "finds damage in transfer or on disk, not a file made to match" in result.stdout
    assert (cache / offline.name).read_bytes() == offline.read_bytes()
    assert ModelStore(cache=cache).state("offline").cached


def test_an_import_never_redefines_a_model_demucs_defines(
    tmp_path: Path, model_repo: Path, cache: Path
) -> None:
    """A folder with its own `htdemucs.yaml` and `files.txt` would make the default model
    load its file (a pickle: code), "verified" against the checksum the same folder gave:
    refused, nothing copied, and htdemucs stays what demucs's own list says."""
    store = ModelStore(cache=cache)
    own = store.index().files_of("htdemucs")
    hostile = tmp_path / "hostile"
    build_mirror(hostile, model_repo / "tiny.th")  # htdemucs.yaml naming its own file
    with pytest.raises(ModelStoreError, match=r"htdemucs.yaml redefines htdemucs, a model demucs"):
        store.import_folder(hostile)
    assert model_files(cache) == set() and not store.lists.exists()

    listed = tmp_path / "listed"  # the checksum of a file demucs names, from the folder
    fake = build_mirror(listed, model_repo / "tiny.th", name="mine", sig=own[0].sig)
    with pytest.raises(ModelStoreError, match=rf"lists {fake.name} for the model file"):
        store.import_folder(listed)
    assert model_files(cache) == set()

    # lists an earlier import kept for the default hub add models, never redefine one
    store.lists.mkdir(parents=True)
    (store.lists / "htdemucs.yaml").write_text("models: ['0a1b2c3d']\n")
    (store.lists / "files.txt").write_text((hostile / "files.txt").read_text())
    assert store.index().files_of("htdemucs") == own


def test_the_model_hub_is_the_config_files_choice_never_a_presets_or_a_drops(
    tmp_path: Path, model_repo: Path
) -> None:
    data = config_data(tmp_path, model_repo, presets={"six": {"model_hub": "http://x/"}})
    with pytest.raises(ConfigError, match="unknown key presets.six.model_hub"):
        settings_from_dict(data)
    settings = settings_from_dict(config_data(tmp_path, model_repo))
    song = tmp_path / "inbox" / "Song.mp3"
    song.parent.mkdir(parents=True)
    song.write_bytes(b"")
    (tmp_path / "inbox" / "Song.mp3.stemdeck.toml").write_text(
        'model_hub = "http://127.0.0.1:9/"\n'
    )
    job = Job(
        id="j",
        name="Song",
        kind=JobKind.FILE,
        state=JobState.QUEUED,
        source=str(song),
        rel_path="Song.mp3",
    )
    with pytest.raises(choices.ChoiceError, match="model_hub"):
        choices.for_job(settings, job)


def test_doctor_says_a_model_is_not_downloaded_yet_and_downloads_nothing(
    config: Path, hub: ModelHub, cache: Path
) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "stemdeck_watch", "--config", str(config), "doctor"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env_for(config.parent),
    )
    line = next(line for line in result.stdout.splitlines() if "model htdemucs" in line)
    assert line.startswith("[ok  ]"), result.stdout
    assert "not downloaded yet" in line and "about 80 MB" in line
    assert "`stemdeck-watch models pull htdemucs`" in line
    assert hub.requests == [] and model_files(cache) == set()


@pytest.mark.slow
def test_doctor_checks_a_presets_own_precision(tmp_path: Path, model_repo: Path) -> None:
    """A preset may set its own precision: doctor loads the model in it too, so a setting
    the device refuses (float16 off CUDA) fails in doctor, not on the preset's first song."""
    data = config_data(tmp_path, model_repo, presets={"gpu": {"precision": "float16"}})
    data["separation"]["device"] = "cpu"
    findings = check_models(settings_from_dict(data))
    preset = [f for f in findings if "(preset gpu)" in f.title]
    assert preset and not preset[0].ok and "float16" in preset[0].detail, findings
    assert all(f.ok for f in findings if "preset" not in f.title), findings


def test_a_hub_that_misstates_the_size_gets_sane_progress_and_no_model_file(
    config: Path, hub: ModelHub, cache: Path
) -> None:
    """The HEAD says 1,000 bytes, the GET streams 12 MB: progress never shows a total the
    bytes have passed, and prints a line per 10 MB, not one per chunk."""
    hub.head_size, hub.stream_size = 1000, 12_000_000
    result = models(config, "pull", "htdemucs")
    assert result.returncode == 1
    assert "is not the file its name promises" in result.stderr
    progress = [line for line in result.stderr.splitlines() if line.startswith("htdemucs: ")]
    assert 1 <= len(progress) <= 4, result.stderr
    for line in progress:
        figures = re.fullmatch(r"htdemucs: ([\d.]+)(?: / ([\d.]+))? MB", line)
        assert figures, line
        assert figures[2] is None or float(figures[1]) <= float(figures[2]), line
    assert model_files(cache) == set() and leftovers(cache) == set()


def test_a_download_larger_than_the_model_can_be_stops_and_keeps_nothing(
    config: Path,
    hub: ModelHub,
    cache: Path,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
) -> None:
    """An endless stream stops at the catalogue's size and its margin, with an error naming
    the model and the hub; the partial file goes (it cannot be the model)."""
    monkeypatch.setenv("TORCH_HOME", str(cache.parent.parent))
    monkeypatch.setenv("HF_HOME", str(config.parent / "hf"))
    small = dataclasses.replace(catalogue.KNOWN["htdemucs"], size_mb=1)
    monkeypatch.setitem(catalogue.KNOWN, "htdemucs", small)
    hub.endless = True
    codes: list[int] = []
    pull = threading.Thread(
        target=lambda: codes.append(main(["--config", str(config), "models", "pull", "htdemucs"]))
    )
    pull.start()
    pull.join(timeout=60)
    hub.endless = False
    assert not pull.is_alive() and codes == [1]
    err = capfd.readouterr().err
    assert "model 'htdemucs' from http://127.0.0.1:" in err, err
    assert "sent more than the 1,500,000 bytes" in err and "stops at 1.5 MB" in err
    assert "nothing of it was kept" in err
    assert max(g.sent for g in hub.gets()) < 16_000_000  # the cap and the socket's buffers
    assert model_files(cache) == set() and leftovers(cache) == set()
