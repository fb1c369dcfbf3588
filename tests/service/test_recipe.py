"""A song separated by recipe: the vocals from a RoFormer, drums, bass and other from Demucs
on what the RoFormer left, stems that add up to the mix, the models named in the manifest.

The RoFormer is a tiny one with random weights saved as the published checkpoint
(`recipe_repo` in conftest.py), loaded through the service's own path."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import soundfile

from stemdeck_watch.cli.status import render
from stemdeck_watch.core.jobs import JobState, made_by_words
from stemdeck_watch.core.config import settings_from_dict
from stemdeck_watch.stages.manifest import read_manifest
from stemdeck_watch.util.synth import write_song
from stemdeck_watch.workers.compiled.model import cxx_compiler
from stemdeck_watch.workers.faultseam import FAULTS_ENV

from support.helpers import config_data, outbox_entries, wait_for

pytestmark = pytest.mark.slow
ROFORMER = "bs_roformer_viperx_1297"


def recipe_settings(tmp_path: Path, repo: Path, **sections: dict) -> object:
    data = config_data(tmp_path, repo, **sections)
    data["output"].update(format="wav", bit_depth=32)
    return settings_from_dict(data, source=tmp_path / "stemdeck.toml")


def test_a_song_tagged_best_gets_roformer_vocals_and_demucs_stems_that_add_up(
    recipe_repo: Path, service_factory, tmp_path: Path
) -> None:
    settings = recipe_settings(tmp_path, recipe_repo)
    service, jobs = service_factory(settings)
    write_song(settings.paths.inbox / "Song [best].wav", 2.0)
    job = jobs.wait_final(1)[0]
    assert job.state is JobState.DONE, job.error
    folder = Path(job.output or "")
    manifest = read_manifest(folder)
    recipe = manifest["recipe"]
    assert {k: recipe[k] for k in ("name", "vocals", "rest")} == {
        "name": "best",
        "vocals": ROFORMER,
        "rest": "htdemucs_ft",
    }
    # compile "auto": a RoFormer this small never pays for a compile, and the manifest says so
    if cxx_compiler() is not None:
        assert recipe["compiled"]["state"] == "not used", recipe
        assert "small model" in recipe["compiled"]["reason"]
    assert recipe["compiled"]["used"] is False
    assert manifest["model"]["name"] == "htdemucs_ft"
    assert manifest["model"]["made_by"] == {
        "vocals": ROFORMER,
        "drums": "htdemucs_ft",
        "bass": "htdemucs_ft",
        "other": "htdemucs_ft",
    }
    assert manifest["settings_from"]["separation.recipe"] == "name tag [best]"
    # the queue (status, the page) says it too, as the registry keeps it
    assert job.to_status()["made_by"] == manifest["model"]["made_by"]
    words = made_by_words(job.to_status()["made_by"])
    assert words == f"drums, bass, other: htdemucs_ft; vocals: {ROFORMER}"
    assert words in render(service.scheduler.snapshot())
    # the stems add up to the mix: float rounding of the subtractions, nothing more
    assert manifest["levels"]["residual_db"] < -100
    stems = [soundfile.read(folder / f"{s}.wav", dtype="float64")[0] for s in made(manifest)]
    mix, _ = soundfile.read(settings.paths.processed / "Song [best].wav", dtype="float64")
    total = sum(stems) / manifest["levels"]["gain"]
    assert np.max(np.abs(total - mix)) < 1e-5
    # the RoFormer's vocals are not Demucs's: the tiny Demucs alone gives other vocals
    assert np.max(np.abs(stems[list(made(manifest)).index("vocals")])) > 0


def made(manifest: dict) -> list[str]:
    return list(manifest["model"]["made_by"])


def test_a_roformer_checkpoint_whose_keys_do_not_fit_fails_the_song_naming_the_key(
    recipe_repo: Path, service_factory, tmp_path: Path
) -> None:
    import torch

    repo = tmp_path / "repo"
    repo.mkdir()
    for path in recipe_repo.iterdir():
        (repo / path.name).write_bytes(path.read_bytes())
    checkpoint = next(repo.glob("*.ckpt"))
    state = torch.load(checkpoint, weights_only=True)  # the test's own file
    first = next(iter(state))
    state["not_a_layer.weight"] = state.pop(first)
    torch.save(state, checkpoint)
    settings = recipe_settings(tmp_path, repo, separation={"recipe": "best"})
    service, jobs = service_factory(settings)
    write_song(settings.paths.inbox / "Song.wav", 1.0)
    job = jobs.wait_final(1)[0]
    assert job.state is JobState.FAILED
    assert first in (job.error or "") and "not_a_layer.weight" in (job.error or "")


def test_a_stalled_roformer_is_stopped_and_the_song_tried_again(
    recipe_repo: Path, service_factory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    faults = tmp_path / "faults"
    faults.mkdir()
    (faults / "1-stall").write_text("1")  # the RoFormer's first report: inside its first chunk
    monkeypatch.setenv(FAULTS_ENV, str(faults))
    settings = recipe_settings(
        tmp_path, recipe_repo, separation={"recipe": "best", "stall_seconds": 3.0}
    )
    service, jobs = service_factory(settings)
    write_song(settings.paths.inbox / "Song.wav", 1.0)
    job = jobs.wait_final(1)[0]
    assert job.state is JobState.DONE, job.error
    assert not (faults / "1-stall").exists()  # it fired
    assert [fault.kind for fault in job.faults] == ["stalled"]


def test_a_cancel_stops_the_roformer_at_once(
    recipe_repo: Path, service_factory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    faults = tmp_path / "faults"
    faults.mkdir()
    (faults / "slow").write_text("0.3")  # every report of the worker 0.3 s late
    monkeypatch.setenv(FAULTS_ENV, str(faults))
    settings = recipe_settings(tmp_path, recipe_repo, separation={"recipe": "best"})
    service, jobs = service_factory(settings)
    write_song(settings.paths.inbox / "Song.wav", 2.0)
    running = wait_for(
        lambda: [
            j for j in jobs.latest.values() if j.state is JobState.SEPARATING and j.progress > 0.2
        ],
        60,
        "the RoFormer under way",
    )[0]
    assert running.progress < 0.5  # the RoFormer's half of the separation
    started = time.monotonic()
    assert service.queue.cancel(running.id, "cancelled by the test") == "running"
    job = jobs.wait_final(1)[0]
    assert job.state is JobState.CANCELLED
    assert time.monotonic() - started < 5  # the worker is stopped, not waited for
    assert outbox_entries(settings.paths.outbox) == set()


def test_out_of_memory_under_the_roformer_halves_its_batch_then_goes_to_the_cpu(
    recipe_repo: Path, service_factory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The memory runs out inside the RoFormer (as torch says it on MPS, then CUDA): the
    second attempt runs shrunk (the RoFormer's batch halved, Demucs's window too), the third
    on the fallback device; the song is separated by recipe all the same."""
    faults = tmp_path / "faults"
    faults.mkdir()
    for n, kind in enumerate(("oom-mps", "oom-cuda"), 1):
        (faults / f"{n}-{kind}").write_text("1")  # the RoFormer's first report
    monkeypatch.setenv(FAULTS_ENV, str(faults))
    settings = recipe_settings(
        tmp_path,
        recipe_repo,
        separation={"recipe": "best", "device": "auto", "fallback_device": "cpu"},
    )
    service, jobs = service_factory(settings)
    write_song(settings.paths.inbox / "Song.wav", 1.0)
    job = jobs.wait_final(1)[0]
    assert job.state is JobState.DONE, job.error
    assert [(f.kind, f.device) for f in job.faults] == [("memory", "mps"), ("memory", "cuda")]
    manifest = read_manifest(Path(job.output or ""))
    assert manifest["memory_plan"]["device"] == "cpu" and manifest["memory_plan"]["shrink"] == 1
    assert manifest["model"]["made_by"]["vocals"] == ROFORMER


