"""What each optional output step costs per minute of audio, next to the separation itself.

One synthetic song (`stemdeck_watch.util.synth`, a beat at 120 BPM) of `--minutes`, split into four
stems written as the worker writes them (scratch .npy). Each step runs `--runs` times and the
median is reported in seconds per minute of audio:

- write: the four stems as 16-bit wav, every optional step off (the baseline publish);
- resample: `output.samplerate = 48000` (soxr, inside the write loop);
- tags: flac stems tagged with mutagen (the flac write itself is reported beside it);
- beat grid: `beats.json` from the drums stem (librosa, warm) — and once, in a fresh process,
  the cold cost of the first song (librosa/numba load);
- preview: peaks of the four stems + drawing `preview.png` (Pillow);
- manifest: sha256 of every file in the folder;
- separation: a full-size HTDemucs (the `htdemucs` architecture, untrained: same compute)
  with demucs's `apply_model` on `--separation-seconds` of audio, scaled to one minute.

    python benchmarks/bench_output.py [--minutes 1] [--runs 5] [--separation-seconds 10]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results" / "output.json"
SR = 44100
sys.path.insert(0, str(ROOT))

from stemdeck_watch.core.config import OutputSettings, SeparationSettings  # noqa: E402
from stemdeck_watch.stages.preview import Peaks, draw_preview  # noqa: E402
from stemdeck_watch.stages.publish import SongInfo, list_files, write_song  # noqa: E402
from stemdeck_watch.stages.scratch import AudioReader, AudioWriter  # noqa: E402
from stemdeck_watch.stages.songfolder import write_beat_grid  # noqa: E402

STEMS = ("drums", "bass", "other", "vocals")
PLAIN = dataclasses.replace(OutputSettings(), beat_grid=False, preview=False, tags=False)


def make_stems(folder: Path, minutes: float) -> dict[str, Path]:
    """Four stems whose sum is the synthetic song, appended in 10 s pieces."""
    from stemdeck_watch.util.synth import song

    audio = song(minutes * 60, SR, seed=1).T
    stems = {}
    folder.mkdir(parents=True, exist_ok=True)
    for i, name in enumerate(STEMS):
        path = folder / f"{name}.npy"
        with AudioWriter(path, 2) as writer:
            for start in range(0, audio.shape[1], 10 * SR):
                writer.write(audio[:, start:start + 10 * SR] * (0.1 * (i + 1)))
        stems[name] = path
    return stems


def median_of(runs: int, step: Callable[[], float]) -> float:
    return statistics.median(step() for _ in range(runs))


def timed(action: Callable[[], Any]) -> float:
    started = time.perf_counter()
    action()
    return time.perf_counter() - started


def measure_steps(work: Path, stems: dict[str, Path], runs: int) -> dict[str, float]:
    """Median seconds of each step for the whole song."""
    sep = SeparationSettings()
    info = SongInfo("song", tags={"title": "Bench", "artist": "Synth", "album": "Bench"})

    def publish(out: OutputSettings, key: str | None = None) -> float:
        target = work / "out"
        shutil.rmtree(target, ignore_errors=True)
        timings: dict[str, float] = {}
        seconds = timed(lambda: write_song(target, stems, SR, "song", sep, out, info=info,
                                           timings=timings))
        return timings[key] if key else seconds

    def preview() -> float:
        def run() -> None:
            frames = AudioReader(stems["drums"]).frames
            peaks = {name: Peaks(frames) for name in stems}
            for name, path in stems.items():
                for start, block in AudioReader(path).blocks(1 << 18):
                    peaks[name].add(start, block)
            draw_preview(work / "preview.png", peaks, "Bench", frames / SR)
        return timed(run)

    results = {
        "write_wav16": median_of(runs, lambda: publish(PLAIN)),
        "resample_48k": median_of(runs, lambda: publish(
            dataclasses.replace(PLAIN, samplerate=48000), "resample")),
        "write_flac": median_of(runs, lambda: publish(dataclasses.replace(PLAIN, format="flac"))),
        "tags_flac": median_of(runs, lambda: publish(
            dataclasses.replace(PLAIN, format="flac", tags=True), "tags")),
        "tags_mp3": median_of(runs, lambda: publish(
            dataclasses.replace(PLAIN, format="mp3", tags=True), "tags")),
        "preview": median_of(runs, preview),
    }
    write_beat_grid(work / "beats.json", stems, SR)  # warm: librosa loaded, numba cache read
    results["beat_grid"] = median_of(runs, lambda: timed(
        lambda: write_beat_grid(work / "beats.json", stems, SR)))
    publish(PLAIN)
    results["manifest_sha256"] = median_of(runs, lambda: timed(lambda: list_files(work / "out")))
    return results


def cold_beat_grid(stems: dict[str, Path], runs: int) -> float:
    """Seconds of the first beat grid in a fresh process (imports included), median."""
    code = ("import sys, time; t = time.perf_counter(); from pathlib import Path; "
            "from stemdeck_watch.stages.songfolder import write_beat_grid; "
            "stems = {'drums': Path(sys.argv[1])}; "
            "write_beat_grid(Path(sys.argv[2]), stems, 44100); print(time.perf_counter() - t)")
    out = stems["drums"].parent / "cold.json"

    def once() -> float:
        done = subprocess.run([sys.executable, "-c", code, str(stems["drums"]), str(out)],
                              check=True, capture_output=True, text=True, cwd=ROOT)
        return float(done.stdout.strip().splitlines()[-1])
    return median_of(runs, once)


def separation_per_minute(seconds: float, runs: int) -> float:
    """Seconds a full-size HTDemucs needs per minute of audio here (CPU)."""
    import torch
    from demucs.apply import apply_model
    from demucs.htdemucs import HTDemucs

    torch.manual_seed(0)
    model = HTDemucs(sources=list(STEMS)).eval()
    mix = torch.randn(1, 2, int(seconds * SR)) * 0.1

    def once() -> float:
        with torch.inference_mode():
            return timed(lambda: apply_model(model, mix, shifts=1, split=True, overlap=0.25,
                                             progress=False))
    return median_of(runs, once) * 60 / seconds


def report(results: dict[str, Any]) -> str:
    per = results["per_minute"]
    sep = results.get("separation_per_minute")
    rows = [("separation (htdemucs, CPU)", sep), ("write 4 stems, wav 16-bit", per["write_wav16"]),
            ("write 4 stems, flac 16-bit", per["write_flac"]),
            ("resample to 48 kHz", per["resample_48k"]), ("tags (flac)", per["tags_flac"]),
            ("tags (mp3)", per["tags_mp3"]), ("beat grid (warm)", per["beat_grid"]),
            ("preview.png", per["preview"]), ("manifest sha256", per["manifest_sha256"])]
    lines = ["| step | s per minute of audio | vs separation |", "|---|---:|---:|"]
    for name, value in rows:
        if value is None:
            continue
        share = f"{100 * value / sep:.2f} %" if sep and value is not sep else "—"
        lines.append(f"| {name} | {value:.3f} | {share} |")
    lines.append(f"| beat grid, first song of a process (librosa load) | "
                 f"{results['cold_beat_grid_seconds']:.2f} s once | |")
    load = results["machine"]["load"][0]
    lines.append(f"\n{results['minutes']:g} min of audio, medians of {results['runs']} runs; "
                 f"{results['machine']['cpus']} CPUs, load average {load:.1f} at the start")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=1.0)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--separation-seconds", type=float, default=10.0,
                        help="audio for the separation reference; 0 = skip it")
    parser.add_argument("--separation-runs", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS, help="raw results (JSON)")
    args = parser.parse_args()
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench-output-") as tmp:
        work = Path(tmp)
        stems = make_stems(work / "stems", args.minutes)
        steps = measure_steps(work, stems, args.runs)
        cold = cold_beat_grid(stems, max(1, args.runs // 2))
    results: dict[str, Any] = {
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count(),
                    "load": os.getloadavg()},
        "minutes": args.minutes, "runs": args.runs,
        "per_minute": {k: v / args.minutes for k, v in steps.items()},
        "cold_beat_grid_seconds": cold,
    }
    if args.separation_seconds > 0:
        results["separation_per_minute"] = separation_per_minute(args.separation_seconds,
                                                                 args.separation_runs)
    results["total_seconds"] = time.monotonic() - began
    print(report(results))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
