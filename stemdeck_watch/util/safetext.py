"""Names from other people, shown safely: in the terminal, the log, text files, notifications.

A song's name is whatever its file was called by whoever dropped it into a synced folder, or
a web page's title. It may hold terminal escape sequences (which recolour, retitle or clear
the terminal showing `status` or the log), newlines (which forge lines in the log, or in
STATUS.txt a phone shows) and direction overrides (which make text read differently from
what it is). So every such name is made inert where it is shown: escaped where a person
should see that something odd is there (terminal, log, notifications), replaced by `?` in
text files people read on a phone (as `ls` shows such names), and markup-escaped where a
notification body is read as markup.
"""

from __future__ import annotations

import re
import unicodedata
from pathlib import PurePath

# C0 and C1 controls, DEL, the Unicode line and paragraph separators, and the bidirectional
# embeddings, overrides and isolates
_CONTROLS = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(match: re.Match[str]) -> str:
    char = match.group()
    if char in _NAMED:
        return _NAMED[char]
    code = ord(char)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def escape_controls(text: object, keep: str = "") -> str:
    """`text` with every control character written out as Python writes it in a string
    (`\\n`, `\\x1b`, `\\u202e`): one line that shows what is there. Characters in `keep`
    (e.g. "\\n" for a traceback) stay as they are."""
    text = str(text)
    if keep:
        return _CONTROLS.sub(lambda m: m.group() if m.group() in keep else _escape(m), text)
    return _CONTROLS.sub(_escape, text)


def strip_controls(text: object, keep: str = "") -> str:
    """`text` with every control character (but those in `keep`) replaced by `?`."""
    text = str(text)
    return _CONTROLS.sub(lambda m: m.group() if m.group() in keep else "?", text)


# what XML 1.0 cannot hold even escaped: C0 controls but tab, newline and carriage return;
# lone surrogates (Python keeps a file name's undecodable bytes as them); U+FFFE and U+FFFF
_NOT_XML = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ud800-\udfff\ufffe\uffff]")
REPLACEMENT = "\ufffd"


def xml_text(text: object) -> str:
    """`text` as XML 1.0 (and UTF-8) can hold it: every character XML forbids becomes U+FFFD,
    the replacement character, which shows that something was there. A parser refuses a
    whole document for one such character, even escaped as `&#xFFFF;`."""
    return _NOT_XML.sub(REPLACEMENT, str(text))


def escape_markup(text: object) -> str:
    """`text` for a body read as markup (desktop notifications): `&`, `<` and `>` escaped."""
    return str(text).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


NAME_BYTES = 255  # one file or folder name on ext4, APFS, NTFS (in UTF-8 bytes)
KEEP_END = 24  # characters a name cut to fit keeps at its end
ELLIPSIS = "…".encode()
JOINING = "\u200d\ufe0e\ufe0f"  # zero-width joiner, text and emoji variation selectors


def cut_to_bytes(text: str, limit: int) -> str:
    """`text` cut to at most `limit` bytes of UTF-8, between whole characters (and not
    between a character and the accents combined with it). File name limits count bytes:
    255 on ext4 and APFS, which 100 Japanese characters already exceed."""
    data = text.encode()
    if len(data) <= limit:
        return text
    cut = data[: max(limit, 0)].decode(errors="ignore")
    while cut and _joined(text, len(cut)):
        cut = cut[:-1]  # the next character would have combined with the last one kept
    return cut


def _joined(text: str, i: int) -> bool:
    """Whether text[i] belongs to the character before it: an accent combined with it, a
    variation selector, or either side of an emoji's zero-width joiner."""
    return (
        unicodedata.combining(text[i]) != 0
        or text[i] in JOINING
        or (i > 0 and text[i - 1] == "\u200d")
    )


def fit_bytes(text: str, limit: int) -> str:
    """`text` in at most `limit` bytes of UTF-8, cut in the middle ("…"): its end is what
    tells names apart (a track's " - 02", a copy's " (2)", the extension), so it is kept."""
    limit = max(limit, 0)
    if len(text.encode()) <= limit:
        return text
    start = max(0, len(text) - KEEP_END)
    while start > 0 and _joined(text, start):
        start -= 1  # never between a character and what is combined with it
    end = text[start:]
    if len(end.encode()) > limit // 2:
        return cut_to_bytes(text, limit)
    return cut_to_bytes(text[:start], limit - len(end.encode()) - len(ELLIPSIS)) + "…" + end


def numbered_name(name: str, n: int, keep_suffix: bool = True) -> str:
    """`song.mp3` → `song (2).mp3`; a folder `My.Song` (keep_suffix=False) → `My.Song (2)`;
    with the name before the number cut where the whole would not fit in NAME_BYTES."""
    if n < 2:
        return name
    plain = PurePath(name)
    stem, suffix = (plain.stem, plain.suffix) if keep_suffix and plain.suffix else (name, "")
    if len(suffix.encode()) > NAME_BYTES // 2:  # no real extension: cut it with the rest
        stem, suffix = name, ""
    tail = f" ({n}){suffix}"
    return fit_bytes(stem, NAME_BYTES - len(tail.encode())) + tail


def with_suffix_bytes(name: str, suffix: str, limit: int = NAME_BYTES) -> str:
    """`name` + `suffix` (a report's ".error.txt"), the name cut in the middle where the
    whole would not fit in `limit` bytes (and the suffix too, where it alone would not)."""
    if len(suffix.encode()) > limit // 2:
        return fit_bytes(name + suffix, limit)
    return fit_bytes(name, limit - len(suffix.encode())) + suffix
