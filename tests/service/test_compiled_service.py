"""The compiled model through the whole service (tiny model, float32, `compile = "on"`): the
songs go on while it loads, it is named in `status`, `status --json` and every manifest, and
`doctor` reports it and builds nothing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import tomli_w

from stemdeck_watch.cli.status import render
from stemdeck_watch.stages.publish import read_manifest
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


def test_songs_go_on_while_it_loads_and_every_surface_names_it(
    make_settings: Any, service_factory: Any, compiled_tiny: BuiltCompile
) -> None:
    settings = make_settings(separation=COMPILED)
    compiled_tiny.copy_to(settings.paths.state)
    service, _ = service_factory(settings)
    manifests = []
    for n in range(3):
        drop(settings, f"song{n}.wav", seed=n)
        folder = wait_for(
            lambda n=n: (
                (settings.paths.outbox / f"song{n}").is_dir() and settings.paths.outbox / f"song{n}"
            ),
            180,
            f"song{n} to be published",
        )
        manifests.append(read_manifest(folder))
    states = [m["compiled"]["state"] for m in manifests]
    assert set(states) <= {"loading", "used"}, states
    for manifest in manifests:
        assert manifest["compiled"]["used"] == (manifest["compiled"]["state"] == "used")
        assert manifest["compiled"]["key"] == compiled_tiny.key
    wait_for(
        lambda: (
            service.client.ensure_model(
                "tiny", str(settings.model_repo), precision="float32"
            ).compiled["state"]
            == "used"
        ),
        180,
        "the worker to run compiled code",
    )
    drop(settings, "last.wav", seed=9)
    folder = wait_for(
        lambda: (settings.paths.outbox / "last").is_dir() and settings.paths.outbox / "last",
        180,
        "the last song to be published",
    )
    last = read_manifest(folder)
    assert last["compiled"]["used"] is True and last["compiled"]["speedup"] > 0
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
    assert "model tiny compiled: loading — loading from the cache (measured before" in out
