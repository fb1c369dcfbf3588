"""`doctor`: check, one line each, everything a working service needs.

Each check says what it found and, when something is wrong, what to do. It loads the model in
a real worker process (the only step that imports torch), so a model that `run` could not load
shows up here first.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import time
from pathlib import Path
from typing import Callable

from stemdeck_watch.core.config import Settings
from stemdeck_watch.intake.watcher import choose_mode
from stemdeck_watch.core.lock import running_pid
from stemdeck_watch.core.paths import filesystem_type

SYNC_FOLDER_HINTS = (
    "dropbox",
    "google drive",
    "googledrive",
    "onedrive",
    "icloud",
    "nextcloud",
    "syncthing",
    "mobile documents",
)


@dataclasses.dataclass(frozen=True)
class Finding:
    ok: bool
    title: str
    detail: str
    warning: bool = False

    def line(self) -> str:
        mark = "ok  " if self.ok and not self.warning else ("warn" if self.ok else "FAIL")
        return f"[{mark}] {self.title}: {self.detail}"


def check_folders(settings: Settings) -> list[Finding]:
    findings = []
    folders = settings.paths
    for name in ("inbox", "outbox", "processed", "failed", "state"):
        path: Path = getattr(folders, name)
        try:
            path.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=path, prefix=".stemdeck-doctor-"):
                pass
        except OSError as exc:
            findings.append(
                Finding(
                    False,
                    f"folders.{name}",
                    f"{path} is not writable "
                    f"({exc.strerror or exc}); fix its permissions or choose "
                    f"another folder",
                )
            )
            continue
        fs = filesystem_type(path)
        findings.append(Finding(True, f"folders.{name}", f"{path}{f' ({fs})' if fs else ''}"))
    state = str(folders.state).lower()
    if any(hint in state for hint in SYNC_FOLDER_HINTS):
        findings.append(
            Finding(
                True,
                "state folder",
                f"{folders.state} looks like a sync "
                "folder; the registry database should stay on local disk — set "
                "folders.state elsewhere",
                warning=True,
            )
        )
    return findings


def check_sync_layout(
    settings: Settings, extra_roots: list[tuple[str, Path]] | None = None
) -> Finding | None:
    """An inbox inside a synced folder wants outbox/ and processed/ in the same one: a phone
    then sees its song move from inbox to processed and its stems appear. None when the
    inbox is not in a synced folder this can recognise."""
    from stemdeck_watch.intake.syncfolders import find_sync_folder, nextcloud_roots

    if extra_roots is None:
        extra_roots = [("Nextcloud", root) for root in nextcloud_roots()]
    folders = settings.paths
    synced = find_sync_folder(folders.inbox, extra_roots)
    if synced is None:
        return None
    outside = [
        f"{name}/ ({getattr(folders, name)})"
        for name in ("outbox", "processed")
        if not synced.holds(getattr(folders, name))
    ]
    where = f"the inbox is inside a {synced.client} folder ({synced.root})"
    if outside:
        return Finding(
            True,
            "sync layout",
            f"{where}, but {' and '.join(outside)} "
            f"{'is' if len(outside) == 1 else 'are'} not: other devices see songs "
            f"vanish from the inbox without their stems; move "
            f"{'it' if len(outside) == 1 else 'them'} into {synced.root} too",
            warning=True,
        )
    return Finding(True, "sync layout", f"{where}, with outbox/ and processed/ beside it")


def check_watcher(settings: Settings) -> Finding:
    mode, why = choose_mode(settings.watch, settings.paths.inbox)
    detail = f"{mode} ({why})"
    limit = Path("/proc/sys/fs/inotify/max_user_watches")
    if mode == "native" and limit.exists():
        try:
            watches = int(limit.read_text())
            folders = (
                sum(1 for _ in os.walk(settings.paths.inbox)) if settings.watch.recursive else 1
            )
            detail += f"; {folders} folder(s) to watch, OS limit {watches}"
            if folders > watches * 0.8:
                return Finding(
                    True,
                    "watcher",
                    detail + " — close to the limit; the service will fall back to polling",
                    warning=True,
                )
        except (OSError, ValueError):
            pass
    return Finding(True, "watcher", detail)


def check_decode(settings: Settings) -> Finding:
    from stemdeck_watch.stages.decode import decode_to_file
    from stemdeck_watch.util.synth import write_song

    try:
        with tempfile.TemporaryDirectory(prefix="stemdeck-doctor-") as tmp:
            source = write_song(Path(tmp) / "probe.flac", 1.5)
            decoded = decode_to_file(source, Path(tmp) / "probe.npy", 44100, 2)
        import av

        return Finding(
            True,
            "decoding",
            f"PyAV {av.__version__} decoded a flac probe ({decoded.seconds:.1f} s)",
        )
    except Exception as exc:
        return Finding(
            False,
            "decoding",
            f"could not decode a probe file: {exc}; reinstall "
            "with `pip install --force-reinstall av`",
        )


def check_models(settings: Settings) -> list[Finding]:
    from stemdeck_watch.workers.executor import worker_env_for
    from stemdeck_watch.workers.local import WorkerClient

    wanted = {}
    for preset in (None, *settings.presets):
        sep, _ = settings.for_preset(preset)
        repo = settings.resolve_model_repo(sep)
        # a preset's own precision is checked too: float16, say, loads on a GPU alone
        wanted.setdefault((sep.model, str(repo) if repo else None, sep.precision), preset)
    from stemdeck_watch.workers.compiled.cache import CompileSettings

    findings = []
    sep = settings.separation
    client = WorkerClient(
        sep.device,
        worker_env_for(settings),
        threads=sep.threads,
        precision=sep.precision,
        compiling=CompileSettings(
            sep.compile, settings.paths.state / "compiled", sep.compile_cache_mb
        ),
        builds=False,  # doctor reports; the service builds
    )
    try:
        for (model, repo, precision), preset in wanted.items():
            title = f"model {model}" + (f" (preset {preset})" if preset else "")
            waiting = None if repo else not_downloaded(settings, model)
            if waiting:  # doctor downloads nothing: a first run is no failure
                findings.append(Finding(True, title, waiting))
                continue
            started = time.monotonic()
            try:
                info = client.ensure_model(model, repo, precision=precision)
            except Exception as exc:
                findings.append(Finding(False, title, str(exc)))
                continue
            findings.append(
                Finding(
                    True,
                    title,
                    f"loaded in {time.monotonic() - started:.1f} s"
                    f" from {repo or 'the model hub cache'}; stems: "
                    f"{', '.join(info.sources)}",
                )
            )
            findings.append(precision_finding(title, info.precision, client.info()))
            findings.append(compiled_finding(title, info.compiled))
    finally:
        client.close()
    return findings + check_recipes(settings)


def check_recipes(settings: Settings) -> list[Finding]:
    """Whether each recipe the config or a preset names has its RoFormer's two files where
    the worker looks for them: the service does not download a RoFormer by itself."""
    from stemdeck_watch.core.recipes import KNOWN as RECIPES
    from stemdeck_watch.workers.demucs.models import ModelStore
    from stemdeck_watch.workers.roformer.store import where

    cache = ModelStore(settings.separation.model_hub).cache
    findings, seen = [], set()
    for preset in (None, *settings.presets):
        sep, _ = settings.for_preset(preset)
        recipe = RECIPES.get(sep.recipe)
        repo = settings.resolve_model_repo(sep)
        if recipe is None or (recipe.name, repo) in seen:
            continue
        seen.add((recipe.name, repo))
        title = f"recipe {recipe.name}" + (f" (preset {preset})" if preset else "")
        files = where(recipe.vocals, cache, repo)
        missing = [path.name for path in files if not path.is_file()]
        if missing:
            how = (
                f"put them in separation.model_repo ({repo})"
                if repo
                else f"run `stemdeck-watch models pull {recipe.vocals}`"
            )
            findings.append(
                Finding(
                    False,
                    title,
                    f"the RoFormer {recipe.vocals} is missing {', '.join(missing)}: {how}; "
                    f"songs under this recipe fail until it is there",
                )
            )
        else:
            findings.append(
                Finding(True, title, f"the RoFormer {recipe.vocals} is in {files[0].parent}")
            )
    return findings


def not_downloaded(settings: Settings, model: str) -> str | None:
    """What to say of a pretrained model not in the cache yet (None: it is there, or not one
    of the hub's, which loading reports)."""
    from stemdeck_watch.util.redact import redact_url
    from stemdeck_watch.workers.demucs.models import ModelStore, ModelStoreError

    store = ModelStore(settings.separation.model_hub)
    try:
        state = store.state(model)
    except ModelStoreError:
        return None
    if state.files == 0 or state.cached or state.hf:
        return None
    size = f" (about {state.size_mb} MB)" if state.size_mb else ""
    return (
        f"not downloaded yet: the service downloads it{size} from {redact_url(store.hub)} when it "
        f"first needs it; `stemdeck-watch models pull {model}` downloads it now"
    )


def precision_finding(title: str, choice: dict, worker: dict) -> Finding:
    """The precision the worker chose for a model, with the figures that decided it."""
    from stemdeck_watch.workers.demucs.precision import cpu_bf16_flags

    figures = ""
    if choice.get("probed"):
        figures = (
            f"; measured {choice['speedup']:.2f}× float32 speed in a convolution probe "
            "(the model was not run in it)"
        )
    elif choice.get("speedup") is not None:
        snr = choice.get("worst_snr_db")
        figures = (
            f"; measured {choice['speedup']:.2f}× float32 speed, worst stem "
            f"{'identical' if snr is None else f'{snr:.1f} dB SNR'}, calibration "
            f"{choice.get('calibration_seconds') or 0:.1f} s"
        )
    cpu = ""
    if str(worker.get("device")) == "cpu":
        flags = cpu_bf16_flags()
        cpu = f"; CPU bf16 support: {', '.join(flags) if flags else 'none (emulated)'}"
    return Finding(
        True,
        f"{title} precision",
        f"{choice.get('precision', 'float32')} on {worker.get('device')} with "
        f"{worker.get('threads')} thread(s) — {choice.get('reason')}{figures}{cpu}",
    )


def compiled_finding(title: str, compiled: dict) -> Finding:
    """Whether the worker separates a model with its compiled form, and the figures."""
    state = compiled.get("state", "off")
    if state == "off":
        return Finding(True, f"{title} compiled", 'off (separation.compile = "off")')
    if state == "building":
        return Finding(
            True,
            f"{title} compiled",
            "not built yet: `run` builds it in the background at idle priority (minutes, "
            "once per machine and model) and separates with the eager model meanwhile",
        )
    figures = []
    if compiled.get("load_seconds") is not None:
        figures.append(f"loaded from the cache in {compiled['load_seconds']:.1f} s")
    if compiled.get("compile_seconds") is not None:
        figures.append(f"built in {compiled['compile_seconds']:.0f} s")
    if compiled.get("openvino"):
        figures.append(f"its transformer in OpenVINO {compiled['openvino']}")
    detail = f"{state} — {compiled.get('reason')}" + (f"; {', '.join(figures)}" if figures else "")
    return Finding(True, f"{title} compiled", detail, warning=state in ("unavailable", "failed"))


def check_tray(settings: Settings) -> Finding:
    """Whether `run` would show a tray icon here, and why not."""
    from stemdeck_watch.ui.desktop.tray import detect

    choice = detect(settings.tray.enabled)
    if choice.backend is not None:
        return Finding(True, "tray", f"an icon would be shown ({choice.reason})")
    if settings.tray.enabled is True:
        return Finding(False, "tray", f"tray.enabled = true, but {choice.reason}")
    if settings.tray.enabled is False:
        return Finding(True, "tray", "off (tray.enabled = false)")
    return Finding(True, "tray", f"none — `run` goes headless: {choice.reason}", warning=True)


def check_notify(settings: Settings) -> list[Finding]:
    """Each notification target apprise can use; "desktop" says what it reaches or what is
    missing."""
    from stemdeck_watch.ui.desktop.notify import DESKTOP, check_urls, resolve_desktop
    from stemdeck_watch.core.errors import ConfigError

    notify = settings.notify
    if not notify.urls or not notify.events:
        return [Finding(True, "notifications", "off (notify.urls or notify.events is empty)")]
    findings = []
    try:
        check_urls(notify)
    except ConfigError as exc:
        findings.append(Finding(False, "notifications", str(exc)))
    others = [u for u in notify.urls if u != DESKTOP]
    if others and not findings:
        findings.append(Finding(True, "notifications", f"{len(others)} apprise URL(s) accepted"))
    if DESKTOP in notify.urls:
        url, why = resolve_desktop()
        findings.append(
            Finding(True, "desktop notifications", f"through {url}")
            if url
            else Finding(True, "desktop notifications", f"off: {why}", warning=True)
        )
    return findings


def check_links(settings: Settings) -> Finding:
    if not settings.links.enabled:
        return Finding(True, "links", "link files are off (links.enabled = false)")
    try:
        from yt_dlp.version import __version__ as version
    except ImportError:
        return Finding(False, "links", "yt-dlp is not installed: pip install yt-dlp")
    return Finding(
        True,
        "links",
        f"yt-dlp {version} downloads .url/.webloc/.desktop links "
        f"(sites change often: `pip install -U yt-dlp` keeps it working)",
    )


def check_executor(settings: Settings) -> list[Finding]:
    """Where separation runs (for Ray: whether it is installed; Ray is never imported with
    "local"), and each worker as the service last recorded it: machine, device, process."""
    from stemdeck_watch.workers import ray_installed
    from stemdeck_watch.store.snapshot import recorded_workers

    ex = settings.executor
    if ex.kind == "local":
        findings = [Finding(True, "executor", "local: one resident worker process on this machine")]
    else:
        count = (
            "one worker per GPU (or per cpus_per_worker cores) of each machine, as "
            "machines come and go"
            if ex.workers == "auto"
            else f"{ex.workers} worker(s)"
        )
        plan = (
            f"{count} of {ex.gpus_per_worker:g} GPU and {ex.cpus_per_worker:g} CPU each "
            f"on the Ray cluster at {ex.address}"
        )
        if not ray_installed():
            return [
                Finding(
                    False,
                    "executor",
                    f'executor.kind = "ray" ({plan}), but Ray is '
                    f"not installed: pip install 'stemdeck-watch[ray]' (here and on "
                    f'every worker machine), or set executor.kind = "local"',
                )
            ]
        from importlib.metadata import version

        findings = [Finding(True, "executor", f"ray {version('ray')}: {plan}")]
    for each in recorded_workers(settings):
        where = each.get("hostname") or "this machine"
        if each.get("node_ip"):
            where += f" ({each['node_ip']})"
        findings.append(
            Finding(
                True,
                f"worker {each.get('index', 0)}",
                f"{where}, {each.get('device')}, {each.get('threads')} "
                f"thread(s), pid {each.get('pid') or '-'} (as last recorded)",
            )
        )
    return findings


def check_service(settings: Settings) -> Finding:
    pid = running_pid(settings.paths.state)
    return Finding(True, "service", f"running (pid {pid})" if pid else "not running")


def run_doctor(settings: Settings, emit: Callable[[str], None]) -> int:
    """Print each finding as it comes; exit status 1 if anything failed."""
    source = settings.source or "built-in defaults (no stemdeck.toml found)"
    findings = [Finding(True, "config", str(source))]
    emit(findings[0].line())
    checks: list[Callable[[], list[Finding] | Finding]] = [
        lambda: check_folders(settings),
        lambda: [f for f in [check_sync_layout(settings)] if f is not None],
        lambda: check_watcher(settings),
        lambda: check_decode(settings),
        lambda: check_models(settings),
        lambda: check_tray(settings),
        lambda: check_notify(settings),
        lambda: check_links(settings),
        lambda: check_executor(settings),
        lambda: check_service(settings),
    ]
    for check in checks:
        result = check()
        for finding in result if isinstance(result, list) else [result]:
            findings.append(finding)
            emit(finding.line())
    failed = [f for f in findings if not f.ok]
    emit(f"{len(failed)} problem(s) found" if failed else "everything looks fine")
    return 1 if failed else 0
