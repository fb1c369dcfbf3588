"""`models`: the pretrained Demucs models and the catalogued RoFormer checkpoints — list them
with what each scores as published, download one, check the cache, import an offline copy. The service downloads a missing model by itself on first use; these
commands do it ahead, with a progress bar, or without a network at all (`import`). They
never import torch: they answer at once, also while the service runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, TextIO, TypeVar

from stemdeck_watch.core.config import Settings
from stemdeck_watch.util.redact import redact_url
from stemdeck_watch.util.safetext import escape_controls
from stemdeck_watch.core.recipes import RECIPES
from stemdeck_watch.workers.demucs.catalogue import CATALOGUE
from stemdeck_watch.workers.roformer import catalogue as roformer_catalogue

T = TypeVar("T")

if TYPE_CHECKING:  # imported when the command runs: the parser is built for every command
    from stemdeck_watch.workers.demucs.models import ModelState, ModelStore
    from stemdeck_watch.workers.roformer.store import RoformerStore

EXIT_OK, EXIT_FAILED = 0, 1
# what "verified" proves, said wherever the commands say it (docs: Models, Trust boundaries)
PROVES = (
    "each file's sha256 matches the checksum in its name: that finds damage in transfer or "
    "on disk, not a file made to match (the checksum is short, and where it came with the "
    "files their maker made it too)"
)
# ...and for a file the catalogue holds no sha256 for (an entry nobody has pinned yet)
PROVES_NOTHING = (
    "no sha256 is pinned for it, so neither damage nor a different file can be found: "
    "compare the sha256 shown with a copy you trust"
)
BAR = 30  # characters of the progress bar


def add_parser(add: Callable[..., argparse.ArgumentParser]) -> None:
    """The `models` command and its actions, on the CLI's parser."""
    models = add(
        "models", help="the Demucs models and RoFormer checkpoints: list, download, check, import"
    )
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
    pull.add_argument(
        "name", metavar="NAME", help="a model name, e.g. htdemucs or bs_roformer_viperx_1297"
    )
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
        help="the folder holding the .th files (and files.txt, .yaml), or the RoFormer "
        ".ckpt and .yaml files under their published names",
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
    from stemdeck_watch.workers.demucs.models import ModelStore, ModelStoreError

    from stemdeck_watch.workers.roformer.store import RoformerStore, RoformerStoreError

    store = ModelStore(settings.separation.model_hub)
    roformers = RoformerStore(store.cache, settings.separation.model_hub)
    action = args.models_command
    try:
        if action == "list":
            return _list(store, roformers, settings, args.json, out)
        if action == "pull" and args.name in roformer_catalogue.KNOWN:
            return _pull_roformer(roformers, settings, args.name, out, err)
        if action == "pull":
            return _pull(store, settings, args.name, out, err)
        if action == "verify":
            return max(_verify(store, out, err), _verify_roformers(roformers, out, err))
        return _import(store, roformers, args.folder, out, err)
    except (ModelStoreError, RoformerStoreError, download.DownloadError) as exc:
        print(f"stemdeck-watch: {escape_controls(exc)}", file=err)
        return EXIT_FAILED


def _list(
    store: ModelStore,
    roformers: RoformerStore,
    settings: Settings,
    as_json: bool,
    out: TextIO,
) -> int:
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
                    "recipe": settings.separation.recipe or None,
                    "model_repo": settings.separation.model_repo or None,
                    "models": [_as_dict(s) for s in states],
                    "roformer": [
                        _roformer_dict(entry, roformers) for entry in roformer_catalogue.CATALOGUE
                    ],
                    "recipes": [dataclasses.asdict(recipe) for recipe in RECIPES],
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
    _list_roformers(roformers, settings, out)
    print(f"\ncache: {escape_controls(store.cache)}", file=out)
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


def _roformer_dict(entry: roformer_catalogue.Checkpoint, store: RoformerStore) -> dict[str, Any]:
    state = store.state(entry.name)
    return {
        "name": entry.name,
        "architecture": entry.architecture,
        "trained_by": entry.trained_by,
        "stems": list(entry.stems),
        "size_mb": entry.megabytes,
        "parameters": entry.parameters,
        "licence": entry.licence,
        "source": entry.checkpoint_url,
        "config_source": entry.config_url,
        "checkpoint_sha256": entry.checkpoint_sha256,
        "config_sha256": entry.config_sha256,
        "scores": [dataclasses.asdict(score) for score in entry.scores],
        "cached": state.cached,
        "partial_bytes": state.partial_bytes,
    }


