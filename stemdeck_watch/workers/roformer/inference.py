"""Separate a song of any length with a RoFormer, chunk by chunk, in memory bounded by the chunk.

A RoFormer sees a fixed chunk (`audio.chunk_size`: 8 s for the published vocal models). The
song is cut the way Music-Source-Separation-Training cuts it, which is how the published
scores were measured: both ends of the song are padded by reflection (by the overlap, when
the song is longer than twice that), chunks start every `chunk_size // num_overlap` samples,
a chunk running past the end is padded (by reflection when more than half of it is song,
with zeros otherwise), and the chunks' outputs are added with a window that fades in and out
linearly over a tenth of the chunk and divided by the summed window. Two things differ from
that code, both at the edges: the first chunk never fades in and every chunk that reaches the
end never fades out (there it applied the rule to whole batches, so a batch's first chunk
could fade in at the song's start, where nothing else covers it); and the fade is never
longer than the overlap, so every sample keeps a positive weight whatever `num_overlap` is.

The chunks are computed in order, `batch_size` at a time, and added into an accumulator one
chunk plus one batch of steps long; after each batch every sample before the next chunk's
start is final, so it is divided out and handed to the sink at once. Memory therefore depends
on the chunk and the batch, never on the song; the input is read in chunk-sized ranges.

`on_progress(fraction)` is called after each chunk, and within a chunk after each of the
model's transformers (24 times per chunk for the published BS-RoFormer, 12 for the Kimberley
Jensen Mel-Band RoFormer): a chunk of a full-size model takes seconds on a GPU but up to
minutes on a small CPU, and both a cancel and a watch for a stalled worker need to hear from
it more often than that. Raising from it (a cancel) stops the separation there, inside the
chunk, and nothing more is handed to the sink.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable, Protocol

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from stemdeck_watch.stages.scratch import AudioReader, AudioWriter
from stemdeck_watch.workers.demucs.precision import autocast
from stemdeck_watch.workers.roformer.layers import Transformer

Read = Callable[[int, int], np.ndarray]  # song frames [start, stop) as (channels, n) float32
Sink = Callable[[np.ndarray], None]  # the next frames of every stem, (stems, channels, n)


class ChunkedModel(Protocol):
    """What chunked inference needs of a model (checkpoint.LoadedRoformer has it)."""

    @property
    def module(self) -> nn.Module: ...  # (b, channels, chunk) → (b, stems, channels, chunk)

    @property
    def stems(self) -> tuple[str, ...]: ...

    @property
    def channels(self) -> int: ...

    @property
    def chunk_size(self) -> int: ...

    @property
    def num_overlap(self) -> int: ...


@dataclasses.dataclass(frozen=True)
class ChunkPlan:
    """Where the chunks of a song of `frames` samples fall, on the padded time line (song
    frame f is padded frame f + border)."""

    frames: int
    chunk: int
    step: int
    fade: int
    border: int

    @property
    def padded(self) -> int:
        return self.frames + 2 * self.border

    @property
    def starts(self) -> range:
        return range(0, self.padded, self.step)

    def length(self, start: int) -> int:
        """Samples of the padded song in the chunk at `start`."""
        return min(self.chunk, self.padded - start)

    def window(self, start: int) -> torch.Tensor:
        """The chunk's overlap-add weight: linear fades, none at the song's two ends."""
        window = torch.ones(self.chunk)
        if self.fade:
            if start > 0:
                window[: self.fade] = torch.linspace(0.0, 1.0, self.fade)
            if start + self.chunk < self.padded:
                window[-self.fade :] = torch.linspace(1.0, 0.0, self.fade)
        return window


def plan_chunks(frames: int, chunk: int, num_overlap: int) -> ChunkPlan:
    if chunk < 1 or num_overlap < 1:
        raise ValueError(f"chunk {chunk} and num_overlap {num_overlap} must be at least 1")
    step = max(1, chunk // num_overlap)
    overlap = chunk - step
    border = overlap if frames > 2 * overlap and overlap > 0 else 0
    return ChunkPlan(frames, chunk, step, min(chunk // 10, overlap), border)


def _reflect(index: np.ndarray, n: int) -> np.ndarray:
    """Song indices of padded positions mirrored at the song's ends (without repeating the
    edge sample, as `F.pad(mode="reflect")`); valid while the padding is shorter than n."""
    index = np.abs(index)
    return np.where(index >= n, 2 * (n - 1) - index, index)


def _chunk_input(read: Read, plan: ChunkPlan, start: int, channels: int) -> torch.Tensor:
    """(channels, chunk) float32: the padded song's samples from `start`, the rest padded."""
    length = plan.length(start)
    wanted = _reflect(np.arange(start, start + length) - plan.border, plan.frames)
    lo, hi = int(wanted.min()), int(wanted.max()) + 1
    block = np.asarray(read(lo, hi), dtype=np.float32)
    if block.shape != (channels, hi - lo):
        raise ValueError(
            f"read({lo}, {hi}) gave an array of shape {block.shape}, not {(channels, hi - lo)}"
        )
    part = torch.from_numpy(np.ascontiguousarray(block[:, wanted - lo]))
    if length == plan.chunk:
        return part
    mode = "reflect" if length > plan.chunk // 2 else "constant"
    return F.pad(part[None], (0, plan.chunk - length), mode=mode)[0]


