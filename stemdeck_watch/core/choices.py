"""Choices made in the drop itself: a sidecar file or a short tag in the song's name.

A preset folder per combination of options is clumsy; a person who wants this one song as
six stems, or as vocals + the rest, says so where they drop it:

- a tag in the name, `Song [6s].mp3`, `Song [vocals, flac].mp3` (TAGS lists them): a
  bracketed group at the end of the name, in lower case. A group with capitals (`[Live]`,
  `[Official Video]`) or with no word that is or looks like a tag is part of the title;
- a sidecar `Song.mp3.stemdeck.toml` holding any keys a preset may set (`two_stems =
  "vocals"`, `format = "flac"`, …), read when the job starts.

A link file (`Song [vocals].url`, `Song.url.stemdeck.toml`) carries them the same way. The
song's settings are, from weakest to strongest: the config, the preset folder, the name's
tags, the sidecar. A bad tag or sidecar fails that song with a reason naming the tag or key;
the manifest records where each setting came from.
"""

from __future__ import annotations

import dataclasses
import difflib
import errno
import hashlib
import logging
import os
import re
import stat
import sys
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser, from PyPI
    import tomli as tomllib

from stemdeck_watch.core import dropgate
from stemdeck_watch.core.config import (
    OutputSettings,
    SeparationSettings,
    Settings,
    check_song_settings,
    with_recipe,
)
from stemdeck_watch.core.errors import ConfigError, FilesystemError, StageError
from stemdeck_watch.core.jobs import Job
from stemdeck_watch.core.paths import move_file
from stemdeck_watch.util.safefile import read_regular

log = logging.getLogger(__name__)

SIDECAR_SUFFIX = ".stemdeck.toml"
SIDECAR_LIMIT = 64 << 10  # bytes: a few keys; anything larger is not a sidecar
STEMS = ("vocals", "drums", "bass", "other", "guitar", "piano")
TAGS: dict[str, dict[str, Any]] = {
    "6s": {"model": "htdemucs_6s"},
    "ft": {"model": "htdemucs_ft"},
    **{stem: {"two_stems": stem} for stem in STEMS},
    **{fmt: {"format": fmt} for fmt in ("wav", "flac", "mp3")},
    "daw": {"session": ["dawproject", "reaper"]},
    "dj": {"stem_file": True},
    "practice": {"practice": True},
    "best": {"recipe": "best"},  # core/recipes.py
}
_GROUP = re.compile(r"\s*\[([^\[\]]*)\]\s*$")


class ChoiceError(StageError):
    """A tag in the name or a sidecar that cannot be used; the song fails, naming it."""

    stage = "reading its choices"


@dataclasses.dataclass(frozen=True)
class Chosen:
    separation: SeparationSettings
    output: OutputSettings
    origins: dict[str, str]  # "separation.model" → "config", "preset six", "name tag [6s]"…


def _tag_group(stem: str) -> tuple[str, list[str]] | None:
    """The name without its tag group and the group's words, or None if it has none."""
    match = _GROUP.search(stem)
    if not match or match.group(1) != match.group(1).lower():
        return None
    words = [w for w in re.split(r"[\s,+]+", match.group(1).strip()) if w]
    if not words or not any(w in TAGS or _guess(w) for w in words):
        return None
    return stem[: match.start()].rstrip() or stem, words


def _guess(word: str, cutoff: float = 0.75) -> str | None:
    """The tag `word` looks like: close enough to make its group a tag group (a typo), or
    with a lower cutoff, a hint in the error."""
    found = difflib.get_close_matches(word, list(TAGS), n=1, cutoff=cutoff)
    return found[0] if found else None


def song_name(stem: str) -> str:
    """The song's name without its tag group: `Song [6s]` → `Song` (the outbox folder)."""
    found = _tag_group(stem)
    return found[0] if found else stem


