"""Workers forked from the zygote (workers/zygote.py), over the worker's real protocol."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from stemdeck_watch.core.errors import Cancelled, WorkerDied
from stemdeck_watch.store.jobqueue import JobControl
from stemdeck_watch.workers import local, zygote
from stemdeck_watch.workers.faultseam import FAULTS_ENV
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


@pytest.fixture
def stopped_zygote() -> Iterator[int]:
    """The zygote, stopped (SIGSTOP): a start waits on it as on a zygote slow to import.
    Whatever the test did to it, the next test finds a zygote that answers."""
    zygote.ready()
    stopped = zygote.pid()
    assert stopped is not None
    os.kill(stopped, signal.SIGSTOP)
    try:
        yield stopped
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(stopped, signal.SIGKILL)
        wait_for(lambda: zygote.pid() != stopped, 15, "the stopped zygote to be gone")


def test_a_zygote_that_does_not_answer_is_replaced_and_no_worker_is_mistaken_for_another(
    model_repo, tmp_path, stopped_zygote, monkeypatch
):
    client = WorkerClient("cpu")
    try:
        with monkeypatch.context() as patch, pytest.raises(WorkerDied, match="not answer in 1 s"):
            patch.setattr(zygote, "FORK_TIMEOUT", 1.0)  # a zygote done with its imports
            client.ensure_model("tiny", str(model_repo))
    finally:
        client.close()
    with contextlib.suppress(ProcessLookupError):  # had it been left, it would answer now
        os.kill(stopped_zygote, signal.SIGCONT)
    for round in range(2):
        client = WorkerClient("cpu")
        try:
            pid = separate(client, model_repo, tmp_path, f"song{round}")
            assert client._proc is not None and client._proc.ready is not None
            assert client._proc.ready["pid"] == pid, "the worker that answered is the one tracked"
            assert parent_of(pid) == zygote.pid() != stopped_zygote
        finally:
            client.close()


def test_a_zygote_lost_while_it_starts_a_worker_is_a_machine_fault(
    model_repo, stopped_zygote, monkeypatch
):
    asked = asked_to_start(monkeypatch)
    client = WorkerClient("cpu")
    try:
        loading, outcome = in_thread(lambda: client.ensure_model("tiny", str(model_repo)))
        assert asked.wait(10)
        os.kill(stopped_zygote, signal.SIGKILL)  # the start request waits on it
        loading.join(30)
        assert len(outcome) == 1 and isinstance(outcome[0], WorkerDied), outcome
        assert "zygote ended" in str(outcome[0])
        client.ensure_model("tiny", str(model_repo))  # the next start gets a new zygote
    finally:
        client.close()


def test_a_shutdown_while_a_worker_starts_leaves_no_worker(model_repo, stopped_zygote, monkeypatch):
    asked = asked_to_start(monkeypatch)
    client = WorkerClient("cpu")
    try:
        loading, outcome = in_thread(lambda: client.ensure_model("tiny", str(model_repo)))
        assert asked.wait(10)
        client.shutdown()  # the service stops while the zygote has the start request
        os.kill(stopped_zygote, signal.SIGCONT)
        loading.join(30)
        assert len(outcome) == 1 and isinstance(outcome[0], Cancelled), outcome
        assert client.pids == []
        wait_for(
            lambda: not [p for p, (parent, _) in processes().items() if parent == stopped_zygote],
            10,
            "the worker the zygote forked to end",
        )
    finally:
        client.close()


def asked_to_start(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Set once a worker start has been asked of a zygote."""
    asked = threading.Event()
    original = zygote._Zygote.start

    def start(self: Any, argv: list[str], env: dict[str, str], *rest: Any) -> Any:
        asked.set()
        return original(self, argv, env, *rest)

    monkeypatch.setattr(zygote._Zygote, "start", start)
    return asked


def in_thread(work: Callable[[], Any]) -> tuple[threading.Thread, list[BaseException]]:
    """`work` started on a thread; what it raised, once the thread ended."""
    outcome: list[BaseException] = []

    def run() -> None:
        try:
            work()
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, outcome


