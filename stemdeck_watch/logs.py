"""Logging: a rotating file in the state dir (for `doctor` and bug reports) and the terminal."""
from __future__ import annotations

import logging
import logging.handlers
import sys
from pathlib import Path

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
        log_dir = state_dir / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        log_file = log_dir / "stemdeck-watch.log"
        file_handler = logging.handlers.RotatingFileHandler(
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
