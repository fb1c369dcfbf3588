"""Command line: `stemdeck-watch run | demo | status [--json] | pause | start | cancel JOB |
move JOB --after JOB|--first | retry JOB | remove JOB | open | doctor |
models list|pull NAME|verify|import FOLDER | health [--stall SECONDS] | autostart [--remove] [--headless] |
config init [PATH]`.

Exit codes everywhere: 0 success, 1 the operation failed, 2 bad usage or bad configuration.
Only `run`, `demo` and `doctor` start the worker process (the only thing that imports torch);
everything else answers in a fraction of a second, so modules are imported per command.
The control commands (pause … open) talk to the running service through its local API, found
via the discovery file in the state folder; `status` reads the registry and works while stopped.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from stemdeck_watch import __version__
from stemdeck_watch.core.config import Settings, load_settings, write_default_config
from stemdeck_watch.core.errors import ConfigError, StemdeckError
from stemdeck_watch.util.safetext import escape_controls

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
CONFIG_HELP = "config file (default: ./stemdeck.toml, then the platform config dir)"


class CommandParser(argparse.ArgumentParser):
    """A command's parser, at any depth: it takes the global options too, so they may
    follow the command (`models list --config x.toml`). Its own commands are parsed by
    CommandParsers again (argparse gives a parser's subparsers its own class), so a command
    added anywhere later has them without being told."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # SUPPRESS: absent here, the value given before the command stays
        self.add_argument(
            "--config", type=Path, metavar="PATH", default=argparse.SUPPRESS, help=CONFIG_HELP
        )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="stemdeck-watch",
        description="Turn songs dropped into an inbox folder into separated stems.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument("--config", type=Path, metavar="PATH", help=CONFIG_HELP)
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=CommandParser)
    add = commands.add_parser
    run = add("run", help="run the service in the foreground (Ctrl-C stops it)")
    run.add_argument("--no-tray", action="store_true", help="no tray icon (servers)")
    run.add_argument("-v", "--verbose", action="store_true", help="debug output on the terminal")
    run.add_argument(
        "--page-local",
        action="store_true",
        help="the page on loopback this run, whatever api.host says (a container with no "
        "password yet)",
    )
    demo = add("demo", help="offline demo: a tiny model on two synthetic songs")
    demo.add_argument("--dir", type=Path, help="workspace to use (default: a new temporary folder)")
    status = add("status", help="show the queue (works while stopped too)")
    status.add_argument("--json", action="store_true", help="machine-readable output")
    status.add_argument(
        "--all",
        action="store_true",
        help="every job ever (default: the queue and the most recent finished jobs)",
    )
    add("pause", help="pause the queue: the running song finishes, no new one starts")
    add("start", help="start the queue (also a queue restored after a restart)")
    job_help = "a job id, a unique id prefix or a unique song name"
    add("cancel", help="cancel a job; its file stays where it is").add_argument(
        "job", metavar="JOB", help=job_help
    )
    move = add("move", help="move a queued job after another one, or first")
    move.add_argument("job", metavar="JOB", help=job_help)
    where = move.add_mutually_exclusive_group(required=True)
    where.add_argument("--after", metavar="JOB", help="put it right after this job")
    where.add_argument("--first", action="store_true", help="put it at the head of the queue")
    add("retry", help="queue a failed or cancelled job again").add_argument(
        "job", metavar="JOB", help=job_help
    )
    add("remove", help="delete a finished job's stems and forget it for good").add_argument(
        "job", metavar="JOB", help=job_help
    )
    add("open", help="open the queue page in the default browser")
    add("doctor", help="check folders, watcher, decoding and the model")
    from stemdeck_watch.cli.models import add_parser as add_models

    add_models(add)
    from stemdeck_watch.cli.health import add_parser as add_health

    add_health(add)
    from stemdeck_watch.cli.password import add_parser as add_password

    add_password(add)
    autostart = add("autostart", help="start the service at login (the platform's own way)")
    autostart.add_argument(
        "--remove", action="store_true", help="remove what `autostart` installed"
    )
    autostart.add_argument(
        "--headless", action="store_true", help="without the tray (Linux: a systemd user unit)"
    )
    config = add("config", help="configuration file")
    config_commands = config.add_subparsers(dest="config_command", metavar="ACTION")
    init = config_commands.add_parser("init", help="write a complete default stemdeck.toml")
    init.add_argument("path", nargs="?", type=Path, default=Path("stemdeck.toml"))
    init.add_argument("--force", action="store_true", help="overwrite an existing file")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return EXIT_USAGE
    try:
        if args.command == "config":
            return _config(args, parser)
        if args.command == "demo":
            return _demo(args)
        if args.command == "autostart":
            return _autostart(args)
        settings = load_settings(args.config)
        if args.command in STEERING_COMMANDS:
            return _steer(args, settings)
        if args.command == "health":
            from stemdeck_watch.cli.health import run as health

            return health(args, settings)
        return {
            "run": _run,
            "status": _status,
            "doctor": _doctor,
            "models": _models,
            "password": _password,
        }[args.command](args, settings)
    except ConfigError as exc:
        print(f"stemdeck-watch: configuration error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except StemdeckError as exc:  # may name a song or another machine: no escape sequences
        message = escape_controls(exc, keep="\n")
        print(f"stemdeck-watch: {message}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        return EXIT_FAILED


def _config(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if args.config_command != "init":
        parser.parse_args(["config", "--help"])
        return EXIT_USAGE
    try:
        path = write_default_config(args.path, force=args.force)
    except FileExistsError:
        print(
            f"stemdeck-watch: {args.path} already exists; pass --force to overwrite it",
            file=sys.stderr,
        )
        return EXIT_FAILED
    except OSError as exc:
        print(f"stemdeck-watch: could not write {args.path}: {exc.strerror}", file=sys.stderr)
        return EXIT_FAILED
    print(f"wrote {path}")
    return EXIT_OK


def _run(args: argparse.Namespace, settings: Settings) -> int:
    import logging

    from stemdeck_watch.ui.desktop.notify import check_urls
    from stemdeck_watch.ui.desktop.tray import choose, run_with_tray
    from stemdeck_watch.cli.logs import setup_logging
    from stemdeck_watch.service import Service

    if args.page_local:
        import dataclasses

        settings = dataclasses.replace(
            settings, api=dataclasses.replace(settings.api, host="127.0.0.1")
        )
    check_urls(settings.notify)  # a URL apprise cannot use: exit 2, before anything starts
    tray = choose(settings.tray.enabled, no_tray=args.no_tray)  # tray.enabled = true: or exit 2
    log_file = setup_logging(settings.paths.state, verbose=args.verbose)
    print(f"stemdeck-watch {__version__}: logging to {log_file}; Ctrl-C stops", file=sys.stderr)
    stop = threading.Event()
    _on_stop_signals(stop)
    if tray.backend is None:
        if settings.tray.enabled == "auto" and not args.no_tray:
            logging.getLogger("stemdeck_watch.ui.desktop.tray").info(
                "no tray icon: %s; running headless", tray.reason
            )
        Service(settings).run_until(stop)
    else:
        run_with_tray(Service(settings), stop, tray.backend)
    return EXIT_OK


def _on_stop_signals(stop: threading.Event) -> None:
    def handler(signum: int, _frame: object) -> None:
        if stop.is_set():  # a second Ctrl-C: the user really wants out
            raise KeyboardInterrupt
        stop.set()

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)
    if hasattr(signal, "SIGBREAK"):
        signal.signal(signal.SIGBREAK, handler)  # type: ignore[attr-defined]


def _status(args: argparse.Namespace, settings: Settings) -> int:
    from stemdeck_watch.cli.status import collect, render, to_json

    status = collect(settings, every_job=args.all)
    recent = len(status["jobs"]) if args.all else 10
    print(to_json(status) if args.json else render(status, recent))
    return EXIT_OK


STEERING_COMMANDS = ("pause", "start", "cancel", "move", "retry", "remove", "open")


def _steer(args: argparse.Namespace, settings: Settings) -> int:
    """The commands that steer the running service through its local API."""
    from stemdeck_watch.ui.web.client import Client, job_path

    client = Client.connect(settings.paths.state)
    command = args.command
    if command == "open":
        import webbrowser

        url, seconds = client.page_link()  # the service answers and the token is right
        print(url)
        if not webbrowser.open(url):
            print(
                f"stemdeck-watch: could not start a browser; open the address above (it "
                f"works once, within {seconds:.0f} s)",
                file=sys.stderr,
            )
        return EXIT_OK
    if command in ("pause", "start"):
        queue = client.post(f"/api/queue/{command}")
        print(_queue_line(queue))
    elif command == "move":
        body = {"first": True} if args.first else {"after": args.after}
        reply = client.post(job_path(args.job, "move"), body)
        print(f"moved {_shown(_name_of(reply))} {'first' if args.first else 'after ' + args.after}")
        if reply.get("note"):
            print(_shown(reply["note"]))
        for i, job in enumerate(reply["queued"], 1):
            print(f"  {i:>2}. {_shown(job['name'])}  ({job['id']})")
    elif command == "remove":
        reply = client.post(job_path(args.job, "remove"))
        print(f"removed {_shown(reply['removed']['name'])} (job {reply['removed']['id']})")
        if reply["not_deleted"]:
            print(
                "could not delete: " + "; ".join(map(_shown, reply["not_deleted"])), file=sys.stderr
            )
            return EXIT_FAILED
    else:
        reply = client.post(job_path(args.job, command))
        job = reply["job"]
        if command == "cancel":
            print(f"cancelled {_shown(job['name'])} (job {job['id']})")
        elif job is None:
            print(
                _shown(reply.get("note") or "the file waits in the inbox until the queue has room")
            )
        else:
            print(f"queued {_shown(job['name'])} again as job {job['id']}")
    return EXIT_OK


def _queue_line(queue: dict) -> str:
    queued, running = len(queue["queued"]), queue["running"]
    if queue["paused"]:
        finishing = f"{_shown(running['name'])} finishes, " if running else ""
        what = "paused" if queue["pause_reason"] == "user" else f"paused ({queue['pause_reason']})"
        return f"{what}: {finishing}{queued} queued; `stemdeck-watch start` starts again"
    doing = f"running {_shown(running['name'])}, " if running else ""
    return f"started: {doing}{queued} queued"


def _shown(text: object) -> str:
    """A song's name (or a message naming one) for the terminal: it comes from whoever named
    the file, so its control characters are escaped, never sent to the terminal."""
    return escape_controls(text)


def _name_of(reply: dict) -> str:
    job_id = reply["job"]
    return next((j["name"] for j in reply["queued"] if j["id"] == job_id), job_id)


def _autostart(args: argparse.Namespace) -> int:
    """Install (or remove) what starts the service at login; see ui/desktop/autostart.py."""
    from stemdeck_watch.ui.desktop import autostart

    home = Path.home()
    if args.remove:
        removed, foreign = autostart.remove(autostart.all_places(sys.platform, home))
        for path in removed:
            print(f"removed {path}")
        for path in foreign:
            print(f"left {path} alone: it was not written by `stemdeck-watch autostart`")
        if not removed and not foreign:
            print("nothing to remove: `stemdeck-watch autostart` has not installed anything")
        if any(path.name == autostart.UNIT for path in removed):
            print(f"if it was enabled: systemctl --user disable --now {autostart.UNIT}")
        return EXIT_OK
    settings = load_settings(args.config)
    entry = autostart.entry_for(
        sys.platform,
        home,
        autostart.command(settings.source, args.headless),
        settings.source,
        args.headless,
    )
    try:
        done = autostart.install(entry)
    except autostart.NotOurs as exc:
        print(f"stemdeck-watch: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except OSError as exc:
        print(
            f"stemdeck-watch: could not write {entry.path}: {exc.strerror or exc}", file=sys.stderr
        )
        return EXIT_FAILED
    print(f"{done} {entry.path}")
    if settings.source:
        print(f"it runs with the config {settings.source}")
    else:
        print(
            "no stemdeck.toml was found, so it runs with the built-in defaults; "
            "`stemdeck-watch config init` writes one (then run `autostart` again)"
        )
    if entry.after:
        print(entry.after)
    return EXIT_OK


def _models(args: argparse.Namespace, settings: Settings) -> int:
    from stemdeck_watch.cli.models import run

    return run(args, settings)


def _password(args: argparse.Namespace, settings: Settings) -> int:
    from stemdeck_watch.cli.password import run

    return run(args, settings)


def _doctor(args: argparse.Namespace, settings: Settings) -> int:
    from stemdeck_watch.cli.doctor import run_doctor

    return run_doctor(settings, print)


def _demo(args: argparse.Namespace) -> int:
    from stemdeck_watch.cli.demo import run_demo
    from stemdeck_watch.cli.logs import setup_logging

    setup_logging(None)
    return run_demo(args.dir, print)
