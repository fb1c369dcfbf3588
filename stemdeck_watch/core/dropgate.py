"""The one gate for what a file dropped into the inbox may choose (docs: Trust boundaries).

Anyone who can write the synced inbox can drop a song with a name tag (`Song [6s].mp3`) or
a sidecar (`Song.mp3.stemdeck.toml`). That is a partly trusted peer, not the owner: what it
chooses is held to the drop's own allow-list and bounds, tighter than the owner's config
(which may go further, for its own songs):

- keys: a song's own [separation] and [output] keys, never where models load from
  (`model_repo`, `model_hub`) nor how the machine copes with every song (`threads`,
  `stall_seconds`, `fallback_device`, `compile`, …);
- the model: a name demucs itself defines (htdemucs, htdemucs_ft, mdx_extra, …) or one the
  owner configured (`separation.model`, a preset's); with a `model_repo` configured, any
  plain name, which loads from that folder only. Never a URL, a scheme such as `hf://` or
  a path: a model file is code the worker runs;
- a recipe (`recipe`, `[best]`): a name from core/recipes.py only, whose models are the
  catalogue's; never a checkpoint, a URL or a folder;
- the work and room one song may take: `segment` within the model's own, `shifts` and
  `overlap` capped, lists (practice speeds, mixes) short, text short, tables shallow.

`check_values` checks each drop's keys and values as it is read, `check_song` what they make
together once the song's settings are merged; both raise ConfigError naming the key and what
is allowed, which core/choices.py turns into the song's failure naming the tag or sidecar.
"""

from __future__ import annotations

from typing import Any, Mapping

from stemdeck_watch.core.config import (
    MACHINE_KEYS,
    OWNER_ONLY,
    SeparationSettings,
    Settings,
    check_overrides,
)
from stemdeck_watch.core.errors import ConfigError
from stemdeck_watch.core.recipes import KNOWN as RECIPES
from stemdeck_watch.util.validators import MODEL_NAME, MODEL_SEGMENT, MODEL_STEMS, show

# Keys a drop never sets: where model files come from (code the worker loads), and how the
# machine copes with every song (the worker's threads, the stall watchdog, the fallback)
DROP_BARRED = OWNER_ONLY | MACHINE_KEYS | {"threads"}
MAX_SHIFTS = 5  # random-shift passes: each is a whole separation again
MAX_OVERLAP = 0.5  # 0.5 computes each frame twice; 0.99 a hundred times
OTHER_SEGMENT = 10.0  # seconds: for a model demucs does not define (demucs's own default)
MAX_ITEMS = 8  # entries of a list or table (practice speeds, mixes, a mix's stems)
MAX_TEXT = 200  # characters of a text value (a layout, a stem name)
MAX_DEPTH = 3  # nesting: a table of lists of text (mixes) is the deepest a song's key goes


