"""Link files → the URL they point at: Windows `.url`, macOS `.webloc`, Linux `.desktop`.

People save a link from a browser or a phone into the synced inbox; each platform writes its
own kind of file. Only `http` and `https` are accepted: a link file is untrusted input, and a
`file:` or `javascript:` URL must never be fetched. Every refusal names the link file.
"""

from __future__ import annotations

import configparser
import plistlib
from pathlib import Path
from urllib.parse import urlsplit

from stemdeck_watch.core.errors import StageError
from stemdeck_watch.util.safefile import FileTooLarge, NotRegularFile, read_regular

LINK_EXTENSIONS = frozenset({"url", "webloc", "desktop"})
MAX_LINK_FILE = 64 * 1024  # a link file is a few hundred bytes; more is not a link file


class LinkError(StageError):
    stage = "reading the link"


def is_link_file(path: Path | str) -> bool:
    return Path(path).suffix.lower().lstrip(".") in LINK_EXTENSIONS


def read_link(path: Path) -> str:
    """The http(s) URL in a link file; LinkError with a reason that names the file. Only a
    plain file is read (a FIFO would block the queue for ever)."""
    try:
        data = read_regular(path, MAX_LINK_FILE)
    except FileTooLarge:
        raise LinkError(
            f"{path.name} is not a link file: it holds more than "
            f"{MAX_LINK_FILE:,} bytes (a link file holds a few hundred); save the "
            f"link again"
        ) from None
    except NotRegularFile:
        raise LinkError(f"{path.name} is not a link file: it is not a plain file") from None
    except OSError as exc:
        raise LinkError(f"could not read the link file {path}: {exc.strerror or exc}") from exc
    kind = path.suffix.lower().lstrip(".")
    url = {"url": _from_url_file, "webloc": _from_webloc, "desktop": _from_desktop}[kind](
        path, data
    )
    return check_url(url, path.name)


def check_url(url: str, where: str, fix: str = "fix or delete the file") -> str:
    """`url` as a web address to download, stripped; LinkError naming `where` otherwise.

    The one check of a URL from outside (a link file, the API, a playlist's entries): only
    http(s), a host, a port that is a port, text that UTF-8 can hold. `fix` says what to do
    about it, for whoever gave the URL."""
    url = url.strip()
    if not url:
        raise LinkError(f"{where} holds no URL; save the link again")
    problem = url_problem(url)
    if problem == "scheme":
        shown = url if len(url) <= 80 else url[:77] + "…"
        raise LinkError(
            f"{where} points at {shown!r}, which is not a web "
            f"address (only http and https links are downloaded)"
        )
    if problem is not None:
        shown = url if len(url) <= 80 else url[:77] + "…"
        raise LinkError(f"the link in {where} is not a valid URL ({problem}): {shown!r}; {fix}")
    return url


def url_problem(url: str) -> str | None:
    """What makes `url` no web address to download ("scheme" for a scheme other than
    http(s)), or None. Python's URL parser raises on some malformed addresses (an unclosed
    IPv6 bracket, a port out of range) and text a lone surrogate is in cannot be sent: each
    is a reason here, never an exception."""
    try:
        url.encode("utf-8")
    except UnicodeEncodeError as exc:
        return f"character {exc.start + 1} is a lone surrogate, not valid Unicode"
    try:
        parts = urlsplit(url)
        scheme, host, _port = parts.scheme.lower(), parts.hostname, parts.port
    except ValueError as exc:
        return str(exc) or "it cannot be parsed"
    if scheme not in ("http", "https"):
        return "scheme"
    if not host:
        return "it names no host"
    return None


def _ini(path: Path, data: bytes, section: str) -> configparser.SectionProxy:
    parser = configparser.ConfigParser(interpolation=None, strict=False)  # "%20" is common
    parser.optionxform = str  # type: ignore[assignment,method-assign]  # keys are case-sensitive
    try:
        parser.read_string(data.decode("utf-8-sig", errors="replace"))
    except configparser.Error as exc:
        raise LinkError(f"{path.name} is not a readable link file: {exc}".splitlines()[0]) from None
    if not parser.has_section(section):
        raise LinkError(f"{path.name} is not a link file: it has no [{section}] section")
    return parser[section]


def _from_url_file(path: Path, data: bytes) -> str:
    section = _ini(path, data, "InternetShortcut")
    return section.get("URL", "")


def _from_desktop(path: Path, data: bytes) -> str:
    entry = _ini(path, data, "Desktop Entry")
    if entry.get("Type", "") != "Link":
        raise LinkError(
            f"{path.name} is a .desktop file of Type={entry.get('Type', '(none)')}, "
            f"not a link (Type=Link)"
        )
    return entry.get("URL", "")


def _from_webloc(path: Path, data: bytes) -> str:
    try:
        plist = plistlib.loads(data)  # XML and binary (bplist00) alike
    except Exception:
        raise LinkError(
            f"{path.name} is not a readable .webloc file (neither an XML nor a "
            f"binary property list)"
        ) from None
    url = plist.get("URL", "") if isinstance(plist, dict) else ""
    return url if isinstance(url, str) else ""
