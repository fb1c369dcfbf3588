"""The parts of each network, each compiled ahead of time as one graph into a file and loaded
back.

`torch.compile` on its own traces the model with Dynamo in every process that uses it: even
with all of Inductor's code in its cache, a full-size HTDemucs took about ten seconds to trace
again, so a restarted worker separated with the eager model for half a minute before the
compiled one was back. torch can instead compile a function that is one whole graph ahead of
time and save it with its guards (`torch.compile(..., fullgraph=True).aot_compile`); loading
it back (`torch.compiler.load_compiled_function`) traces nothing and takes seconds.

What is compiled is each part of a network: its direct children (a list of layers opened into
its layers), the encoder and decoder layers and the transformer, where the compute is. The
network's own forward stays eager: its STFT and inverse STFT and the few cheap steps between
the parts. Inductor has no kernels for complex numbers, and the inverse STFT's overlap-add,
traced through, becomes one C++ kernel of thousands of loops that takes the compiler longer
than the rest of the model together (with it a full-size build took 751 s here). Where
OpenVINO is installed the transformer is converted for it rather than compiled
(compiled/openvinograph.py): `build` and `load` take each part to the one or the other. Compiled as
one whole graph with the STFT as an opaque operator, a full-size HTDemucs under bfloat16
autocast came out NaN (torch 2.13), while each part compiled on its own matched eager
bfloat16 to 50 dB or more.

One part keeps an eager piece inside: the transformer's position embedding
(`_get_pos_embedding`) draws a random shift each call; traced, the draw becomes a generated
global that a saved function cannot take along. It becomes an opaque operator here (a
torch.library custom op): the graph calls it and it runs eager, as the model's own method.
Which module it works for is an index into `_OWNERS`, written into the graph as a constant, so
`prepare` must register the same modules in the same order in the process that loads as in
the one that built.

A part's inputs in a separation are what one segment of silence gives it in the build, so its
graph is built from a real forward pass (hooks record what each part is called with). A saved
function checks its guards on every call: the input's shape, dtype and the modes it runs under
(inference mode, autocast), as they were when it was loaded, which is why loading happens
under the separation's modes. A call they refuse raises, and model.py runs that part eager.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Callable

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

from stemdeck_watch.workers.compiled import openvinograph
from stemdeck_watch.workers.compiled.cache import PART_SUFFIX
from stemdeck_watch.workers.demucs.precision import autocast

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
def _pos_embedding_for(owner: int) -> Callable[..., torch.Tensor]:
    return lambda t, b, c, device: _pos_embedding(t, b, c, torch.device(device), owner)


ROUTED = "_get_pos_embedding"  # the method routed through the operator


def release() -> None:
    """Give every routed module its own method back and forget it, so a model let go is not
    kept in memory by its owner number."""
    for module in _OWNERS:
        vars(module).pop(ROUTED, None)
    _OWNERS.clear()


def prepare(networks: list[Any]) -> None:
    """Route each network's position embedding through the operator. Eager separation gives
    the same stems through it; the compiled graphs need it, with the same owners. Modules an
    earlier call routed go back to their own methods: their owner numbers are reused.
    Networks with nothing to route (a RoFormer) leave another model's routing as it is."""
    routed = [m for n in networks for m in n.modules() if callable(getattr(type(m), ROUTED, None))]
    if not routed:
        return
    release()
    for module in routed:
        _OWNERS.append(module)
        setattr(module, ROUTED, _pos_embedding_for(len(_OWNERS) - 1))


def unsupported(networks: list[Any]) -> str | None:
    """Why these networks are not compiled, or None: HTDemucs and the RoFormers are. The
    others (HDemucs of `hdemucs_mmi` and `mdx*`, Demucs v2) hold LSTMs, which a whole-part
    graph refuses, and pad their last segment to another length than the rest, which the
    guards refuse. (A RoFormer pads every chunk to its full length: workers/roformer.)"""
    from demucs.htdemucs import HTDemucs

    from stemdeck_watch.workers.roformer.architectures import ARCHITECTURES

    compiled = (HTDemucs, *ARCHITECTURES.values())
    other = sorted({type(n).__name__ for n in networks if not isinstance(n, compiled)})
    if other:
        return (
            f"compiling is for HTDemucs models (htdemucs, htdemucs_ft, htdemucs_6s) and the "
            f"RoFormers, not {', '.join(other)}"
        )
    return None