def check_values(values: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The keys and values one drop (a sidecar, a name's tags) sets, checked as the config
    checks them and then against the drop's own bounds; `where` prefixes the key in an
    error ("Song.mp3.stemdeck.toml: "). Returns the normalised values."""
    for k, v in values.items():
        if not _shallow(v, MAX_DEPTH):
            raise ConfigError(
                f"{where}{k} is nested deeper than a song's setting goes ({MAX_DEPTH} levels)"
            )
        if k in DROP_BARRED - OWNER_ONLY:
            raise ConfigError(
                f"{where}{k} cannot be chosen by a file in the inbox: it says how this "
                f"machine copes with every song; set it in the config file or a preset"
            )
    checked = check_overrides(values, where, dropped=True)
    for k, v in checked.items():
        _check_bounds(k, v, where)
    return checked


def check_song(
    sep: SeparationSettings,
    origins: Mapping[str, str],
    settings: Settings,
    preset: str | None,
) -> None:
    """What a song's drop chose, merged with the config and the preset (`sep`; `origins`:
    key → where it came from, "config", "preset x", "sidecar …", "name tag […]"): a model
    from the allow-list, a segment within that model's own. The output keys need nothing
    of each other here: each is bounded alone. ConfigError names the origin."""
    model_from = origins.get("model", "config")
    if is_dropped(model_from) and not model_allowed(sep.model, settings, preset):
        raise ConfigError(
            f"model = {show(sep.model)} (chosen by the {model_from}) is not a model a file "
            f"in the inbox may choose: {allowed_models_text(settings, preset)}"
        )
    segment_from = origins.get("segment", "config")
    if is_dropped(segment_from) and sep.segment:
        own = own_segment(sep.model)
        if sep.segment > own:
            raise ConfigError(
                f"segment = {sep.segment:g} (chosen by the {segment_from}) is longer than "
                f"the model {show(sep.model)}'s own segment: a file in the inbox may choose "
                f"0 (the model's own) up to {own:g} seconds"
            )


def model_allowed(name: str, settings: Settings, preset: str | None) -> bool:
    """Whether a drop may choose the model `name` for a song in `preset`'s folder: a plain
    name that demucs defines, that the owner configured, or (with a model_repo configured)
    that loads from the owner's folder alone."""
    if not MODEL_NAME.fullmatch(name) or ".." in name:
        return False
    if name in MODEL_STEMS or name in owner_models(settings):
        return True
    overrides = settings.presets.get(preset or "", {})
    return bool(overrides.get("model_repo", settings.separation.model_repo))


def owner_models(settings: Settings) -> frozenset[str]:
    """The models the owner's config names: `separation.model` and every preset's."""
    named = {settings.separation.model}
    named.update(
        str(overrides["model"]) for overrides in settings.presets.values() if "model" in overrides
    )
    return frozenset(named)


def allowed_models_text(settings: Settings, preset: str | None) -> str:
    """What a drop may choose as its model, for an error message."""
    names = sorted(set(MODEL_STEMS) | owner_models(settings))
    text = f"one of {', '.join(names)}"
    overrides = settings.presets.get(preset or "", {})
    if overrides.get("model_repo", settings.separation.model_repo):
        text += ", or the name of a model in separation.model_repo"
    return text + " (never a URL, a scheme such as hf:// or a path)"


def own_segment(model: str) -> float:
    """The longest segment (seconds) a drop may choose for `model`: its own."""
    return MODEL_SEGMENT.get(model, OTHER_SEGMENT)


def is_dropped(origin: str) -> bool:
    """Whether a setting's origin is a file in the inbox (a sidecar or a name tag)."""
    return origin.startswith(("sidecar ", "name tag "))


def _check_bounds(key: str, value: Any, where: str) -> None:
    if key == "recipe" and value and value not in RECIPES:
        raise ConfigError(
            f"{where}recipe = {show(value)} is not a recipe: a file in the inbox may choose "
            f"one of {', '.join(RECIPES)}"
        )
    if key == "shifts" and value > MAX_SHIFTS:
        raise ConfigError(
            f"{where}shifts = {value} is more than a file in the inbox may choose: 0 to "
            f"{MAX_SHIFTS} (each shift is another whole separation); the config file may "
            f"set more"
        )
    if key == "overlap" and value > MAX_OVERLAP:
        raise ConfigError(
            f"{where}overlap = {value:g} is more than a file in the inbox may choose: 0 to "
            f"{MAX_OVERLAP:g}; the config file may set more"
        )
    if key == "segment" and value > max(MODEL_SEGMENT.values()):
        raise ConfigError(
            f"{where}segment = {value:g} is longer than any model's own segment: a file in "
            f"the inbox may choose 0 (the model's own) up to the model's own "
            f"({', '.join(sorted({f'{s:g} s' for s in MODEL_SEGMENT.values()}))} for the "
            f"models demucs defines, {OTHER_SEGMENT:g} s for others)"
        )
    items = [value] if isinstance(value, str) else list(_texts(value))
    if any(len(text) > MAX_TEXT for text in items):
        raise ConfigError(
            f"{where}{key} holds a text longer than {MAX_TEXT} characters, more than a "
            f"file in the inbox may choose"
        )
    sizes = [len(value)] if isinstance(value, (tuple, list, dict)) else []
    if isinstance(value, dict):
        sizes += [len(v) for v in value.values() if isinstance(v, (tuple, list))]
    if any(size > MAX_ITEMS for size in sizes):
        raise ConfigError(
            f"{where}{key} lists {max(sizes)} entries; a file in the inbox may choose at "
            f"most {MAX_ITEMS} (each is more work and room for this one song)"
        )


def _texts(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [t for k, v in value.items() for t in (str(k), *_texts(v))]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _texts(v)]
    return []


def _shallow(value: Any, depth: int) -> bool:
    """Whether `value` nests no deeper than `depth` (without recursion: a table 3,000 deep
    must not exhaust the stack of whoever looks at it)."""
    todo = [(value, 1)]
    while todo:
        item, level = todo.pop()
        if isinstance(item, (dict, list, tuple)):
            if level > depth:
                return False
            todo.extend((v, level + 1) for v in (item.values() if isinstance(item, dict) else item))
    return True
