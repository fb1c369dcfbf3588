"""stemdeck.toml → settings: defaults, validation messages, presets, `config init`."""

from __future__ import annotations

import subprocess
import sys

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib
from pathlib import Path

import pytest

from stemdeck_watch.cli.main import main
from stemdeck_watch.core.config import (
    default_toml,
    load_settings,
    settings_from_dict,
    write_default_config,
)
from stemdeck_watch.core.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]


def test_defaults_match_the_design_contract() -> None:
    settings = settings_from_dict({})
    assert settings.watch.mode == "auto"
    assert settings.queue.max_pending_files == 20
    assert settings.queue.max_pending_links == 200
    assert settings.queue.resume_attempts == 1
    assert settings.queue.start_paused_after_restore is True
    assert settings.separation.model == "htdemucs"
    assert settings.output.format == "wav"
    assert settings.links.max_filesize == 500 * 1024 * 1024
    assert settings.tray.enabled == "auto"
    assert "mp3" in settings.watch.extensions and "mkv" in settings.watch.extensions


def test_repository_stemdeck_toml_is_the_documented_default() -> None:
    with open(REPO / "stemdeck.toml", "rb") as handle:
        data = tomllib.load(handle)
    assert data == default_toml()


def test_unknown_key_names_the_key_and_suggests_the_right_one() -> None:
    with pytest.raises(ConfigError) as info:
        settings_from_dict({"watch": {"setle_seconds": 2}})
    message = str(info.value)
    assert "watch.setle_seconds" in message and "settle_seconds" in message
    with pytest.raises(ConfigError, match="unknown key colour"):
        settings_from_dict({"colour": {}})


