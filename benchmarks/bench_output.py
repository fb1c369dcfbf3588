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
- the outputs that open in a session, each alone over the baseline song folder: the DJ stem
  file (`output.stem_file`, five AAC streams), the practice renders (`output.practice`: a
  click, the song minus each stem, 75 %), the DAW projects (`output.session`), each with the
  disk it adds;
- separation: a full-size HTDemucs (the `htdemucs` architecture, untrained: same compute)
  with demucs's `apply_model` on `--separation-seconds` of audio, scaled to one minute.

    python benchmarks/bench_output.py [--minutes 1] [--runs 5] [--separation-seconds 10]
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from harness import ROOT, machine, parser as bench_parser, write_results
from stemdeck_watch.core.config import OutputSettings, SeparationSettings
from stemdeck_watch.stages.preview import Peaks, draw_preview
from stemdeck_watch.stages.publish import SongInfo, write_song
from stemdeck_watch.stages.manifest import list_files
from stemdeck_watch.stages.scratch import AudioReader, AudioWriter
from stemdeck_watch.stages.songfolder import make_song_folder, write_beat_grid

SR = 44100
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
                writer.write(audio[:, start : start + 10 * SR] * (0.1 * (i + 1)))
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
        seconds = timed(
            lambda: write_song(target, stems, SR, "song", sep, out, info=info, timings=timings)
        )
        return timings[key] if key else seconds

    def preview() -> float:
        def run() -> None:
            frames = AudioReader(stems["drums"]).frames
            peaks = {name: Peaks(frames) for name in stems}
            for name, path in stems.items():
                for start, block in AudioReader(path).blocks(1 << 18):
                    peaks[name].add(start, block)
            (work / "preview.png").unlink(missing_ok=True)  # new in each song folder
            draw_preview(work / "preview.png", peaks, "Bench", frames / SR)

        return timed(run)

    results = {
        "write_wav16": median_of(runs, lambda: publish(PLAIN)),
        "resample_48k": median_of(
            runs, lambda: publish(dataclasses.replace(PLAIN, samplerate=48000), "resample")
        ),
        "write_flac": median_of(runs, lambda: publish(dataclasses.replace(PLAIN, format="flac"))),
        "tags_flac": median_of(
            runs, lambda: publish(dataclasses.replace(PLAIN, format="flac", tags=True), "tags")
        ),
        "tags_mp3": median_of(
            runs, lambda: publish(dataclasses.replace(PLAIN, format="mp3", tags=True), "tags")
        ),
        "preview": median_of(runs, preview),
    }

    def beat_grid() -> None:
        (work / "beats.json").unlink(missing_ok=True)  # a song folder's file is new each time
        write_beat_grid(work / "beats.json", stems, SR)

    beat_grid()  # warm: librosa loaded, numba cache read
    results["beat_grid"] = median_of(runs, lambda: timed(beat_grid))
    publish(PLAIN)
    results["manifest_sha256"] = median_of(runs, lambda: timed(lambda: list_files(work / "out")))
    return results


OPTIONAL = {
    "stem_file": dataclasses.replace(PLAIN, stem_file=True),
    "practice": dataclasses.replace(PLAIN, practice=True),
    "session": dataclasses.replace(PLAIN, session=("dawproject", "reaper")),
}


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def measure_optional(work: Path, stems: dict[str, Path], runs: int) -> dict[str, dict[str, float]]:
    """Median seconds of each optional output as the song folder writes it (its own timing;
    the beat grid the practice click and the projects' tempo use is timed apart), and the
    bytes it adds to the plain folder."""
    sep = SeparationSettings()
    info = SongInfo("song", tags={"title": "Bench", "artist": "Synth", "album": "Bench"})

    def folder(out: OutputSettings) -> tuple[float, int]:
        target = work / "optional"
        shutil.rmtree(target, ignore_errors=True)
        target.mkdir()
        song = make_song_folder(target, stems, SR, info, sep, out)
        return song.timings.get(key, 0.0), folder_bytes(target)

    key = "write"
    plain = folder(PLAIN)[1]
    results = {}
    for key, out in OPTIONAL.items():
        sizes: list[int] = []

        def once(out: OutputSettings = out) -> float:
            seconds, size = folder(out)
            sizes.append(size)
            return seconds

        results[key] = {
            "seconds": median_of(runs, once),
            "extra_bytes": statistics.median(sizes) - plain,
        }
    return results


