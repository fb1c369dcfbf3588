"""Stems that add back up to the song: one gain for the whole song, the residual and each
file's loudness in the manifest, read back with soundfile and pyloudnorm."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import soundfile

from stemdeck_watch.core.config import OutputSettings, SeparationSettings
from stemdeck_watch.stages.decode import decode_to_file
from stemdeck_watch.stages.levels import LoudnessMeter
from stemdeck_watch.stages.publish import SongInfo, write_song
from stemdeck_watch.stages.scratch import AudioReader, AudioWriter

MODEL_RATE = 44100
INPUT_RATE = 48000
SOURCES = ("drums", "bass", "other", "vocals")
# what each fake stem holds of the input: they add up to 1, and drums and bass alone go
# beyond full scale, so the song must be turned down to be written without clipping
SHARES = (1.3, -0.6, 0.1, 0.2)
RESIDUAL_DB = -30.0  # the fake model leaves out this much (noise added to "other")


def out(**kw) -> OutputSettings:
    return dataclasses.replace(OutputSettings(), beat_grid=False, preview=False, tags=False, **kw)


def tones(seconds: float, rate: int) -> np.ndarray:
    """Stereo tones below 10 kHz, loud (peak 0.8): what survives a trip through 44.1 kHz."""
    t = np.arange(int(seconds * rate)) / rate
    left = 0.5 * np.sin(2 * np.pi * 220 * t) + 0.3 * np.sin(2 * np.pi * 3150 * t)
    right = 0.5 * np.sin(2 * np.pi * 330 * t) + 0.3 * np.sin(2 * np.pi * 1234 * t)
    return np.stack([left, right], axis=1).astype(np.float32)


def separated(decoded: Path, folder: Path) -> dict[str, Path]:
    """Stems as a model with a known residual leaves them: shares of the input that add up
    to it, plus noise RESIDUAL_DB below the input in one of them."""
    reader = AudioReader(decoded)
    rng = np.random.default_rng(3)
    power = float(np.mean(np.square(reader.read(0, reader.frames))))
    noise_scale = np.sqrt(power * 10 ** (RESIDUAL_DB / 10))
    folder.mkdir(parents=True, exist_ok=True)
    stems = {}
    for name, share in zip(SOURCES, SHARES, strict=True):
        with AudioWriter(folder / f"{name}.npy", reader.channels) as writer:
            for _, block in reader.blocks(30_000):
                part = block * share
                if name == "other":
                    part = part + noise_scale * rng.standard_normal(block.shape)
                writer.write(part.astype(np.float32))
        stems[name] = folder / f"{name}.npy"
    return stems


def lag_of(got: np.ndarray, want: np.ndarray, most: int = 3000) -> int:
    """Frames `got` is late against `want` (an mp3 decoder's delay), by cross-correlation."""
    a, b = got[:, 0].astype(np.float64), want[:, 0].astype(np.float64)
    n = min(len(a), len(b)) - most
    scores = [float(np.dot(a[lag : lag + n], b[:n])) for lag in range(most)]
    return int(np.argmax(scores))


def error_db(total: np.ndarray, reference: np.ndarray, edge: int) -> float:
    n = min(len(total), len(reference))
    band = slice(edge, n - edge)  # the edges hold a resampler's fade
    error = total[band] - reference[band]
    return float(10 * np.log10(np.sum(error**2) / np.sum(reference[band] ** 2)))


@pytest.mark.parametrize("fmt", ["wav", "flac", "mp3"])
@pytest.mark.parametrize("rate", ["model", "input", 48000])
def test_the_written_stems_add_up_to_the_input_within_the_models_residual(
    tmp_path: Path, fmt: str, rate: str | int
) -> None:
    source = tmp_path / "in.wav"
    soundfile.write(source, tones(3.0, INPUT_RATE), INPUT_RATE, subtype="FLOAT")
    decoded = decode_to_file(source, tmp_path / "input.npy", MODEL_RATE, 2)
    stems = separated(decoded.path, tmp_path / "stems")
    info = SongInfo(
        "in", input_samplerate=INPUT_RATE, input_frames=decoded.source_frames, source=decoded.path
    )
    levels: dict = {}
    entries = write_song(
        tmp_path / "s",
        stems,
        MODEL_RATE,
        "in",
        SeparationSettings(),
        out(format=fmt, samplerate=rate),
        block_frames=20_000,
        info=info,
        levels=levels,
    )
    # the residual the manifest records is the one the fake model left
    assert levels["residual_db"] == pytest.approx(RESIDUAL_DB, abs=0.3)
    # one gain for the whole song: drums alone peak at 1.3 x 0.8, so it is turned down
    assert levels["gain"] == pytest.approx(1 / (1.01 * 1.3 * 0.8), rel=0.02)
    assert levels["gain_db"] == pytest.approx(20 * np.log10(levels["gain"]), abs=0.01)
    written = [soundfile.read(tmp_path / "s" / e["file"], dtype="float64") for e in entries]
    assert all(w[1] == entries[0]["samplerate"] for w in written)
    total = sum(w[0][: min(len(x[0]) for x in written)] for w in written) / levels["gain"]
    if rate == "model":
        reference = AudioReader(decoded.path).read(0, decoded.frames).T.astype(np.float64)
    else:
        reference, _ = soundfile.read(source, dtype="float64")
    if fmt == "mp3":  # the decoder's delay; every stem has the same
        total = total[lag_of(total, reference) :]
    # the stems add up to the input up to what the model left out; the format adds its own
    # error: quantisation in wav/flac (far below), the codec's noise in mp3
    allowed = {"wav": 0.2, "flac": 0.2, "mp3": 1.5}[fmt]
    assert error_db(total, reference, INPUT_RATE // 10) < RESIDUAL_DB + allowed


def test_the_loudness_of_every_file_is_what_pyloudnorm_measures_of_it(tmp_path: Path) -> None:
    import pyloudnorm

    source = tmp_path / "in.wav"
    audio = tones(4.0, INPUT_RATE)
    audio[:INPUT_RATE] *= 0.01  # a quiet start: the gates have something to do
    soundfile.write(source, audio, INPUT_RATE, subtype="FLOAT")
    decoded = decode_to_file(source, tmp_path / "input.npy", MODEL_RATE, 2)
    stems = separated(decoded.path, tmp_path / "stems")
    silent = tmp_path / "stems" / "silent.npy"
    with AudioWriter(silent, 2) as writer:
        writer.write(np.zeros((2, decoded.frames), np.float32))
    stems["vocals"] = silent
    entries = write_song(
        tmp_path / "s",
        stems,
        MODEL_RATE,
        "in",
        SeparationSettings(),
        out(format="wav", bit_depth=24, samplerate="input", mixes={"band": ["drums", "bass"]}),
        info=SongInfo("in", input_samplerate=INPUT_RATE, input_frames=decoded.source_frames),
    )
    for entry in entries:
        data, rate = soundfile.read(tmp_path / "s" / entry["file"], dtype="float64")
        if entry["name"] == "vocals":
            assert entry["loudness"] is None  # silence has no loudness (and no -inf in JSON)
            continue
        assert entry["loudness"] == pytest.approx(
            pyloudnorm.Meter(rate).integrated_loudness(data), abs=0.05
        ), entry["name"]


def test_loudness_measured_in_blocks_is_the_whole_signals() -> None:
    import pyloudnorm

    rng = np.random.default_rng(0)
    for rate in (44100, 48000, 22050, 8000):
        t = np.arange(int(7.33 * rate)) / rate
        audio = np.stack(
            [
                0.3 * np.sin(2 * np.pi * 440 * t) * (t < 3),
                0.2 * rng.standard_normal(t.size) * (1 + np.sin(t)),
            ]
        )
        meter = LoudnessMeter(rate, 2)
        for start in range(0, audio.shape[1], 12_345):
            meter.add(audio[:, start : start + 12_345].astype(np.float32))
        assert meter.integrated() == pytest.approx(
            pyloudnorm.Meter(rate).integrated_loudness(audio.T), abs=0.02
        ), rate


def test_the_residual_summed_in_blocks_is_the_whole_signals_in_float64() -> None:
    from stemdeck_watch.stages.levels import Residual

    rng = np.random.default_rng(1)
    source = (0.3 * rng.standard_normal((2, 300_000))).astype(np.float32)
    total = source * np.float32(0.97) + (1e-3 * rng.standard_normal(source.shape)).astype(
        np.float32
    )
    residual, exact, silent = Residual(), Residual(), Residual()
    for start in range(0, source.shape[1], 65_536):
        block = slice(start, start + 65_536)
        residual.add(source[:, block], total[:, block].T.copy().T)  # interleaved, as written
        exact.add(source[:, block], source[:, block])
        silent.add(np.zeros((2, 100), np.float32), total[:, :100])
    wide = source.astype(np.float64)
    expected = 10 * np.log10(np.sum((wide - total) ** 2) / np.sum(wide**2))
    assert residual.db == pytest.approx(expected, abs=0.01)
    assert exact.db == -200.0  # stems that add up exactly: -200 dB, never -inf
    assert silent.db is None


@pytest.mark.slow
def test_a_published_song_records_its_gain_residual_and_loudness(
    make_settings, service_factory, tmp_path: Path
) -> None:
    """Through the real service and worker: the manifest's residual is what the written
    stems, with the gain undone, leave of the input; each stem's loudness is pyloudnorm's."""
    import pyloudnorm

    from stemdeck_watch.core.jobs import JobState
    from stemdeck_watch.stages.manifest import read_manifest
    from stemdeck_watch.util.synth import write_song as synth_song

    settings = make_settings(output={"format": "flac", "bit_depth": 24})
    _service, jobs = service_factory(settings)
    made = synth_song(tmp_path / "made" / "song.wav", 3.0)
    made.replace(settings.paths.inbox / "song.wav")
    (job,) = jobs.wait_final(1)
    assert job.state is JobState.DONE, job.error
    folder = Path(job.output)
    manifest = read_manifest(folder)
    levels = manifest["levels"]
    stems = [soundfile.read(folder / e["file"], dtype="float64")[0] for e in manifest["stems"]]
    total = sum(stems) / levels["gain"]
    decoded = decode_to_file(
        settings.paths.processed / "song.wav", tmp_path / "in.npy", MODEL_RATE, 2
    )
    source = AudioReader(decoded.path).read(0, decoded.frames).T.astype(np.float64)
    residual = 10 * np.log10(np.sum((source - total) ** 2) / np.sum(source**2))
    assert levels["residual_db"] == pytest.approx(residual, abs=0.05)
    assert levels["gain"] <= 1.0 and max(np.abs(s).max() for s in stems) < 1.0
    for entry, audio in zip(manifest["stems"], stems, strict=True):
        want = pyloudnorm.Meter(MODEL_RATE).integrated_loudness(audio)
        assert entry["loudness"] == (
            pytest.approx(want, abs=0.05) if np.isfinite(want) else None
        ), entry["name"]


def test_outputs_written_at_once_are_the_files_written_one_by_one(tmp_path: Path) -> None:
    """The song's outputs are written on two threads: the same bytes, entries, peaks and
    loudness as one at a time, in the plan's order (stems, then mixes), resampled too."""
    from stemdeck_watch.stages.preview import Peaks

    source = tmp_path / "in.wav"
    soundfile.write(source, tones(3.0, INPUT_RATE), INPUT_RATE, subtype="FLOAT")
    decoded = decode_to_file(source, tmp_path / "input.npy", MODEL_RATE, 2)
    stems = separated(decoded.path, tmp_path / "stems")
    settings = out(
        format="flac", bit_depth=24, samplerate="input", mixes={"band": ["drums", "bass"]}
    )
    written = {}
    for threads in (1, 2):
        peaks: dict[str, Peaks] = {}
        entries = write_song(
            tmp_path / f"t{threads}",
            stems,
            MODEL_RATE,
            "in",
            SeparationSettings(),
            settings,
            block_frames=20_000,  # several blocks per output: threads interleave mid-file
            info=SongInfo("in", input_samplerate=INPUT_RATE, input_frames=decoded.source_frames),
            peaks=peaks,
            threads=threads,
        )
        files = {e["file"]: (tmp_path / f"t{threads}" / e["file"]).read_bytes() for e in entries}
        columns = {k: np.concatenate([p.low, p.high]) for k, p in peaks.items()}
        written[threads] = (entries, files, columns)
    entries, files, columns = written[2]
    assert [e["name"] for e in entries][:4] == list(SOURCES) and entries[-1]["name"] == "band"
    assert entries == written[1][0]
    assert files == written[1][1]
    assert columns.keys() == written[1][2].keys() == set(SOURCES)
    assert all(np.array_equal(columns[k], written[1][2][k]) for k in columns)
    assert all(np.ptp(c) > 0 for c in columns.values())


def test_an_output_that_cannot_be_written_fails_the_song_with_its_name(tmp_path: Path) -> None:
    source = tmp_path / "in.wav"
    soundfile.write(source, tones(1.0, MODEL_RATE), MODEL_RATE, subtype="FLOAT")
    decoded = decode_to_file(source, tmp_path / "input.npy", MODEL_RATE, 2)
    stems = separated(decoded.path, tmp_path / "stems")
    staging = tmp_path / "s"
    staging.mkdir()
    (staging / "bass.wav").mkdir()  # a folder where a stem goes: its write fails
    from stemdeck_watch.core.errors import PublishError

    with pytest.raises(PublishError, match="bass.wav"):
        write_song(staging, stems, MODEL_RATE, "in", SeparationSettings(), out(), threads=2)
