"""Separate a song of any length in bounded memory, with the result of one whole-song pass.

`demucs.apply.apply_model(model, mix, shifts, split=True, overlap, segment)` holds the whole
song and every stem of it in memory. Inside, it is a sum of independent pieces: for each model
of a bag and each random shift, the (shifted) song is cut into segments on a fixed grid
(`stride = (1 - overlap) * segment`), each segment goes through the model on its own, and the
outputs are overlap-added with a triangular weight and divided by the summed weights; shifts
are averaged and bag members weighted. Every output sample depends only on the few segments
that cover it.

This module runs exactly that computation window by window (`WINDOW_SECONDS` of output at a
time): for each (model, shift) pass it keeps demucs's segment grid, computes each segment once
(with the same padded input demucs would give it, read from the scratch file), overlap-adds it
into a running accumulator, and once every segment covering a window has been added, divides
that window out, combines shifts and models in demucs's order and appends it to the per-stem
files. What is carried from one window to the next is only the partial sums of the segments
that straddle the boundary (at most one segment long), so no segment is computed twice, no
context is thrown away, and the samples are the ones `apply_model` on the whole song gives —
with the same random shifts, the same float operations in the same order. Memory depends on
the window and the segment, never on the song.

The random shifts are drawn from Python's `random` in the order `apply_model` draws them (per
model of a bag, per shift), so `random.seed(n)` before either gives the same shifts.
"""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path
from typing import Any, Callable

import torch
from demucs.apply import BagOfModels, TensorChunk, apply_model
from demucs.htdemucs import HTDemucs

from stemdeck_watch.stages.scratch import AudioReader, AudioWriter, stats_of

WINDOW_SECONDS = 30.0


@dataclasses.dataclass(frozen=True)
class _Segment:
    offset: int  # start on the pass's (shifted) time line
    length: int  # frames of output it contributes (shorter at the end)
    start: int  # first input frame the model sees (its padded input), song coordinates
    size: int  # frames the model sees


