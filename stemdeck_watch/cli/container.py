"""The container image's start, before the service: a complete config in `/config` that
points at the image's volumes, written only where none exists, and the configured model
downloaded into `/models` with its progress in the log where it is not there yet
(`container/entrypoint.sh` runs `python -m stemdeck_watch.cli.container /config/stemdeck.toml`
as the share's user).

The defaults of a desktop install do not fit a container: its folders are under a home
folder the container does not have, nobody sits at a tray or a desktop to see notifications
or press Start after a restart. Every other key keeps its default and is written out, so the
owner edits the file rather than looking up what can be set.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any, TextIO

from stemdeck_watch.core.config import Settings, default_toml, load_settings
from stemdeck_watch.core.errors import ConfigError
from stemdeck_watch.util.safefile import discard, new_temp

# the image's volumes (Containerfile `VOLUME`); the state (registry, log, scratch) sits
# beside the config so that one volume holds everything the service remembers
FOLDERS = {
    "inbox": "/inbox",
    "outbox": "/outbox",
    "processed": "/processed",
    "failed": "/failed",
    "state": "/config/state",
}


def container_config() -> dict[str, Any]:
    """The complete default configuration with the container's folders; no tray, no desktop
    notifications, and a queue cut off by a restart (the runtime's stop, the box's reboot)
    starting again by itself: nobody is there to press Start."""
    data = default_toml()
    data["folders"].update(FOLDERS)
    data["tray"]["enabled"] = False
    data["notify"]["urls"] = []
    data["queue"]["start_paused_after_restore"] = False
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
    from stemdeck_watch.workers.catalogue import CATALOGUE
    from stemdeck_watch.workers.models import ModelStore

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
    fetch_model(settings, sys.stdout, sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
