"""The container's first config (`python -m stemdeck_watch.cli.container`, run by the image's
entrypoint): the image's volumes, nothing that needs a desktop, a queue that starts again by
itself after a restart, the page for other devices over HTTPS at the port compose publishes —
and the owner's own file, or anything else with that name, never replaced. The page's
password and names come from the container's environment; without a password the page stays
on loopback and the log says how to set one."""

from __future__ import annotations

import io
import os
import stat
from pathlib import Path

import pytest

from stemdeck_watch.cli.container import (
    FOLDERS,
    PAGE_LOCAL,
    PAGE_PORT,
    apply_environment,
    main,
    page_needs_password,
    password_from,
    write_first_config,
)
from stemdeck_watch.core.config import load_settings
from stemdeck_watch.core.errors import ConfigError
from stemdeck_watch.util.passwords import verify_password

PASSWORD = "couch potato 42"


def test_the_first_config_points_at_the_volumes_and_needs_no_desktop(tmp_path: Path):
    path = tmp_path / "config" / "stemdeck.toml"
    assert write_first_config(path)
    settings = load_settings(path)
    assert {name: str(getattr(settings.paths, name)) for name in FOLDERS} == FOLDERS
    assert settings.tray.enabled is False and settings.notify.urls == ()
    assert settings.queue.start_paused_after_restore is False
    assert (settings.api.host, settings.api.port, settings.api.https) == (
        "0.0.0.0",
        PAGE_PORT,
        True,
    )
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


def test_the_password_from_a_secret_is_stored_as_its_hash_and_the_hosts_as_listed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
):
    path = tmp_path / "stemdeck.toml"
    write_first_config(path)
    text = path.read_text().replace("[api]\n", "[api]\n# the phone's port\n")
    path.write_text(text.replace("hosts = []", 'hosts = [\n    "old.local",\n]'))
    secret = tmp_path / "secret"
    secret.write_text(PASSWORD + "\n")
    for name in ("PASSWORD", "PASSWORD_FILE", "FILE__PASSWORD", "STEMDECK_HOSTS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PASSWORD_FILE", str(secret))
    monkeypatch.setenv("STEMDECK_HOSTS", "NAS.local, 192.168.1.20 music.example.org")
    path.write_text(path.read_text().replace('model_repo = ""', 'model_repo = "/repo"'))
    assert main([str(path)]) == 0  # a password: the page as configured
    text = path.read_text()
    assert 'model_repo = "/repo"' in text  # no download in this test
    assert PASSWORD not in text and PASSWORD not in capsys.readouterr().err
    assert "# the phone's port\n" in text  # the owner's file, edited, not rewritten
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    api = load_settings(path).api
    assert verify_password(PASSWORD, api.password_hash)
    assert api.hosts == ("nas.local", "192.168.1.20", "music.example.org")

    assert main([str(path)]) == 0  # the same again: the file untouched
    assert path.read_text() == text
    monkeypatch.setenv("STEMDECK_HOSTS", "nas.local")
    secret.write_text("a new password")  # the variable is the password while it is set
    assert main([str(path)]) == 0
    api = load_settings(path).api
    assert verify_password("a new password", api.password_hash) and api.hosts == ("nas.local",)
    assert path.read_text().count("hosts = ") == 1


def test_a_password_variable_that_cannot_be_used_is_named_and_nothing_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    path = tmp_path / "stemdeck.toml"
    write_first_config(path)
    settings = load_settings(path)
    before = path.read_text()
    for environ, words in (
        ({"PASSWORD_FILE": str(tmp_path / "absent")}, "PASSWORD_FILE="),
        ({"FILE__PASSWORD": str(tmp_path)}, "FILE__PASSWORD="),
        ({"PASSWORD": "short"}, "PASSWORD: the password must have at least 8"),
        ({"STEMDECK_HOSTS": "https://nas.local/"}, "STEMDECK_HOSTS="),
    ):
        with pytest.raises(ConfigError, match=words):
            apply_environment(path, settings, environ, io.StringIO())
    assert path.read_text() == before
    assert password_from({}) is None and password_from({"PASSWORD": ""}) is None
    secret = tmp_path / "secret"
    secret.write_text(PASSWORD)
    given = {"PASSWORD_FILE": str(secret), "PASSWORD": "another one"}
    assert password_from(given) == (PASSWORD, "PASSWORD_FILE")  # the secret first


def test_with_no_password_the_page_stays_on_loopback_and_the_log_says_how_to_set_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
):
    path = tmp_path / "stemdeck.toml"
    write_first_config(path)
    path.write_text(path.read_text().replace('model_repo = ""', 'model_repo = "/repo"'))
    for name in ("PASSWORD", "PASSWORD_FILE", "FILE__PASSWORD", "STEMDECK_HOSTS"):
        monkeypatch.delenv(name, raising=False)
    assert main([str(path)]) == PAGE_LOCAL
    said = capsys.readouterr().err
    assert "docker exec -it stemdeck stemdeck-entrypoint password" in said
    assert "PASSWORD_FILE" in said and "restart" in said
    local = tmp_path / "local.toml"
    local.write_text('[api]\nhost = "127.0.0.1"\n')
    assert not page_needs_password(load_settings(local), io.StringIO())
