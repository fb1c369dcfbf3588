"""Chunked separation against whole-song `apply_model`, in one torch process.

Run by tests/workers/test_long_songs.py (the test process itself never imports torch):

    python tests/support/long_song_checks.py MODEL_REPO WORKDIR [--seconds 240] [--no-memo]

prints one JSON object. Every check decodes a synthetic song with the service's own decoder
(which also yields the normalisation statistics) and compares, stem by stem:

- "long":  a 4-minute song, the worker's chunked path (30 s windows) against `apply_model` on
  the whole song with the same settings and the same normalisation; plus lengths and the
  sample-to-sample jumps at window boundaries.
- "short": a song shorter than one window against the worker's code before chunking (load the
  whole file, torch statistics, `apply_model`): must be the same samples.
- "bag":   a bag of two models, 2 shifts, segment 3 s, overlap 0.4, 3 s windows.
- "stats": the realistic path: the decoder's streamed statistics against torch's statistics of
  the whole song (what the worker computed before), across windows.

Speed: by default the model's forward is memoised on the exact bytes of its input: the
whole-song pass records each segment's output, the chunked pass replays it, and any input the
whole-song pass never saw is computed for real (a miss). The model is deterministic (checked
here), so this changes no sample; it halves the time and adds a check of its own: with zero
misses, the chunked path fed the model exactly the inputs of the whole-song pass, segment for
segment. `--no-memo` computes everything twice.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import soundfile
import torch

import demucs.transformer
from demucs.apply import BagOfModels, apply_model
from demucs.pretrained import get_model

from stemdeck_watch.workers.demucs.chunked import separate_to_files
from stemdeck_watch.stages.decode import DecodedAudio, decode_to_file
from stemdeck_watch.workers.tinymodel import save_tiny_model
from stemdeck_watch.util.synth import song

SR = 44100
SEED = 1234


class Memo:
    """Record a model's forward outputs by input bytes; replay them later."""

    def __init__(self, model: Any, enabled: bool):
        self.enabled = enabled
        self.store: dict[tuple, torch.Tensor] = {}
        self.replaying = False
        self.hits = self.misses = self.recorded = 0
        members = list(model.models) if isinstance(model, BagOfModels) else [model]
        for index, member in enumerate(members):
            member.forward = self._wrap(index, member.forward)

    def _wrap(self, index: int, forward: Any) -> Any:
        def memo_forward(mix: torch.Tensor) -> torch.Tensor:
            if not self.enabled:
                return forward(mix)
            key = (
                index,
                tuple(mix.shape),
                hashlib.sha1(mix.detach().cpu().contiguous().numpy().tobytes()).digest(),
            )
            if self.replaying:
                if key in self.store:
                    self.hits += 1
                    return self.store.pop(key)
                self.misses += 1
                return forward(mix)
            out = forward(mix)
            self.store[key] = out.clone()
            self.recorded += 1
            return out

        return memo_forward


def whole_song(
    model: Any,
    audio: np.ndarray,
    *,
    shifts: int,
    overlap: float,
    segment: float | None,
    stats: tuple[float, float] | None = None,
) -> np.ndarray:
    """The worker before chunking: the whole song in memory, normalised (with torch's own
    statistics unless `stats` is given), one `apply_model`."""
    mix = torch.from_numpy(np.ascontiguousarray(audio))
    if stats is None:
        ref = mix.mean(0)
        mean, std = ref.mean(), ref.std()
    else:
        mean = torch.tensor(stats[0], dtype=torch.float32)
        std = torch.tensor(stats[1], dtype=torch.float32)
    if not torch.isfinite(std) or std < 1e-8:
        std = torch.tensor(1.0)
    random.seed(SEED)
    with torch.inference_mode():
        sources = apply_model(
            model,
            ((mix - mean) / std)[None],
            shifts=shifts,
            split=True,
            overlap=overlap,
            segment=segment,
            progress=False,
            device="cpu",
        )[0]
    return (sources * std + mean).numpy()


def chunked(model: Any, decoded: DecodedAudio, out: Path, **kwargs: Any) -> dict[str, np.ndarray]:
    random.seed(SEED)
    paths = separate_to_files(model, decoded.path, out, device="cpu", **kwargs)
    return {name: np.load(path) for name, path in paths.items()}


def snr_db(reference: np.ndarray, estimate: np.ndarray) -> float:
    noise = float(np.square(reference.astype(np.float64) - estimate).sum())
    signal = float(np.square(reference.astype(np.float64)).sum())
    return float("inf") if noise == 0 else 10 * np.log10(signal / noise)


def compare(model: Any, reference: np.ndarray, result: dict[str, np.ndarray]) -> dict[str, Any]:
    return {
        "snr_db": {
            name: snr_db(reference[i], result[name]) for i, name in enumerate(model.sources)
        },
        "identical": all(
            np.array_equal(reference[i], result[name]) for i, name in enumerate(model.sources)
        ),
        "shapes": {name: list(result[name].shape) for name in model.sources},
    }


def decode_song(
    work: Path, name: str, seconds: float, seed: int = 0
) -> tuple[DecodedAudio, np.ndarray]:
    source = work / f"{name}.wav"
    soundfile.write(source, song(seconds, seed=seed), SR, subtype="PCM_16")
    decoded = decode_to_file(source, work / f"{name}.npy", SR, 2)
    return decoded, np.load(decoded.path)


