"""Loading a published RoFormer checkpoint: weights only, every key accounted for.

The published checkpoints are `.ckpt` files written by `torch.save(model.state_dict())`: a
pickle. Unpickling runs whatever the file names, so they are read only through torch's
restricted unpickler (`weights_only=True`), which builds tensors, numbers, strings and the
plain containers of a state dict and refuses everything else; a file that needs more is
refused with torch's reason. `.safetensors` files are read with safetensors, which holds no
code at all.

The state dict then has to fit the model built from the configuration exactly: every key
there, none left over, every shape equal. A partial load would run and produce noise, so
any difference is an error naming the keys, before `load_state_dict(strict=True)` (which
would say the same, less readably).
"""

from __future__ import annotations

import dataclasses
import pickle
import re
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn

from stemdeck_watch.core.errors import ModelError
from stemdeck_watch.workers.roformer.architectures import ARCHITECTURES
from stemdeck_watch.workers.roformer.config import RoformerConfig, read_config

# where trainers wrap the state dict: Lightning's `state_dict`, some scripts' `state`
_WRAPPERS = ("state_dict", "state", "model")
_SHOWN = 5  # keys named in an error before "and N more"


@dataclasses.dataclass(frozen=True)
class LoadedRoformer:
    """A model ready to separate, with what its configuration says about running it."""

    module: nn.Module  # in eval mode; forward: (b, channels, chunk) → (b, stems, channels, chunk)
    config: RoformerConfig

    @property
    def stems(self) -> tuple[str, ...]:
        return self.config.stems

    @property
    def samplerate(self) -> int:
        return self.config.sample_rate

    @property
    def channels(self) -> int:
        return self.config.channels

    @property
    def chunk_size(self) -> int:
        return self.config.chunk_size

    @property
    def num_overlap(self) -> int:
        return self.config.num_overlap


def build_model(config: RoformerConfig, device: str | torch.device | None = None) -> nn.Module:
    """The architecture the configuration describes, with fresh weights (`device="meta"`
    builds it without memory, to compare its keys and shapes)."""
    cls = ARCHITECTURES[config.architecture]
    try:
        with torch.device(device or "cpu"):
            model = cls(**config.model)
    except ValueError as exc:
        raise ModelError(f"the model configuration {config.path}: {exc}") from exc
    model.chunk_size, model.samplerate = config.chunk_size, config.sample_rate
    return model


def read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of the checkpoint at `path`, never running code from it."""
    path = Path(path)
    if path.suffix == ".safetensors":
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            return dict(load_file(str(path), device="cpu"))
        except (OSError, SafetensorError) as exc:
            raise ModelError(f"could not read the checkpoint {path}: {exc}") from exc
    try:
        # weights_only: torch's restricted unpickler, the one safe way to read a .ckpt pickle
        data: Any = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise ModelError(
            f"refused the checkpoint {path}: it is not a plain state dict of tensors "
            f"({_unpickling_reason(exc)}); checkpoints are read only with torch's weights-only "
            "reader, never as arbitrary pickles, so a file that needs more is not loaded"
        ) from exc
    except (OSError, RuntimeError, EOFError, ValueError) as exc:
        raise ModelError(f"could not read the checkpoint {path}: {exc}") from exc
    return _state_dict_of(data, path)


def _unpickling_reason(exc: BaseException) -> str:
    """What torch's weights-only reader stopped at (`Unsupported global: GLOBAL getattr`),
    without its advice to load the file unrestricted."""
    found = re.search(r"WeightsUnpickler error:\s*(.+?)(?:\. |\.?\n|$)", str(exc), re.S)
    return found.group(1).strip() if found else str(exc).strip().splitlines()[0]


def _state_dict_of(data: Any, path: Path) -> dict[str, torch.Tensor]:
    if isinstance(data, Mapping) and not any(isinstance(v, torch.Tensor) for v in data.values()):
        for wrapper in _WRAPPERS:
            if isinstance(data.get(wrapper), Mapping):
                data = data[wrapper]
                break
    if not isinstance(data, Mapping) or not data:
        raise ModelError(f"the checkpoint {path} holds no state dict (a mapping of tensors)")
    wrong = [str(k) for k, v in data.items() if not isinstance(k, str) or not torch.is_tensor(v)]
    if wrong:
        raise ModelError(
            f"the checkpoint {path} holds entries that are not tensors: {_names(wrong)}"
        )
    return dict(data)


def _names(keys: list[str]) -> str:
    shown = ", ".join(keys[:_SHOWN])
    return shown + (f" and {len(keys) - _SHOWN} more" if len(keys) > _SHOWN else "")


def check_fit(model: nn.Module, state: Mapping[str, torch.Tensor], path: Path) -> None:
    """Raise ModelError naming every key that is missing, unexpected or of another shape."""
    expected = model.state_dict()
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    shapes = [
        f"{k} {tuple(state[k].shape)} where the model has {tuple(v.shape)}"
        for k, v in expected.items()
        if k in state and tuple(state[k].shape) != tuple(v.shape)
    ]
    problems = []
    if missing:
        problems.append(f"missing {_names(missing)}")
    if unexpected:
        problems.append(f"unexpected {_names(unexpected)}")
    if shapes:
        problems.append(f"other shape: {_names(shapes)}")
    if problems:
        raise ModelError(
            f"the checkpoint {path} does not fit the model its configuration describes "
            f"({'; '.join(problems)}): the configuration and the checkpoint must be the "
            "pair published together"
        )


def load_roformer(
    config_path: Path, checkpoint_path: Path, architecture: str | None = None
) -> LoadedRoformer:
    """Build the configured model and load the checkpoint into it, strictly."""
    config = read_config(config_path, architecture)
    model = build_model(config)
    state = read_state_dict(checkpoint_path)
    check_fit(model, state, Path(checkpoint_path))
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as exc:  # dtypes that cannot be copied; check_fit caught the rest
        raise ModelError(f"could not load the checkpoint {checkpoint_path}: {exc}") from exc
    model.eval()
    return LoadedRoformer(model, config)
