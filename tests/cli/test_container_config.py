"""The container's first config (`python -m stemdeck_watch.cli.container`, run by the image's
entrypoint): the image's volumes, nothing that needs a desktop, a queue that starts again by
itself after a restart — and the owner's own file, or anything else with that name, never
replaced."""

from __future__ import annotations

import os
from pathlib import Path

from stemdeck_watch.cli.container import FOLDERS, main, write_first_config
from stemdeck_watch.core.config import load_settings


def test_the_first_config_points_at_the_volumes_and_needs_no_desktop(tmp_path: Path):
    path = tmp_path / "config" / "stemdeck.toml"
    assert write_first_config(path)
    settings = load_settings(path)
    assert {name: str(getattr(settings.paths, name)) for name in FOLDERS} == FOLDERS
    assert settings.tray.enabled is False and settings.notify.urls == ()
    assert settings.queue.start_paused_after_restore is False
    assert [p.name for p in path.parent.iterdir()] == ["stemdeck.toml"]  # no temporary left


def test_an_existing_config_or_a_link_is_left_as_it_is(tmp_path: Path, capsys):
    path = tmp_path / "stemdeck.toml"
    path.write_text('[separation]\nmodel_repo = "/repo"\nmodel = "mine"\n')
    assert main([str(path)]) == 0  # model_repo: no download either
    assert path.read_text().endswith('model = "mine"\n')
    assert "wrote" not in capsys.readouterr().out
    link = tmp_path / "linked.toml"
    os.symlink(tmp_path / "elsewhere.toml", link)
    assert not write_first_config(link)
    assert not (tmp_path / "elsewhere.toml").exists()