def name_choices(filename: str) -> dict[str, tuple[Any, str]]:
    """key → (value, origin) from the tags in a file name; ChoiceError for an unknown tag or
    two tags setting one key."""
    stem = filename.rsplit(".", 1)[0] if "." in filename.lstrip(".") else filename
    found = _tag_group(stem)
    if found is None:
        return {}
    chosen: dict[str, tuple[Any, str]] = {}
    for word in found[1]:
        if word not in TAGS:
            guess = _guess(word, cutoff=0.5)
            hint = f" (did you mean [{guess}]?)" if guess else ""
            raise ChoiceError(
                f"unknown tag [{word}] in the name {filename!r}{hint}; tags: "
                f"{', '.join(f'[{t}]' for t in TAGS)} — rename the file"
            )
        for key, value in TAGS[word].items():
            if key in chosen:
                raise ChoiceError(
                    f"the tags {chosen[key][1].split()[-1]} and [{word}] in the "
                    f"name {filename!r} both choose {key}; keep one"
                )
            chosen[key] = (value, f"name tag [{word}]")
    return chosen


def sidecar_of(source: Path) -> Path:
    return source.with_name(source.name + SIDECAR_SUFFIX)


def sidecar_choices(source: Path) -> dict[str, Any] | None:
    """The keys of `Song.mp3.stemdeck.toml` beside `source`, or None without one; read only
    if it is a plain file of bounded size (the inbox is shared)."""
    path = sidecar_of(source)
    if _lstat(path) is None:
        return None
    try:
        data = tomllib.loads(read_regular(path, SIDECAR_LIMIT).decode("utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise ChoiceError(str(FilesystemError("read", path, reason=exc))) from exc
    except tomllib.TOMLDecodeError as exc:
        raise ChoiceError(f"could not parse {path.name}: {exc}; fix or remove it") from exc
    except RecursionError:  # arrays or tables nested thousands deep: no song's setting
        raise ChoiceError(
            f"could not parse {path.name}: it nests tables or arrays thousands deep, "
            f"deeper than any setting goes; fix or remove it"
        ) from None
    return data


def for_job(settings: Settings, job: Job) -> Chosen:
    """The job's separation and output settings — config, preset, name tags, sidecar — and
    where each came from. What the tags and the sidecar choose passes the drop's gate
    (core/dropgate.py). ChoiceError names the tag, the key or the file that is wrong."""
    source = Path(job.source)
    overrides: dict[str, Any] = {}
    origins: dict[str, str] = {}
    preset = settings.presets.get(job.preset or "", {})
    for key, value in preset.items():
        overrides[key], origins[key] = value, f"preset {job.preset}"
    tagged = name_choices(source.name)
    try:
        checked = dropgate.check_values({k: v for k, (v, _o) in tagged.items()}, "")
    except ConfigError as exc:
        raise ChoiceError(f"the name {source.name!r}: {exc}") from None
    for key, value in checked.items():
        overrides[key], origins[key] = value, tagged[key][1]
    sidecar = sidecar_choices(source)
    if sidecar is not None:
        name = sidecar_of(source).name
        try:
            checked = dropgate.check_values(sidecar, "")
        except ConfigError as exc:
            raise ChoiceError(f"{name}: {exc}; fix {name} or remove it") from None
        for key, value in checked.items():
            overrides[key], origins[key] = value, f"sidecar {name}"
    fields = {f.name for f in dataclasses.fields(SeparationSettings)}
    sep = dataclasses.replace(
        settings.separation, **{k: v for k, v in overrides.items() if k in fields}
    )
    out = dataclasses.replace(
        settings.output, **{k: v for k, v in overrides.items() if k not in fields}
    )
    if sep.recipe and _nearer(origins.get("model", "config"), origins.get("recipe", "config")):
        # a model chosen nearer the song than the recipe ([6s] under a recipe of the
        # config): that model alone separates it
        sep = dataclasses.replace(sep, recipe="")
        origins["recipe"] = origins["model"]
    elif sep.recipe and sep.model != with_recipe(sep).model:
        sep = with_recipe(sep)  # the recipe names the model: chosen where the recipe was
        origins["model"] = origins.get("recipe", "config")
    try:
        dropgate.check_song(sep, origins, settings, job.preset)
    except ConfigError as exc:
        raise ChoiceError(f"{source.name}: {exc}") from None
    try:
        check_song_settings(sep, out, f"{source.name}: ")
    except ConfigError as exc:
        raise ChoiceError(str(exc)) from None
    every = {
        f"separation.{f.name}": origins.get(f.name, "config")
        for f in dataclasses.fields(SeparationSettings)
    }
    every.update(
        {
            f"output.{f.name}": origins.get(f.name, "config")
            for f in dataclasses.fields(OutputSettings)
        }
    )
    return Chosen(sep, out, every)


_STRENGTH = ("config", "preset", "name tag", "sidecar")  # weakest first


def _nearer(origin: str, than: str) -> bool:
    """Whether a setting from `origin` is stronger than one from `than`."""

    def strength(where: str) -> int:
        return next((i for i, kind in enumerate(_STRENGTH) if where.startswith(kind)), 0)

    return strength(origin) > strength(than)


def separation_choices(settings: Settings, job: Job) -> str:
    """What the job's drop (a sidecar, a name's tags) chose for its separation, as a report
    names it ("segment = 7.8, shifts = 5 by the sidecar Song.wav.stemdeck.toml"), or "":
    a machine fault under such a song may be the song's own doing."""
    try:
        chosen = for_job(settings, job)
    except ChoiceError:
        return ""
    by: dict[str, list[str]] = {}
    for key, origin in chosen.origins.items():
        section, _, name = key.partition(".")
        if section == "separation" and dropgate.is_dropped(origin):
            value = getattr(chosen.separation, name)
            by.setdefault(origin, []).append(f"{name} = {value!r}")
    return "; ".join(f"{', '.join(keys)} by the {origin}" for origin, keys in by.items())


def settings_for(settings: Settings, job: Job) -> tuple[SeparationSettings, OutputSettings]:
    """The job's settings with its choices, for planning (work ahead, the disk check): where
    the choices cannot be used, the preset's settings (the job fails on them when it runs)."""
    try:
        chosen = for_job(settings, job)
    except ChoiceError:
        return settings.for_preset(job.preset)
    return chosen.separation, chosen.output


def _lstat(path: Path) -> os.stat_result | None:
    """The entry itself (a link is not followed), or None where there is none: also for a
    song whose name leaves no room for the suffix (the name would be too long)."""
    try:
        return os.lstat(path)
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ENAMETOOLONG, errno.ENOTDIR):
            return None
        raise ChoiceError(str(FilesystemError("read", path, reason=exc))) from exc


class _Any:
    """Whatever sidecar is beside the song (see move_sidecar)."""

    def __repr__(self) -> str:
        return "ANY"


ANY: Any = _Any()


def sidecar_digest(source: Path) -> str | None:
    """The sha256 of the sidecar beside `source` as it is now, or None without a (readable)
    one: what tells the sidecar a song's choices were read from from one put there later."""
    path = sidecar_of(source)
    try:
        if _lstat(path) is None:
            return None
        return hashlib.sha256(read_regular(path, SIDECAR_LIMIT)).hexdigest()
    except (OSError, ChoiceError):
        return None


def move_sidecar(source: Path, moved_to: Path, used: str | None = ANY) -> str | None:
    """Take the song's sidecar along to where the song went (processed/ or failed/), named
    after it there. `used`: the sha256 of the sidecar the song was separated with (None: it
    had none); a sidecar that is not that one (it came, or changed, after the song started)
    stays in the inbox, where a song dropped again beside it is separated with it. ANY: the
    sidecar goes with the song whatever it holds (a failed song, whose choices are fixed where
    it lies). Never under another name: the song's move left the sidecar's name free (see
    `move_file`'s companion), and one taken since stays where it is. Returns why it stayed,
    for the song's record, or None; never fatal."""
    sidecar = sidecar_of(source)
    try:
        found = _lstat(sidecar)
    except ChoiceError as exc:
        log.warning("the choices of %s stay in the inbox: %s", source.name, exc)
        return None
    if moved_to == source or found is None or not stat.S_ISREG(found.st_mode):
        return None
    if used is not ANY and sidecar_digest(source) != used:
        changed = used is not None
        why = (
            f"{sidecar.name} {'changed' if changed else 'arrived'} after the song started, "
            f"so the song was separated without {'this version of ' if changed else ''}it; "
            f"it stays in the inbox: put {source.name} back beside it to separate the song "
            f"with it, or delete it"
        )
        log.warning("%s", why)
        return why
    target = sidecar_of(moved_to)
    if os.path.lexists(target):
        why = f"{sidecar} stays where it is: {target} is taken"
        log.warning("%s", why)
        return why
    try:
        move_file(sidecar, target)
    except FilesystemError as exc:
        log.warning("the choices of %s stay in the inbox: %s", source.name, exc)
    return None