class _Pass:
    """One model at one shift over the whole song: apply_model's `split` branch, streamed.

    Time lines: the pass sees the song shifted so that its index 0 is song frame `origin`
    (origin <= 0; demucs pads with zeros before the song and drops that part of the output)."""

    def __init__(
        self,
        model: Any,
        segment: float | None,
        overlap: float,
        transition_power: float,
        origin: int,
        song_frames: int,
        device: torch.device,
    ):
        self.model = model
        self.segment = segment  # as given to apply_model (None: the model's own)
        seconds = segment if segment is not None else model.segment
        assert seconds is not None and seconds > 0.0
        self.segment_length = int(model.samplerate * seconds)
        self.stride = int((1 - overlap) * self.segment_length)
        if self.stride <= 0:
            raise ValueError(
                f"overlap {overlap} leaves no stride for a segment of {self.segment_length} frames"
            )
        self.origin = origin
        self.length = song_frames - origin  # frames of the shifted time line
        self.device = device
        seg = self.segment_length
        # the triangle of demucs.apply.apply_model, built the same way on the same device
        weight = torch.cat(
            [
                torch.arange(1, seg // 2 + 1, device=device),
                torch.arange(seg - seg // 2, 0, -1, device=device),
            ]
        )
        self.weight = (weight / weight.max()) ** transition_power
        self.total = len(range(0, self.length, self.stride))
        self.next = 0  # index of the next segment to compute
        self.base = 0  # time-line index of acc[..., 0]
        self.acc: torch.Tensor | None = None
        self.weights: torch.Tensor | None = None

    def segment_at(self, k: int) -> _Segment:
        offset = k * self.stride
        length = min(self.segment_length, self.length - offset)
        model = self.model
        # the length apply_model(split=False) pads each chunk to
        if isinstance(model, HTDemucs) and self.segment is not None:
            size = int(self.segment * model.samplerate)
        elif hasattr(model, "valid_length"):
            size = model.valid_length(length)
        else:
            size = length
        return _Segment(offset, length, self.origin + offset - (size - length) // 2, size)

    def pending(self, stop: int) -> list[_Segment]:
        """The segments not computed yet that start before song frame `stop`."""
        end = min(stop - self.origin, self.length)
        last = -(-end // self.stride) if end > 0 else 0  # segments with offset < end
        return [self.segment_at(k) for k in range(self.next, max(self.next, last))]

    def run(
        self,
        segments: list[_Segment],
        source: torch.Tensor,
        source_start: int,
        on_segment: Callable[[], None],
    ) -> None:
        """Compute `segments` (inputs read from `source`, which starts at song frame
        `source_start`) and overlap-add them."""
        if not segments:
            return
        end = segments[-1].offset + segments[-1].length
        self._grow(end)
        assert self.acc is not None and self.weights is not None
        for seg in segments:
            position = seg.start + (seg.size - seg.length) // 2 - source_start
            chunk = TensorChunk(source, position, seg.length)
            out = apply_model(
                self.model,
                chunk,
                shifts=0,
                split=False,
                progress=False,
                device=self.device,
                segment=self.segment,
            )
            lo = seg.offset - self.base
            self.acc[..., lo : lo + seg.length] += (self.weight[: seg.length] * out).to(
                source.device
            )
            self.weights[lo : lo + seg.length] += self.weight[: seg.length].to(source.device)
            self.next += 1
            on_segment()

    def take(self, start: int, stop: int) -> torch.Tensor:
        """Song frames [start, stop) of this pass, final (every covering segment is in);
        forgets everything before `stop`."""
        lo, hi = start - self.origin - self.base, stop - self.origin - self.base
        assert self.acc is not None and self.weights is not None
        assert self.next == self.total or self.next * self.stride >= stop - self.origin
        out = self.acc[..., lo:hi] / self.weights[lo:hi]
        self.acc = self.acc[..., hi:].clone()
        self.weights = self.weights[hi:].clone()
        self.base += hi
        return out

    def _grow(self, end: int) -> None:
        have = 0 if self.acc is None else self.acc.shape[-1]
        need = end - self.base
        if need <= have:
            return
        sources, channels = len(self.model.sources), int(self.model.audio_channels)
        acc = torch.zeros(1, sources, channels, need)
        weights = torch.zeros(need)
        if self.acc is not None and self.weights is not None:
            acc[..., :have] = self.acc
            weights[:have] = self.weights
        self.acc, self.weights = acc, weights


def _song_stats(
    reader: AudioReader, stats: tuple[float, float] | None, whole: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """demucs's normalisation (`ref = mix.mean(0)`; its mean and std), as float32 tensors.
    A song that is one window long is in memory anyway: computed from it exactly as a
    whole-song pass does. Longer songs use the statistics decode accumulated, or a streamed
    pass over the file when none were given."""
    if whole is not None:
        ref = whole.mean(0)
        mean, std = ref.mean(), ref.std()
    else:
        if stats is None:
            stats = stats_of(reader.path)
        mean = torch.tensor(stats[0], dtype=torch.float32)
        std = torch.tensor(stats[1], dtype=torch.float32)
    if not torch.isfinite(std) or std < 1e-8:  # silence: nothing to normalise
        std = torch.tensor(1.0)
    if not torch.isfinite(mean):
        mean = torch.tensor(0.0)
    return mean, std


def separate_to_files(
    model: Any,
    input_path: Path,
    output_dir: Path,
    *,
    shifts: int = 1,
    overlap: float = 0.25,
    segment: float | None = None,
    device: str | torch.device = "cpu",
    stats: tuple[float, float] | None = None,
    window: float = WINDOW_SECONDS,
    transition_power: float = 1.0,
    on_progress: Callable[[float], None] = lambda _: None,
) -> dict[str, Path]:
    """Separate the (channels, frames) float32 `.npy` at `input_path` into
    `output_dir/<stem>.npy` (same layout), `window` seconds of output at a time; returns the
    stem files. The result equals `apply_model(model, normalised_mix, shifts=shifts,
    split=True, overlap=overlap, segment=segment)` un-normalised, as the worker always did."""
    device = torch.device(device)
    reader = AudioReader(input_path)
    frames, channels = reader.frames, reader.channels
    samplerate = int(model.samplerate)
    window_frames = max(1, int(window * samplerate))
    whole = torch.from_numpy(reader.read(0, frames)) if frames <= window_frames else None
    mean, std = _song_stats(reader, stats, whole)

    members = list(model.models) if isinstance(model, BagOfModels) else [model]
    passes: list[list[_Pass]] = []
    for member in members:  # shifts drawn in apply_model's order: per model, per shift
        runs = []
        for _ in range(max(1, shifts)):
            origin = 0
            if shifts:
                max_shift = int(0.5 * member.samplerate)
                origin = random.randint(0, max_shift) - max_shift
            runs.append(_Pass(member, segment, overlap, transition_power, origin, frames, device))
        passes.append(runs)
    total = sum(p.total for runs in passes for p in runs)
    done = [0]

    def segment_done() -> None:
        done[0] += 1
        on_progress(min(1.0, done[0] / total))

    output_dir.mkdir(parents=True, exist_ok=True)
    paths = {name: output_dir / f"{name}.npy" for name in model.sources}
    writers: list[AudioWriter] = []
    try:
        for name in model.sources:
            writers.append(AudioWriter(paths[name], channels))
        with torch.inference_mode():
            for start in range(0, frames, window_frames):
                stop = min(frames, start + window_frames)
                todo = [[p.pending(stop) for p in runs] for runs in passes]
                spans = [
                    (s.start, s.start + s.size) for runs in todo for segs in runs for s in segs
                ]
                lo = min((a for a, _ in spans), default=start)
                hi = max((b for _, b in spans), default=start)
                source = _normalised(reader, whole, lo, hi, mean, std)
                estimates = _window(
                    model, passes, todo, source, lo, start, stop, shifts, segment_done
                )
                result = (estimates[0] * std + mean).cpu().numpy()
                for writer, audio in zip(writers, result):
                    writer.write(audio)
        for writer in writers:
            writer.close()
    except BaseException:
        for writer in writers:
            writer.abort()
        raise
    return paths


def _normalised(
    reader: AudioReader,
    whole: torch.Tensor | None,
    lo: int,
    hi: int,
    mean: torch.Tensor,
    std: torch.Tensor,
) -> torch.Tensor:
    """Song frames [lo, hi), normalised, as (1, channels, n); zeros outside the song (the
    padding demucs gives the song's edges)."""
    frames = reader.frames
    out = torch.zeros(1, reader.channels, max(0, hi - lo))
    a, b = max(lo, 0), min(hi, frames)
    if b > a:
        audio = whole[:, a:b] if whole is not None else torch.from_numpy(reader.read(a, b))
        out[0, :, a - lo : b - lo] = (audio - mean) / std
    return out


def _window(
    model: Any,
    passes: list[list[_Pass]],
    todo: list[list[list[_Segment]]],
    source: torch.Tensor,
    source_start: int,
    start: int,
    stop: int,
    shifts: int,
    segment_done: Callable[[], None],
) -> torch.Tensor:
    """Song frames [start, stop) of every stem, combined as apply_model combines them."""
    bag = isinstance(model, BagOfModels)
    estimates: float | torch.Tensor = 0.0
    totals = [0.0] * len(model.sources)
    for m, runs in enumerate(passes):
        # each pass is run and its window taken before the next starts: one pass's
        # accumulator at a time, however many shifts
        out: float | torch.Tensor
        if shifts:
            out = 0.0
            for run, segments in zip(runs, todo[m]):
                run.run(segments, source, source_start, segment_done)
                out += run.take(start, stop)
            out /= shifts
        else:
            runs[0].run(todo[m][0], source, source_start, segment_done)
            out = runs[0].take(start, stop)
        if not bag:
            assert isinstance(out, torch.Tensor)
            return out
        assert isinstance(out, torch.Tensor)
        for k, inst_weight in enumerate(model.weights[m]):
            out[:, k, :, :] *= inst_weight
            totals[k] += inst_weight
        estimates += out
        del out
    assert isinstance(estimates, torch.Tensor)
    for k in range(estimates.shape[1]):
        estimates[:, k, :, :] /= totals[k]
    return estimates
