"""Value checks for config keys: each returns the normalised value or raises ValueError
whose text says what is allowed; `config` turns that into "KEY = VALUE is not allowed:
expected …".
"""

from __future__ import annotations

import ipaddress
import math
import re
import string
from pathlib import PurePosixPath
from typing import Any, Callable

from stemdeck_watch.util.redact import redact_url
from stemdeck_watch.util.safetext import xml_text

Check = Callable[[Any], Any]
LAYOUT_FIELDS = ("stem", "name", "ext", "model", "title", "artist", "album", "preset")
MP3_RATES = (8000, 11025, 12000, 16000, 22050, 24000, 32000, 44100, 48000)  # MPEG audio
# The stems of the models whose names are known without loading them (demucs's pretrained
# models): a mix or `two_stems` naming another stem is a config-time error for these.
FOUR = ("drums", "bass", "other", "vocals")
MODEL_STEMS: dict[str, tuple[str, ...]] = {
    **{
        name: FOUR
        for name in (
            "htdemucs",
            "htdemucs_ft",
            "hdemucs_mmi",
            "mdx",
            "mdx_extra",
            "mdx_q",
            "mdx_extra_q",
            "repro_mdx_a",
            "repro_mdx_a_time_only",
            "repro_mdx_a_hybrid_only",
        )
    },
    "htdemucs_6s": FOUR + ("guitar", "piano"),
}
# The segment (seconds) each of those models was trained on and separates in: 7.8 for the
# Transformer models (their own length, never longer), 44 for the others (their `.yaml`).
MODEL_SEGMENT: dict[str, float] = {
    name: 7.8 if name.startswith("htdemucs") else 44.0 for name in MODEL_STEMS
}
# A model name as demucs looks one up: in its own lists, the hub's, or a model_repo folder.
# Never a URL, a scheme (`hf://`, which demucs fetches from HuggingFace before anything
# else) or a path: those would load code from somewhere nobody configured.
MODEL_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}")


def number(
    minimum: float | None = None,
    maximum: float | None = None,
    *,
    integer: bool = False,
    below: float | None = None,
    unit: str = "",
) -> Check:
    kind = "a whole number" if integer else "a number"
    bounds = []
    if minimum is not None:
        bounds.append(f"≥ {minimum:g}")
    if maximum is not None:
        bounds.append(f"≤ {maximum:g}")
    if below is not None:
        bounds.append(f"< {below:g}")
    allowed = " ".join([kind, " and ".join(bounds), unit]).replace("  ", " ").strip()

    def check(value: Any) -> Any:
        ok_type = isinstance(value, int) if integer else isinstance(value, (int, float))
        if isinstance(value, bool) or not ok_type:
            raise ValueError(allowed)
        if not math.isfinite(value):  # TOML has nan and inf; every bound passes a nan
            raise ValueError(f"{allowed}, not {value}")
        if (
            (minimum is not None and value < minimum)
            or (maximum is not None and value > maximum)
            or (below is not None and value >= below)
        ):
            raise ValueError(allowed)
        return value if integer else float(value)

    return check


def count_or_auto(minimum: int, maximum: int) -> Check:
    """A whole number in [minimum, maximum], or "auto"."""
    count = number(minimum, maximum, integer=True)

    def check(value: Any) -> Any:
        if value == "auto":
            return value
        try:
            return count(value)
        except ValueError as exc:
            raise ValueError(f'"auto" or {exc}') from None

    return check


def number_list(minimum: float, maximum: float, *, integer: bool = False, unit: str = "") -> Check:
    """A list of numbers, each checked as `number` checks one; duplicates dropped."""
    one = number(minimum, maximum, integer=integer, unit=unit)

    def check(value: Any) -> tuple[Any, ...]:
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"a list of {_plural(one)}")
        try:
            return tuple(dict.fromkeys(one(v) for v in value))
        except ValueError:
            raise ValueError(f"a list of {_plural(one)}") from None

    return check


def _plural(check: Check) -> str:
    try:
        check(None)
    except ValueError as exc:
        return str(exc).replace("a whole number", "whole numbers").replace("a number", "numbers")
    return "numbers"  # pragma: no cover - a number check refuses None


def choice(*allowed: Any) -> Check:
    def check(value: Any) -> Any:
        # type() and not ==: TOML's true must not pass for 1, nor 1 for true.
        if any(type(a) is type(value) and a == value for a in allowed):
            return value
        raise ValueError("one of " + ", ".join(show(a) for a in allowed))

    return check


