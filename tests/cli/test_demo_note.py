"""The demo's last words name the command as it was installed: a clone's `.venv` (what
`make demo` makes) is only mentioned when the demo runs from one. Each layout is laid out
on disk and the note is read from its real paths."""

from __future__ import annotations

import sys
from pathlib import Path

from stemdeck_watch.cli.demo import untrained_note

BIN = "Scripts" if sys.platform == "win32" else "bin"
NAME = "stemdeck-watch.exe" if sys.platform == "win32" else "stemdeck-watch"


def script_in(prefix: Path) -> Path:
    script = prefix / BIN / NAME
    script.parent.mkdir(parents=True)
    script.write_text("#!/bin/sh\n")
    script.chmod(0o755)
    return script


def test_a_wheel_in_a_virtual_environment_names_the_script_not_a_clone(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    script = script_in(venv)
    on_path = untrained_note(venv, path=str(script.parent), argv0=str(script))
    assert "stemdeck-watch doctor && stemdeck-watch run" in on_path
    assert ".venv" not in on_path and "clone" not in on_path and "make demo" not in on_path

    off_path = untrained_note(venv, path=str(tmp_path / "elsewhere"), argv0=str(script))
    assert f"{script} doctor && {script} run" in off_path and "not on PATH" in off_path
    assert ".venv" not in off_path and "clone" not in off_path
    # started as `python -m stemdeck_watch`: the script beside this Python is still it
    assert untrained_note(venv, path="", argv0=str(tmp_path / "__main__.py")) == off_path


def test_a_clones_venv_is_named_with_the_clones_folder(tmp_path: Path) -> None:
    clone = tmp_path / "stemdeck-watch"
    clone.mkdir()
    (clone / "pyproject.toml").write_text('[project]\nname = "stemdeck-watch"\n')
    script = script_in(clone / ".venv")
    note = untrained_note(clone / ".venv", path="", argv0=str(script))
    assert f".venv/{BIN}/{NAME} doctor && .venv/{BIN}/{NAME} run" in note
    assert f"in the clone's folder, {clone}" in note and "make demo" in note
    # an activated environment: the name is enough
    assert "stemdeck-watch doctor &&" in untrained_note(
        clone / ".venv", path=str(script.parent), argv0=str(script)
    )
    # a `.venv` that is not in this project's clone is just a virtual environment
    (clone / "pyproject.toml").write_text('[project]\nname = "something-else"\n')
    assert "clone's folder" not in untrained_note(clone / ".venv", path="", argv0=str(script))


def test_no_script_at_all_names_python_m(tmp_path: Path) -> None:
    python = tmp_path / "python3"
    note = untrained_note(tmp_path, path="", argv0="-c", executable=str(python))
    assert f"{python} -m stemdeck_watch doctor && {python} -m stemdeck_watch run" in note
    assert "clone" not in note and ".venv" not in note
