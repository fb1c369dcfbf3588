"""`stemdeck.toml` → typed, validated settings.

Every key is declared once, as a dataclass field whose metadata holds its check and its TOML
default; the loader, `config init` and the reference's key table (docs/reference/config.md)
all come from these fields.
Unknown keys and bad values are errors that name the key, the value and what is allowed: a
typo in a config file must never be silently ignored.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import os
import sys

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser, from PyPI
    import tomli as tomllib
from pathlib import Path
from typing import Any, Mapping

from stemdeck_watch.core.errors import ConfigError
from stemdeck_watch.core.paths import default_config_file, default_state_dir
from stemdeck_watch.core.recipes import KNOWN as RECIPES
from stemdeck_watch.core.recipes import recipe_name
from stemdeck_watch.util.passwords import check_stored
from stemdeck_watch.util.redact import redact_url
from stemdeck_watch.util.validators import (
    MP3_RATES,
    Check,
    boolean,
    byte_size,
    choice,
    choice_list,
    check_model_stems,
    count_or_auto,
    extension_list,
    layout_template,
    mix_table,
    model_name,
    number,
    number_list,
    host_names,
    hub_url,
    listen_address,
    ray_address,
    sample_rate,
    show,
    stem_name,
    text,
    text_list,
    url_list,
)

AUDIO_EXTENSIONS = (
    "wav",
    "flac",
    "mp3",
    "m4a",
    "aac",
    "ogg",
    "oga",
    "opus",
    "aiff",
    "aif",
    "aifc",
    "wma",
    "mp4",
    "mkv",
    "webm",
    "mov",
)
NOTIFY_EVENTS = (
    "done",
    "failed",
    "queue_drained",
    "queue_full",
    "restored",
    "disk_low",
    "share_away",
)


def key(default: Any, check: Check, doc: str) -> Any:
    """Declare a config key: its TOML default, its check and its meaning (the reference)."""
    meta = {"check": check, "doc": doc, "toml": default}
    checked = check(default)
    if isinstance(checked, (dict, list)):
        return dataclasses.field(default_factory=lambda: check(default), metadata=meta)
    return dataclasses.field(default=checked, metadata=meta)


# ---------------------------------------------------------------- sections


@dataclasses.dataclass(frozen=True)
class FolderSettings:
    inbox: str = key(
        "~/StemDeck/inbox", text, "watched folder; songs and link files dropped here become jobs"
    )
    outbox: str = key("~/StemDeck/outbox", text, "one folder of stems per finished song")
    processed: str = key(
        "~/StemDeck/processed", text, "inputs move here once their stems are published"
    )
    failed: str = key("~/StemDeck/failed", text, "inputs that failed, each with <file>.error.txt")
    state: str = key("", text, 'registry, logs and scratch files; "" = the platform state dir')


@dataclasses.dataclass(frozen=True)
class WatchSettings:
    mode: str = key(
        "auto",
        choice("auto", "native", "polling"),
        "auto: native events, polling on network filesystems or when native fails",
    )
    settle_seconds: float = key(
        3.0,
        number(0.1, unit="(seconds)"),
        "a file must stay unchanged this long before it is queued (1 s, if shorter, once "
        "its writer closed it or renamed it into place, where native events show that)",
    )
    poll_interval: float = key(
        2.0, number(0.1, unit="(seconds)"), "seconds between polls in polling mode"
    )
    rescan_seconds: float = key(
        300.0,
        number(0, unit="(seconds)"),
        "full rescan of the inbox every N seconds; 0 = only at start and after watcher errors",
    )
    recursive: bool = key(True, boolean, "watch subfolders of the inbox too")
    ignore: tuple[str, ...] = key(
        [], text_list, "extra glob patterns to ignore, added to the built-in ones"
    )
    extensions: tuple[str, ...] = key(
        list(AUDIO_EXTENSIONS), extension_list, "file extensions that become jobs"
    )
    standby: bool = key(
        False,
        boolean,
        "another computer owns this (synced) inbox: wait and "
        "take over when its heartbeat goes stale instead of refusing to start",
    )


@dataclasses.dataclass(frozen=True)
class QueueSettings:
    max_pending_files: int = key(
        20, number(1, integer=True), "queued files beyond this wait in the inbox"
    )
    max_pending_links: int = key(200, number(1, integer=True), "the same for links")
    resume_attempts: int = key(
        1, number(0, integer=True), "how often a job cut off by a crash is resumed before it fails"
    )
    worker_retries: int = key(
        2,
        number(0, 20, integer=True),
        "attempts a song gets again after a machine fault (the worker "
        "process or actor died, its machine left, it stalled); each goes "
        "back to the head of the queue, on another worker where there is "
        "one; after that the song fails with every attempt's reason",
    )
    start_paused_after_restore: bool = key(
        True, boolean, "jobs restored after a restart wait for Start (or a new file)"
    )
    on_duplicate: str = key(
        "skip",
        choice("skip", "separate"),
        "a song whose content and settings match a done job whose outbox "
        "folder still holds them: skip (the input moves to processed/, the "
        "job names the existing folder) or separate it again",
    )
    work_beside: str = key(
        "auto",
        choice("auto", "on", "off"),
        "publish the last song behind and decode the next one ahead while "
        "the worker separates; auto: where the worker leaves a core free or "
        "runs on a GPU, and on a CPU it fills for songs without a beat "
        "grid; on: always; off: never",
    )


@dataclasses.dataclass(frozen=True)
class SeparationSettings:
    model: str = key(
        "htdemucs",
        model_name,
        "Demucs model name (htdemucs, htdemucs_ft, "
        "htdemucs_6s, mdx_extra, …) or a name in model_repo; a plain "
        "name, never a URL, a scheme such as hf:// or a path",
    )
    recipe: str = key(
        "",
        recipe_name,
        "which model makes which stem, by name: best (vocals from the BS-RoFormer "
        "bs_roformer_viperx_1297, drums, bass and other from htdemucs_ft run on the mix "
        "minus those vocals), best_quick (the same vocals, the rest from htdemucs), mel "
        "(vocals from mel_band_roformer_kj); the recipe names its models, so model is not "
        'used; "" = model alone',
    )
    model_repo: str = key(
        "", text, 'a local folder of model files, fully offline; "" = the model hub'
    )
    model_hub: str = key(
        "https://dl.fbaipublicfiles.com/demucs/",
        hub_url,
        "where models missing from the cache are downloaded from (the service "
        "on first use, `stemdeck-watch models pull`): demucs's own model "
        "mirror, or a mirror with the same file layout; set in the config "
        "file only, never by a preset, name tag or sidecar",
    )
    device: str = key(
        "auto",
        choice("auto", "cpu", "cuda", "mps"),
        "where the model runs; auto: cuda, then mps, then cpu",
    )
    shifts: int = key(
        1,
        number(0, 20, integer=True),
        "random-shift passes averaged: better quality, proportionally slower",
    )
    overlap: float = key(0.25, number(0, below=1), "overlap between segments")
    segment: float = key(
        0.0,
        number(0, 3600, unit="(seconds)"),
        "segment length in seconds; 0 = the model's own",
    )
    two_stems: str = key(
        "",
        stem_name,
        'a stem name for STEM + no_STEM output, e.g. "vocals" '
        '→ vocals + no_vocals (the sum of the others); "" = every stem',
    )
    precision: str = key(
        "auto",
        choice("auto", "float32", "bfloat16", "float16"),
        "auto: measured once per model load: bfloat16 (on CUDA also float16) "
        "autocast is kept only if ≥ 1.2× faster than float32 and every stem "
        "matches float32 to ≥ 35 dB SNR, else float32; float32, bfloat16 or "
        "float16 (CUDA only) force one",
    )
    threads: int = key(
        0,
        number(0, 1024, integer=True),
        "threads the worker separates with; 0 = one per physical core the service may use "
        "(its CPU affinity); set "
        "fewer to keep the computer responsive while you work on it",
    )
    fallback_device: str = key(
        "cpu",
        choice("cpu", ""),
        "where a song goes when a GPU runs out of memory under it "
        'twice (after a try with half the window and segment): "cpu" '
        '(slower, but done) or "" (it fails)',
    )
    compile: str = key(
        "auto",
        choice("auto", "off", "on"),
        "auto: a compiled model (torch.compile; its transformer in OpenVINO "
        "where installed) is built once per machine and "
        "model in a background process at idle priority while songs go on "
        "with the eager model, kept in the state folder, and used only if "
        "measured ≥ 1.15× faster and every stem matches float32 to ≥ 35 dB SNR "
        "(CPU only; needs a C++ compiler); on: used once built whatever its "
        "speed (never less accurate); off: never",
    )
    compile_cache_mb: float = key(
        2048.0,
        number(16, unit="(MB)"),
        "the most the compiled-model cache in the state folder takes; the "
        "builds used longest ago go first",
    )
    stall_seconds: float = key(
        0.0,
        number(0, unit="(seconds)"),
        "a worker that reports no progress for this long while it "
        "separates or loads a model is stopped and the song tried again (a machine "
        "fault, queue.worker_retries); 0 = ten times the slowest "
        "segment measured on that worker, never under 60 s",
    )


@dataclasses.dataclass(frozen=True)
class OutputSettings:
    format: str = key("wav", choice("wav", "flac", "mp3"), "file format of the stems")
    bit_depth: int = key(16, choice(16, 24, 32), "16 or 24-bit integer; 32 = float (wav only)")
    mp3_bitrate: int = key(320, choice(96, 128, 160, 192, 224, 256, 320), "kbit/s for mp3")
    clip: str = key(
        "rescale",
        choice("rescale", "clamp"),
        "avoid clipping by turning the whole song down by one gain, every stem "
        "and mix alike (rescale), or by clamping samples",
    )
    layout: str = key(
        "{stem}.{ext}",
        layout_template,
        "file name of each stem inside the song folder; fields {stem}, {name} "
        "(song), {ext}, {model}, {title}, {artist}, {album} (tags; the file name "
        "when missing), {preset}; may contain subfolders; .., absolute paths and "
        "anything that could leave the song folder are refused at load",
    )
    mixes: dict = key(
        {},
        mix_table,
        "extra mixes written beside the stems, e.g. instrumental = "
        '["drums", "bass", "other"], or a play-along mix without your instrument; a mix name '
        "starts with a letter or digit and is not the name of a stem",
    )
    samplerate: str | int = key(
        "model",
        sample_rate,
        '"model" (44100 for demucs), "input" (the input\'s rate and '
        "exact frame count) or a rate in Hz (mp3: the MPEG rates "
        "8000–48000 only)",
    )
    beat_grid: bool = key(
        True, boolean, "beats.json: tempo and beat times from the drums stem (or the mix), librosa"
    )
    preview: bool = key(True, boolean, "preview.png: the stems' waveforms with title and length")
    tags: bool = key(
        True, boolean, 'flac/mp3 stems tagged "Title (stem)", artist, album, track number (mutagen)'
    )
    session: tuple[str, ...] = key(
        [],
        choice_list("dawproject", "reaper", what="projects"),
        "DAW projects beside the stems (with the mix as a muted track): dawproject, reaper",
    )
    stem_file: bool = key(
        False,
        boolean,
        "a .stem.mp4 named after the song: NI Stems (master "
        "+ drums, bass, other, vocals as AAC) for Traktor, Mixxx, djay",
    )
    practice: bool = key(
        False,
        boolean,
        "practice/: mp3s for a phone: a click track with a "
        "count-in, the song minus each stem with the click, slowed versions",
    )
    practice_speeds: tuple[float, ...] = key(
        [75],
        number_list(25, 99, unit="(percent)"),
        "slowed versions in practice/, in percent of the song's speed (pitch kept); [] = none",
    )


@dataclasses.dataclass(frozen=True)
class LinkSettings:
    enabled: bool = key(True, boolean, ".url / .webloc / .desktop link files become downloads")
    max_duration: int = key(
        1800, number(0, integer=True, unit="(seconds)"), "longest download accepted; 0 = no limit"
    )
    max_filesize: int = key("500MB", byte_size, "largest download accepted")
    playlists: bool = key(
        False,
        boolean,
        "a playlist link becomes one job per entry, in playlist order; false = its first item only",
    )
    max_entries: int = key(
        50,
        number(1, 1000, integer=True),
        "a playlist longer than this queues its first N entries only; the "
        "rest are named in its summary",
    )
    max_page_bytes: int = key(
        "10MB", byte_size, "largest web page (or playlist) read while looking for a link's audio"
    )
    page_timeout: float = key(
        60.0,
        number(1, unit="(seconds)"),
        "how long a link's pages may keep it waiting for the site, before its download",
    )
    timeout: float = key(
        1800.0,
        number(0, unit="(seconds)"),
        "how long a link's whole fetch, pages and download, may keep it "
        "waiting for the site; 0 = no limit",
    )
    allow_private: bool = key(
        False,
        boolean,
        "fetch links that lead to this machine or the "
        "local network (loopback, private, link-local addresses)",
    )


@dataclasses.dataclass(frozen=True)
class NotifySettings:
    urls: tuple[str, ...] = key(
        ["desktop"],
        url_list,
        "where notifications go: any apprise URL (ntfy://…, mailto://…, "
        'json://host/…, …); "desktop" = the platform\'s desktop '
        "notifications; a URL apprise cannot use stops run with exit 2",
    )
    events: tuple[str, ...] = key(
        list(NOTIFY_EVENTS), choice_list(*NOTIFY_EVENTS, what="events"), "which events notify"
    )


@dataclasses.dataclass(frozen=True)
class ApiSettings:
    enabled: bool = key(True, boolean, "the local HTTP API and queue page")
    host: str = key(
        "127.0.0.1",
        listen_address,
        "the address the page and API listen on: loopback (127.0.0.1, localhost, ::1) for this "
        "computer only; any other (0.0.0.0 = every address) lets other devices sign in, and "
        "needs a password (`stemdeck-watch password`)",
    )
    port: int = key(
        0,
        number(0, 65535, integer=True),
        "0 = pick a free port (the discovery file <state>/api.json names it)",
    )
    max_upload_mb: int = key(
        2048,
        number(1, 1 << 20, integer=True),
        "largest song the queue page may upload into the inbox, in MB "
        "(a larger one is refused with the reason; copy it into the "
        "inbox instead)",
    )
    password_hash: str = key(
        "",
        check_stored,
        "the page's password as a salted scrypt hash, never the password itself: set it with "
        '`stemdeck-watch password`; "" = none (loopback only)',
    )
    hosts: tuple[str, ...] = key(
        [],
        host_names,
        'names other devices reach this machine by ("nas.local"), besides its IP addresses: '
        "a request naming any other host is refused",
    )
    https: bool = key(
        False,
        boolean,
        "serve the page over HTTPS: with api.tls_cert and api.tls_key, or else a self-signed "
        "certificate made at the first start (its fingerprint in `status`)",
    )
    tls_cert: str = key(
        "", text, "the HTTPS certificate (PEM, with its chain); relative to the config file"
    )
    tls_key: str = key(
        "", text, "its private key (PEM, not encrypted); relative to the config file"
    )


@dataclasses.dataclass(frozen=True)
class TraySettings:
    enabled: bool | str = key(
        "auto",
        choice(True, False, "auto"),
        "tray icon: auto (where a display and a tray backend with a menu "
        "exist, else headless; the log and doctor say why), true (no tray "
        "= exit 2, saying what to install), false",
    )


@dataclasses.dataclass(frozen=True)
class ExecutorSettings:
    kind: str = key(
        "local",
        choice("local", "ray"),
        'where separation runs: "local" (the one '
        "resident worker process on this machine; Ray is never imported) or "
        '"ray" (resident workers on a Ray cluster)',
    )
    address: str = key(
        "auto",
        ray_address,
        'the Ray cluster: "auto" (the cluster this machine '
        'joined with ray start), "local" (a private one started with the '
        'service), "ray://HOST:10001" (Ray Client) or "HOST:6379" (the head); an '
        "address where nothing listens is an error at start",
    )
    workers: int | str = key(
        1,
        count_or_auto(1, 256),
        "resident workers (Ray actors), one job in flight on each; above 1 "
        'needs kind = "ray"; "auto" (Ray) keeps one per GPU, or per '
        "cpus_per_worker cores on machines without one, of the machines "
        "the cluster has now: a machine that joins gets workers within "
        "seconds, one that leaves takes its workers (their songs go back "
        "to the queue), no restart",
    )
    gpus_per_worker: float = key(
        0.0, number(0, 64), "GPUs each worker reserves: 1 on GPU machines, 0 for CPU"
    )
    cpus_per_worker: float = key(
        1.0,
        number(0.5, 1024),
        "CPU cores each worker reserves; with separation.threads = 0 "
        "it separates with that many threads",
    )


SECTIONS: dict[str, type] = {
    "folders": FolderSettings,
    "watch": WatchSettings,
    "queue": QueueSettings,
    "separation": SeparationSettings,
    "output": OutputSettings,
    "links": LinkSettings,
    "notify": NotifySettings,
    "api": ApiSettings,
    "tray": TraySettings,
    "executor": ExecutorSettings,
}
PRESET_SECTIONS = ("separation", "output")
# [separation] keys only the config file sets: where model files (pickles) come from is the
# owner's choice, never a preset's or a file dropped into the inbox; and the compiled model
# belongs to the resident worker, which serves every song
SERVICE_ONLY = frozenset({"model_hub", "compile", "compile_cache_mb"})
# ...and keys a file dropped into the inbox (a sidecar) never sets: a folder of model files is
# code the worker loads, so it comes from the config or one of its presets
OWNER_ONLY = SERVICE_ONLY | {"model_repo"}
# [separation] keys that say how the machine copes, not what the stems are: left out of a
# song's recorded settings (its manifest, and the key duplicates are told by)
MACHINE_KEYS = frozenset({"stall_seconds", "fallback_device", "compile", "compile_cache_mb"})


@dataclasses.dataclass(frozen=True)
class Folders:
    """The folders after `~` and relative paths are resolved (relative to the config file)."""

    inbox: Path
    outbox: Path
    processed: Path
    failed: Path
    state: Path

    @property
    def staging(self) -> Path:
        return self.outbox / ".stemdeck-staging"

    @property
    def scratch(self) -> Path:
        return self.state / "scratch"


@dataclasses.dataclass(frozen=True)
class Settings:
    folders: FolderSettings
    watch: WatchSettings
    queue: QueueSettings
    separation: SeparationSettings
    output: OutputSettings
    links: LinkSettings
    notify: NotifySettings
    api: ApiSettings
    tray: TraySettings
    presets: Mapping[str, Mapping[str, Any]]
    source: Path | None = None
    executor: ExecutorSettings = dataclasses.field(default_factory=ExecutorSettings)

    @functools.cached_property
    def paths(self) -> Folders:
        """Resolved once: the pipeline and scheduler ask for it on every job."""
        base = self.source.parent if self.source else Path.cwd()
        state = self.folders.state or str(default_state_dir())
        return Folders(
            *(
                resolve_path(v, base)
                for v in (
                    self.folders.inbox,
                    self.folders.outbox,
                    self.folders.processed,
                    self.folders.failed,
                    state,
                )
            )
        )

    @property
    def model_repo(self) -> Path | None:
        return self.resolve_model_repo(self.separation)

    def resolve_model_repo(self, separation: SeparationSettings) -> Path | None:
        if not separation.model_repo:
            return None
        return resolve_path(
            separation.model_repo, self.source.parent if self.source else Path.cwd()
        )

    def for_preset(self, preset: str | None) -> tuple[SeparationSettings, OutputSettings]:
        """The separation and output settings of a job, with its preset's overrides applied."""
        overrides = self.presets.get(preset or "", {})
        sep = dataclasses.replace(
            self.separation,
            **{k: v for k, v in overrides.items() if k in _field_names(SeparationSettings)},
        )
        out = dataclasses.replace(
            self.output, **{k: v for k, v in overrides.items() if k in _field_names(OutputSettings)}
        )
        if "model" in overrides and "recipe" not in overrides:
            sep = dataclasses.replace(sep, recipe="")  # the preset's model alone
        return with_recipe(sep), out