def separate_stream(
    model: ChunkedModel,
    read: Read,
    frames: int,
    sink: Sink,
    *,
    num_overlap: int | None = None,
    batch_size: int = 1,
    precision: str = "float32",
    on_progress: Callable[[float], None] | None = None,
) -> None:
    """Separate the song `read` gives (`frames` samples, the model's channel count) and hand
    every stem to `sink` in order, each song sample exactly once. `num_overlap` defaults to
    the model's configuration; `batch_size` chunks go through the model at once (the
    configurations' own figures are for GPUs; on a CPU one is as fast and needs least)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, not {batch_size}")
    if frames <= 0:
        return
    module = model.module
    weight = next(iter(module.parameters()), None)
    device = weight.device if weight is not None else torch.device("cpu")
    plan = plan_chunks(frames, model.chunk_size, num_overlap or model.num_overlap)
    starts = list(plan.starts)
    stems, channels = len(model.stems), model.channels
    capacity = plan.chunk + batch_size * plan.step
    acc = torch.zeros(stems, channels, capacity)
    weights = torch.zeros(capacity)
    base = 0  # padded frame of acc[..., 0]; everything before it has been handed on
    inside = _Inside(module, len(starts), on_progress)
    try:
        for first in range(0, len(starts), batch_size):
            batch = starts[first : first + batch_size]
            inputs = torch.stack([_chunk_input(read, plan, s, channels) for s in batch])
            inside.begin(first)
            with torch.inference_mode(), autocast(device.type, precision):
                outputs = module(inputs.to(device))
            base = _add(outputs, batch, first, starts, plan, acc, weights, base, sink, on_progress)
    finally:
        inside.close()


class _Inside:
    """Progress from inside a chunk's forward pass: a hook after each transformer of the
    model reports `(chunks done + k / (transformers + 1)) / chunks`, short of the chunk's own
    whole step, so the fractions keep rising whatever the batch."""

    def __init__(self, module: nn.Module, total: int, report: Callable[[float], None] | None):
        self.total, self.report, self.done, self.count = total, report, 0, 0
        parts = [m for m in module.modules() if isinstance(m, Transformer)]
        self.parts = len(parts)
        self.handles = [p.register_forward_hook(self._hook) for p in parts] if report else []

    def begin(self, done: int) -> None:
        self.done, self.count = done, 0

    def _hook(self, *_: object) -> None:
        self.count += 1
        assert self.report is not None
        self.report((self.done + min(self.count, self.parts) / (self.parts + 1)) / self.total)

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


def _add(
    outputs: torch.Tensor,
    batch: list[int],
    first: int,
    starts: list[int],
    plan: ChunkPlan,
    acc: torch.Tensor,
    weights: torch.Tensor,
    base: int,
    sink: Sink,
    on_progress: Callable[[float], None] | None,
) -> int:
    """Overlap-add one batch's outputs, hand on every sample now final, shift the
    accumulator past them; returns its new base."""
    stems, channels, capacity = acc.shape
    outputs = outputs.float().cpu()
    if outputs.shape[1:] != (stems, channels, plan.chunk):
        raise ValueError(
            f"the model gave {tuple(outputs.shape[1:])} per chunk, "
            f"not {(stems, channels, plan.chunk)}"
        )
    for number, (out, start) in enumerate(zip(outputs, batch), start=first + 1):
        length, window = plan.length(start), plan.window(start)
        at = start - base
        acc[..., at : at + length] += out[..., :length] * window[:length]
        weights[at : at + length] += window[:length]
        if on_progress is not None:
            on_progress(number / len(starts))
    following = first + len(batch)
    final = starts[following] if following < len(starts) else plan.padded
    lo, hi = max(base, plan.border), min(final, plan.border + plan.frames)
    if hi > lo:
        span = weights[lo - base : hi - base]
        if not bool((span > 0).all()):  # the plan guarantees it; never divide by zero
            raise RuntimeError(f"no chunk weighs padded frames {lo}..{hi}")
        sink((acc[..., lo - base : hi - base] / span).numpy())
    shift = final - base
    acc[..., : capacity - shift] = acc[..., shift:].clone()
    acc[..., capacity - shift :] = 0.0
    weights[: capacity - shift] = weights[shift:].clone()
    weights[capacity - shift :] = 0.0
    return final


def separate_array(
    model: ChunkedModel, mix: np.ndarray, **options: object
) -> dict[str, np.ndarray]:
    """Every stem of the (channels, frames) `mix`, as arrays of its shape (the output is
    allocated once; the working memory is `separate_stream`'s)."""
    mix = np.asarray(mix, dtype=np.float32)
    if mix.ndim != 2 or mix.shape[0] != model.channels:
        raise ValueError(f"the model takes ({model.channels}, frames) audio, not {mix.shape}")
    out = np.empty((len(model.stems), *mix.shape), np.float32)
    done = [0]

    def sink(block: np.ndarray) -> None:
        out[..., done[0] : done[0] + block.shape[-1]] = block
        done[0] += block.shape[-1]

    separate_stream(model, lambda a, b: mix[:, a:b], mix.shape[1], sink, **options)  # type: ignore[arg-type]
    return dict(zip(model.stems, out))


def separate_file(
    model: ChunkedModel, input_path: Path, output_dir: Path, **options: object
) -> dict[str, Path]:
    """Separate the scratch `.npy` at `input_path` into `output_dir/<stem>.npy` (the same
    layout, written as it is computed; a failure or cancel removes them); returns the files."""
    reader = AudioReader(input_path)
    if reader.channels != model.channels:
        raise ValueError(
            f"{input_path} has {reader.channels} channel(s); the model takes {model.channels}"
        )
    output_dir.mkdir(parents=True, exist_ok=True)
    paths = {stem: output_dir / f"{stem}.npy" for stem in model.stems}
    writers: list[AudioWriter] = []
    try:
        for stem in model.stems:
            writers.append(AudioWriter(paths[stem], reader.channels))

        def sink(block: np.ndarray) -> None:
            for writer, audio in zip(writers, block):
                writer.write(audio)

        separate_stream(model, reader.read, reader.frames, sink, **options)  # type: ignore[arg-type]
        for writer in writers:
            writer.close()
    except BaseException:
        for writer in writers:
            writer.abort()
        raise
    return paths
