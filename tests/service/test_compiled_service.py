"""The compiled model through the whole service (tiny model, float32, `compile = "on"`): a
service that starts with it built runs its first song compiled, names it in `status`,
`status --json` and every manifest, and `doctor` reports it and builds nothing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import tomli_w

from stemdeck_watch.cli.status import render
from stemdeck_watch.stages.manifest import read_manifest
from stemdeck_watch.util.synth import write_song

from support.compiled import BuiltCompile
from support.helpers import config_data, wait_for

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(sys.platform != "linux", reason="Inductor's CPU compile, tried on Linux"),
]
COMPILED = {"precision": "float32", "compile": "on"}


def drop(settings: Any, name: str, seed: int) -> Path:
    staged = write_song(settings.paths.inbox.parent / "staging" / name, 4.0, seed=seed)
    return staged.rename(settings.paths.inbox / name)


def test_every_song_runs_compiled_from_the_first_and_every_surface_names_it(
    make_settings: Any, service_factory: Any, compiled_tiny: BuiltCompile
) -> None:
    settings = make_settings(separation=COMPILED)
    compiled_tiny.copy_to(settings.paths.state)
    service, _ = service_factory(settings)
    for n in range(2):
        drop(settings, f"song{n}.wav", seed=n)
        folder = wait_for(
            lambda n=n: (
                (settings.paths.outbox / f"song{n}").is_dir() and settings.paths.outbox / f"song{n}"
            ),
            180,
            f"song{n} to be published",
        )
        compiled = read_manifest(folder)["compiled"]
        assert compiled["state"] == "used" and compiled["used"] is True, compiled
        assert compiled["key"] == compiled_tiny.key and compiled["speedup"] > 0
    snapshot = service.scheduler.snapshot()
    assert snapshot["worker"]["compiled"]["state"] == "used"
    assert "compiled: used — compiled:" in render(snapshot)


def test_doctor_reports_it_and_builds_nothing(
    tmp_path: Path, model_repo: Path, compiled_tiny: BuiltCompile
) -> None:
    config = tmp_path / "stemdeck.toml"
    config.write_text(tomli_w.dumps(config_data(tmp_path, model_repo, separation=COMPILED)))

    def doctor() -> str:
        result = subprocess.run(
            [sys.executable, "-m", "stemdeck_watch", "--config", str(config), "doctor"],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert result.returncode == 0, result.stdout + result.stderr
        return result.stdout

    out = doctor()
    assert "[ok  ] model tiny compiled: not built yet: `run` builds it in the background" in out
    assert not any((tmp_path / "state" / "compiled").glob("*")), "doctor built nothing"
    compiled_tiny.copy_to(tmp_path / "state")
    out = doctor()
    assert "model tiny compiled: used — compiled: " in out and "loaded from the cache in" in out
