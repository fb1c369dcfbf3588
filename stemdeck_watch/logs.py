"""Logging: a rotating file in the state dir (for `doctor` and bug reports) and the terminal.

The log names every song, folder and link (whose URLs may carry share tokens): its folder and
files are for the user only (0700 / 0600), whatever the umask.
"""
from __future__ import annotations

import logging
import logging.handlers
import os
import sys
from pathlib import Path
from typing import Any

from stemdeck_watch.paths import private_dir, tighten

FORMAT = "%(asctime)s %(levelname)-7s %(name)s: %(message)s"
TERMINAL_FORMAT = "%(asctime)s %(levelname)-7s %(message)s"


def setup_logging(state_dir: Path | None, verbose: bool = False, terminal: bool = True) -> Path | None:
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
            log_file, maxBytes=2_000_000, backupCount=5, encoding="utf-8")
        file_handler.setFormatter(logging.Formatter(FORMAT))
        file_handler.setLevel(logging.DEBUG)
        root.addHandler(file_handler)
    if terminal:
        stream = logging.StreamHandler(sys.stderr)
        stream.setFormatter(logging.Formatter(TERMINAL_FORMAT, "%H:%M:%S"))
        stream.setLevel(logging.DEBUG if verbose else logging.INFO)
        root.addHandler(stream)
    return log_file


class _PrivateFileHandler(logging.handlers.RotatingFileHandler):
    """A rotating log whose files (each new one after a rollover too) are created 0600."""

    def _open(self) -> Any:
        return open(self.baseFilename, self.mode, encoding=self.encoding, errors=self.errors,
                    opener=lambda path, flags: os.open(path, flags, 0o600))
