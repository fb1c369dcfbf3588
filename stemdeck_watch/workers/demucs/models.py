"""The pretrained Demucs models: which there are, which files each needs, and the cache.

demucs names its models' files in `demucs/remote/` (shipped with it): `files.txt` lists every
model file as `<signature>-<sha256 prefix>.th` under a `root:` folder of the hub, and
`<name>.yaml` says which signatures a named model (a bag) combines. The files come from the
hub (`separation.model_hub`, demucs's own mirror by default) into torch.hub's checkpoints
folder, under the names torch.hub gives them, so a model demucs downloaded is cached here too
and the other way round.

A hub may serve its own `files.txt` and `<name>.yaml` at its root (a mirror of other models,
or the tests' loopback mirror of a tiny one); they are kept beside the cache, per hub, and
take precedence over demucs's own lists for that hub: the hub is the owner's choice
(`separation.model_hub`). `models import FOLDER` reads them from an offline copy too, but a
folder only adds models: the names and checksums demucs defines stay demucs's.

"Verified" means a file's sha256 starts with the checksum its name carries (8 hex digits
in demucs's lists): it finds a file damaged in transfer or on disk. It is no proof of who
made the file: the checksum is short, and where it came with the files (a hub's or a
folder's list), whoever made the file made the checksum too.

Nothing here imports torch but `ModelStore.load` (the worker's): `stemdeck-watch models`
answers at once.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.util
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any, Callable

from stemdeck_watch.util.redact import redact_url
from stemdeck_watch.util.safefile import discard, open_new, temp_name, write_replacing
from stemdeck_watch.util.validators import MODEL_STEMS
from stemdeck_watch.workers import download
from stemdeck_watch.workers.demucs.catalogue import CATALOGUE, KNOWN, size_cap

log = logging.getLogger(__name__)

DEFAULT_HUB = "https://dl.fbaipublicfiles.com/demucs/"  # demucs.pretrained.ROOT_URL
HUB_ENV = "STEMDECK_MODEL_HUB"  # the hub, for the worker process (from separation.model_hub)
INDEX_DIR = ".stemdeck-index"  # beside the cache: each hub's own lists, by hub
FILE_NAME = re.compile(r"[A-Za-z0-9_]+-[0-9a-f]{8,64}\.th")
ROOT = re.compile(r"(?:[A-Za-z0-9_][A-Za-z0-9_.-]*/)*")
INDEX_LIMIT = 1 << 20

# bytes done, bytes in all (None: the hub did not say)
OnProgress = Callable[[int, "int | None"], None]


class ModelStoreError(Exception):
    """A model cannot be had as asked; the message says why and what to do."""


class UnknownModel(ModelStoreError):
    pass


class NotCached(ModelStoreError):
    pass


@dataclasses.dataclass(frozen=True)
class ModelFile:
    sig: str
    name: str  # `955717e8-8726e21a.th`: its name in the cache (torch.hub's: the URL's last part)
    path: str  # `hybrid_transformer/955717e8-8726e21a.th`: where it is on the hub

    @property
    def checksum(self) -> str:
        return download.checksum_of(self.name)


@dataclasses.dataclass(frozen=True)
class Bag:
    models: tuple[str, ...]
    weights: list[list[float]] | None = None
    segment: float | None = None


@dataclasses.dataclass
class Index:
    """Every model file by signature, and the named models (bags)."""

    files: dict[str, ModelFile] = dataclasses.field(default_factory=dict)
    bags: dict[str, Bag] = dataclasses.field(default_factory=dict)

    def sigs(self, name: str) -> list[str]:
        """The signatures `name` loads, in order (a bag), or `name` itself (one file)."""
        if name in self.bags:
            return list(self.bags[name].models)
        if name in self.files:
            return [name]
        known = ", ".join(entry.name for entry in CATALOGUE)
        raise UnknownModel(
            f"no model {name!r} is known: the known models are {known} "
            f"(`stemdeck-watch models list`); a model of your own goes in a "
            f"folder named by separation.model_repo"
        )

    def files_of(self, name: str) -> list[ModelFile]:
        """Every file `name` needs, each once."""
        out: dict[str, ModelFile] = {}
        for sig in self.sigs(name):
            if sig not in self.files:
                raise UnknownModel(
                    f"model {name!r} needs the model file {sig}, which the "
                    f"hub's files.txt does not list"
                )
            out.setdefault(sig, self.files[sig])
        return list(out.values())

    def merge(self, other: Index) -> Index:
        return Index({**self.files, **other.files}, {**self.bags, **other.bags})


def parse_files(text: str, where: str) -> dict[str, ModelFile]:
    """demucs's `files.txt`: `root: FOLDER/` lines, then the files under that folder."""
    root, files = "", {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("root:"):
            root = line.split(":", 1)[1].strip()
            if not ROOT.fullmatch(root) or ".." in root.split("/"):
                raise ModelStoreError(f"{where} line {number}: {root!r} is not a folder name")
            continue
        if not FILE_NAME.fullmatch(line):
            raise ModelStoreError(
                f"{where} line {number}: {line!r} is not a model file name "
                f"(SIGNATURE-SHA256PREFIX.th)"
            )
        sig = line.split("-", 1)[0]
        files[sig] = ModelFile(sig, line, root + line)
    return files


def parse_bag(text: str, where: str) -> Bag:
    """A named model's `<name>.yaml`: `models` (signatures), optional `weights`, `segment`."""
    import yaml

    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ModelStoreError(f"could not read {where}: {exc}") from None
    models = data.get("models") if isinstance(data, dict) else None
    if (
        not isinstance(models, list)
        or not models
        or not all(isinstance(m, str) and re.fullmatch(r"[A-Za-z0-9_]+", m) for m in models)
    ):
        raise ModelStoreError(f"{where} has no list of model signatures (models: [...])")
    weights, segment = data.get("weights"), data.get("segment")
    if weights is not None and not (
        isinstance(weights, list)
        and all(
            isinstance(row, list) and all(isinstance(v, (int, float)) for v in row)
            for row in weights
        )
    ):
        raise ModelStoreError(f"{where}: weights must be a list of lists of numbers")
    if segment is not None and not isinstance(segment, (int, float)):
        raise ModelStoreError(f"{where}: segment must be a number")
    return Bag(tuple(models), weights, None if segment is None else float(segment))


def read_index(folder: Path, where: str) -> Index:
    """The lists in `folder` (`files.txt`, `*.yaml`), whichever it has; a catalogued
    RoFormer's configuration (a `.yaml` too, under its published name) is not a list."""
    index = Index()
    listing = folder / "files.txt"
    if listing.is_file():
        index.files = parse_files(listing.read_text(encoding="utf-8"), f"{where}/files.txt")
    for path in _bag_files(folder):
        index.bags[path.stem] = parse_bag(path.read_text(encoding="utf-8"), f"{where}/{path.name}")
    return index


def _bag_files(folder: Path) -> list[Path]:
    from stemdeck_watch.workers.roformer.catalogue import CATALOGUE as ROFORMERS

    theirs = {entry.config_file for entry in ROFORMERS}
    return [path for path in sorted(folder.glob("*.yaml")) if path.name not in theirs]


def demucs_lists() -> Path:
    """demucs's own `remote/` folder, found without importing demucs (which imports torch)."""
    spec = importlib.util.find_spec("demucs")
    if spec is None or not spec.submodule_search_locations:
        raise ModelStoreError("demucs is not installed: `pip install stemdeck-watch` installs it")
    return Path(list(spec.submodule_search_locations)[0]) / "remote"


def cache_dir() -> Path:
    """torch.hub's checkpoints folder, where demucs keeps downloaded models:
    `$TORCH_HOME/hub/checkpoints` (`$XDG_CACHE_HOME/torch`, `~/.cache/torch` by default)."""
    home = os.environ.get("TORCH_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or "~/.cache", "torch"
    )
    return Path(os.path.expanduser(home)) / "hub" / "checkpoints"


def hf_cached(name: str) -> bool:
    """Whether demucs's HuggingFace download of `name` is in the HuggingFace cache (what
    earlier versions of this service downloaded); the worker loads it from there, offline."""
    hub = os.environ.get("HF_HUB_CACHE") or os.path.join(
        os.environ.get("HF_HOME")
        or os.path.join(os.environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface"),
        "hub",
    )
    namespace, base = name.split("/", 1) if "/" in name else ("adefossez", name)
    repo = (
        "HTDemucs"
        if base == "htdemucs"
        else "HTDemucs-" + base[len("htdemucs_") :]
        if base.startswith("htdemucs_")
        else "Demucs-" + base
    )
    snapshots = Path(os.path.expanduser(hub)) / f"models--{namespace}--{repo}" / "snapshots"
    try:
        return any((snap / f"{base}.yaml").is_file() for snap in snapshots.iterdir())
    except OSError:
        return False


@dataclasses.dataclass(frozen=True)
class ModelState:
    """A model as `models list` shows it."""

    name: str
    stems: tuple[str, ...]
    size_mb: int | None
    good_for: str
    files: int  # files it needs
    present: int  # of which are in the cache
    partial_bytes: int  # downloaded so far of the missing ones (a pull resumes from there)
    hf: bool  # in the HuggingFace cache (earlier versions' downloads)

    @property
    def cached(self) -> bool:
        return self.files > 0 and self.present == self.files


class ModelStore:
    """The models of one hub in the cache: what each needs, what is there, pull, verify,
    import, and (in the worker) load."""

    def __init__(
        self, hub: str | None = None, cache: Path | None = None, timeout: float = download.TIMEOUT
    ):
        self.hub = hub or os.environ.get(HUB_ENV) or DEFAULT_HUB
        if not self.hub.endswith("/"):
            self.hub += "/"
        self.cache = cache or cache_dir()
        self.timeout = timeout

    @property
    def lists(self) -> Path:
        """This hub's own lists, kept beside the cache (one folder per hub)."""
        key = hashlib.sha256(self.hub.encode()).hexdigest()[:16]
        return self.cache / INDEX_DIR / key

    def index(self) -> Index:
        """demucs's lists, with this hub's own (kept from a pull or an import) over them. The
        default hub serves no lists: what is kept for it came from an import, which adds
        models but never redefines one demucs defines."""
        base = read_index(demucs_lists(), "demucs/remote")
        if not self.lists.is_dir():
            return base
        kept = read_index(self.lists, str(self.lists))
        if self.hub == DEFAULT_HUB:
            kept = Index(
                {sig: f for sig, f in kept.files.items() if sig not in base.files},
                {name: bag for name, bag in kept.bags.items() if name not in base.bags},
            )
        return base.merge(kept)

    def refresh(self, name: str) -> None:
        """Keep the hub's own `files.txt` and `<name>.yaml`, where it serves them (demucs's
        own mirror serves neither: its lists ship with demucs)."""
        if self.hub == DEFAULT_HUB:
            return
        listing = download.fetch_text(self.hub + "files.txt", INDEX_LIMIT)
        bag = (
            download.fetch_text(self.hub + f"{name}.yaml", INDEX_LIMIT)
            if re.fullmatch(r"[A-Za-z0-9_]+", name)
            else None
        )
        if listing is not None:
            parse_files(listing, redact_url(self.hub) + "files.txt")
        if bag is not None:
            parse_bag(bag, redact_url(self.hub) + f"{name}.yaml")
        if listing is None and bag is None:
            return
        self.lists.mkdir(parents=True, exist_ok=True)
        if listing is not None:
            write_replacing(self.lists / "files.txt", listing)
        if bag is not None:
            write_replacing(self.lists / f"{name}.yaml", bag)

    def state(self, name: str, index: Index | None = None) -> ModelState:
        index = index or self.index()
        known = KNOWN.get(name)
        try:
            files = index.files_of(name)
        except UnknownModel:
            files = []
        present = [f for f in files if (self.cache / f.name).is_file()]
        partial = sum(
            download.partial_bytes(self.cache / f.name) for f in files if f not in present
        )
        return ModelState(
            name,
            MODEL_STEMS.get(name, ()),
            known.size_mb if known else None,
            known.good_for if known else "",
            len(files),
            len(present),
            partial,
            hf_cached(name),
        )

    def pull(
        self, name: str, on_progress: OnProgress | None = None, fetch: bool = True
    ) -> list[Path]:
        """Make every file of `name` present and verified in the cache: files already there
        are checked (a damaged one is downloaded again), missing ones downloaded from the hub
        (`fetch`; else NotCached says what is missing), never more in all than the
        catalogue's size for `name` and a margin (`size_cap`): a hub that sends more is cut
        off with TooLarge. Returns the files, in the model's order."""
        files = self._files(name, fetch)
        missing = [f for f in files if not self._verified(f)]
        if missing and not fetch:
            raise NotCached(f"model {name!r} is not downloaded yet")
        if missing:
            self.refresh(name)
            files = self._files(name, fetch)
            missing = [f for f in files if not self._verified(f)]
        sizes = {f.name: download.remote_size(self.hub + f.path) for f in missing}
        done = sum((self.cache / f.name).stat().st_size for f in files if f not in missing)
        total = (
            None
            if None in sizes.values()
            else done + sum(s for s in sizes.values() if s is not None)
        )
        cap = size_cap(name)
        if total is not None and total > cap:
            raise download.TooLarge(self._too_large(name, cap, f"says it is {total:,} bytes"))
        report = on_progress or (lambda _d, _t: None)
        for f in missing:
            log.info("downloading %s for model %s from %s", f.name, name, redact_url(self.hub))
            path = self.cache / f.name
            try:
                download.fetch(
                    self.hub + f.path,
                    path,
                    functools.partial(_offset, report, done, total),
                    self.timeout,
                    limit=cap - done,
                )
            except download.TooLarge as exc:
                raise download.TooLarge(self._too_large(name, cap, str(exc))) from None
            done += path.stat().st_size
        report(done, None if total is not None and done > total else total)
        return [self.cache / f.name for f in files]

    def _too_large(self, name: str, cap: int, what: str) -> str:
        known = KNOWN.get(name)
        size = f"about {known.size_mb} MB" if known else "not in the catalogue"
        return (
            f"model {name!r} from {redact_url(self.hub)}: {what}; the model is {size}, so "
            f"its download stops at {cap / 1e6:.1f} MB and nothing of it was kept. Is "
            f"separation.model_hub a mirror of demucs's model files?"
        )

    def _files(self, name: str, fetch: bool) -> list[ModelFile]:
        try:
            return self.index().files_of(name)
        except UnknownModel:
            if not fetch or self.hub == DEFAULT_HUB:
                raise
        self.refresh(name)  # a model only this hub lists
        return self.index().files_of(name)

    def _verified(self, entry: ModelFile) -> bool:
        """Whether the cached file is there and whole; a damaged one is removed (it is a
        cache: the hub has it)."""
        path = self.cache / entry.name
        if not path.is_file():
            return False
        if download.matches(path, entry.checksum):
            return True
        log.warning(
            "the cached model file %s is damaged (its sha256 does not start with %s); "
            "removing it so it is downloaded again",
            path,
            entry.checksum,
        )
        discard(path)
        return False

    def verify(self) -> list[tuple[Path, str | None]]:
        """Every model file in the cache that the lists name, with what is wrong with it
        (None: whole). Damaged files are left for the user to see; `pull` replaces them."""
        index, out = self.index(), []
        by_name = {f.name: f for f in index.files.values()}
        for path in sorted(self.cache.glob("*.th")):
            entry = by_name.get(path.name)
            if entry is None:
                continue
            ok = download.matches(path, entry.checksum)
            out.append(
                (path, None if ok else f"damaged: its sha256 does not start with {entry.checksum}")
            )
        return out

    def import_folder(self, folder: Path) -> tuple[list[str], list[tuple[Path, str]]]:
        """Copy the model files of an offline copy (a folder of `.th` files as on the hub, in
        its folders or not, with its own `files.txt` and `.yaml` files if it has them) into
        the cache, each verified. Returns (names of the files imported, (file, why) for each
        one refused)."""
        if not folder.is_dir():
            raise ModelStoreError(
                f"{folder} is not a folder: name the folder holding the "
                f"model files (SIGNATURE-SHA256PREFIX.th)"
            )
        theirs = read_index(folder, str(folder))
        _refuse_redefined(theirs, read_index(demucs_lists(), "demucs/remote"), folder)
        if theirs.files or theirs.bags:
            self.lists.mkdir(parents=True, exist_ok=True)
            for source in [folder / "files.txt", *_bag_files(folder)]:
                if source.is_file():
                    write_replacing(self.lists / source.name, source.read_text(encoding="utf-8"))
        by_name = {f.name: f for f in self.index().files.values()}
        imported, refused = [], []
        self.cache.mkdir(parents=True, exist_ok=True)
        for path in _model_files(folder):
            entry = by_name.get(path.name)
            if entry is None:
                refused.append((path, "not a file of any model the lists name"))
            elif (self.cache / entry.name).is_file() and self._verified(entry):
                imported.append(entry.name)  # there already
            elif not download.matches(path, entry.checksum):
                refused.append((path, f"damaged: its sha256 does not start with {entry.checksum}"))
            else:
                self._copy_in(path, self.cache / entry.name, entry.checksum)
                imported.append(entry.name)
        return imported, refused

    def _copy_in(self, source: Path, dest: Path, checksum: str) -> None:
        tmp = dest.with_name(temp_name(dest.name, download.PARTIAL))
        try:
            with open(source, "rb") as src, open_new(tmp) as out:
                shutil.copyfileobj(src, out, 1 << 20)
                out.flush()
                os.fsync(out.fileno())
            if not download.matches(tmp, checksum):  # changed while we copied it
                raise ModelStoreError(f"{source} changed while it was copied; try again")
            os.replace(tmp, dest)
        except BaseException:
            discard(tmp)
            raise

    def load(self, name: str) -> Any:
        """The model, built the way demucs builds a pretrained one (its `load_model` for each
        file, a `BagOfModels` for a named model) from files `pull` made present and verified.
        The worker's: this imports torch."""
        from demucs.apply import BagOfModels
        from demucs.states import load_model

        index = self.index()
        models = [load_model(self.cache / index.files[sig].name) for sig in index.sigs(name)]
        bag = index.bags.get(name)
        model = BagOfModels(models, bag.weights, bag.segment) if bag else models[0]
        model.eval()
        return model


def _refuse_redefined(theirs: Index, demucs: Index, folder: Path) -> None:
    """An imported folder's lists may add models, never change one demucs defines: its
    `<name>.yaml` and the checksums of its files come from demucs's own lists, or a folder
    could make `htdemucs` load any file (a model file is code) "verified" against the
    checksum the same folder supplied. Raises ModelStoreError, naming the list."""
    for name, bag in sorted(theirs.bags.items()):
        if name in demucs.bags and bag != demucs.bags[name]:
            raise ModelStoreError(
                f"refused: {folder / (name + '.yaml')} redefines {name}, a model demucs "
                f"itself defines; its files and checksums come from demucs's own list, never "
                f"from an imported folder. Remove {name}.yaml from the folder (the files of "
                f"the real {name} are taken by their names), or name a model of your own "
                f"otherwise; nothing was imported"
            )
    for sig, entry in sorted(theirs.files.items()):
        if sig in demucs.files and entry.name != demucs.files[sig].name:
            raise ModelStoreError(
                f"refused: {folder / 'files.txt'} lists {entry.name} for the model file "
                f"{sig}, which demucs's own list names {demucs.files[sig].name}; a checksum of "
                f"a model demucs defines never comes from an imported folder. Remove that "
                f"line; nothing was imported"
            )


def _offset(report: OnProgress, before: int, total: int | None, present: int) -> None:
    """A file's progress as the model's: the bytes of the files before it added. A hub whose
    size was wrong (more bytes arrive than it said) gives no total: "31.5 / 0.0 MB" would
    help nobody."""
    done = before + present
    report(done, None if total is not None and done > total else total)


def _model_files(folder: Path, depth: int = 3) -> list[Path]:
    """The `.th` files in `folder` and its folders (as deep as a hub's layout goes); links
    are not followed."""
    found: list[Path] = []
    for entry in sorted(os.scandir(folder), key=lambda e: e.name):
        if entry.is_dir(follow_symlinks=False) and depth > 1:
            found += _model_files(Path(entry.path), depth - 1)
        elif entry.is_file(follow_symlinks=False) and entry.name.endswith(".th"):
            found.append(Path(entry.path))
    return found
