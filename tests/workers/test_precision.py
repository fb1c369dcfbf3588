"""The fastest safe precision: the measured rule, its figures, and the path end to end."""

from __future__ import annotations

import io
import json
import logging
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile

from stemdeck_watch.cli import status
from stemdeck_watch.cli.doctor import precision_finding
from stemdeck_watch.core.config import settings_from_dict
from stemdeck_watch.core.errors import ConfigError
from stemdeck_watch.core.jobs import JobState
from stemdeck_watch.workers.demucs.precision import (
    CALIBRATE_ENV,
    MIN_SNR_DB,
    MIN_SPEEDUP,
    Choice,
    Measurement,
    decide,
    physical_cores,
    threads_for,
)
from stemdeck_watch.workers.demucs import precision
from stemdeck_watch.workers.worker import ONEDNN_ENV, Worker
from stemdeck_watch.util.synth import write_song

from support.helpers import config_data

SUPPORT = Path(__file__).resolve().parents[1] / "support"


@pytest.fixture(autouse=True)
def onednn_as_users_have_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """The suite turns oneDNN off in its workers (conftest); the precisions are measured
    and run here as a user's worker does, with it on (bfloat16 on a CPU is oneDNN's)."""
    monkeypatch.setenv(ONEDNN_ENV, "1")


def measured(speedup: float, snr: float) -> Measurement:
    return Measurement("bfloat16", speedup, snr, seconds_float32=2.0, seconds=2.0 / speedup)


@pytest.mark.parametrize(
    "speedup, snr, chosen, why",
    [
        (1.7, 45.0, "bfloat16", "1.70× faster than float32 and matches it to 45.0 dB"),
        (1.7, 30.0, "float32", "30.0 dB SNR on its worst stem (needs 35 dB)"),
        (0.6, 45.0, "float32", "only 0.60× as fast (needs 1.2×)"),
        (1.1, 20.0, "float32", "only 1.10× as fast (needs 1.2×) and 20.0 dB SNR"),
        (MIN_SPEEDUP, MIN_SNR_DB, "bfloat16", "1.20× faster"),  # the bounds are inclusive
    ],
)
def test_a_candidate_is_kept_only_if_faster_and_close(speedup, snr, chosen, why):
    choice = decide("auto", "cpu", [measured(speedup, snr)], calibration_seconds=3.0)
    assert choice.precision == chosen and why in choice.reason, choice
    assert (choice.speedup, choice.worst_snr_db) == (speedup, snr)  # figures kept either way
    assert Choice.from_dict(json.loads(json.dumps(choice.to_dict()))) == choice


def test_the_fastest_good_candidate_wins_and_nothing_to_try_is_float32():
    fp16 = Measurement("float16", 3.0, 40.0, 2.0, 0.67)
    bf16 = Measurement("bfloat16", 2.0, 50.0, 2.0, 1.0)
    assert decide("auto", "cuda", [bf16, fp16]).precision == "float16"
    assert (
        decide("auto", "cuda", [bf16, Measurement("float16", 3.0, 20.0, 2.0, 0.67)]).precision
        == "bfloat16"
    )
    nothing = decide("auto", "mps", [])
    assert nothing.precision == "float32" and "no reduced precision" in nothing.reason


def test_identical_output_is_written_as_json_null_not_infinity():
    data = decide("auto", "cpu", [measured(2.0, float("inf"))]).to_dict()
    assert data["precision"] == "bfloat16" and data["worst_snr_db"] is None
    json.dumps(data, allow_nan=False)


def test_doctor_tells_a_probe_only_figure_from_an_identical_output():
    """Both have no finite SNR to write; only one ran the model."""
    worker = {"device": "cpu", "threads": 2}
    probe_only = Measurement("bfloat16", 0.01, math.nan, math.nan, math.nan, probed=True)
    hopeless = json.loads(json.dumps(decide("auto", "cpu", [probe_only]).to_dict()))
    assert hopeless["probed"] is True and hopeless["worst_snr_db"] is None, hopeless
    said = precision_finding("model", hopeless, worker).detail
    assert "0.01× float32 speed in a convolution probe" in said, said
    assert "identical" not in said and "SNR" not in said, said
    identical = decide("auto", "cpu", [measured(2.0, float("inf"))]).to_dict()
    assert identical["probed"] is False
    assert "worst stem identical" in precision_finding("model", identical, worker).detail


