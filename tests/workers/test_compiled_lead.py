"""A recipe's RoFormer compiled as the Demucs model is: the first song with it asks for the
background build and separates eager, the next adopts the build before it starts, measures
it, and runs it; its stems are eager's to float rounding, its progress still comes from
inside each chunk, and it is named wherever the Demucs model's compile is.

The Demucs half here is a tiny HDemucs, which is never compiled, so the only build is the
RoFormer's (a tiny BS-RoFormer saved as `bs_roformer_viperx_1297`: conftest's recipe_repo)."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

from stemdeck_watch.cli.status import render
from stemdeck_watch.core.config import settings_from_dict
from stemdeck_watch.core.jobs import JobState
from stemdeck_watch.stages.manifest import read_manifest
from stemdeck_watch.store.jobqueue import JobControl
from stemdeck_watch.util.synth import write_song
from stemdeck_watch.workers.compiled.cache import CompileSettings
from stemdeck_watch.workers.local import WorkerClient
from stemdeck_watch.workers.separator import DemucsSettings, Lead

from support.compiled import BUILD_TIMEOUT, require_compiler
from support.helpers import config_data, wait_for

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(sys.platform != "linux", reason="Inductor's CPU compile, tried on Linux"),
]
ROFORMER = "bs_roformer_viperx_1297"
SR = 44100


@pytest.fixture
def hybrid_recipe_repo(recipe_repo: Path, tmp_path: Path) -> Path:
    """recipe_repo, with `htdemucs_ft` a tiny HDemucs (compiling is not for it)."""
    torch = pytest.importorskip("torch")
    from demucs.hdemucs import HDemucs

    repo = tmp_path / "models"
    shutil.copytree(recipe_repo, repo)
    (repo / "htdemucs_ft.yaml").unlink()
    torch.manual_seed(0)
    model = HDemucs(sources=["drums", "bass", "other", "vocals"], channels=4)
    args, kwargs = model._init_args_kwargs
    state = {"klass": HDemucs, "args": args, "kwargs": kwargs, "state": model.state_dict()}
    torch.save(state, repo / "htdemucs_ft.th")
    return repo


def mix(folder: Path, seconds: float = 3.0) -> Path:
    path = folder / "mix.npy"
    rng = np.random.default_rng(2)
    np.save(path, (0.1 * rng.standard_normal((2, int(seconds * SR)))).astype(np.float32))
    return path


def separate(client: WorkerClient, repo: Path, source: Path, out: Path) -> tuple[object, dict]:
    reports: list[float] = []
    result = client.separate(
        "job",
        "htdemucs_ft",
        str(repo),
        source,
        out,
        demucs=DemucsSettings(shifts=0),
        lead=Lead(ROFORMER),
        control=JobControl("job"),
        on_progress=reports.append,
        precision="float32",
    )
    return result, {"stems": {k: np.load(v) for k, v in result.stems.items()}, "reports": reports}


def test_the_lead_is_built_in_the_background_then_adopted_and_runs_as_eager_does(
    hybrid_recipe_repo: Path, tmp_path: Path
) -> None:
    require_compiler()
    cache = tmp_path / "compiled"
    client = WorkerClient("cpu", precision="float32", compiling=CompileSettings("on", cache))
    try:
        demucs = client.ensure_model("htdemucs_ft", str(hybrid_recipe_repo)).compiled
        assert demucs["state"] == "unavailable", demucs  # the only build is the lead's
        source = mix(tmp_path)
        first, eager = separate(client, hybrid_recipe_repo, source, tmp_path / "first")
        lead = first.lead_compiled
        assert lead is not None and lead["state"] == "building" and lead["used"] is False, lead
        assert client.builder is not None
        building = client.builder.info()
        assert building is not None and building["model"] == ROFORMER
        assert client.info()["lead_compiled"]["build"]["pid"] > 0
        ended = wait_for(
            lambda: client.builder.result(lead["key"]), BUILD_TIMEOUT, "the RoFormer's compile"
        )
        assert ended["ok"], ended
        cancel_while_measured_is_not_a_verdict(hybrid_recipe_repo, cache)

        second, compiled = separate(client, hybrid_recipe_repo, source, tmp_path / "second")
        lead = second.lead_compiled
        assert lead is not None and lead["state"] == "used" and lead["used"] is True, lead
        assert lead["speedup"] > 0 and lead["compile_seconds"] > 0, lead
        assert client.info()["lead_compiled"]["state"] == "used"
        assert second.made_by["vocals"] == ROFORMER
        # the compiled RoFormer's stems are the eager one's, to float rounding
        for stem, samples in eager["stems"].items():
            np.testing.assert_allclose(compiled["stems"][stem], samples, atol=1e-5)
        # measuring it beat the watch at each call of a part (5 parts, 4 passes), before
        # the song's own progress began
        assert compiled["reports"][: 5 * 4] == [0.0] * (5 * 4), compiled["reports"][:30]
        # progress still comes from inside each chunk (hooks on its transformers)
        inside = [v for v in compiled["reports"] if 0 < v < 0.5]
        assert len(inside) >= len([v for v in eager["reports"] if 0 < v < 0.5]) > 0
    finally:
        client.close()
    # a restarted worker runs it from its first song: the verdict is kept, so it is only
    # warmed up (one pass, beating the watch), not measured again
    client = WorkerClient("cpu", precision="float32", compiling=CompileSettings("on", cache))
    try:
        third, again = separate(client, hybrid_recipe_repo, source, tmp_path / "third")
        assert third.lead_compiled is not None and third.lead_compiled["used"] is True
        assert again["reports"][:5] == [0.0] * 5 and again["reports"][5] != 0.0, again["reports"]
        np.testing.assert_allclose(again["stems"]["vocals"], compiled["stems"]["vocals"])
    finally:
        client.close()


def test_the_service_names_the_compiled_lead_in_the_manifest_and_status(
    hybrid_recipe_repo: Path, service_factory, tmp_path: Path
) -> None:
    require_compiler()
    data = config_data(
        tmp_path,
        hybrid_recipe_repo,
        separation={"recipe": "best", "compile": "on", "precision": "float32"},
    )
    data["output"].update(format="wav", bit_depth=32)
    settings = settings_from_dict(data, source=tmp_path / "stemdeck.toml")
    service, jobs = service_factory(settings)
    recipes = []
    for n in range(2):
        write_song(settings.paths.inbox / f"Song{n}.wav", 2.0, seed=n)
        job = jobs.wait_final(n + 1)[-1]
        assert job.state is JobState.DONE, job.error
        recipes.append(read_manifest(Path(job.output or ""))["recipe"])
        if n == 0:  # the first song asked for the build: the next adopts it once built
            wait_for(
                lambda: list((settings.paths.state / "compiled").glob("*/entry.json")),
                BUILD_TIMEOUT,
                "the RoFormer's compile",
            )
    assert recipes[0]["compiled"]["state"] == "building", recipes[0]
    assert recipes[0]["compiled"]["used"] is False
    assert recipes[1]["compiled"]["state"] == "used" and recipes[1]["compiled"]["used"], recipes
    assert recipes[1]["vocals"] == ROFORMER
    snapshot = service.scheduler.snapshot()
    assert snapshot["worker"]["lead_compiled"]["state"] == "used"
    assert "compiled lead: used — compiled: " in render(snapshot)


class Cancelled(Exception):
    pass


def cancel_while_measured_is_not_a_verdict(repo: Path, cache: Path) -> None:
    """A cancel said through the watch's beat while the build is measured (as a Ray worker's
    progress says one) is the song's: it goes up, and no verdict is kept for the build."""
    torch = pytest.importorskip("torch")
    import tqdm

    from stemdeck_watch.workers.compiled.cache import CompileCache
    from stemdeck_watch.workers.compiled.model import CompiledSlot
    from stemdeck_watch.workers.demucs.precision import threads_for
    from stemdeck_watch.workers.recipe import load_lead

    def cancel() -> None:
        raise Cancelled

    threads, monitor = torch.get_num_threads(), tqdm.tqdm.monitor_interval
    torch.set_num_threads(threads_for(0))  # the worker's: the build's key holds it
    tqdm.tqdm.monitor_interval = 0  # no thread of tqdm's left behind by the compiled code
    try:
        lead = load_lead(ROFORMER, str(repo), "cpu")
        slot = CompiledSlot("on", CompileCache(cache), "cpu")
        with pytest.raises(Cancelled):
            slot.refresh(lead.module, ROFORMER, "float32", cancel)
    finally:
        torch.set_num_threads(threads)
        tqdm.tqdm.monitor_interval = monitor
    assert slot.state not in ("used", "not used", "failed"), slot.to_dict()
    assert not list(cache.glob("*.verdict.json"))
