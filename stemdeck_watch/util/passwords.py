"""The page's password, kept only as a salted scrypt hash (the standard library's).

The config file holds `scrypt$n=…,r=…,p=…$<salt>$<hash>` (salt and hash in unpadded
base64): the parameters travel with the hash, so a later release may raise them without
making the passwords set before it unusable. Checking takes a tenth of a second or more on
purpose: so does every guess, and the sign-in also limits guesses per address.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
import secrets

SCHEME = "scrypt"
N, R, P = 1 << 15, 8, 1  # 32 MiB of memory per check
SALT_BYTES, HASH_BYTES = 16, 32
MAX_PASSWORD_BYTES = 1024  # a longer one adds nothing and only costs time to hash
MIN_PASSWORD_CHARS = 8
STORED = re.compile(
    r"scrypt\$n=(?P<n>[0-9]{1,9}),r=(?P<r>[0-9]{1,3}),p=(?P<p>[0-9]{1,3})"
    r"\$(?P<salt>[A-Za-z0-9+/]{16,88})\$(?P<hash>[A-Za-z0-9+/]{32,88})"
)
FORMAT = "scrypt$n=N,r=R,p=P$SALT$HASH, as `stemdeck-watch password` writes it"


def hash_password(password: str) -> str:
    """A new salted hash of `password`, with its parameters."""
    _check_length(password)
    salt = secrets.token_bytes(SALT_BYTES)
    digest = _scrypt(password, salt, N, R, P)
    return f"{SCHEME}$n={N},r={R},p={P}${_b64(salt)}${_b64(digest)}"


def verify_password(password: str, stored: str) -> bool:
    """True if `password` is the one `stored` was made from (compared in constant time)."""
    match = STORED.fullmatch(stored)
    if match is None or not password or len(password.encode("utf-8")) > MAX_PASSWORD_BYTES:
        return False
    n, r, p = int(match["n"]), int(match["r"]), int(match["p"])
    expected = _unb64(match["hash"])
    try:
        digest = _scrypt(password, _unb64(match["salt"]), n, r, p, len(expected))
    except ValueError:  # parameters scrypt refuses (n not a power of two, too much memory)
        return False
    return hmac.compare_digest(digest, expected)


def check_stored(value: str) -> str:
    """The config's check: "" (no password) or a hash in this module's format."""
    match = STORED.fullmatch(value)
    if value and match is None:
        raise ValueError(FORMAT)
    if match is not None:
        n = int(match["n"])
        if n < 2 or n & (n - 1) or n > 1 << 20:
            raise ValueError(f"{FORMAT}; n must be a power of two up to 1048576")
    return value


def password_problem(password: str) -> str | None:
    """Why `password` cannot be the page's password, or None."""
    if len(password) < MIN_PASSWORD_CHARS:
        return f"the password must have at least {MIN_PASSWORD_CHARS} characters"
    if len(password.encode("utf-8")) > MAX_PASSWORD_BYTES:
        return f"the password may have at most {MAX_PASSWORD_BYTES} bytes"
    if password != password.strip():
        return "the password starts or ends with a space (a copy-and-paste slip?)"
    return None


def _check_length(password: str) -> None:
    problem = password_problem(password)
    if problem:
        raise ValueError(problem)


def _scrypt(password: str, salt: bytes, n: int, r: int, p: int, size: int = HASH_BYTES) -> bytes:
    memory = 128 * r * (n + p + 2)  # what scrypt needs, with room: OpenSSL's default cap is 32 MiB
    return hashlib.scrypt(
        password.encode("utf-8"), salt=salt, n=n, r=r, p=p, maxmem=memory + (1 << 20), dklen=size
    )


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii").rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.b64decode(text + "=" * (-len(text) % 4))
