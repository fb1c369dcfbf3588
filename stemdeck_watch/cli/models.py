"""`models`: the pretrained Demucs models — list them, download one, check the cache, import
an offline copy. The service downloads a missing model by itself on first use; these
commands do it ahead, with a progress bar, or without a network at all (`import`). They
never import torch: they answer at once, also while the service runs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, TextIO

from stemdeck_watch.core.config import Settings
from stemdeck_watch.util.redact import redact_url
from stemdeck_watch.util.safetext import escape_controls
from stemdeck_watch.workers.catalogue import CATALOGUE

if TYPE_CHECKING:  # imported when the command runs: the parser is built for every command
    from stemdeck_watch.workers.models import ModelState, ModelStore

EXIT_OK, EXIT_FAILED = 0, 1
# what "verified" proves, said wherever the commands say it (docs: Models, Trust boundaries)
PROVES = (
    "each file's sha256 matches the checksum in its name: that finds damage in transfer or "
    "on disk, not a file made to match (the checksum is short, and where it came with the "
    "files their maker made it too)"
)
BAR = 30  # characters of the progress bar


def add_parser(add: Callable[..., argparse.ArgumentParser]) -> None:
    """The `models` command and its actions, on the CLI's parser."""
    models = add("models", help="the Demucs models: list, download, check, import")
    actions = models.add_subparsers(dest="models_command", metavar="ACTION", required=True)
    listing = actions.add_parser(
        "list",
        help="the known models: stems, download size, what "
        "each is good for, whether it is downloaded",
    )
    listing.add_argument("--json", action="store_true", help="machine-readable output")
    pull = actions.add_parser(
        "pull",
        help="download a model from separation.model_hub into "
        "the cache, verified; an interrupted download resumes",
    )
    pull.add_argument("name", metavar="NAME", help="a model name, e.g. htdemucs")
    actions.add_parser(
        "verify",
        help="check every cached model file against the checksum in its name "
        "(finds damage, not a file made to match)",
    )
    imports = actions.add_parser(
        "import",
        help="copy the model files of an offline copy "
        "(a folder as on the model hub) into the cache, verified; its lists "
        "may add models, never redefine one demucs defines",
    )
    imports.add_argument(
        "folder",
        metavar="FOLDER",
        type=Path,
        help="the folder holding the .th files (and files.txt, .yaml)",
    )


def run(
    args: argparse.Namespace,
    settings: Settings,
    out: TextIO | None = None,
    err: TextIO | None = None,
) -> int:
    # the streams as they are when the command runs, not when this module was imported (a
    # caller, a test's capture, may have replaced and closed those since)
    out, err = out or sys.stdout, err or sys.stderr
    from stemdeck_watch.workers import download
    from stemdeck_watch.workers.models import ModelStore, ModelStoreError

    store = ModelStore(settings.separation.model_hub)
    action = args.models_command
    try:
        if action == "list":
            return _list(store, settings, args.json, out)
        if action == "pull":
            return _pull(store, settings, args.name, out, err)
        if action == "verify":
            return _verify(store, out, err)
        return _import(store, args.folder, out, err)
    except (ModelStoreError, download.DownloadError) as exc:
        print(f"stemdeck-watch: {escape_controls(exc)}", file=err)
        return EXIT_FAILED


