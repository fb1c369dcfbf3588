"""URLs as they may be shown: in an error message, on the terminal, in the log.

A notification URL carries its credentials (`mailto://user:password@host`,
`json://host/?token=…`, `discord://id/token`); a message about a URL the service cannot use must
still say which one, without what lets a reader use it. Kept free of imports beyond `re`:
the configuration's error messages use it.
"""

from __future__ import annotations

import re

HIDDEN = "***"
# a URL: a scheme of two or more characters (not a drive letter), a colon, no spaces or quotes
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]+:[^\s'\"]+")
# scheme:[//]user:password@ — the password runs to the last "@" before the path
_PASSWORD = re.compile(
    r"(?P<head>[A-Za-z][A-Za-z0-9+.-]*:(?://)?[^/?#@:\s]*:)"
    r"(?P<secret>[^/?#\s]*)@"
)
# name:password@host without a scheme (a URL typed without one): the same
_BARE = re.compile(r"^(?P<head>[^:/@\s]+:)(?!//)(?P<secret>[^/?#\s:]*)@")
# scheme://name@ without a password: apprise puts tokens there (pover://user@token)
_USER = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.-]*://)(?P<secret>[^/?#@:\s]+)@")
_QUERY = re.compile(r"(?P<head>[?&;](?P<key>[^=&;#\s]*)=)(?P<secret>[^&;#\s]*)")
_SEGMENT = re.compile(r"(?<=[/@:])[A-Za-z0-9_\-]{16,}(?=[/?#@:\s'\",]|$)")
_SECRET_KEY = re.compile(
    r"(?i)token|key|secret|pass|pwd|^pw$|auth|sig|cred|session|code|hash|"
    r"webhook|bearer|private"
)


def redact_url(text: str) -> str:
    """`text` with the secrets of every URL in it replaced by ***: a password after `user:`,
    a user name that looks like a token, query values of token-like keys or that look like
    tokens, and parts of the address that look like tokens (16+ letters and digits). Text
    outside URLs (a folder path) is left as it is."""
    return _URL.sub(lambda m: _redact(m[0]), text)


def _redact(url: str) -> str:
    url = _PASSWORD.sub(lambda m: m["head"] + HIDDEN + "@", url)
    url = _BARE.sub(lambda m: m["head"] + HIDDEN + "@", url)
    url = _USER.sub(
        lambda m: m["head"] + (HIDDEN if _tokenish(m["secret"]) else m["secret"]) + "@", url
    )
    url = _QUERY.sub(
        lambda m: (
            m["head"]
            + (
                HIDDEN
                if m["secret"] and (_SECRET_KEY.search(m["key"]) or _tokenish(m["secret"]))
                else m["secret"]
            )
        ),
        url,
    )
    return _SEGMENT.sub(lambda m: HIDDEN if _tokenish(m[0]) else m[0], url)


def _tokenish(value: str) -> bool:
    """Looks generated rather than chosen: long, with letters and digits."""
    return len(value) >= 16 and any(c.isdigit() for c in value) and any(c.isalpha() for c in value)