def _list_roformers(store: RoformerStore, settings: Settings, out: TextIO) -> None:
    """The RoFormer checkpoints, each score with its test set (figures on different sets do
    not compare), and the recipes that use them."""
    print("\nRoFormer checkpoints (vocals; SDR in dB as published, by test set):", file=out)
    for entry in roformer_catalogue.CATALOGUE:
        state = store.state(entry.name)
        cached = (
            "yes"
            if state.cached
            else f"partly ({download_mb(state.partial_bytes)} MB; pull resumes)"
            if state.partial_bytes
            else "no"
        )
        print(
            f"  {entry.name}  {entry.architecture}, by {entry.trained_by}, ≈{entry.megabytes} MB, "
            f"licence: {entry.licence or 'not published'}, sha256: "
            f"{'pinned' if state.pinned else 'not pinned'}, cached: {cached}",
            file=out,
        )
        for score in entry.scores:
            print(f"      {score.stem:<12} {score.sdr:7.2f}  {score.test_set}", file=out)
        print(f"      source: {entry.checkpoint_url}", file=out)
    print("\nrecipes (separation.recipe; tag [best]):", file=out)
    for recipe in RECIPES:
        mark = " *" if recipe.name == settings.separation.recipe else ""
        print(
            f"  {recipe.name}{mark}: vocals {recipe.vocals}, drums/bass/other {recipe.rest}; "
            f"{recipe.about}",
            file=out,
        )
    print(
        "compare figures on the same test set only; on the "
        f"{roformer_catalogue.MULTISONG} ZFTurbo's table gives its fine-tuned HTDemucs4 "
        "vocals model 8.78",
        file=out,
    )


def _with_progress(name: str, pull: Callable[[Callable[..., None]], T], err: TextIO) -> T | None:
    """`pull(progress)` under a progress bar on `err`. A download cut off or interrupted
    keeps what it has: None, and the command that resumes it said."""
    from stemdeck_watch.workers import download

    bar = ProgressBar(name, err)
    try:
        try:
            return pull(bar.update)
        finally:
            bar.close()  # what follows on a line of its own
    except (download.Interrupted, KeyboardInterrupt) as exc:
        what = escape_controls(exc) if str(exc) else f"interrupted at {bar.words()}"
        print(
            f"stemdeck-watch: {what}; run `stemdeck-watch models pull "
            f"{escape_controls(name)}` again to resume",
            file=err,
        )
        return None


def _pull_roformer(
    store: RoformerStore, settings: Settings, name: str, out: TextIO, err: TextIO
) -> int:
    if settings.separation.model_repo:
        print(
            f"note: separation.model_repo is set, so the service loads {escape_controls(name)} "
            f"from {escape_controls(settings.separation.model_repo)}, not from this cache",
            file=err,
        )
    started = time.monotonic()
    pulled = _with_progress(name, lambda progress: store.pull(name, progress), err)
    if pulled is None:
        return EXIT_FAILED
    paths, notes = pulled
    size = sum(path.stat().st_size for path in paths)
    checked = "unchecked" if notes else "verified"
    print(
        f"{escape_controls(name)}: ready, {len(paths)} file(s), {download_mb(size)} MB, "
        f"{checked}, in {escape_controls(store.folder)} ({time.monotonic() - started:.1f} s)",
        file=out,
    )
    for note in notes:
        print(f"unchecked: {escape_controls(note)}", file=out)
    if len(notes) < len(paths):
        print("verified: each file's sha256 equals the one the catalogue pins", file=out)
    return EXIT_OK


def _verify_roformers(store: RoformerStore, out: TextIO, err: TextIO) -> int:
    damaged = 0
    for path, problem, pinned in store.verify():
        if problem is not None:
            damaged += 1
            print(f"DAMAGED  {path.name}: {problem}; delete it and pull again", file=out)
        elif pinned:
            print(f"ok       {path.name}", file=out)
        else:
            print(f"unpinned {path.name}: {PROVES_NOTHING}", file=out)
    if damaged:
        print(f"stemdeck-watch: {damaged} damaged RoFormer file(s)", file=err)
        return EXIT_FAILED
    return EXIT_OK


def _pull(store: ModelStore, settings: Settings, name: str, out: TextIO, err: TextIO) -> int:
    if settings.separation.model_repo:
        print(
            f"note: separation.model_repo is set, so the service loads its models from "
            f"{escape_controls(settings.separation.model_repo)}, not from this cache",
            file=err,
        )
    started = time.monotonic()
    paths = _with_progress(name, lambda progress: store.pull(name, progress), err)
    if paths is None:
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
    """The Demucs files of the cache."""
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


def _import(
    store: ModelStore, roformers: RoformerStore, folder: Path, out: TextIO, err: TextIO
) -> int:
    imported, refused = store.import_folder(folder)
    for name in imported:
        print(f"imported {name}", file=out)
    if imported:
        print(f"verified: {PROVES}", file=out)
    theirs, refused_theirs, notes = roformers.import_folder(folder)
    for name in theirs:
        print(f"imported {name}", file=out)
    for note in notes:
        print(f"unchecked: {escape_controls(note)}", file=out)
    imported += theirs
    refused += refused_theirs
    for path, why in refused:
        print(f"refused  {escape_controls(path)}: {why}", file=err)
    index = store.index()
    ready = [entry.name for entry in CATALOGUE if store.state(entry.name, index).cached]
    print(f"models ready in {escape_controls(store.cache)}: {', '.join(ready) or 'none'}", file=out)
    if not imported and not refused:
        print(
            f"stemdeck-watch: no model files (.th, or a catalogued RoFormer's .ckpt and "
            f".yaml) in {escape_controls(folder)}",
            file=err,
        )
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