def _list(store: ModelStore, settings: Settings, as_json: bool, out: TextIO) -> int:
    index = store.index()
    states = [store.state(entry.name, index) for entry in CATALOGUE]
    chosen = settings.separation.model
    if as_json:
        print(
            json.dumps(
                {
                    "hub": redact_url(store.hub),
                    "cache": str(store.cache),
                    "model": chosen,
                    "model_repo": settings.separation.model_repo or None,
                    "models": [_as_dict(s) for s in states],
                },
                indent=2,
            ),
            file=out,
        )
        return EXIT_OK
    rows = [("model", "stems", "download", "cached", "good for")]
    for state in states:
        mark = " *" if state.name == chosen else ""
        rows.append(
            (
                state.name + mark,
                str(len(state.stems)),
                f"≈{state.size_mb} MB",
                _cached_words(state),
                state.good_for,
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    for row in rows:
        print(
            "  ".join(cell.ljust(width) for cell, width in zip(row, widths)) + "  " + row[4],
            file=out,
        )
    print(
        f"\n* separation.model; stems: {', '.join(states[0].stems)} (htdemucs_6s: "
        f"also guitar, piano)",
        file=out,
    )
    print(f"cache: {escape_controls(store.cache)}", file=out)
    print(f"hub:   {escape_controls(redact_url(store.hub))}", file=out)
    if settings.separation.model_repo:
        print(
            f"separation.model_repo = {escape_controls(settings.separation.model_repo)}: the "
            f"service loads its models from that folder, not from this cache",
            file=out,
        )
    return EXIT_OK


def _as_dict(state: ModelState) -> dict[str, Any]:
    return {
        "name": state.name,
        "stems": list(state.stems),
        "size_mb": state.size_mb,
        "good_for": state.good_for,
        "cached": state.cached,
        "files": state.files,
        "files_cached": state.present,
        "partial_bytes": state.partial_bytes,
        "huggingface_cache": state.hf,
    }


def _cached_words(state: ModelState) -> str:
    if state.cached:
        return "yes"
    if state.hf:
        return "yes (HuggingFace cache)"
    if state.partial_bytes:
        return f"partly ({download_mb(state.partial_bytes)} MB; pull resumes)"
    if state.present:
        return f"{state.present} of {state.files} files"
    return "no"


def _pull(store: ModelStore, settings: Settings, name: str, out: TextIO, err: TextIO) -> int:
    if settings.separation.model_repo:
        print(
            f"note: separation.model_repo is set, so the service loads its models from "
            f"{escape_controls(settings.separation.model_repo)}, not from this cache",
            file=err,
        )
    from stemdeck_watch.workers import download

    bar = ProgressBar(name, err)
    started = time.monotonic()
    try:
        try:
            paths = store.pull(name, bar.update)
        finally:
            bar.close()  # what follows on a line of its own
    except download.Interrupted as exc:
        print(
            f"stemdeck-watch: {escape_controls(exc)}; run `stemdeck-watch models pull "
            f"{escape_controls(name)}` again to resume",
            file=err,
        )
        return EXIT_FAILED
    except KeyboardInterrupt:
        print(
            f"stemdeck-watch: interrupted at {bar.words()}; run `stemdeck-watch models pull "
            f"{escape_controls(name)}` again to resume",
            file=err,
        )
        return EXIT_FAILED
    size = sum(path.stat().st_size for path in paths)
    print(
        f"{escape_controls(name)}: ready, {len(paths)} file(s), {download_mb(size)} MB, "
        f"verified, in {escape_controls(store.cache)} ({time.monotonic() - started:.1f} s)",
        file=out,
    )
    print(f"verified: {PROVES}", file=out)
    return EXIT_OK


def _verify(store: ModelStore, out: TextIO, err: TextIO) -> int:
    checked = store.verify()
    index = store.index()
    users: dict[str, list[str]] = {}
    for name in list(index.bags):
        for sig in index.bags[name].models:
            if sig in index.files:
                users.setdefault(index.files[sig].name, []).append(name)
    damaged = 0
    for path, problem in checked:
        if problem is None:
            print(f"ok       {path.name}", file=out)
            continue
        damaged += 1
        models = sorted(set(users.get(path.name, [])))
        fix = (
            f"; `stemdeck-watch models pull {models[0]}` downloads it again"
            if models
            else "; delete it"
        )
        print(
            f"DAMAGED  {path.name} ({', '.join(models) or 'no named model'}): {problem}{fix}",
            file=out,
        )
    if not checked:
        print(f"no model files in {escape_controls(store.cache)} yet", file=out)
        return EXIT_OK
    whole = len(checked) - damaged
    print(
        f"{whole} of {len(checked)} model file(s) in {escape_controls(store.cache)} are whole",
        file=out,
    )
    print(f"whole: {PROVES}", file=out)
    if damaged:
        print(f"stemdeck-watch: {damaged} damaged model file(s)", file=err)
        return EXIT_FAILED
    return EXIT_OK


def _import(store: ModelStore, folder: Path, out: TextIO, err: TextIO) -> int:
    imported, refused = store.import_folder(folder)
    for name in imported:
        print(f"imported {name}", file=out)
    if imported:
        print(f"verified: {PROVES}", file=out)
    for path, why in refused:
        print(f"refused  {escape_controls(path)}: {why}", file=err)
    index = store.index()
    ready = [entry.name for entry in CATALOGUE if store.state(entry.name, index).cached]
    print(f"models ready in {escape_controls(store.cache)}: {', '.join(ready) or 'none'}", file=out)
    if not imported and not refused:
        print(f"stemdeck-watch: no model files (.th) in {escape_controls(folder)}", file=err)
    return EXIT_OK if imported and not refused else EXIT_FAILED


def download_mb(size: int) -> str:
    return f"{size / 1e6:.1f}"


class ProgressBar:
    """`htdemucs [#######.......] 34.0 / 80.2 MB` on a terminal, redrawn in place at most
    ten times a second; a line every tenth of the way otherwise (a log, a test), or every
    10 MB where the size is not known. A total the bytes have passed was wrong (a hub
    that misstated the size) and is not shown."""

    def __init__(self, name: str, stream: TextIO):
        self.name, self.stream = name, stream
        self.tty = stream.isatty()
        self.done: int = 0
        self.total: int | None = None
        self._drawn = 0.0
        self._step = -1
        self._shown = ""

    def words(self) -> str:
        total = f" / {download_mb(self.total)}" if self.total else ""
        return f"{download_mb(self.done)}{total} MB"

    def update(self, done: int, total: int | None) -> None:
        if total is not None and done > total:
            total = None
        self.done, self.total = done, total
        if self.tty:
            now = time.monotonic()
            if now - self._drawn < 0.1 and not (total and done >= total):
                return
            self._drawn = now
            filled = int(BAR * done / total) if total else 0
            bar = f"[{'#' * filled}{'.' * (BAR - filled)}] " if total else ""
            self.stream.write(f"\r{escape_controls(self.name)} {bar}{self.words()}\033[K")
            self.stream.flush()
            return
        step = int(10 * done / total) if total else done // 10_000_000
        words = self.words()
        if step != self._step and words != self._shown:
            self._step, self._shown = step, words
            print(f"{escape_controls(self.name)}: {words}", file=self.stream, flush=True)

    def close(self) -> None:
        if self.tty and self._drawn:
            self._drawn = 0.0
            self.stream.write("\n")
            self.stream.flush()