def cold_beat_grid(stems: dict[str, Path], runs: int) -> float:
    """Seconds of the first beat grid in a fresh process (imports included), median."""
    code = (
        "import sys, time; t = time.perf_counter(); from pathlib import Path; "
        "from stemdeck_watch.stages.songfolder import write_beat_grid; "
        "stems = {'drums': Path(sys.argv[1])}; "
        "write_beat_grid(Path(sys.argv[2]), stems, 44100); print(time.perf_counter() - t)"
    )
    out = stems["drums"].parent / "cold.json"

    def once() -> float:
        done = subprocess.run(
            [sys.executable, "-c", code, str(stems["drums"]), str(out)],
            check=True,
            capture_output=True,
            text=True,
            cwd=ROOT,
        )
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
            return timed(
                lambda: apply_model(model, mix, shifts=1, split=True, overlap=0.25, progress=False)
            )

    return median_of(runs, once) * 60 / seconds


def report(results: dict[str, Any]) -> str:
    per = results["per_minute"]
    sep = results.get("separation_per_minute")
    rows = [
        ("separation (htdemucs, CPU)", sep),
        ("write 4 stems, wav 16-bit", per["write_wav16"]),
        ("write 4 stems, flac 16-bit", per["write_flac"]),
        ("resample to 48 kHz", per["resample_48k"]),
        ("tags (flac)", per["tags_flac"]),
        ("tags (mp3)", per["tags_mp3"]),
        ("beat grid (warm)", per["beat_grid"]),
        ("preview.png", per["preview"]),
        ("manifest sha256", per["manifest_sha256"]),
    ]
    lines = ["| step | s per minute of audio | vs separation |", "|---|---:|---:|"]
    for name, value in rows:
        if value is None:
            continue
        share = f"{100 * value / sep:.2f} %" if sep and value is not sep else "—"
        lines.append(f"| {name} | {value:.3f} | {share} |")
    lines.append(
        f"| beat grid, first song of a process (librosa load) | "
        f"{results['cold_beat_grid_seconds']:.2f} s once | |"
    )
    names = {
        "stem_file": "DJ stem file (.stem.mp4)",
        "practice": "practice renders (mp3)",
        "session": "DAW projects (.dawproject, .rpp)",
    }
    lines += [
        "",
        "| output | s per minute of audio | vs separation | extra disk per minute |",
        "|---|---:|---:|---:|",
    ]
    for key, row in results["optional_per_minute"].items():
        share = f"{100 * row['seconds'] / sep:.2f} %" if sep else "—"
        lines.append(
            f"| {names[key]} | {row['seconds']:.3f} | {share} | {row['extra_mb']:.2f} MB |"
        )
    load = results["machine"]["load"][0]
    lines.append(
        f"\n{results['minutes']:g} min of audio, medians of {results['runs']} runs; "
        f"{results['machine']['cpus']} CPUs, load average {load:.1f} at the start"
    )
    return "\n".join(lines)


def main() -> int:
    parser = bench_parser(__doc__, "output")
    parser.add_argument("--minutes", type=float, default=1.0)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument(
        "--separation-seconds",
        type=float,
        default=10.0,
        help="audio for the separation reference; 0 = skip it",
    )
    parser.add_argument("--separation-runs", type=int, default=3)
    args = parser.parse_args()
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench-output-") as tmp:
        work = Path(tmp)
        stems = make_stems(work / "stems", args.minutes)
        steps = measure_steps(work, stems, args.runs)
        optional = measure_optional(work, stems, args.runs)
        cold = cold_beat_grid(stems, max(1, args.runs // 2))
    results: dict[str, Any] = {
        "machine": {**machine(), "cpus": os.cpu_count(), "load": os.getloadavg()},
        "minutes": args.minutes,
        "runs": args.runs,
        "per_minute": {k: v / args.minutes for k, v in steps.items()},
        "cold_beat_grid_seconds": cold,
        "optional_per_minute": {
            k: {
                "seconds": v["seconds"] / args.minutes,
                "extra_mb": v["extra_bytes"] / args.minutes / 1e6,
            }
            for k, v in optional.items()
        },
    }
    if args.separation_seconds > 0:
        results["separation_per_minute"] = separation_per_minute(
            args.separation_seconds, args.separation_runs
        )
    results["total_seconds"] = time.monotonic() - began
    print(report(results))
    write_results(args.out, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
