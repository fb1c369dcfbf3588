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


def escape_markup(text: object) -> str:
    """`text` for a body read as markup (desktop notifications): `&`, `<` and `>` escaped."""
    return str(text).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