@pytest.mark.parametrize(
    "asked, device, shrink, batch",
    [
        (None, "cuda", 0, 4),
        (None, "cuda", 1, 2),
        (None, "cuda", 3, 1),
        (None, "cpu", 0, 1),
        (8, "cpu", 1, 4),
    ],
)
def test_the_roformers_batch_is_its_own_on_a_gpu_one_on_a_cpu_and_halved_per_shrink(
    asked, device, shrink, batch
) -> None:
    from stemdeck_watch.workers.recipe import lead_batch

    assert lead_batch(asked, 4, device, {"shrink": shrink}) == batch


@pytest.mark.parametrize(
    "asked, device, precision",
    [
        (None, "cpu", "float32"),
        ("auto", "cpu", "float32"),
        ("auto", "cuda", "float16"),
        ("auto", "mps", "float32"),
        ("bfloat16", "cuda", "bfloat16"),
        ("float32", "cuda", "float32"),
    ],
)
def test_the_roformer_runs_in_float16_on_a_gpu_and_float32_elsewhere_unless_asked(
    asked, device, precision
) -> None:
    from stemdeck_watch.workers.recipe import lead_precision
    from stemdeck_watch.workers.separator import Lead

    assert lead_precision(asked, device) == precision
    assert Lead("bs_roformer_viperx_1297").to_request()["precision"] == "auto"


def test_a_song_under_a_recipe_whose_checkpoint_is_missing_fails_saying_what_to_do(
    model_repo: Path, service_factory, tmp_path: Path
) -> None:
    """The service never downloads a RoFormer by itself: a song under a recipe whose
    checkpoint is not on disk fails at once, naming the files and where they go, as a
    fault of its settings (no retry), and the next song goes on."""
    repo = tmp_path / "models"
    repo.mkdir()
    shutil.copy(model_repo / "tiny.th", repo / "tiny.th")
    (repo / "htdemucs_ft.yaml").write_text("models: ['tiny']\n")
    settings = recipe_settings(tmp_path, repo, separation={"model": "tiny"})
    service, jobs = service_factory(settings)
    write_song(settings.paths.inbox / "Song [best].wav", 1.0)
    [job] = jobs.wait_final(1)
    assert job.state is JobState.FAILED
    error = job.error or ""
    assert "model_bs_roformer_ep_317_sdr_12.9755.ckpt" in error, error
    assert f"separation.model_repo ({repo})" in error and "models list" in error, error
    assert job.faults == (), job.faults  # not a fault of the machine: not tried again
    write_song(settings.paths.inbox / "Plain.wav", 1.0)
    assert jobs.wait_final(2)[-1].state is JobState.DONE
