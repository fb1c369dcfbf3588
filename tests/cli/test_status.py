"""`status` when the registry is not what it should be: just created, or damaged."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest

from stemdeck_watch.cli import main as cli
from stemdeck_watch.store.registry import REGISTRY_FILE

from support.helpers import write_config


@pytest.fixture
def config_file(tmp_path: Path, model_repo: Path) -> Path:
    return write_config(tmp_path, model_repo)


def test_status_of_a_registry_created_a_moment_ago_says_no_jobs(settings, config_file, capsys):
    sqlite3.connect(settings.paths.state / REGISTRY_FILE).close()  # file there, no tables yet
    assert cli.main(["--config", str(config_file), "status"]) == 0
    out = capsys.readouterr().out
    assert "queued:  0" in out and "Traceback" not in out
    assert cli.main(["--config", str(config_file), "status", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["jobs"] == []


def test_status_of_a_damaged_registry_names_the_file_and_what_to_do(settings, config_file, capsys):
    path = settings.paths.state / REGISTRY_FILE
    path.write_bytes(b"this is not a database, it was cut off by a disk error" * 100)
    assert cli.main(["--config", str(config_file), "status"]) == 1
    err = capsys.readouterr().err
    assert str(path) in err and "damaged" in err and "move it aside" in err
    assert "Traceback" not in err
