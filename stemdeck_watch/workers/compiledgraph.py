"""Each network of the model as one graph, compiled ahead of time into a file and loaded back.

`torch.compile` on its own traces the model with Dynamo in every process that uses it: even
with all of Inductor's code in its cache, a full-size HTDemucs took about ten seconds to trace
again, so a restarted worker separated with the eager model for half a minute before the
compiled one was back. torch can instead compile a function that is one whole graph ahead of
time and save it with its guards (`torch.compile(..., fullgraph=True).aot_compile`); loading
it back (`torch.compiler.load_compiled_function`) traces nothing and takes seconds.

One graph means no graph breaks, yet three parts of the network must stay eager (why:
compiled.py). They become opaque operators here (torch.library custom ops): the graph calls
them and they run eager, as the model's own methods. Which module an operator works for is an
index into `_OWNERS`, written into the graph as a constant, so `prepare` must register the
same modules in the same order in the process that loads as in the one that built.

- the STFT and the inverse STFT (`_spec`, `_ispec`);
- the transformer's position embedding (`_get_pos_embedding`), which also draws a random
  shift: traced, the draw becomes a generated global that a saved function cannot take along.

A saved function checks its guards on every call: the input's shape, dtype and the modes it
runs under (inference mode, autocast), as they were when it was loaded, which is why loading
happens under the separation's modes. A call they refuse raises, and compiled.py runs that
segment eager.
"""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path
from typing import Any, Callable

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

from stemdeck_watch.workers.precision import autocast

GUARDS_REFUSED = "GuardManager check failed"  # in the error a saved function's refusal raises

_OWNERS: list[Any] = []


def available() -> str | None:
    """Why this torch cannot compile ahead of time and load it back, or None if it can."""
    if not hasattr(torch.compiler, "load_compiled_function"):
        return (
            f"torch {torch.__version__} cannot save a compiled model "
            f"(torch.compiler.load_compiled_function is missing)"
        )
    return None


def _real_shape(make: Callable[[], torch.Tensor], device: Any) -> torch.Tensor:
    """An empty tensor shaped like what `make` returns when it is run for real: the
    operators' shapes come from the model's own code, never written out a second time."""
    with unset_fake_temporarily():
        out = make()
    return torch.empty(out.shape, dtype=out.dtype, device=device)


@torch.library.custom_op("stemdeck::spec", mutates_args=())
def _spec(x: torch.Tensor, owner: int) -> torch.Tensor:
    module = _OWNERS[owner]
    return type(module)._spec(module, x).contiguous()


@_spec.register_fake
def _(x: torch.Tensor, owner: int) -> torch.Tensor:
    module = _OWNERS[owner]
    return _real_shape(
        lambda: type(module)._spec(module, torch.zeros(x.shape, dtype=x.dtype)), x.device
    )


@torch.library.custom_op("stemdeck::ispec", mutates_args=())
def _ispec(z: torch.Tensor, length: int, owner: int) -> torch.Tensor:
    module = _OWNERS[owner]
    return type(module)._ispec(module, z, length).contiguous()


@_ispec.register_fake
def _(z: torch.Tensor, length: int, owner: int) -> torch.Tensor:
    module = _OWNERS[owner]
    return _real_shape(
        lambda: type(module)._ispec(module, torch.zeros(z.shape, dtype=z.dtype), length),
        z.device,
    )


@torch.library.custom_op("stemdeck::pos_embedding", mutates_args=())
def _pos_embedding(t: int, b: int, c: int, device: torch.device, owner: int) -> torch.Tensor:
    module = _OWNERS[owner]
    return type(module)._get_pos_embedding(module, t, b, c, device).contiguous()


@_pos_embedding.register_fake
def _(t: int, b: int, c: int, device: torch.device, owner: int) -> torch.Tensor:
    module = _OWNERS[owner]
    return _real_shape(lambda: type(module)._get_pos_embedding(module, t, b, c, "cpu"), device)


# The replacements take exactly the arguments the networks pass: a default argument would
# be a guard the saved function cannot carry.
def _spec_for(owner: int) -> Callable[..., torch.Tensor]:
    return lambda x: _spec(x, owner)


def _ispec_for(owner: int) -> Callable[..., torch.Tensor]:
    return lambda z, length: _ispec(z, length, owner)


def _pos_embedding_for(owner: int) -> Callable[..., torch.Tensor]:
    return lambda t, b, c, device: _pos_embedding(t, b, c, torch.device(device), owner)


ROUTED = ("_spec", "_ispec", "_get_pos_embedding")


def prepare(networks: list[Any]) -> None:
    """Route each network's eager parts through the operators. Eager separation gives the
    same stems through them; the compiled graphs need them, with the same owners. Modules an
    earlier call routed go back to their own methods: their owner numbers are reused."""
    for module in _OWNERS:
        for name in ROUTED:
            vars(module).pop(name, None)
    _OWNERS.clear()
    for network in networks:
        for module in network.modules():
            routes = []
            if callable(getattr(type(module), "_spec", None)):
                routes += [("_spec", _spec_for), ("_ispec", _ispec_for)]
            if callable(getattr(type(module), "_get_pos_embedding", None)):
                routes.append(("_get_pos_embedding", _pos_embedding_for))
            if routes:
                _OWNERS.append(module)
                for name, route in routes:
                    setattr(module, name, route(len(_OWNERS) - 1))


def segment_input(network: Any, device: str) -> torch.Tensor:
    """Silence of the shape separation hands the network (one segment, batch of one), made
    as separation makes it (an inference tensor): the shape the compiled graph is for."""
    frames = int(float(network.segment) * int(network.samplerate))
    if hasattr(network, "valid_length"):
        frames = int(network.valid_length(frames))
    with torch.inference_mode():
        return torch.zeros(1, int(network.audio_channels), frames, device=device)


def modes(device: str, precision: str) -> contextlib.ExitStack:
    """The modes separation runs the networks under, which the guards check."""
    stack = contextlib.ExitStack()
    stack.enter_context(torch.inference_mode())
    stack.enter_context(autocast(device, precision))
    return stack


def saved(folder: Path, index: int) -> Path:
    """Where the `index`th network is saved in a build or an entry."""
    return folder / f"network-{index}.bin"


def build(networks: list[Any], folder: Path, device: str, precision: str) -> None:
    """Compile each network and save it into `folder` (Inductor writes its code into its
    cache folder, which the caller sets)."""
    prepare(networks)
    for index, network in enumerate(networks):
        compile_ = torch.compile(type(network).forward, fullgraph=True, dynamic=False)
        with modes(device, precision):
            compiled = compile_.aot_compile(  # type: ignore[attr-defined]
                ((network, segment_input(network, device)), {})
            )
        compiled.save_compiled_function(str(saved(folder, index)))


def load(networks: list[Any], folder: Path, device: str, precision: str) -> list[Any]:
    """The networks saved in `folder`, each bound to its eager network (the weights are
    shared, not copied): callables taking what the network takes."""
    prepare(networks)
    calls = []
    with modes(device, precision):  # the guards are made against the modes in force
        for index, network in enumerate(networks):
            with open(saved(folder, index), "rb") as file:
                compiled = torch.compiler.load_compiled_function(
                    file, f_globals=type(network).forward.__globals__
                )
            calls.append(functools.partial(compiled, network))
    return calls
