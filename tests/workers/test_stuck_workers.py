"""A stuck process never holds the service: workers, zygotes, loads and builds that hang, are
stopped (SIGSTOP) or lost are ended by signal within their deadlines, a cancel answers at once,
and nothing of them is left behind (workers/lifetime.py, zygote.py, local.py, compiled/build.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from stemdeck_watch.core.errors import Cancelled, WorkerDied, WorkerStalled
from stemdeck_watch.store.jobqueue import JobControl
from stemdeck_watch.workers import local, zygote
from stemdeck_watch.workers.compiled.build import CompileBuilder
from stemdeck_watch.workers.local import WorkerClient

from support.helpers import noise_mix, processes, wait_for
from support.processes import (
    FAMILY_ENV,
    freeze,
    gone_or_zombie,
    kill,
    marked,
    new_mark,
    wait_none_left,
)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(sys.platform != "linux", reason="signals, /proc and pidfds: Linux"),
]

CANCEL_ANSWER = 2.0  # seconds a cancel may take to answer
STALL = 3.0  # separation.stall_seconds in these tests


@pytest.fixture
def client(faults: Path) -> Iterator[WorkerClient]:
    """A worker client whose workers see the fault seam's folder."""
    made = WorkerClient("cpu", stall_seconds=STALL)
    try:
        yield made
    finally:
        finished(made.close, 20, "closing the client")


@pytest.fixture
def zygote_afterwards() -> Iterator[None]:
    """Whatever the test did to the zygote (stopped, killed), the next test finds one that
    answers (a new one, started when needed)."""
    zygote.ready()
    first = zygote.pid()
    yield
    if first is not None and processes().get(first, (0, ""))[1] == "T":
        kill(first)
        wait_for(lambda: zygote.pid() != first, 15, "the stopped zygote to be gone")


def finished(work: Callable[[], Any], seconds: float, what: str) -> list[Any]:
    """Run `work` on a thread; what it returned or raised, which must come within `seconds`."""
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append(work())
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=run, name=f"test-{what}", daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"{what} did not end within {seconds:.0f} s"
    return outcome


def separating(
    client: WorkerClient,
    model_repo: Path,
    tmp_path: Path,
    control: JobControl,
    monkeypatch: pytest.MonkeyPatch,
) -> tuple[threading.Thread, list[BaseException | object], threading.Event]:
    """A separation of a long song started on a thread (each segment waits 30 s: the
    `slow` fault), and an event set once its request has gone to the worker."""
    begun = threading.Event()
    outcome: list[BaseException | object] = []
    mix = noise_mix(tmp_path, 1.0)
    original = local._Process.send

    def send(self: Any, request: dict[str, Any]) -> None:
        original(self, request)
        if request.get("op") == "separate":
            begun.set()

    monkeypatch.setattr(local._Process, "send", send)

    def run() -> None:
        try:
            outcome.append(
                client.separate(
                    "song",
                    "tiny",
                    str(model_repo),
                    mix,
                    tmp_path / "out",
                    control=control,
                    on_progress=lambda v: None,
                    stall_seconds=60.0,
                )
            )
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=run, name="test-separating", daemon=True)
    thread.start()
    return thread, outcome, begun


