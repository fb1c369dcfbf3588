"""`password`: the page's password for other devices, stored only as a salted hash.

It is read twice from the terminal (never echoed), or once from standard input with
`--stdin` (a script, a container's secret); it never appears in the command line, where every
local user could read it. The hash goes into `[api] password_hash` of the config file, the
rest of the file kept as it was.
"""

from __future__ import annotations

import argparse
import getpass
import sys
from pathlib import Path
from typing import Callable

from stemdeck_watch.core.config import Settings
from stemdeck_watch.core.configedit import set_key
from stemdeck_watch.core.errors import ConfigError
from stemdeck_watch.core.paths import default_config_file
from stemdeck_watch.util.passwords import MAX_PASSWORD_BYTES, hash_password, password_problem


def add_parser(add: Callable[..., argparse.ArgumentParser]) -> None:
    command = add(
        "password",
        help="set the password other devices sign in to the queue page with (api.host)",
    )
    how = command.add_mutually_exclusive_group()
    how.add_argument(
        "--stdin", action="store_true", help="read the password from standard input (one line)"
    )
    how.add_argument(
        "--remove", action="store_true", help="remove it: the page is then for this computer only"
    )


def run(args: argparse.Namespace, settings: Settings) -> int:
    path = settings.source or Path(getattr(args, "config", None) or default_config_file())
    if args.remove:
        value = ""
    else:
        password = _from_stdin() if args.stdin else _from_terminal()
        problem = password_problem(password)
        if problem:
            raise ConfigError(f"{problem}; nothing was changed")
        value = hash_password(password)
    set_key(path, "api", "password_hash", value, secret=True)
    if value:
        print(f"the password's hash is in {path} (api.password_hash); the password is not")
    else:
        print(f"removed the password from {path}; other devices cannot sign in")
    print("a running service uses it after a restart")
    return 0


def _from_stdin() -> str:
    line = sys.stdin.readline(MAX_PASSWORD_BYTES + 2)
    return line.removesuffix("\n").removesuffix("\r")


def _from_terminal() -> str:
    if not sys.stdin.isatty():
        raise ConfigError(
            "no terminal to ask for the password on: pass --stdin and send it on standard input"
        )
    first = getpass.getpass("new password for the queue page: ")
    if getpass.getpass("the same again: ") != first:
        raise ConfigError("the two passwords differ; nothing was changed")
    return first
