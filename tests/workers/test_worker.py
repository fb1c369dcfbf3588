"""The resident worker process with the tiny model, over its real protocol."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from stemdeck_watch.core.errors import Cancelled, ModelError, OutOfMemory
from stemdeck_watch.store.jobqueue import JobControl
from stemdeck_watch.workers.local import WorkerClient
from stemdeck_watch.workers.separator import DemucsSettings

from support.helpers import noise_mix, separate_tiny, wait_for

pytestmark = pytest.mark.slow
SR = 44100


@pytest.fixture
def client() -> WorkerClient:
    client = WorkerClient("cpu")
    yield client
    client.close()


def test_one_worker_serves_every_request_and_reports_progress(client, model_repo, tmp_path):
    info = client.ensure_model("tiny", str(model_repo))
    assert info.sources == ("drums", "bass", "other", "vocals") and info.samplerate == SR
    source = noise_mix(tmp_path, 9.0)
    progress: list[float] = []
    first = separate_tiny(client, model_repo, source, tmp_path / "a", JobControl("job"), progress)
    second = separate_tiny(client, model_repo, source, tmp_path / "b", JobControl("job"))
    assert first.worker_pid == second.worker_pid == client.pid
    assert client.pids == [first.worker_pid]
    assert progress and progress == sorted(progress) and progress[-1] == pytest.approx(1.0)
    for name, path in first.stems.items():
        assert np.load(path).shape == (2, 9 * SR), name
    assert client.versions["demucs"] == "4.1.0"


def test_a_missing_model_is_a_clear_error_and_the_worker_lives_on(client, model_repo):
    with pytest.raises(ModelError) as info:
        client.ensure_model("htdemucs_6s", str(model_repo))
    message = str(info.value)
    assert "htdemucs_6s" in message and "separation.model_repo" in message and "tiny.th" in message
    pid = client.pid
    assert client.ensure_model("tiny6", str(model_repo)).sources[-2:] == ("guitar", "piano")
    assert client.pid == pid


def test_no_network_and_no_repo_fails_fast_and_says_what_to_do(tmp_path):
    client = WorkerClient("cpu", env={"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")})
    try:
        started = time.monotonic()
        with pytest.raises(ModelError) as info:
            client.ensure_model("htdemucs", None)
        assert time.monotonic() - started < 20  # worker start + check, no 30 s network hang
        assert "separation.model_repo" in str(info.value) and "htdemucs" in str(info.value)
    finally:
        client.close()


def test_cancel_stops_the_worker_within_a_second(client, model_repo, tmp_path):
    client.ensure_model("tiny", str(model_repo))
    source = noise_mix(tmp_path, 240.0)
    control = JobControl("job")
    progress: list[float] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            separate_tiny(client, model_repo, source, tmp_path / "out", control, progress)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    wait_for(lambda: progress, 60, "separation progress")
    pid = client.pid
    assert pid
    cancelled_at = time.monotonic()
    control.cancel("input removed")
    thread.join(10)
    assert time.monotonic() - cancelled_at < 1.0
    assert len(errors) == 1 and isinstance(errors[0], Cancelled)
    assert client.pid is None  # the worker is gone; the next request starts a new one
    assert (
        separate_tiny(
            client, model_repo, noise_mix(tmp_path, 2.0), tmp_path / "next", JobControl("job")
        ).worker_pid
        != pid
    )


def test_a_worker_that_dies_fails_the_request_with_its_last_words(client, model_repo, tmp_path):
    client.ensure_model("tiny", str(model_repo))
    source = noise_mix(tmp_path, 240.0)
    progress: list[float] = []
    errors: list[BaseException] = []
    thread = threading.Thread(
        target=lambda: _capture(
            errors,
            separate_tiny,
            client,
            model_repo,
            source,
            tmp_path / "o",
            JobControl("job"),
            progress,
        )
    )
    thread.start()
    wait_for(lambda: progress, 60, "separation progress")
    os.kill(client.pid, signal.SIGKILL)  # what the OOM killer does
    thread.join(20)
    # a machine fault, and (nothing here sends SIGKILL) most likely the OOM killer's
    assert len(errors) == 1 and isinstance(errors[0], OutOfMemory) and errors[0].device == "cpu"
    assert "killed by SIGKILL" in str(errors[0]) and "out of memory" in str(errors[0])
    assert separate_tiny(
        client, model_repo, noise_mix(tmp_path, 2.0), tmp_path / "n", JobControl("job")
    )


def _capture(errors: list[BaseException], fn, *args) -> None:
    try:
        fn(*args)
    except BaseException as exc:
        errors.append(exc)


def test_a_song_longer_than_a_window_is_separated_window_by_window(client, model_repo, tmp_path):
    from stemdeck_watch.stages.scratch import stats_of

    client.ensure_model("tiny", str(model_repo))
    source = noise_mix(tmp_path, 12.0)
    whole = client.separate(
        "job",
        "tiny",
        str(model_repo),
        source,
        tmp_path / "whole",
        control=JobControl("job"),
        on_progress=lambda v: None,
        demucs=DemucsSettings(shifts=0),  # no random shifts: comparable runs
    )
    progress: list[float] = []
    windows = client.separate(
        "job",
        "tiny",
        str(model_repo),
        source,
        tmp_path / "win",
        control=JobControl("job"),
        on_progress=progress.append,
        demucs=DemucsSettings(shifts=0, stats=stats_of(source)),
        window=2.5,
    )  # 5 windows
    assert len(progress) >= 4 and progress == sorted(progress)  # one per 4 s segment
    assert progress[-1] == pytest.approx(1.0)
    for name, path in windows.stems.items():
        got, want = np.load(path), np.load(whole.stems[name])
        assert got.shape == want.shape == (2, 12 * SR)
        snr = 10 * np.log10(np.square(want).sum() / max(np.square(got - want).sum(), 1e-30))
        assert snr > 100, f"{name}: {snr:.1f} dB"


def test_a_worker_whose_parent_died_before_it_started_watching_exits() -> None:
    """A worker told who started it (the service, or the zygote it was forked from) exits at
    once when that process is already gone, instead of waiting on a pipe nobody closes (a
    zygote's worker holds a copy of its own stdin's other end)."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    worker = subprocess.Popen(
        [sys.executable, "-m", "stemdeck_watch.workers.worker", "--parent", str(gone.pid)],
        stdin=subprocess.PIPE,  # kept open: only the parent watch can end it
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        assert worker.wait(60) == 0
    finally:
        worker.kill()
        worker.wait()
        worker.stdin.close()  # type: ignore[union-attr]


def test_a_reader_whose_pipe_is_closed_under_it_ends_quietly() -> None:
    """A worker stopped while its reader threads still read: the pipe closed under them ends
    them, rather than raising in the thread ("I/O operation on closed file")."""
    from stemdeck_watch.workers.local import lines

    read, write = os.pipe()
    with os.fdopen(read) as reader:
        os.write(write, b"first\nsecond\n")
        os.close(write)
        found = lines(reader)
        assert next(found) == "first\n"
        reader.close()
        assert list(found) == []