def test_a_lost_zygote_and_a_stopped_worker_end_the_song_at_once_and_leave_nothing(
    client: WorkerClient,
    model_repo: Path,
    tmp_path: Path,
    faults: Path,
    zygote_afterwards: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The worker hangs (SIGSTOP) and its zygote is lost (SIGKILL) mid-song: the song ends in
    a machine fault at once (not after the stall limit, nor never), the stopped worker does
    not live on adopted by PID 1, and closing the client returns."""
    (faults / "slow").write_text("30")
    control = JobControl("song")
    thread, outcome, begun = separating(client, model_repo, tmp_path, control, monkeypatch)
    assert begun.wait(60)
    worker, lost = client.pid, zygote.pid()
    assert worker is not None and lost is not None
    freeze(worker)
    kill(lost)
    thread.join(15)
    assert not thread.is_alive(), "the separation waits on a stopped worker of a lost zygote"
    assert len(outcome) == 1 and type(outcome[0]) is WorkerDied, outcome
    assert "zygote" in str(outcome[0])
    wait_for(lambda: gone_or_zombie([worker]), 5, "the stopped worker to be ended")
    finished(client.close, 10, "closing the client")


def test_with_the_zygote_stopped_a_cancel_answers_at_once_and_ends_the_worker(
    client: WorkerClient,
    model_repo: Path,
    tmp_path: Path,
    faults: Path,
    zygote_afterwards: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A cancel (the song's file deleted, on the watcher's thread) with the zygote stopped:
    it answers within 2 s, the separation ends Cancelled and the worker is ended; a shutdown
    then returns, and the next worker start is given up at once."""
    (faults / "slow").write_text("30")
    control = JobControl("song")
    thread, outcome, begun = separating(client, model_repo, tmp_path, control, monkeypatch)
    assert begun.wait(60)
    worker, stopped = client.pid, zygote.pid()
    assert worker is not None and stopped is not None
    freeze(stopped)
    started = time.monotonic()
    [answer] = finished(lambda: control.cancel("the input was removed"), CANCEL_ANSWER, "cancel")
    assert answer is True and time.monotonic() - started < CANCEL_ANSWER
    thread.join(10)
    assert not thread.is_alive() and len(outcome) == 1 and isinstance(outcome[0], Cancelled)
    wait_for(lambda: gone_or_zombie([worker]), 5, "the worker to be ended")
    # a start asked of the stopped zygote is given up as soon as the service stops
    starting = JobControl("next")
    begun_start = threading.Event()

    def start_next() -> None:
        begun_start.set()
        client.ensure_model("tiny", str(model_repo), starting)

    thread2 = threading.Thread(target=lambda: finished(start_next, 20, "start"), daemon=True)
    thread2.start()
    assert begun_start.wait(5)
    finished(client.shutdown, CANCEL_ANSWER, "shutdown")
    thread2.join(10)
    assert not thread2.is_alive(), "a worker start waits on a stopped zygote after shutdown"


def test_a_stall_with_the_zygote_stopped_is_reported_at_the_stall_limit(
    client: WorkerClient,
    model_repo: Path,
    tmp_path: Path,
    faults: Path,
    zygote_afterwards: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    (faults / "1-stall").write_text("1")
    client.ensure_model("tiny", str(model_repo))
    worker, stopped = client.pid, zygote.pid()
    assert worker is not None and stopped is not None
    freeze(stopped)
    started = time.monotonic()
    [outcome] = finished(
        lambda: client.separate(
            "song",
            "tiny",
            str(model_repo),
            noise_mix(tmp_path, 1.0),
            tmp_path / "out",
            control=JobControl("song"),
            on_progress=lambda v: None,
            stall_seconds=STALL,
        ),
        STALL + 10,
        "the stalled separation",
    )
    assert isinstance(outcome, WorkerStalled), outcome
    assert time.monotonic() - started < STALL + 6
    wait_for(lambda: gone_or_zombie([worker]), 5, "the stalled worker to be ended")


def test_a_worker_that_hangs_while_loading_is_stopped_at_the_stall_limit(
    client: WorkerClient, model_repo: Path, faults: Path
) -> None:
    """A load (as the warm-up's, with nothing to cancel it) whose worker hangs is watched as a
    separation is: stopped after the stall limit, a machine fault; the next load works. A
    cancel of a load that hangs answers at once."""
    (faults / "1-stall-load").touch()
    started = time.monotonic()
    [outcome] = finished(
        lambda: client.ensure_model("tiny", str(model_repo)), STALL + 30, "the hung load"
    )
    assert isinstance(outcome, WorkerStalled), outcome
    assert "while it loaded model tiny" in str(outcome)
    assert time.monotonic() - started < STALL + 25  # the worker's start, then the limit
    hung = client.pids[-1]
    wait_for(lambda: gone_or_zombie([hung]), 5, "the hung worker to be ended")
    (faults / "2-stall-load").touch()
    control = JobControl("song")
    loading = threading.Thread(
        target=lambda: finished(
            lambda: client.ensure_model("tiny", str(model_repo), control), 60, "load"
        ),
        daemon=True,
    )
    loading.start()
    wait_for(lambda: not (faults / "2-stall-load").exists(), 30, "the load to hang")
    finished(lambda: control.cancel("cancelled"), CANCEL_ANSWER, "cancel")
    loading.join(10)
    assert not loading.is_alive()
    assert client.ensure_model("tiny", str(model_repo)).name == "tiny"


# ---------------------------------------------------------------- the background compile


def start_build(builder: CompileBuilder, tmp_path: Path) -> None:
    builder.request("key", "tiny", str(tmp_path), "float32", "cpu")
    wait_for(builder._armed.is_set, 30, "the build to say it dies with the service")
    group = getattr(builder, "_group", None) or (builder._proc.pid if builder._proc else None)
    assert group is not None
    wait_for(
        lambda: len([p for p, (_, _s) in processes().items() if _pgid(p) == group]) >= 5,
        30,
        "the build's compiler stand-ins to start",
    )


def _pgid(pid: int) -> int:
    try:
        return os.getpgid(pid)
    except OSError:
        return -1


def test_closing_a_stopped_build_ends_it_and_its_compilers(tmp_path: Path, faults: Path) -> None:
    (faults / "1-stall-build").touch()
    mark = new_mark()
    builder = CompileBuilder(tmp_path / "cache", 100.0, {**os.environ, FAMILY_ENV: mark})
    start_build(builder, tmp_path)
    with builder.held():  # a song separates: the build and its compilers are stopped
        wait_for(lambda: "T" in marked(mark).values(), 10, "the build to be stopped")
        finished(builder.close, 15, "closing the builder")
    wait_none_left(mark, 10)


SERVICE = """
import os, sys, threading
from pathlib import Path
from stemdeck_watch.workers.compiled.build import CompileBuilder
builder = CompileBuilder(Path(sys.argv[1]), 100.0, dict(os.environ))
builder.request("key", "tiny", sys.argv[2], "float32", "cpu")
if not builder._armed.wait(60):
    sys.exit(3)
print("armed", getattr(builder, "_group", None) or builder._proc.pid, flush=True)
sys.stdin.readline()
held = builder.held()
held.__enter__()
print("held", flush=True)
threading.Event().wait(120)
"""


def test_a_build_stopped_for_a_song_dies_with_a_killed_service_compilers_and_all(
    tmp_path: Path, faults: Path
) -> None:
    """The service is SIGKILLed while its build is stopped for a song (SIGSTOP): nothing of
    the build is left, its compiler processes neither (stopped, adopted by PID 1)."""
    (faults / "1-stall-build").touch()
    mark = new_mark()
    service = subprocess.Popen(
        [sys.executable, "-c", SERVICE, str(tmp_path / "cache"), str(tmp_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, FAMILY_ENV: mark},
    )
    try:
        assert service.stdout is not None and service.stdin is not None
        line = service.stdout.readline().split()
        assert line[:1] == ["armed"], line
        group = int(line[1])
        wait_for(
            lambda: sum(1 for p in marked(mark) if _pgid(p) == group) >= 5,
            30,
            "the compiler stand-ins to start",
        )
        service.stdin.write("hold\n")
        service.stdin.flush()
        assert service.stdout.readline() == "held\n"
        wait_for(
            lambda: {marked(mark).get(p) for p in marked(mark) if _pgid(p) == group} == {"T"},
            10,
            "the build and its compilers to be stopped",
        )
        service.kill()
        service.wait(10)
        wait_none_left(mark, 10)
    finally:
        service.kill()
        service.wait(10)
        for pipe in (service.stdin, service.stdout):
            if pipe is not None:
                pipe.close()
        for pid in marked(mark):
            kill(pid)


# ---------------------------------------------------------------- the service killed

OWNER = """
import sys, threading
from stemdeck_watch.workers import zygote
from stemdeck_watch.workers.local import WorkerClient
client = WorkerClient("cpu")
client.ensure_model("tiny", sys.argv[1])
print(zygote.pid(), client.pid, flush=True)
threading.Event().wait(120)
"""


def test_a_killed_service_leaves_neither_its_stopped_zygote_nor_its_stopped_worker(
    model_repo: Path,
) -> None:
    """The service is SIGKILLed while its zygote and its worker are stopped (SIGSTOP): both
    die with it, as nothing of them could act on the service's end."""
    mark = new_mark()
    service = subprocess.Popen(
        [sys.executable, "-c", OWNER, str(model_repo)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, FAMILY_ENV: mark},
    )
    try:
        assert service.stdout is not None
        pids = [int(p) for p in service.stdout.readline().split()]
        assert len(pids) == 2 and set(pids) <= set(marked(mark)), pids
        for pid in pids:
            freeze(pid)
        wait_for(lambda: {marked(mark).get(p) for p in pids} == {"T"}, 10, "both to stop")
        service.kill()
        service.wait(10)
        wait_none_left(mark, 10)
    finally:
        service.kill()
        service.wait(10)
        if service.stdout is not None:
            service.stdout.close()
        for pid in marked(mark):
            kill(pid)
