"""One key of `stemdeck.toml` changed in place, the rest of the file kept as it was.

A config file is the owner's text, with their comments and their order; rewriting it from the
parsed data would lose both. So a key is changed by editing its line: the key's line in its
table is replaced, or a line is added at the end of the table (a table added at the end of the
file where there is none). The result is parsed before it is written, and must hold the new
value and otherwise the same data; it replaces the file whole (a new file beside it, renamed
over it), so a reader sees the old file or the new one. The file keeps its permissions, less
any for other users where the value is a secret.
"""

from __future__ import annotations

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

from stemdeck_watch.core.errors import ConfigError
from stemdeck_watch.util.safefile import replacing

MAX_CONFIG_BYTES = 4 << 20
_TABLE = re.compile(r"^\s*\[\s*([A-Za-z0-9_.-]+)\s*\]\s*(#.*)?$")
_ANY_TABLE = re.compile(r"^\s*\[")


def set_key(
    path: Path, section: str, name: str, value: str | list[str], *, secret: bool = False
) -> None:
    """Set `[section] name = "value"` (or a list of strings) in the config file at `path`
    (created if missing). `secret`: the file is left readable by its owner only."""
    path = Path(path)
    try:
        old = path.read_text(encoding="utf-8") if path.exists() else ""
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"could not read config {path}: {exc}") from None
    if len(old) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{path} is not a config file: it is larger than 4 MiB")
    before = _parse(old, path)
    new = _edited(old, before, section, name, value, path)
    after = _parse(new, path)
    expected = {**before, section: {**before.get(section, {}), name: value}}
    if after != expected:  # the edit would change anything else: leave the file alone
        raise ConfigError(
            f"could not set {section}.{name} in {path} without changing other keys; "
            f'set it by hand in its [{section}] table: {name} = "…"'
        )
    mode = stat.S_IMODE(path.stat().st_mode) if path.exists() else 0o600
    if secret:
        mode &= 0o700
    path.parent.mkdir(parents=True, exist_ok=True)
    with replacing(path, "w", encoding="utf-8", newline="") as handle:
        os.fchmod(handle.fileno(), mode)
        handle.write(new)


def _parse(text: str, path: Path) -> dict[str, Any]:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"could not parse config {path}: {exc}") from None


def _edited(
    text: str, data: dict[str, Any], section: str, name: str, value: str | list[str], path: Path
) -> str:
    shown = (
        _toml_string(value)
        if isinstance(value, str)
        else "[" + ", ".join(_toml_string(item) for item in value) + "]"
    )
    line = f"{name} = {shown}"
    newline = "\r\n" if "\r\n" in text else "\n"
    lines = text.splitlines(keepends=True)
    start = next(
        (i for i, row in enumerate(lines) if (m := _TABLE.match(row)) and m[1] == section), None
    )
    if start is None:
        if section in data:  # set as dotted keys or an inline table: not a line to edit safely
            raise ConfigError(
                f"{path} sets [{section}] in a way this command does not edit; "
                f'set it by hand: {section}.{name} = "…"'
            )
        ending = "" if not text or text.endswith(("\n", "\r\n")) else newline
        gap = newline if text.strip() else ""
        return f"{text}{ending}{gap}[{section}]{newline}{line}{newline}"
    end = next((i for i in range(start + 1, len(lines)) if _ANY_TABLE.match(lines[i])), len(lines))
    key = re.compile(rf"^\s*{re.escape(name)}\s*=")
    for i in range(start + 1, end):
        if key.match(lines[i]):
            last = _value_end(lines, i, end)
            ending = newline if lines[last].endswith(("\n", "\r")) else ""
            lines[i : last + 1] = [line + ending]
            return "".join(lines)
    last = max(
        (
            i
            for i in range(start, end)
            if lines[i].strip() and not lines[i].lstrip().startswith("#")
        ),
        default=start,
    )
    if not lines[last].endswith(("\n", "\r")):
        lines[last] += newline
    lines.insert(last + 1, line + newline)
    return "".join(lines)


def _value_end(lines: list[str], first: int, end: int) -> int:
    """The last line of the key set on line `first`: a value may span lines (an array
    written one item a line); it ends at the first line where the key's text parses."""
    for last in range(first, end):
        try:
            tomllib.loads("".join(lines[first : last + 1]))
        except tomllib.TOMLDecodeError:
            continue
        return last
    return first  # the whole file's parse, after the edit, says what is wrong


def _toml_string(value: str) -> str:
    """A TOML basic string: quotes, backslashes and control characters escaped."""
    escaped = value.replace("\\", "\\\\").replace('"', '\\"')
    escaped = re.sub(r"[\x00-\x1f\x7f]", lambda m: f"\\u{ord(m[0]):04x}", escaped)
    return f'"{escaped}"'