def with_recipe(sep: SeparationSettings) -> SeparationSettings:
    """`sep` with its recipe's Demucs model as the model: a recipe names its models."""
    recipe = RECIPES.get(sep.recipe)
    if recipe is None or sep.model == recipe.rest:
        return sep
    return dataclasses.replace(sep, model=recipe.rest)


def resolve_path(value: str, base: Path) -> Path:
    path = Path(os.path.expandvars(os.path.expanduser(value)))
    return (path if path.is_absolute() else base / path).resolve()


def _field_names(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def _unknown_key(where: str, name: str, allowed: list[str]) -> ConfigError:
    hint = difflib.get_close_matches(name, allowed, n=1)
    guess = f" (did you mean {hint[0]!r}?)" if hint else ""
    return ConfigError(f"unknown key {where}{name}{guess}; allowed: {', '.join(allowed)}")


def _build_section(cls: type, table: Any, where: str) -> Any:
    if not isinstance(table, dict):
        raise ConfigError(f"[{where.rstrip('.')}] must be a table of keys")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for name in table:
        if name not in fields:
            raise _unknown_key(where, name, list(fields))
    return cls(
        **{
            name: _check(f, table.get(name, f.metadata["toml"]), where)
            for name, f in fields.items()
        }
    )


def _check(field: dataclasses.Field, value: Any, where: str) -> Any:
    try:
        return field.metadata["check"](value)
    except ValueError as exc:
        raise ConfigError(
            f"{where}{field.name} = {_show_value(value)} is not allowed: expected {exc}"
        ) from None


def _show_value(value: Any) -> str:
    """A value as an error message shows it; a URL without its credentials."""
    return redact_url(repr(value) if isinstance(value, (dict, list)) else show(value))


def _build_presets(table: Any) -> dict[str, dict[str, Any]]:
    if not isinstance(table, dict):
        raise ConfigError("[presets] must hold tables such as [presets.karaoke]")
    presets: dict[str, dict[str, Any]] = {}
    for name, overrides in table.items():
        where = f"presets.{name}."
        if not isinstance(overrides, dict):
            raise ConfigError(f"presets.{name} must be a table, e.g. [presets.{name}]")
        if not name or name.startswith(".") or any(c in name for c in '/\\:*?"<>|'):
            raise ConfigError(
                f"presets.{name}: the preset name is also a folder name in the inbox; "
                "use letters, digits, spaces, '-' or '_'"
            )
        presets[name] = check_overrides(overrides, where)
    return presets


def check_overrides(
    overrides: Mapping[str, Any], where: str, dropped: bool = False
) -> dict[str, Any]:
    """Keys a preset may set (any [separation] or [output] key), each checked as in the
    config file; `where` prefixes the key in an error ("presets.six.", "Song.mp3.stemdeck.toml: ").
    `dropped`: the keys come from a file in the inbox, which may not say where models load
    from."""
    barred = OWNER_ONLY if dropped else SERVICE_ONLY
    allowed = {
        f.name: f
        for s in PRESET_SECTIONS
        for f in dataclasses.fields(SECTIONS[s])
        if f.name not in barred
    }
    checked = {}
    for k, v in overrides.items():
        if dropped and k in OWNER_ONLY:
            raise ConfigError(
                f"{where}{k} cannot be chosen by a file in the inbox: the model "
                f"files it names are loaded as code; set it in the config file "
                f"or a preset"
            )
        if k not in allowed:
            raise _unknown_key(where, k, list(allowed))
        checked[k] = _check(allowed[k], v, where)
    return checked


def check_song_settings(sep: SeparationSettings, out: OutputSettings, where: str) -> None:
    """What only the keys together can get wrong (flac at 32 bits, a stem the model lacks)."""
    _check_output(out, where)
    try:
        check_model_stems(sep.model, sep.two_stems, out.mixes)
    except ValueError as exc:
        raise ConfigError(f"{where}{exc}") from None


def settings_from_dict(data: Mapping[str, Any], source: Path | None = None) -> Settings:
    for name in data:
        if name not in SECTIONS and name != "presets":
            raise _unknown_key("", name, [*SECTIONS, "presets"])
    sections = {
        name: _build_section(cls, data.get(name, {}), f"{name}.") for name, cls in SECTIONS.items()
    }
    sections["separation"] = with_recipe(sections["separation"])
    settings = Settings(**sections, presets=_build_presets(data.get("presets", {})), source=source)
    _check_folders(settings)
    for preset in (None, *settings.presets):
        sep, out = settings.for_preset(preset)
        _check_output(out, f"presets.{preset}." if preset else "output.")
        try:
            check_model_stems(sep.model, sep.two_stems, out.mixes)
        except ValueError as exc:
            raise ConfigError(f"presets.{preset}: {exc}" if preset else str(exc)) from None
    return settings


def _check_output(out: OutputSettings, where: str) -> None:
    if out.format == "flac" and out.bit_depth == 32:
        raise ConfigError(
            f'{where}bit_depth = 32 is not allowed with format = "flac": flac holds '
            f'16 or 24-bit samples; use 24, or format = "wav" for float'
        )
    if out.format == "mp3" and isinstance(out.samplerate, int) and out.samplerate not in MP3_RATES:
        raise ConfigError(
            f"{where}samplerate = {out.samplerate} is not allowed with format = "
            f'"mp3": mp3 holds {", ".join(map(str, MP3_RATES))} Hz; choose one '
            f'of those, or "wav"/"flac" for any rate'
        )


def _check_folders(settings: Settings) -> None:
    """The inbox must not contain the other folders (their files would become jobs) nor they it."""
    paths = settings.paths
    others = {
        "outbox": paths.outbox,
        "processed": paths.processed,
        "failed": paths.failed,
        "state": paths.state,
    }
    for name, path in others.items():
        if path == paths.inbox or paths.inbox in path.parents or path in paths.inbox.parents:
            raise ConfigError(
                f"folders.{name} = {str(path)!r} overlaps folders.inbox = "
                f"{str(paths.inbox)!r}: choose folders outside each other"
            )


def load_settings(path: Path | None = None) -> Settings:
    """Read the config: the given file, else ./stemdeck.toml, else the platform config file,
    else the built-in defaults."""
    if path is None:
        for candidate in (Path.cwd() / "stemdeck.toml", default_config_file()):
            if candidate.is_file():
                path = candidate
                break
        else:
            return settings_from_dict({})
    path = Path(path).resolve()
    try:
        with open(path, "rb") as handle:
            data = tomllib.load(handle)
    except FileNotFoundError:
        raise ConfigError(
            f"could not read config {path}: no such file "
            "(create one with `stemdeck-watch config init`)"
        ) from None
    except OSError as exc:
        raise ConfigError(f"could not read config {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"could not parse config {path}: {exc}") from None
    try:
        return settings_from_dict(data, source=path)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None


def default_toml() -> dict[str, Any]:
    """The complete default configuration as TOML data (what `config init` writes)."""
    data: dict[str, Any] = {}
    for name, cls in SECTIONS.items():
        data[name] = {f.name: _toml_value(f.metadata["toml"]) for f in dataclasses.fields(cls)}
    return data


def _toml_value(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def key_table() -> list[tuple[str, Any, str]]:
    """(key, default, meaning) for every key: the reference's key table is built from it."""
    return [
        (f"{name}.{f.name}", f.metadata["toml"], f.metadata["doc"])
        for name, cls in SECTIONS.items()
        for f in dataclasses.fields(cls)
    ]


def write_default_config(path: Path, force: bool = False) -> Path:
    import tomli_w

    path = Path(path)
    if path.exists() and not force:
        raise FileExistsError(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(tomli_w.dumps(default_toml()).encode())
    os.replace(tmp, path)
    return path