def test_threads_default_to_physical_cores_and_can_be_set():
    assert 1 <= physical_cores() <= (len(__import__("os").sched_getaffinity(0)))
    assert threads_for(0) == physical_cores() and threads_for(3) == 3


@pytest.mark.parametrize(
    "values, words",
    [
        ({"precision": "fp8"}, ["separation.precision", "fp8", "bfloat16"]),
        ({"threads": -1}, ["separation.threads", "-1"]),
    ],
)
def test_bad_precision_or_threads_name_the_key(tmp_path, model_repo, values, words):
    with pytest.raises(ConfigError) as info:
        settings_from_dict(config_data(tmp_path, model_repo, separation=values))
    for word in words:
        assert word in str(info.value), str(info.value)


@pytest.mark.slow
def test_the_rule_on_the_tiny_model_with_injected_calibration_results(model_repo):
    proc = subprocess.run(
        [sys.executable, str(SUPPORT / "precision_checks.py"), str(model_repo)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    close, far, slower = result["close"], result["far"], result["slower"]
    # the real bfloat16 output of the tiny model is close to float32: with the speed-up
    # injected, bfloat16 is chosen; the figures say why
    assert close["precision"] == "bfloat16", close
    assert close["speedup"] == 1.5 and close["worst_snr_db"] >= MIN_SNR_DB
    assert far["precision"] == "float32" and far["worst_snr_db"] < MIN_SNR_DB, far
    assert "dB SNR on its worst stem" in far["reason"]
    assert slower["precision"] == "float32" and "0.80× as fast" in slower["reason"], slower
    # a candidate the convolution probe finds hopeless is never run on the model
    hopeless = result["hopeless"]
    assert hopeless["precision"] == "float32" and result["hopeless_measured"] == [], result
    assert hopeless["speedup"] == 0.01 and hopeless["worst_snr_db"] is None, hopeless
    assert "convolution probe" in hopeless["reason"] and "not run" in hopeless["reason"]
    # the real probe takes moments even where bfloat16 has no kernels (a hundredfold slower)
    assert 0 < result["probe"]["speedup"] < 100 and result["probe"]["seconds"] < 10, result
    # the tiny model is skipped unless forced: nothing measured, and the reason says so
    assert result["small"]["precision"] == "float32" and result["small_measured"] == []
    assert "small model" in result["small"]["reason"]
    assert result["set"] == {
        **result["set"],
        "precision": "bfloat16",
        "reason": "set in the configuration",
    }


@pytest.mark.slow
def test_a_real_calibration_and_bfloat16_end_to_end(
    make_settings, service_factory, monkeypatch, caplog
):
    """The tiny model calibrated for real (forced) on the default settings, and a preset
    that separates in bfloat16: stems come out, manifests, status and the log record the
    precision."""
    monkeypatch.setenv(CALIBRATE_ENV, "always")  # the worker inherits it
    caplog.set_level(logging.INFO, logger="stemdeck_watch.workers.local")
    settings = make_settings(presets={"bf16": {"precision": "bfloat16"}})
    service, jobs = service_factory(settings)
    inbox = settings.paths.inbox
    write_song(inbox / "auto.wav", 3.0, seed=1)
    write_song(inbox / "bf16" / "half.wav", 3.0, seed=2)
    finished = jobs.wait_final(2, timeout=300)
    assert [j.state for j in finished] == [JobState.DONE] * 2, finished

    auto = json.loads((settings.paths.outbox / "auto" / "stemdeck.json").read_text())
    measured_choice = auto["precision"]
    assert measured_choice["setting"] == "auto" and measured_choice["calibration_seconds"] > 0
    keep = measured_choice["speedup"] >= MIN_SPEEDUP and (
        measured_choice["worst_snr_db"] is None or measured_choice["worst_snr_db"] >= MIN_SNR_DB
    )
    assert measured_choice["precision"] == ("bfloat16" if keep else "float32"), measured_choice
    # the figures in the log, whether bfloat16 ran on the model or only in the probe
    said = [r.getMessage() for r in caplog.records if "measured precision for tiny" in r.message]
    assert said and f"{measured_choice['speedup']:.2f}× speed" in said[0], caplog.text

    half = json.loads((settings.paths.outbox / "bf16" / "half" / "stemdeck.json").read_text())
    assert half["precision"]["precision"] == "bfloat16"
    assert half["precision"]["reason"] == "set in the configuration"
    for stem in ("drums", "bass", "other", "vocals"):
        audio, _ = soundfile.read(settings.paths.outbox / "bf16" / "half" / f"{stem}.wav")
        assert audio.shape == (3 * 44100, 2) and np.isfinite(audio).all() and audio.any()

    worker = service.scheduler.snapshot()["worker"]
    assert worker["model"] == "tiny" and worker["threads"] >= 1 and worker["device"] == "cpu"
    assert worker["precision"]["setting"] in ("auto", "bfloat16")
    assert status.collect(settings)["worker"] == worker  # the CLI reads the same from disk


@pytest.mark.slow
def test_a_choice_made_on_another_device_is_made_again(model_repo):
    """The service hands a restarted worker the choice its predecessor made, to skip the
    calibration; a worker on another device (the GPU gone, a Ray actor on another machine)
    chooses again instead of running in what suited that device."""
    worker = Worker("cpu", io.StringIO())
    elsewhere = {"setting": "auto", "precision": "float16", "reason": "measured", "device": "cuda"}
    choice = worker.precision("tiny", str(model_repo), "auto", elsewhere)
    assert (choice.precision, choice.device) == ("float32", "cpu"), choice
    here = {**elsewhere, "precision": "bfloat16", "device": "cpu"}
    other = Worker("cpu", io.StringIO())
    assert other.precision("tiny", str(model_repo), "auto", here).precision == "bfloat16"


def test_physical_cores_counts_only_the_cpus_this_process_may_use(tmp_path, monkeypatch):
    """Two cores with two hyper-threads each: allowed all four threads, or one of each core,
    the process separates on two cores; allowed only one core's two threads (a container's
    cpuset), on one."""
    for cpu, core in enumerate((0, 1, 0, 1)):  # cpu0/cpu2 share core 0, cpu1/cpu3 core 1
        topology = tmp_path / f"cpu{cpu}" / "topology"
        topology.mkdir(parents=True)
        (topology / "core_id").write_text(f"{core}\n")
        (topology / "physical_package_id").write_text("0\n")
    monkeypatch.setattr(precision, "CPU_SYSFS", str(tmp_path))
    precision._linux_physical_cores.cache_clear()  # what this machine's sysfs said
    try:
        for allowed, cores in (({0, 1, 2, 3}, 2), ({0, 2}, 1), ({0, 1}, 2)):
            monkeypatch.setattr(os, "sched_getaffinity", lambda _pid, allowed=allowed: allowed)
            assert precision.physical_cores() == cores, allowed
    finally:
        precision._linux_physical_cores.cache_clear()  # ...and not the made-up one


@pytest.mark.parametrize(
    "line, flags",
    [
        ("flags\t\t: fpu avx2 avx512f avx512_bf16 amx_tile", ["amx_tile", "avx512_bf16"]),
        ("flags\t\t: fpu avx2", []),
        ("Features\t: fp asimd sve bf16 i8mm", ["bf16"]),  # an Arm CPU (Graviton3, say)
    ],
)
def test_bf16_in_hardware_is_found_on_x86_and_arm(tmp_path, monkeypatch, line, flags):
    info = tmp_path / "cpuinfo"
    info.write_text(f"processor\t: 0\n{line}\n")
    monkeypatch.setattr(precision, "CPUINFO", str(info))
    assert precision.cpu_bf16_flags() == flags