def jumps(result: dict[str, np.ndarray], window_frames: int) -> dict[str, Any]:
    """Largest sample-to-sample step across window boundaries and everywhere else."""
    report = {}
    for name, audio in result.items():
        step = np.abs(np.diff(audio.astype(np.float64), axis=1)).max(axis=0)
        boundaries = np.arange(window_frames, audio.shape[1], window_frames) - 1
        elsewhere = np.delete(step, boundaries)
        report[name] = {
            "boundary": float(step[boundaries].max()),
            "elsewhere": float(elsewhere.max()),
            "boundaries": len(boundaries),
        }
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("repo", type=Path)
    parser.add_argument("work", type=Path)
    parser.add_argument("--seconds", type=float, default=240.0)
    parser.add_argument("--window", type=float, default=30.0)
    parser.add_argument("--no-memo", action="store_true")
    parser.add_argument("--only", nargs="*", default=["long", "short", "bag", "stats"])
    args = parser.parse_args(argv)
    # HTDemucs's transformer draws from `random` in every forward; demucs draws the shifts
    # from it between passes, so a whole-song run's second shift depends on how many
    # segments came before. A private generator for the transformer keeps the shift draws
    # alone on `random`, so both paths draw the same shifts (the transformer's draw,
    # randrange(1), is always 0 anyway).
    demucs.transformer.random = random.Random(0)
    torch.manual_seed(0)
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    memo_on = not args.no_memo
    model = get_model("tiny", repo=args.repo)
    report: dict[str, Any] = {"memo": memo_on}
    with torch.inference_mode():  # the model is deterministic: the memo's premise
        probe = torch.randn(1, 2, 4 * SR)
        report["deterministic"] = bool(torch.equal(model(probe), model(probe)))
    memo = Memo(model, memo_on)

    if "long" in args.only:
        started = time.monotonic()
        decoded, audio = decode_song(work, "long", args.seconds)
        settings = {"shifts": 1, "overlap": 0.25, "segment": None}
        memo.replaying = False
        t0 = time.monotonic()
        reference = whole_song(model, audio, stats=decoded.stats, **settings)
        t1 = time.monotonic()
        memo.replaying = True
        result = chunked(
            model, decoded, work / "long-stems", stats=decoded.stats, window=args.window, **settings
        )
        t2 = time.monotonic()
        report["long"] = {
            **compare(model, reference, result),
            "seconds": args.seconds,
            "input_frames": decoded.frames,
            "window": args.window,
            "jumps": jumps(result, int(args.window * SR)),
            "reference_jumps": jumps(
                {n: reference[i] for i, n in enumerate(model.sources)}, int(args.window * SR)
            ),
            "recorded": memo.recorded,
            "hits": memo.hits,
            "misses": memo.misses,
            "time_whole": t1 - t0,
            "time_chunked": t2 - t1,
            "time_total": time.monotonic() - started,
        }
        memo.store.clear()
        del reference, result

    if "short" in args.only:
        memo.recorded = memo.hits = memo.misses = 0
        decoded, audio = decode_song(work, "short", 10.0, seed=3)
        memo.replaying = False
        reference = whole_song(model, audio, shifts=1, overlap=0.25, segment=None)
        memo.replaying = True
        result = chunked(
            model,
            decoded,
            work / "short-stems",
            stats=decoded.stats,
            shifts=1,
            overlap=0.25,
            segment=None,
        )
        report["short"] = {
            **compare(model, reference, result),
            "hits": memo.hits,
            "misses": memo.misses,
            "input_frames": decoded.frames,
        }
        memo.store.clear()

    if "bag" in args.only:
        second = save_tiny_model(work / "models", "tinyb", seed=1)
        bag = BagOfModels(
            [get_model("tiny", repo=args.repo), get_model("tinyb", repo=second.parent)],
            weights=[[1.0, 2.0, 1.0, 1.0], [1.0, 1.0, 3.0, 0.5]],
        )
        bag_memo = Memo(bag, memo_on)
        decoded, audio = decode_song(work, "bag", 8.0, seed=4)
        settings = {"shifts": 2, "overlap": 0.4, "segment": 3.0}
        # exact statistics on both sides: this check is about the windows, not rounding
        mix = torch.from_numpy(np.ascontiguousarray(audio)).mean(0)
        exact = (float(mix.mean()), float(mix.std()))
        reference = whole_song(bag, audio, **settings)
        bag_memo.replaying = True
        result = chunked(bag, decoded, work / "bag-stems", stats=exact, window=3.0, **settings)
        report["bag"] = {
            **compare(bag, reference, result),
            "hits": bag_memo.hits,
            "misses": bag_memo.misses,
            "input_frames": decoded.frames,
            "jumps": jumps(result, 3 * SR),
        }

    if "stats" in args.only:
        memo.enabled = False  # the inputs differ in the last bits: nothing to replay
        decoded, audio = decode_song(work, "stats", 12.0, seed=5)
        reference = whole_song(model, audio, shifts=1, overlap=0.25, segment=None)
        result = chunked(
            model,
            decoded,
            work / "stats-stems",
            stats=decoded.stats,
            window=4.0,
            shifts=1,
            overlap=0.25,
            segment=None,
        )
        mix = torch.from_numpy(np.ascontiguousarray(audio)).mean(0)
        report["stats"] = {
            **compare(model, reference, result),
            "decoded": list(decoded.stats or ()),
            "torch": [float(mix.mean()), float(mix.std())],
            "numpy64": [
                float(mix.numpy().astype(np.float64).mean()),
                float(mix.numpy().astype(np.float64).std(ddof=1)),
            ],
        }
    json.dump(report, sys.stdout)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
