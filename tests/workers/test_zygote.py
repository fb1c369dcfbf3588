"""Workers forked from the zygote (workers/zygote.py), over the worker's real protocol."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest

from stemdeck_watch.store.jobqueue import JobControl
from stemdeck_watch.workers import zygote
from stemdeck_watch.workers.local import WorkerClient

from support.helpers import noise_mix, processes, separate_tiny, wait_for

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(sys.platform != "linux", reason="workers fork from a zygote on Linux"),
]


def separate(client: WorkerClient, model_repo: Path, tmp_path: Path, name: str) -> int:
    """One separation of a second of noise; the pid of the worker that did it."""
    out = tmp_path / name
    result = separate_tiny(client, model_repo, noise_mix(tmp_path, 1.0), out, JobControl(name))
    assert sorted(p.name for p in out.iterdir()) == [
        "bass.npy",
        "drums.npy",
        "other.npy",
        "vocals.npy",
    ]
    return result.worker_pid


def parent_of(pid: int) -> int:
    return processes()[pid][0]


def test_every_worker_is_forked_from_one_zygote(model_repo, tmp_path):
    pids = []
    for round in range(2):  # a worker ended (as by a cancel) and the next one
        client = WorkerClient("cpu")
        try:
            pids.append(separate(client, model_repo, tmp_path, f"song{round}"))
            assert parent_of(pids[-1]) == zygote.pid()
        finally:
            client.close()
    assert pids[0] != pids[1] and parent_of(zygote.pid()) == os.getpid()


def test_with_exec_a_worker_is_a_fresh_interpreter(model_repo, tmp_path, monkeypatch):
    monkeypatch.setenv(zygote.START_ENV, "exec")
    client = WorkerClient("cpu")
    try:
        pid = separate(client, model_repo, tmp_path, "song")
        assert parent_of(pid) == os.getpid()
    finally:
        client.close()


def test_a_lost_zygote_takes_its_idle_worker_along_and_the_next_song_gets_new_ones(
    model_repo, tmp_path
):
    client = WorkerClient("cpu")
    try:
        first = separate(client, model_repo, tmp_path, "before")
        lost = zygote.pid()
        assert lost is not None
        os.kill(lost, signal.SIGKILL)  # the OOM killer, say
        wait_for(lambda: first not in processes(), 15, "the orphaned worker to exit")
        second = separate(client, model_repo, tmp_path, "after")
        assert zygote.pid() not in (None, lost) and parent_of(second) == zygote.pid()
    finally:
        client.close()