def parts(network: Any, prefix: str = "") -> dict[str, Any]:
    """The parts of a network by name: its direct children, a list of layers opened into its
    layers (`encoder.0`, `encoder.1`, …), and a list of lists into theirs (a RoFormer's
    blocks: `layers.0.0`, its first block's first transformer)."""
    found: dict[str, Any] = {}
    for name, child in network.named_children():
        if isinstance(child, (torch.nn.ModuleList, torch.nn.ModuleDict)):
            found.update(parts(child, f"{prefix}{name}."))
        else:
            found[f"{prefix}{name}"] = child
    return found


def segment_input(network: Any, device: str) -> torch.Tensor:
    """Silence of the shape separation hands the network (one segment, or a RoFormer's
    chunk, batch of one), made as separation makes it (an inference tensor): what the
    compiled parts are built for."""
    frames = getattr(network, "chunk_size", None)  # a RoFormer: workers/roformer/inference.py
    if frames is None:
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


def saved(folder: Path, index: int, part: str) -> Path:
    """Where a part of the `index`th network is saved in a build or an entry."""
    return folder / f"network-{index}.{part}{PART_SUFFIX}"


def part_inputs(network: Any, device: str, precision: str) -> dict[str, tuple[Any, Any, Any]]:
    """Each part with what it is called with (part, args, kwargs) when the network separates
    a segment of silence, by name; a part the forward does not call is left out."""
    called: dict[str, tuple[Any, Any, Any]] = {}

    def recorder(name: str) -> Callable[..., None]:
        def record(part: Any, args: Any, kwargs: Any) -> None:
            called.setdefault(name, (part, args, kwargs))

        return record

    hooks = [
        part.register_forward_pre_hook(recorder(name), with_kwargs=True)
        for name, part in parts(network).items()
    ]
    try:
        with modes(device, precision):
            network(segment_input(network, device))
    finally:
        for hook in hooks:
            hook.remove()
    return called


def _laid_out(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
    """`args` and `kwargs` with every tensor in the standard (contiguous) layout. Guards check
    strides too, and a part's input is the output of another, eager or compiled, which lay
    out the same values differently: one layout at the build and at every call keeps the
    parts independent of each other."""

    def lay(value: Any) -> Any:
        return value.contiguous() if isinstance(value, torch.Tensor) else value

    return tuple(map(lay, args)), {key: lay(value) for key, value in kwargs.items()}


def _bound(compiled: Callable[..., Any], part: Any, name: str) -> Callable[..., Any]:
    """`compiled` bound to `part`, named as its saved file (`network-0.encoder.3`): what a
    refusal names, as a network holds several parts of one class."""

    def call(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = _laid_out(args, kwargs)
        return compiled(part, *args, **kwargs)

    call.__name__ = name
    return call


def build(networks: list[Any], folder: Path, device: str, precision: str) -> None:
    """Compile each part of each network and save it into `folder` (Inductor writes its code
    into its cache folder, which the caller sets): the transformer converted for OpenVINO
    where it takes it (compiled/openvinograph.py), every other part through Inductor."""
    release()  # OpenVINO converts the model's own position embedding
    called = [part_inputs(network, device, precision) for network in networks]
    for index, inputs in enumerate(called):
        for name, (part, args, kwargs) in list(inputs.items()):
            if openvinograph.takes(part, args, kwargs, device):
                openvinograph.build(part, args, openvinograph.saved(folder, index, name))
                del inputs[name]
    prepare(networks)
    for index, inputs in enumerate(called):
        for name, (part, args, kwargs) in inputs.items():
            compile_ = torch.compile(type(part).forward, fullgraph=True, dynamic=False)
            with modes(device, precision):
                args, kwargs = _laid_out(args, kwargs)
                compiled = compile_.aot_compile(((part, *args), kwargs))  # type: ignore[attr-defined]
            compiled.save_compiled_function(str(saved(folder, index, name)))


def load(networks: list[Any], folder: Path, device: str, precision: str) -> list[tuple[Any, Any]]:
    """The parts saved in `folder`: (part, callable) pairs, each callable bound to its eager
    part (the weights are shared, not copied) and taking what the part takes."""
    prepare(networks)
    pairs = []
    with modes(device, precision):  # the guards are made against the modes in force
        for index, network in enumerate(networks):
            for name, part in parts(network).items():
                converted = openvinograph.saved(folder, index, name)
                if converted.exists():
                    pairs.append((part, openvinograph.load(converted, precision, converted.stem)))
                    continue
                path = saved(folder, index, name)
                try:
                    file = open(path, "rb")
                except FileNotFoundError:
                    continue  # a part the forward does not call
                with file:
                    compiled = torch.compiler.load_compiled_function(
                        file, f_globals=type(part).forward.__globals__
                    )
                pairs.append((part, _bound(compiled, part, path.stem)))
    if not pairs:
        raise FileNotFoundError(f"no compiled part in {folder}")
    return pairs
