"""Logging: a rotating file in the state dir (for `doctor` and bug reports) and the terminal.

Log messages name songs, and a song's name is whatever someone called a file in a synced
folder: every record is written with its control characters escaped (see SafeFormatter), so
a name cannot forge a log line or send escape sequences to the terminal. The log also names
links, whose URLs may carry share tokens: its folder and files are for the user only (0700 /
0600), whatever the umask.
"""

from __future__ import annotations

import logging
import logging.handlers
import os
import sys
from pathlib import Path
from typing import Any

from stemdeck_watch.util.safetext import escape_controls
from stemdeck_watch.core.paths import private_dir, tighten

FORMAT = "%(asctime)s %(levelname)-7s %(name)s: %(message)s"
TERMINAL_FORMAT = "%(asctime)s %(levelname)-7s %(message)s"


class SafeFormatter(logging.Formatter):
    """A Formatter whose message is one line with every control character escaped (`\\n`,
    `\\x1b`); a traceback keeps its own line breaks but nothing else. On every handler, so
    every logger's records are covered, whatever they log."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        saved = record.message
        record.message = escape_controls(saved)
        try:
            return super().formatMessage(record)
        finally:
            record.message = saved

    def formatException(self, ei: Any) -> str:
        return escape_controls(super().formatException(ei), keep="\n")

    def formatStack(self, stack_info: str) -> str:
        return escape_controls(super().formatStack(stack_info), keep="\n")


def setup_logging(
    state_dir: Path | None, verbose: bool = False, terminal: bool = True
) -> Path | None:
    """Configure the `stemdeck_watch` loggers; returns the log file's path."""
    root = logging.getLogger("stemdeck_watch")
    root.setLevel(logging.DEBUG)
    for handler in list(root.handlers):
        root.removeHandler(handler)
        handler.close()
    root.propagate = False
    log_file = None
    if state_dir is not None:
        log_dir = private_dir(private_dir(state_dir) / "logs")
        log_file = log_dir / "stemdeck-watch.log"
        for old in log_dir.glob(log_file.name + "*"):
            tighten(old)  # written by an older version with the umask's mode
        file_handler = _PrivateFileHandler(
            log_file, maxBytes=2_000_000, backupCount=5, encoding="utf-8"
        )
        file_handler.setFormatter(SafeFormatter(FORMAT))
        file_handler.setLevel(logging.DEBUG)
        root.addHandler(file_handler)
    if terminal:
        stream = logging.StreamHandler(sys.stderr)
        stream.setFormatter(SafeFormatter(TERMINAL_FORMAT, "%H:%M:%S"))
        stream.setLevel(logging.DEBUG if verbose else logging.INFO)
        root.addHandler(stream)
    return log_file


class _PrivateFileHandler(logging.handlers.RotatingFileHandler):
    """A rotating log whose files (each new one after a rollover too) are created 0600."""

    def _open(self) -> Any:
        return open(
            self.baseFilename,
            self.mode,
            encoding=self.encoding,
            errors=self.errors,
            opener=lambda path, flags: os.open(path, flags, 0o600),
        )