@pytest.mark.parametrize(
    "data, words",
    [
        ({"watch": {"settle_seconds": -1}}, ["watch.settle_seconds = -1", "≥ 0.1"]),
        ({"watch": {"mode": "inotify"}}, ['watch.mode = "inotify"', '"auto", "native", "polling"']),
        ({"queue": {"max_pending_files": 2.5}}, ["queue.max_pending_files", "whole number"]),
        ({"separation": {"overlap": 1.0}}, ["separation.overlap = 1", "< 1"]),
        ({"output": {"bit_depth": 20}}, ["output.bit_depth = 20", "16, 24, 32"]),
        ({"output": {"layout": "../{stem}.{ext}"}}, ["output.layout", "{stem}"]),
        ({"output": {"layout": "{track}.{ext}"}}, ["output.layout"]),
        # a name no DAW project could hold (XML forbids U+FFFF even escaped)
        ({"output": {"layout": "{stem}\uffff.{ext}"}}, ["output.layout"]),
        ({"output": {"mixes": {"instrumental": []}}}, ["output.mixes"]),
        ({"tray": {"enabled": 1}}, ["tray.enabled = 1", 'true, false, "auto"']),
        ({"watch": {"recursive": "yes"}}, ['watch.recursive = "yes"', "true or false"]),
        ({"links": {"max_filesize": "lots"}}, ['links.max_filesize = "lots"', "500MB"]),
        (
            {"presets": {"karaoke": {"two_stem": "vocals"}}},
            ["presets.karaoke.two_stem", "two_stems"],
        ),
        ({"presets": {"a/b": {}}}, ["presets.a/b", "folder name"]),
        ({"output": {"format": "flac", "bit_depth": 32}}, ["output.bit_depth = 32", "flac"]),
        # TOML has nan and inf: every bound passes a nan, so they are refused as such
        ({"separation": {"overlap": float("nan")}}, ["separation.overlap = nan", "not nan"]),
        ({"separation": {"segment": float("inf")}}, ["separation.segment = inf", "≤ 3600"]),
        ({"output": {"practice_speeds": [float("nan")]}}, ["output.practice_speeds = [nan]"]),
        # a mix named like a stem would be written over it (or it over the mix)
        ({"output": {"mixes": {"Drums": ["drums", "bass"]}}}, ["output.mixes.Drums", "stem"]),
        ({"output": {"mixes": {"-vocals": ["drums"]}}}, ["bad mix name '-vocals'"]),
        (
            {"separation": {"two_stems": "vocals"}, "output": {"mixes": {"no_vocals": ["bass"]}}},
            ["output.mixes.no_vocals", "stem"],
        ),
    ],
)
def test_bad_values_name_key_value_and_what_is_allowed(data: dict, words: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        settings_from_dict(data)
    for word in words:
        assert word in str(info.value)


def test_folders_must_not_overlap_the_inbox(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="folders.outbox .* overlaps folders.inbox"):
        settings_from_dict(
            {"folders": {"inbox": str(tmp_path / "in"), "outbox": str(tmp_path / "in" / "out")}}
        )


def test_relative_folders_are_relative_to_the_config_file(tmp_path: Path) -> None:
    config = tmp_path / "conf" / "stemdeck.toml"
    config.parent.mkdir()
    config.write_text('[folders]\ninbox = "songs"\nstate = "st"\n')
    settings = load_settings(config)
    assert settings.paths.inbox == (tmp_path / "conf" / "songs").resolve()
    assert settings.paths.state == (tmp_path / "conf" / "st").resolve()


def test_presets_override_separation_and_output() -> None:
    settings = settings_from_dict(
        {
            "presets": {
                "karaoke": {"two_stems": "vocals"},
                "six": {"model": "htdemucs_6s", "format": "flac"},
            }
        }
    )
    sep, out = settings.for_preset("karaoke")
    assert sep.two_stems == "vocals" and sep.model == "htdemucs"
    sep, out = settings.for_preset("six")
    assert sep.model == "htdemucs_6s" and out.format == "flac" and sep.two_stems == ""
    assert settings.for_preset(None) == (settings.separation, settings.output)


def test_config_init_writes_a_complete_loadable_file(tmp_path: Path) -> None:
    path = tmp_path / "stemdeck.toml"
    assert main(["config", "init", str(path)]) == 0
    with open(path, "rb") as handle:
        assert tomllib.load(handle) == default_toml()
    assert load_settings(path).separation.model == "htdemucs"
    assert main(["config", "init", str(path)]) == 1  # never overwrites without --force
    assert main(["config", "init", str(path), "--force"]) == 0


def test_bad_config_exits_2_with_the_message(tmp_path: Path) -> None:
    path = tmp_path / "stemdeck.toml"
    path.write_text("[watch]\nsettle_seconds = 0\n")
    result = subprocess.run(
        [sys.executable, "-m", "stemdeck_watch", "--config", str(path), "status"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2
    assert "watch.settle_seconds = 0 is not allowed" in result.stderr
    path.write_text("[watch\n")
    result = subprocess.run(
        [sys.executable, "-m", "stemdeck_watch", "status", "--config", str(path)],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2 and "could not parse config" in result.stderr


def test_write_default_config_refuses_to_overwrite(tmp_path: Path) -> None:
    path = write_default_config(tmp_path / "x.toml")
    with pytest.raises(FileExistsError):
        write_default_config(path)


@pytest.mark.parametrize(
    "example", sorted((REPO / "examples").glob("*.toml")), ids=lambda p: p.name
)
def test_example_configs_are_valid(example: Path) -> None:
    settings = load_settings(example)
    assert settings.source == example


def test_a_model_is_a_plain_name_never_a_url_a_scheme_or_a_path() -> None:
    """demucs fetches an `hf://` name from HuggingFace before it looks at any repo: the
    config names models by plain name only, as the worker loads them."""
    for model in ("hf://someone/htdemucs", "https://x.example/m", "../m", "a/b"):
        with pytest.raises(ConfigError, match="never a URL, a scheme such as hf:// or a path"):
            settings_from_dict({"separation": {"model": model}})
    assert settings_from_dict({"separation": {"model": "955717e8"}}).separation.model