def test_a_worker_that_ends_with_its_zygote_mid_song_is_no_memory_fault(
    model_repo, tmp_path, monkeypatch
):
    faults = tmp_path / "faults"
    faults.mkdir()
    (faults / "slow").write_text("30")  # each segment takes 30 s longer: the song is long
    monkeypatch.setenv(FAULTS_ENV, str(faults))
    sent = threading.Event()
    original = local._Process.send

    def send(self: Any, request: dict[str, Any]) -> None:
        original(self, request)
        if request.get("op") == "separate":
            sent.set()

    monkeypatch.setattr(local._Process, "send", send)
    client = WorkerClient("cpu")
    try:
        client.ensure_model("tiny", str(model_repo))
        lost = zygote.pid()
        assert lost is not None
        mix, out = noise_mix(tmp_path, 1.0), tmp_path / "out"
        separating, outcome = in_thread(
            lambda: separate_tiny(client, model_repo, mix, out, JobControl("song"))
        )
        assert sent.wait(30)
        os.kill(lost, signal.SIGKILL)  # the worker is at its song for 30 s more
        separating.join(30)
        assert len(outcome) == 1 and type(outcome[0]) is WorkerDied, (
            f"a plain machine fault, not OutOfMemory (its memory was never short): {outcome}"
        )
        assert "zygote" in str(outcome[0])
    finally:
        client.close()


def test_a_worker_starts_from_a_deleted_working_folder_and_leaks_no_descriptor(
    model_repo, tmp_path, monkeypatch
):
    gone = tmp_path / "gone"
    gone.mkdir()
    monkeypatch.chdir(gone)
    gone.rmdir()
    zygote.ready()
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(2):
        client = WorkerClient("cpu")
        try:
            client.ensure_model("tiny", str(model_repo))
        finally:
            client.close()
    assert len(os.listdir("/proc/self/fd")) == before


def test_a_worker_gets_exactly_the_environment_asked_for(model_repo, tmp_path, monkeypatch):
    """The zygote sends only what differs from its own environment: a variable set since it
    started reaches the worker, one unset since does not, and an environment grown by more
    than one message holds starts a fresh interpreter."""
    faults = tmp_path / "faults"
    faults.mkdir()
    (faults / "1-exit").touch()
    monkeypatch.setenv(FAULTS_ENV, str(faults))
    end_zygote()
    try:
        zygote.ready()  # this zygote has the faults folder in its environment
        monkeypatch.delenv(FAULTS_ENV)
        client = WorkerClient("cpu")
        try:
            separate(client, model_repo, tmp_path, "unset")
            assert (faults / "1-exit").exists(), "the worker saw a variable unset since"
            for n in range(3):  # 300 KB (one variable may hold at most 128 KB)
                monkeypatch.setenv(f"STEMDECK_TEST_LARGE{n}", "x" * 100_000)
            client.close()
            client = WorkerClient("cpu")
            pid = separate(client, model_repo, tmp_path, "large")
            assert parent_of(pid) == os.getpid(), "a fresh interpreter, the service's child"
        finally:
            client.close()
    finally:
        monkeypatch.delenv(FAULTS_ENV, raising=False)
        for n in range(3):
            monkeypatch.delenv(f"STEMDECK_TEST_LARGE{n}", raising=False)
        end_zygote()
        zygote.ready()  # a zygote with the suite's own environment for the next tests


def end_zygote() -> None:
    zygote.ready()
    running = zygote.pid()
    assert running is not None
    os.kill(running, signal.SIGKILL)
    wait_for(lambda: zygote.pid() is None, 15, "the zygote to be gone")


CHOOSE_PID = Path("/proc/sys/kernel/ns_last_pid")


def test_a_worker_given_an_earlier_workers_pid_is_not_taken_for_it(model_repo):
    """The service knows its workers by start, not by pid: the kernel hands an ended
    worker's pid to a new process sooner or later (here, on purpose)."""
    if not os.access(CHOOSE_PID, os.W_OK):
        reason = f"choosing a pid takes root ({CHOOSE_PID})"
        if os.environ.get("CI") == "true":
            pytest.fail(f"{reason}; CI runs as root")
        pytest.skip(reason)
    argv, env = ["--device", "cpu", "--threads", "1"], dict(os.environ)
    first = zygote.start(argv, env)
    ended(first)
    assert first.returncode == -signal.SIGKILL
    for _ in range(50):  # another process may take the pid first: try again
        CHOOSE_PID.write_text(str(first.pid - 1))
        second = zygote.start(argv, env)
        try:
            if second.pid != first.pid:
                continue
            assert second.poll() is None, "the new worker taken for the one that ended"
            assert second.stdout is not None and '"ready"' in second.stdout.readline()
            return
        finally:
            ended(second)
    pytest.fail(f"pid {first.pid} was not handed out again in 50 tries")


def ended(worker: zygote.WorkerProcess) -> None:
    """Kill `worker`, wait for it and close its pipes."""
    worker.kill()
    worker.wait(10)
    for pipe in (worker.stdin, worker.stdout, worker.stderr):
        if pipe is not None:
            pipe.close()
