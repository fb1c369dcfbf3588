"""The layout template and stem names are checked when the config loads, not mid-job."""

from __future__ import annotations

from pathlib import Path

import pytest

from stemdeck_watch.core.config import settings_from_dict
from stemdeck_watch.core.errors import ConfigError, PublishError
from stemdeck_watch.stages.naming import stem_file


@pytest.mark.parametrize(
    "layout",
    [
        "../{stem}.{ext}",
        "{stem}/../../{name}.{ext}",
        "/tmp/{stem}.{ext}",
        "C:{stem}.{ext}",
        "..\\{stem}.{ext}",
        "{stem.__class__}.{ext}",
        "{name[0]}/{stem}.{ext}",
        "{stem!r}.{ext}",
        "{title:>300}{stem}.{ext}",
        "{home}/{stem}.{ext}",
        "{name}.{ext}",
        "{stem}\n.{ext}",
        "{}{stem}",
        "{0}{stem}",
        "{stem",
    ],
    ids=lambda s: repr(s),
)
def test_escape_attempts_and_bad_templates_are_refused_at_config_load(layout: str) -> None:
    with pytest.raises(
        ConfigError,
        match=r"(?s)output.layout = .* is not allowed: expected a "
        r"relative file name template with \{stem\}",
    ):
        settings_from_dict({"output": {"layout": layout}})


def test_escapes_are_refused_in_presets_too() -> None:
    with pytest.raises(ConfigError, match=r"presets.odd.layout = "):
        settings_from_dict({"presets": {"odd": {"layout": "../../{stem}.{ext}"}}})


@pytest.mark.parametrize(
    "layout",
    [
        "{stem}.{ext}",
        "{artist}/{album}/{title} - {stem}.{ext}",
        "{preset}/{name} {stem}.{ext}",
        "{stem}_{model}.{ext}",
        "stems/{stem}.{ext}",
    ],
)
def test_good_templates_load(layout: str) -> None:
    assert settings_from_dict({"output": {"layout": layout}}).output.layout == layout


def test_a_name_outside_the_folder_is_refused_at_publish_too(tmp_path: Path) -> None:
    """The second guard, for a template that reached publish some other way."""
    with pytest.raises(PublishError, match="outside the song folder"):
        stem_file("../{stem}.wav", "vocals", {}, tmp_path)


def test_unknown_stems_of_a_known_model_are_a_config_error_listing_its_stems() -> None:
    with pytest.raises(
        ConfigError,
        match=r'two_stems = "guitar" is not a stem of the model '
        r'"htdemucs"; its stems are drums, bass, other, vocals',
    ):
        settings_from_dict({"separation": {"two_stems": "guitar"}})
    with pytest.raises(
        ConfigError,
        match=r'output.mixes.band names "piano", which the model '
        r'"htdemucs" does not separate',
    ):
        settings_from_dict({"output": {"mixes": {"band": ["drums", "piano"]}}})
    six = {
        "separation": {"model": "htdemucs_6s", "two_stems": "guitar"},
        "output": {"mixes": {"band": ["drums", "bass", "piano"]}},
    }
    assert settings_from_dict(six).separation.two_stems == "guitar"
    with pytest.raises(
        ConfigError,
        match=r"presets.karaoke: .*drums, bass, other, vocals, "
        r"guitar, piano",
    ):
        settings_from_dict(
            {"separation": {"model": "htdemucs_6s"}, "presets": {"karaoke": {"two_stems": "voice"}}}
        )
    # a local model's stems are only known when it is loaded: checked at publish instead
    assert settings_from_dict({"separation": {"model": "tiny", "two_stems": "guitar"}})