def boolean(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError("true or false")
    return value


def text(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError("a string")
    return value


def text_list(value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError("a list of strings")
    return tuple(value)


def choice_list(*allowed: str, what: str = "names") -> Check:
    """A list of strings, each one of `allowed`; the error lists the valid ones."""
    valid = ", ".join(show(a) for a in allowed)

    def check(value: Any) -> tuple[str, ...]:
        try:
            items = text_list(value)
        except ValueError:
            raise ValueError(f"a list of {what} from {valid}") from None
        unknown = [v for v in items if v not in allowed]
        if unknown:
            raise ValueError(
                f"a list of {what} from {valid} (unknown: {', '.join(show(v) for v in unknown)})"
            )
        return tuple(dict.fromkeys(items))

    return check


def url_list(value: Any) -> tuple[str, ...]:
    """Notification targets: "desktop" or URLs with a scheme (apprise checks the rest when
    the service starts; importing it here would slow every command down)."""
    items = text_list(value)
    bad = [v for v in items if v.strip() != "desktop" and "://" not in v]
    if bad:
        raise ValueError(
            'a list of apprise URLs such as "json://host/" or "mailto://…", or '
            f'"desktop" (not a URL: {", ".join(redact_url(show(v)) for v in bad)})'
        )
    return tuple(v.strip() for v in items)


def hub_url(value: Any) -> str:
    """A model hub: an http(s) URL of a folder, normalised to end in "/" (files are named
    relative to it)."""
    url = value.strip() if isinstance(value, str) else ""
    scheme, _, rest = url.partition("://")
    if (
        scheme.lower() not in ("http", "https")
        or not rest.strip("/")
        or any(c.isspace() or ord(c) < 32 for c in url)
    ):
        raise ValueError(
            "an http:// or https:// URL of the folder holding the model files, "
            'e.g. "https://dl.fbaipublicfiles.com/demucs/"'
        )
    return url if url.endswith("/") else url + "/"


HOST_NAME = re.compile(
    r"(?=.{1,253}$)[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?(?:\.[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?)*"
)


def listen_address(value: Any) -> str:
    """`api.host`: "localhost" or an IP address of this machine (0.0.0.0 or :: for all)."""
    if value == "localhost":
        return value
    try:
        return str(ipaddress.ip_address(text(value)))
    except ValueError:
        raise ValueError(
            'an IP address ("127.0.0.1", "0.0.0.0" for every address, "192.168.1.20") '
            'or "localhost"'
        ) from None


def host_names(value: Any) -> tuple[str, ...]:
    """`api.hosts`: names (or IP addresses) this machine is reached by, without scheme or port."""
    names = []
    for item in text_list(value):
        name = item.strip().lower().rstrip(".")
        try:
            names.append(str(ipaddress.ip_address(name.strip("[]"))))
            continue
        except ValueError:
            pass
        if not HOST_NAME.fullmatch(name):
            raise ValueError(
                f'a list of host names such as ["nas.local", "music.example.org"] '
                f"(no scheme, port or path; {show(item)} is not one)"
            )
        names.append(name)
    return tuple(names)


def extension_list(value: Any) -> tuple[str, ...]:
    items = text_list(value)
    cleaned = tuple(v.lower().lstrip(".") for v in items)
    if not cleaned or any(not v or "/" in v for v in cleaned):
        raise ValueError('a non-empty list of file extensions such as ["mp3", "wav"]')
    return cleaned


def model_name(value: Any) -> str:
    """A model's name: letters, digits, `_`, `.`, `-`; never a URL, a scheme or a path."""
    if not isinstance(value, str) or not MODEL_NAME.fullmatch(value) or ".." in value:
        raise ValueError(
            'a model name such as "htdemucs" (letters, digits, _ . -), never a URL, '
            "a scheme such as hf:// or a path; a model of your own goes in the folder "
            "named by separation.model_repo"
        )
    return value


def stem_name(value: Any) -> str:
    value = text(value)
    if value and not value.replace("_", "").isalnum():
        raise ValueError('"" (all stems) or a stem name such as "vocals"')
    return value


def layout_template(value: Any) -> str:
    """A stem's file name inside the song folder. Refused here, at config load, is anything
    that could place a file outside the song folder: an absolute path, a drive, `..`, a
    backslash, or a field that is not a plain name (`{stem.__class__}`, `{name[0]}`). The
    values filled in later are sanitised too (stages/naming.py), so a tag cannot escape."""
    value = text(value)
    allowed = (
        'a relative file name template with {stem}, e.g. "{stem}.{ext}" or '
        f'"{{artist}}/{{title}} - {{stem}}.{{ext}}" (fields: '
        f"{', '.join('{' + f + '}' for f in LAYOUT_FIELDS)}; no '..', no absolute path)"
    )
    try:
        fields = [
            (f, spec, conv)
            for _lit, f, spec, conv in string.Formatter().parse(value)
            if f is not None
        ]
        sample = value.format(**{f: "x" for f in LAYOUT_FIELDS})
    except (KeyError, IndexError, ValueError, AttributeError):
        raise ValueError(allowed) from None
    if any(f not in LAYOUT_FIELDS or conv or spec for f, spec, conv in fields):
        raise ValueError(allowed)
    parts = PurePosixPath(sample).parts
    if (
        "stem" not in [f for f, _s, _c in fields]
        or not parts
        or sample.startswith("/")
        or "\\" in value
        or ":" in sample
        or any(p in ("..", ".") for p in parts)
        or any(ord(c) < 32 for c in sample)
        or xml_text(sample) != sample  # a name a DAW project could not hold (U+FFFF)
    ):
        raise ValueError(allowed)
    return value


def sample_rate(value: Any) -> str | int:
    """`"model"` (the model's own rate), `"input"` (the input's) or a rate in Hz."""
    allowed = '"model", "input" or a rate in Hz from 8000 to 384000, e.g. 48000'
    if value in ("model", "input") and isinstance(value, str):
        return value
    if isinstance(value, int) and not isinstance(value, bool) and 8000 <= value <= 384000:
        return value
    raise ValueError(allowed)


def check_model_stems(model: str, two_stems: str, mixes: dict[str, tuple[str, ...]]) -> None:
    """For a model whose stems are known, every stem named in `two_stems` and the mixes must
    be one of them; raises ValueError naming the key, the stem and the model's stems."""
    known = MODEL_STEMS.get(model)
    if known is None:
        return  # a local or custom model: checked when its stems are known, at publish
    stems = ", ".join(known)
    if two_stems and two_stems not in known:
        raise ValueError(
            f"separation.two_stems = {show(two_stems)} is not a stem of the model "
            f"{show(model)}; its stems are {stems}"
        )
    written = {stem.casefold() for stem in known} | ({f"no_{two_stems}"} if two_stems else set())
    for mix, members in mixes.items():
        if mix.casefold() in written:  # one file would be both (names are caseless on macOS)
            raise ValueError(
                f"output.mixes.{mix} has the name of a stem the model {show(model)} writes; "
                f"give the mix another name"
            )
        unknown = [m for m in members if m not in known]
        if unknown:
            raise ValueError(
                f"output.mixes.{mix} names {', '.join(show(m) for m in unknown)}, "
                f"which the model {show(model)} does not separate; its stems are "
                f"{stems}"
            )


def mix_table(value: Any) -> dict[str, tuple[str, ...]]:
    allowed = 'a table of mix name = list of stems, e.g. instrumental = ["drums", "bass", "other"]'
    if not isinstance(value, dict):
        raise ValueError(allowed)
    result: dict[str, tuple[str, ...]] = {}
    for name, stems in value.items():
        if not (name[:1].isalnum() and name.replace("_", "").replace("-", "").isalnum()):
            raise ValueError(allowed + f" (bad mix name {name!r})")
        try:
            stems = text_list(stems)
        except ValueError:
            raise ValueError(allowed) from None
        if not stems or any(not stem_name(s) for s in stems):
            raise ValueError(allowed)
        if name.casefold() in {taken.casefold() for taken in result}:
            raise ValueError(allowed + f" (two mixes named {name!r})")
        result[name] = stems
    return result


def byte_size(value: Any) -> int:
    allowed = 'a size such as "500MB" or "2GB", or a number of bytes'
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    if not isinstance(value, str):
        raise ValueError(allowed)
    units = {
        "": 1,
        "B": 1,
        "K": 1 << 10,
        "KB": 1 << 10,
        "M": 1 << 20,
        "MB": 1 << 20,
        "G": 1 << 30,
        "GB": 1 << 30,
    }
    stripped = value.strip().upper()
    digits = stripped.rstrip("KMGB")
    try:
        amount = float(digits)
    except ValueError:
        raise ValueError(allowed) from None
    unit = stripped[len(digits) :].strip()
    if unit not in units or amount <= 0:
        raise ValueError(allowed)
    return int(amount * units[unit])


def show(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    return str(value)


def ray_address(value: object) -> str:
    """Config check of `executor.address`: "auto" (the cluster this machine belongs to),
    "local" (a private cluster started on this machine), "ray://HOST:PORT" (Ray Client) or
    "HOST:PORT" (the head's GCS address)."""
    if not isinstance(value, str):
        raise ValueError('"auto", "local", "ray://HOST:PORT" or "HOST:PORT"')
    text = value.strip()
    if text in ("auto", "local"):
        return text
    rest = text[len("ray://") :] if text.startswith("ray://") else text
    host, sep, port = rest.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(
            '"auto", "local", "ray://HOST:PORT" (Ray Client, usually '
            'port 10001) or "HOST:PORT" (the head node, usually port 6379)'
        )
    return text
