"""The container image's start, before the service: a complete config in `/config` that
points at the image's volumes, written only where none exists; the page's password and names
from the container's environment; and the configured model downloaded into `/models` with its
progress in the log where it is not there yet (`container/entrypoint.sh` runs
`python -m stemdeck_watch.cli.container /config/stemdeck.toml` as the share's user).

The defaults of a desktop install do not fit a container: its folders are under a home
folder the container does not have, nobody sits at a tray or a desktop to see notifications
or press Start after a restart, and the page is opened from another device: it listens on
every address of the container at a fixed port (the one compose publishes), over HTTPS. Every
other key keeps its default and is written out, so the owner edits the file rather than
looking up what can be set.

The password comes as a linuxserver.io-style variable: `PASSWORD_FILE` or `FILE__PASSWORD`
(a file holding it: a Docker secret) or `PASSWORD`. Only its scrypt hash is stored (as
`stemdeck-watch password` stores it), at each start where the config's hash is not of that
password: the variable is the password while it is set. `STEMDECK_HOSTS` (names or addresses,
separated by commas or spaces) becomes `api.hosts` the same way. With no password anywhere
the service still starts, its page on the container's loopback only, and the log says how to
set one (exit status PAGE_LOCAL tells the entrypoint so).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path
from typing import Any, Mapping, TextIO

from stemdeck_watch.core.config import Settings, default_toml, load_settings
from stemdeck_watch.core.configedit import set_key
from stemdeck_watch.core.errors import ConfigError
from stemdeck_watch.ui.web.gate import is_loopback
from stemdeck_watch.util.passwords import (
    MAX_PASSWORD_BYTES,
    hash_password,
    password_problem,
    verify_password,
)
from stemdeck_watch.util.safefile import discard, new_temp
from stemdeck_watch.util.validators import host_names

# the image's volumes (Containerfile `VOLUME`); the state (registry, log, scratch) sits
# beside the config so that one volume holds everything the service remembers
FOLDERS = {
    "inbox": "/inbox",
    "outbox": "/outbox",
    "processed": "/processed",
    "failed": "/failed",
    "state": "/config/state",
}
PAGE_PORT = 8765  # the port compose publishes; the container's own, whatever the host maps
PAGE_LOCAL = 3  # exit status: start the service with its page on loopback (no password)
# where the password may come from, first set first: a file (a Docker secret), linuxserver.io's
# FILE__ prefix, the value itself
PASSWORD_FILES = ("PASSWORD_FILE", "FILE__PASSWORD")
PASSWORD_VALUE = "PASSWORD"
HOSTS = "STEMDECK_HOSTS"


def container_config() -> dict[str, Any]:
    """The complete default configuration with the container's folders; no tray, no desktop
    notifications, and a queue cut off by a restart (the runtime's stop, the box's reboot)
    starting again by itself: nobody is there to press Start."""
    data = default_toml()
    data["folders"].update(FOLDERS)
    data["tray"]["enabled"] = False
    data["notify"]["urls"] = []
    data["queue"]["start_paused_after_restore"] = False
    data["api"].update(host="0.0.0.0", port=PAGE_PORT, https=True)
    return data


def write_first_config(path: Path) -> bool:
    """Write the container's config to `path` unless something has that name already (the
    owner's edited file is never replaced, even by a second container starting at the same
    moment); True when written."""
    import tomli_w

    if os.path.lexists(path):
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    text = (
        "# stemdeck-watch in a container: written on first start, edit freely (every key is\n"
        "# in the manual's configuration reference); the folders are the image's volumes\n"
        + tomli_w.dumps(container_config())
    )
    with new_temp(path, "w", encoding="utf-8", newline="\n") as (tmp, handle):
        handle.write(text)
    try:
        os.link(tmp, path)  # never over an existing file, unlike a rename
    except FileExistsError:
        return False
    except OSError:  # a filesystem without hard links: a rename, where nothing appeared since
        if os.path.lexists(path):
            return False
        os.replace(tmp, path)
    finally:
        discard(tmp)
    return True


def password_from(environ: Mapping[str, str]) -> tuple[str, str] | None:
    """(the password, where it came from) out of the environment, or None where it gives
    none. A file that cannot be read or a password the page refuses is a ConfigError that
    names the variable."""
    for name in PASSWORD_FILES:
        path = environ.get(name, "")
        if not path:
            continue
        try:
            with open(path, encoding="utf-8") as handle:
                text = handle.read(MAX_PASSWORD_BYTES + 2)
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
            raise ConfigError(
                f"{name}={path}: could not read the password from it ({reason}); it must be a "
                f"file the container's user (PUID {os.getuid()}, PGID {os.getgid()}) can read"
            ) from None
        return _checked(text.splitlines()[0] if text.strip() else "", name), name
    if environ.get(PASSWORD_VALUE):
        return _checked(environ[PASSWORD_VALUE], PASSWORD_VALUE), PASSWORD_VALUE
    return None


def _checked(password: str, name: str) -> str:
    problem = password_problem(password)
    if problem:
        raise ConfigError(f"{name}: {problem}; the page's password was not changed")
    return password


def apply_environment(
    path: Path, settings: Settings, environ: Mapping[str, str], err: TextIO
) -> bool:
    """The password's hash and `api.hosts` from the environment into the config at `path`
    (read as `settings`), each only where the config does not hold it already (the file is
    the owner's: it is edited line by line, never rewritten); True when it changed."""
    changed = False
    given = password_from(environ)
    if given is not None:
        password, name = given
        stored = settings.api.password_hash
        if not (stored and verify_password(password, stored)):
            set_key(path, "api", "password_hash", hash_password(password), secret=True)
            changed = True
            print(
                f"stemdeck-watch: the page's password from {name}: its hash is in {path} "
                f"(api.password_hash); the password is not",
                file=err,
                flush=True,
            )
    wanted = environ.get(HOSTS, "").strip()
    if wanted:
        try:
            names = list(host_names([n for n in re.split(r"[,\s]+", wanted) if n]))
        except ValueError as exc:
            raise ConfigError(f"{HOSTS}={wanted!r}: {exc}") from None
        if list(settings.api.hosts) != names:
            set_key(path, "api", "hosts", names)
            changed = True
            print(f"stemdeck-watch: api.hosts = {names} from {HOSTS}", file=err, flush=True)
    return changed


def page_needs_password(settings: Settings, err: TextIO) -> bool:
    """True where the page is to listen beyond loopback with no password: the service starts
    with it on loopback instead, and the log says how to let other devices in."""
    api = settings.api
    if (
        not api.enabled
        or is_loopback("127.0.0.1" if api.host == "localhost" else api.host)
        or api.password_hash
    ):
        return False
    print(
        f"stemdeck-watch: the queue page is for this container only: other devices sign in "
        f"with a password, and none is set. Set one: `docker exec -it stemdeck "
        f"stemdeck-entrypoint password` (stemdeck: the container's name) and restart the "
        f"container, or give it in {PASSWORD_FILES[0]} (a Docker secret, as in compose.yaml) "
        f"or {PASSWORD_VALUE}; then the page is at https://ADDRESS:{api.port}/ "
        f"(api.host = {api.host!r})",
        file=err,
        flush=True,
    )
    return True


def fetch_model(settings: Settings, out: TextIO, err: TextIO) -> bool:
    """Download the configured model into the cache (`/models`) before the service starts,
    a line of progress every tenth of the way, so the first start's wait is in the log
    rather than inside the first song; True when the model is there afterwards. A model
    from `separation.model_repo`, one already cached, or a name outside the catalogue is
    left alone. A failed download is said with the offline way in, and the service starts
    anyway: it downloads on first use too."""
    if settings.separation.model_repo:
        return True
    from stemdeck_watch.cli.models import run as models
    from stemdeck_watch.workers.demucs.catalogue import CATALOGUE
    from stemdeck_watch.workers.demucs.models import ModelStore

    name = settings.separation.model
    if name not in {entry.name for entry in CATALOGUE}:
        return True
    store = ModelStore(settings.separation.model_hub)
    state = store.state(name)
    if state.cached or state.hf:
        return True
    print(
        f"stemdeck-watch: downloading the model {name} (about {state.size_mb} MB) into "
        f"{store.cache}, once",
        file=err,
        flush=True,
    )
    pulled = models(argparse.Namespace(models_command="pull", name=name), settings, out, err)
    if pulled != 0:
        print(
            f"stemdeck-watch: the model {name} is not there yet; the service tries again when "
            f"the first song comes. Without a network, copy the model files in: "
            f"`stemdeck-watch models import FOLDER` (see the manual's NAS page)",
            file=err,
            flush=True,
        )
    return pulled == 0


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m stemdeck_watch.cli.container CONFIG", file=sys.stderr)
        return 2
    path = Path(args[0])
    try:
        written = write_first_config(path)
    except OSError as exc:
        print(f"stemdeck-watch: could not write {path}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    if written:
        print(f"stemdeck-watch: wrote a default config to {path} (folders: the volumes)")
    try:
        settings = load_settings(path)
    except ConfigError:  # the service says what is wrong with it, and exits
        return 0
    try:
        if apply_environment(path, settings, os.environ, sys.stderr):
            settings = load_settings(path)
    except ConfigError as exc:  # a variable of the container's is wrong: say which
        print(f"stemdeck-watch: {exc}", file=sys.stderr)
        return 2
    fetch_model(settings, sys.stdout, sys.stderr)
    return PAGE_LOCAL if page_needs_password(settings, sys.stderr) else 0


if __name__ == "__main__":
    sys.exit(main())
