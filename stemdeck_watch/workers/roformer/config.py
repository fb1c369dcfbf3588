"""A RoFormer checkpoint's YAML configuration, read safely and checked key by key.

The published configurations are the training configurations of ZFTurbo's
Music-Source-Separation-Training: `model:` (the constructor's arguments), `audio:` (the
chunk the model was trained on), `inference:` (overlap, batch) and `training:` (of which
only the stem names matter here). They are read with `yaml.safe_load`'s loader plus one
tag, `!!python/tuple`, which the published files use for lists of numbers and which builds
nothing but a tuple; any other Python tag is refused.

Every key of `model:` must be one this engine knows, with a value of the right type: an
unknown key may change the architecture, and building the wrong model would only show as a
checkpoint that does not fit (or worse, one that fits and sounds wrong). Keys that matter
only for training (dropout, the training loss, gradient checkpointing, attention kernels)
are accepted and ignored.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import yaml

from stemdeck_watch.core.errors import ModelError

BS = "bs_roformer"
MEL = "mel_band_roformer"

# key: (accepted types, default); None as a default: required
_COMMON: dict[str, tuple[tuple[type, ...], Any]] = {
    "dim": ((int,), None),
    "depth": ((int,), None),
    "stereo": ((bool,), False),
    "num_stems": ((int,), 1),
    "time_transformer_depth": ((int,), 2),
    "freq_transformer_depth": ((int,), 2),
    "linear_transformer_depth": ((int,), 0),
    "dim_head": ((int,), 64),
    "heads": ((int,), 8),
    "stft_n_fft": ((int,), 2048),
    "stft_hop_length": ((int,), 512),
    "stft_win_length": ((int,), 2048),
    "stft_normalized": ((bool,), False),
    "zero_dc": ((bool,), True),
    "mask_estimator_depth": ((int,), None),  # defaults differ: set per architecture below
    "mlp_expansion_factor": ((int,), 4),
    "skip_connection": ((bool,), False),
}
_ARCHITECTURE_KEYS: dict[str, dict[str, tuple[tuple[type, ...], Any]]] = {
    BS: {"freqs_per_bands": ((tuple, list), None), "mask_estimator_depth": ((int,), 2)},
    MEL: {
        "num_bands": ((int,), 60),
        "sample_rate": ((int,), 44100),
        "mask_estimator_depth": ((int,), 1),
    },
}
# read by the training code only: accepted, not used
_TRAINING_ONLY = frozenset(
    {
        "attn_dropout",
        "ff_dropout",
        "flash_attn",
        "sage_attention",
        "use_torch_checkpoint",
        "dim_freqs_in",
        "match_input_audio_length",
        "multi_stft_resolution_loss_weight",
        "multi_stft_resolutions_window_sizes",
        "multi_stft_hop_size",
        "multi_stft_normalized",
    }
)
# features of the training code this engine does not implement: refused by name
_UNSUPPORTED = {"use_pope": "PoPE position embeddings"}


@dataclasses.dataclass(frozen=True)
class RoformerConfig:
    """What building and running one checkpoint needs, checked."""

    path: Path
    architecture: str  # BS or MEL
    model: dict[str, Any]  # the constructor's keyword arguments
    sample_rate: int
    channels: int
    chunk_size: int  # samples per chunk the model sees
    num_overlap: int  # chunks covering each sample
    batch_size: int  # the configuration's own (a GPU figure)
    stems: tuple[str, ...]  # what the model's outputs are, in order


class _Loader(yaml.SafeLoader):
    """safe_load's loader, plus `!!python/tuple` as a plain tuple; a key given twice in one
    mapping is an error (plain YAML loaders keep the last silently, so an edit that adds a
    key the file already has would do nothing)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _value in node.value:
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, (str, int, float, bool)):
                continue  # an unhashable key: safe_load's own error follows
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"{key!r} is given twice", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _tuple(loader: yaml.SafeLoader, node: yaml.Node) -> tuple[Any, ...]:
    if not isinstance(node, yaml.SequenceNode):
        raise yaml.constructor.ConstructorError(
            None, None, "!!python/tuple on something that is not a list", node.start_mark
        )
    return tuple(loader.construct_sequence(node, deep=True))


_Loader.add_constructor("tag:yaml.org,2002:python/tuple", _tuple)


