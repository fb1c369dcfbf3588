"""Songs of any length in bounded memory, with the result of one whole-song separation.

The equivalence checks run in one torch subprocess (tests/support/long_song_checks.py, ~40 s with the
tiny model) and are asserted here one property per test; the scratch-file helpers are tested
directly; the service test cancels a job in the middle of a window.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from stemdeck_watch.core.jobs import JobState
from stemdeck_watch.stages.scratch import (
    HEADER_BYTES,
    AudioReader,
    AudioWriter,
    RunningStats,
    estimate_scratch_bytes,
    stats_of,
)
from stemdeck_watch.workers.worker import WINDOW_ENV
from stemdeck_watch.util.synth import write_song

from support.helpers import outbox_entries, wait_for

SR = 44100
SUPPORT = Path(__file__).resolve().parents[1] / "support"


# ------------------------------------------------------------------ scratch files (no torch)


@pytest.mark.parametrize("channels", [1, 2])
def test_scratch_files_are_written_in_blocks_and_read_back_in_ranges(tmp_path, channels):
    rng = np.random.default_rng(0)
    audio = rng.standard_normal((channels, 10_007)).astype(np.float32)
    path = tmp_path / "a.npy"
    with AudioWriter(path, channels) as writer:
        for start in range(0, audio.shape[1], 999):
            writer.write(audio[:, start : start + 999])
    assert np.array_equal(np.load(path), audio)  # an ordinary .npy, (channels, frames)
    assert path.stat().st_size == HEADER_BYTES + audio.size * 4
    reader = AudioReader(path)
    assert reader.shape == audio.shape
    assert np.array_equal(reader.read(1234, 5678), audio[:, 1234:5678])
    assert reader.read(9_000, 20_000).shape == (channels, 1_007)  # clipped to the file
    assert reader.read(20_000, 30_000).shape == (channels, 0)
    interleaved = reader.read(1234, 5678, interleaved=True)  # for a sound file's writer
    assert np.array_equal(interleaved, audio[:, 1234:5678])
    assert interleaved.T.flags.c_contiguous and reader.read(0, 9).flags.c_contiguous
    c_order = tmp_path / "c.npy"
    np.save(c_order, audio)  # what np.save writes (C order) reads the same
    assert np.array_equal(AudioReader(c_order).read(17, 4000), audio[:, 17:4000])
    assert np.array_equal(AudioReader(c_order).read(17, 4000, interleaved=True), audio[:, 17:4000])


def test_a_scratch_file_cut_short_is_an_error_naming_it(tmp_path):
    path = tmp_path / "a.npy"
    with AudioWriter(path, 2) as writer:
        writer.write(np.ones((2, 1000), np.float32))
    reader = AudioReader(path)
    with open(path, "r+b") as handle:  # the disk filled up under the worker, say
        handle.truncate(HEADER_BYTES + 600 * 2 * 4)
    assert np.array_equal(reader.read(0, 600), np.ones((2, 600), np.float32))
    with pytest.raises(ValueError, match="a.npy holds fewer frames than its header says"):
        reader.read(500, 1000)


def test_a_failed_write_leaves_no_scratch_file(tmp_path):
    path = tmp_path / "a.npy"
    with pytest.raises(RuntimeError):
        with AudioWriter(path, 2) as writer:
            writer.write(np.zeros((2, 100), np.float32))
            raise RuntimeError("cancelled")
    assert not path.exists()


def test_running_statistics_match_the_whole_signal_however_it_is_cut(tmp_path):
    rng = np.random.default_rng(1)
    audio = (0.3 * rng.standard_normal((2, 300_001)) + 0.01).astype(np.float32)
    mono = audio.astype(np.float64).mean(axis=0)
    for size in (1, 4_096, 65_536, 300_001):
        stats = RunningStats()
        for start in range(0, audio.shape[1], size if size > 1 else 77_777):
            stats.add_audio(audio[:, start : start + (size if size > 1 else 77_777)])
        assert stats.count == audio.shape[1]
        assert stats.mean == pytest.approx(mono.mean(), rel=1e-12, abs=1e-15)
        assert stats.std == pytest.approx(mono.std(ddof=1), rel=1e-12)
    path = tmp_path / "a.npy"
    np.save(path, audio)
    assert stats_of(path) == pytest.approx((mono.mean(), mono.std(ddof=1)), rel=1e-12)


def test_the_scratch_estimate_is_input_plus_stems_in_float32():
    one_minute = 60 * SR * 2 * 4
    assert estimate_scratch_bytes(60) == pytest.approx(5 * one_minute, rel=1e-5)
    assert estimate_scratch_bytes(60, stems=6) == pytest.approx(7 * one_minute, rel=1e-5)
    # "about 10x the song as 16-bit wav" for four stems
    assert estimate_scratch_bytes(3600) / (3600 * SR * 2 * 2) == pytest.approx(10, rel=1e-4)
    assert estimate_scratch_bytes(0) == 5 * HEADER_BYTES


# ------------------------------------------------------------- chunked vs whole-song demucs


@pytest.fixture(scope="module")
def checks(model_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("long-song-checks")
    proc = subprocess.run(
        [sys.executable, str(SUPPORT / "long_song_checks.py"), str(model_repo), str(work)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _figures(snr: dict[str, float]) -> str:
    return ", ".join(
        f"{stem} {'inf (bit-identical)' if math.isinf(v) else f'{v:.1f}'} dB"
        for stem, v in snr.items()
    )


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_four_minute_song_in_windows_matches_apply_model_on_the_whole_song(checks):
    long = checks["long"]
    assert long["seconds"] == 240 and long["window"] == 30
    assert checks["deterministic"]
    worst = min(long["snr_db"].values())
    assert worst >= 40, f"SNR per stem vs whole-song apply_model: {_figures(long['snr_db'])}"
    print(f"4-minute song, 30 s windows: {_figures(long['snr_db'])}")
    if checks["memo"]:  # the model saw exactly the whole-song inputs, nothing more
        assert long["misses"] == 0 and long["hits"] == long["recorded"] > 0, long


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_lengths_are_exact(checks):
    long = checks["long"]
    assert abs(long["input_frames"] - 240 * SR) <= 1
    for shape in long["shapes"].values():
        assert shape == [2, long["input_frames"]]
    for shape in checks["short"]["shapes"].values():
        assert shape == [2, checks["short"]["input_frames"]]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_window_boundaries_leave_no_click(checks):
    for case in ("long", "bag"):
        for stem, jump in checks[case]["jumps"].items():
            assert jump["boundaries"] >= 1
            assert jump["boundary"] <= jump["elsewhere"], (case, stem, jump)
    # and each boundary step is the whole-song pass's own step there
    for stem, jump in checks["long"]["jumps"].items():
        reference = checks["long"]["reference_jumps"][stem]
        assert jump["boundary"] == pytest.approx(reference["boundary"], rel=1e-5), stem


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_song_shorter_than_a_window_gives_the_same_samples_as_before(checks):
    short = checks["short"]
    assert short["identical"], f"differs from the whole-song worker: {_figures(short['snr_db'])}"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_shifts_segment_overlap_and_a_bag_of_models_match_across_windows(checks):
    bag = checks["bag"]
    assert bag["identical"], (
        f"bag of 2, shifts 2, segment 3 s, overlap 0.4: {_figures(bag['snr_db'])}"
    )


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_decoders_statistics_give_the_whole_song_result(checks):
    stats = checks["stats"]
    assert stats["decoded"] == pytest.approx(stats["numpy64"], rel=1e-9)
    assert stats["decoded"] == pytest.approx(stats["torch"], rel=1e-5)
    assert min(stats["snr_db"].values()) >= 40, _figures(stats["snr_db"])


# ------------------------------------------------------------------------------ the service


@pytest.mark.slow
def test_cancel_in_the_middle_of_a_window_leaves_nothing_behind(
    make_settings, service_factory, tmp_path, monkeypatch
):
    monkeypatch.setenv(WINDOW_ENV, "6")  # the worker's windows: 6 s
    settings = make_settings()
    service, jobs = service_factory(settings)
    song = write_song(tmp_path / "long.wav", 30.0)  # five windows
    os.replace(song, settings.paths.inbox / "long.wav")
    job = wait_for(
        lambda: next((j for j in jobs.jobs() if j.state is JobState.SEPARATING), None),
        60,
        "separation to start",
    )
    stems = settings.paths.scratch / job.id / "stems"

    def first_window_written() -> bool:
        sizes = [p.stat().st_size for p in stems.glob("*.npy")]
        return len(sizes) == 4 and min(sizes) > HEADER_BYTES + 4 * SR  # > 0.5 s of stereo

    wait_for(first_window_written, 120, "the first window's stems on disk")
    assert jobs.latest[job.id].state is JobState.SEPARATING  # still at work on a window
    pid = service.client.pid
    os.unlink(settings.paths.inbox / "long.wav")
    final = jobs.wait_final(1, 30)[0]
    assert final.state is JobState.CANCELLED
    wait_for(lambda: service.client.pid is None, 5, "the worker to be stopped")
    assert pid not in _live_pids()
    assert not (settings.paths.scratch / job.id).exists()
    assert not settings.paths.staging.exists() or not any(settings.paths.staging.iterdir())
    assert outbox_entries(settings.paths.outbox) == set()
    assert not any(settings.paths.processed.iterdir())


def _live_pids() -> set[int]:
    return {int(p) for p in os.listdir("/proc") if p.isdigit()}