def read_config(path: Path, architecture: str | None = None) -> RoformerConfig:
    """The checked configuration at `path`. `architecture` (from the catalogue) must agree
    with what the keys say; without it the keys decide (`freqs_per_bands`: BS-RoFormer,
    `num_bands`: Mel-Band RoFormer)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ModelError(f"could not read the model configuration {path}: {exc}") from exc
    try:
        data = yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:
        raise ModelError(
            f"the model configuration {path} is not YAML this engine reads (only plain YAML "
            f"and !!python/tuple are accepted): {exc}"
        ) from exc
    return parse_config(data, path, architecture)


def parse_config(data: Any, path: Path, architecture: str | None = None) -> RoformerConfig:
    def bad(what: str) -> ModelError:
        return ModelError(f"the model configuration {path}: {what}")

    if not isinstance(data, dict) or not isinstance(data.get("model"), dict):
        raise bad("has no `model:` section")
    model = data["model"]
    found = {BS} if "freqs_per_bands" in model else set()
    found |= {MEL} if "num_bands" in model else set()
    if len(found) != 1:
        raise bad(
            "names neither `freqs_per_bands` (BS-RoFormer) nor `num_bands` (Mel-Band RoFormer)"
            if not found
            else "names both `freqs_per_bands` and `num_bands`: which architecture is it?"
        )
    kind = found.pop()
    if architecture is not None and architecture != kind:
        raise bad(f"describes a {kind} model, but the catalogue lists it as {architecture}")
    known = {**_COMMON, **_ARCHITECTURE_KEYS[kind]}
    kwargs: dict[str, Any] = {}
    for key, value in model.items():
        if key in _UNSUPPORTED:
            if value:
                raise bad(f"model.{key} asks for {_UNSUPPORTED[key]}, which this engine lacks")
            continue
        if key in _TRAINING_ONLY:
            continue
        if key not in known:
            raise bad(
                f"model.{key} is not a key this engine knows for {kind}; a model built "
                "without it could differ from the checkpoint"
            )
        types, _default = known[key]
        if isinstance(value, bool) and bool not in types or not isinstance(value, types):
            raise bad(f"model.{key} should be {' or '.join(t.__name__ for t in types)}: {value!r}")
        kwargs[key] = value
    for key, (_types, default) in known.items():
        if key not in kwargs:
            if default is None:
                raise bad(f"model.{key} is missing")
            kwargs[key] = default
    for key in ("dim", "depth", "heads", "dim_head", "num_stems", "stft_n_fft"):
        if kwargs[key] < 1:
            raise bad(f"model.{key} should be at least 1: {kwargs[key]}")
    if kind == BS:
        bands = kwargs["freqs_per_bands"]
        if not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in bands):
            raise bad(f"model.freqs_per_bands should be positive whole numbers: {bands!r}")
        kwargs["freqs_per_bands"] = tuple(bands)
        if len(bands) < 2 or sum(bands) != kwargs["stft_n_fft"] // 2 + 1:
            raise bad(
                f"model.freqs_per_bands adds up to {sum(bands)} bins; an STFT of "
                f"stft_n_fft={kwargs['stft_n_fft']} has {kwargs['stft_n_fft'] // 2 + 1}"
            )
        if kwargs["mask_estimator_depth"] < 1:
            raise bad("model.mask_estimator_depth should be at least 1")
    channels = 2 if kwargs["stereo"] else 1
    audio = _section(data, "audio", bad)
    inference = _section(data, "inference", bad)
    chunk_size = _whole(inference.get("chunk_size", audio.get("chunk_size")), "chunk_size", bad)
    sample_rate = _whole(audio.get("sample_rate", 44100), "audio.sample_rate", bad)
    if kind == MEL and kwargs["sample_rate"] != sample_rate:
        raise bad(f"model.sample_rate {kwargs['sample_rate']} ≠ audio.sample_rate {sample_rate}")
    if "num_channels" in audio and audio["num_channels"] != channels:
        raise bad(f"audio.num_channels is {audio['num_channels']} but model.stereo says {channels}")
    return RoformerConfig(
        path=path,
        architecture=kind,
        model=kwargs,
        sample_rate=sample_rate,
        channels=channels,
        chunk_size=chunk_size,
        num_overlap=_whole(inference.get("num_overlap", 2), "inference.num_overlap", bad),
        batch_size=_whole(inference.get("batch_size", 1), "inference.batch_size", bad),
        stems=_stems(data.get("training"), kwargs["num_stems"], bad),
    )


def _section(data: dict[str, Any], name: str, bad: Any) -> dict[str, Any]:
    section = data.get(name) or {}
    if not isinstance(section, dict):
        raise bad(f"`{name}:` should be a mapping")
    return section


def _whole(value: Any, name: str, bad: Any) -> int:
    if value is None:
        raise bad(f"{name} is missing")
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise bad(f"{name} should be a whole number of at least 1: {value!r}")
    return value


def _stems(training: Any, num_stems: int, bad: Any) -> tuple[str, ...]:
    """The names of the model's outputs: its `target_instrument` when it has one output
    (the other instrument of a pair is the mix minus it), else `instruments` in order."""
    training = training if isinstance(training, dict) else {}
    target = training.get("target_instrument")
    instruments = training.get("instruments") or []
    if not isinstance(instruments, (list, tuple)) or not all(
        isinstance(i, str) for i in instruments
    ):
        raise bad(f"training.instruments should be a list of names: {instruments!r}")
    if num_stems == 1 and isinstance(target, str) and target:
        return (target,)
    if len(instruments) == num_stems:
        return tuple(instruments)
    raise bad(
        f"cannot tell what the model's {num_stems} output(s) are: training.target_instrument "
        f"is {target!r} and training.instruments {list(instruments)!r}"
    )
