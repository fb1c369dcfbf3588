"""The compiled model for real: Inductor, a C++ compiler, the background build at idle
priority, the worker adopting it, measuring it and separating with it (the tiny model, float32;
built once per session: tests/support/compiled.py)."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import math
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from stemdeck_watch.store.jobqueue import JobControl
from stemdeck_watch.workers.compiled.build import proc_stat
from stemdeck_watch.workers.compiled.cache import (
    PART_SUFFIX,
    CompileCache,
    CompileSettings,
    Verdict,
)
from stemdeck_watch.workers.local import WorkerClient
from stemdeck_watch.workers.separator import DemucsSettings
from stemdeck_watch.workers.demucs.precision import CALIBRATE_ENV

from support.compiled import BuiltCompile, entry_key, require_compiler
from support.helpers import wait_for

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(sys.platform != "linux", reason="Inductor's CPU compile, tried on Linux"),
]
SR = 44100
# a bound on loading the saved tiny model that no rebuild meets: loading took about 1 s on 2
# quiet cores of an AMD Zen 5 and 12.8 s on a Zen 3 beside the other process's tests, where
# building it (tracing and compiling, what a start without the saved parts would do) took
# 165 s alone and 240 s beside them
LOAD_SECONDS = 30.0


def song(folder: Path, seconds: float = 6.0) -> Path:
    path = folder / "mix.npy"
    rng = np.random.default_rng(1)
    np.save(path, (0.1 * rng.standard_normal((2, int(seconds * SR)))).astype(np.float32))
    return path


def separate(client: WorkerClient, repo: Path, source: Path, out: Path, segment=None):
    result = client.separate(
        "job",
        "tiny",
        str(repo),
        source,
        out,
        demucs=DemucsSettings(shifts=0, segment=segment),
        control=JobControl("job"),
        on_progress=lambda v: None,
        precision="float32",
    )
    return result, {k: np.load(v) for k, v in result.stems.items()}


def worst_snr(reference: dict, estimate: dict) -> float:
    worst = math.inf
    for name, ref in reference.items():
        noise = float(((ref.astype(np.float64) - estimate[name]) ** 2).sum())
        if noise:
            worst = min(worst, 10 * math.log10(float((ref.astype(np.float64) ** 2).sum()) / noise))
    return worst


def client_for(
    cache: Path, setting: str = "on", env: dict | None = None, **options: Any
) -> WorkerClient:
    return WorkerClient(
        "cpu", env, precision="float32", compiling=CompileSettings(setting, cache), **options
    )


def test_the_build_runs_beside_at_idle_priority_and_the_worker_adopts_it(
    compiled_tiny: BuiltCompile,
) -> None:
    before, after = compiled_tiny.before, compiled_tiny.after
    assert before["state"] == "building" and "background" in before["reason"]
    assert compiled_tiny.policies == {os.SCHED_IDLE}, "the build only takes idle CPU"
    assert after["state"] == "used", after
    assert after["speedup"] > 0 and (after["worst_snr_db"] is None or after["worst_snr_db"] >= 35)
    assert after["compile_seconds"] > 0 and after["load_seconds"] > 0
    names = {p.name for p in compiled_tiny.root.iterdir()}
    # the build's process group is forgotten once it ended: nothing reaps that id later
    assert names == {compiled_tiny.key, f"{compiled_tiny.key}.verdict.json"}, names


def test_a_restarted_worker_loads_it_in_seconds_and_separates_with_it(
    compiled_tiny: BuiltCompile, model_repo: Path, tmp_path: Path
) -> None:
    cache = compiled_tiny.copy_to(tmp_path)
    source = song(tmp_path)
    eager = WorkerClient("cpu", precision="float32")
    client = client_for(cache)
    try:
        _, reference = separate(eager, model_repo, source, tmp_path / "eager")
        first = client.ensure_model("tiny", str(model_repo)).compiled
        # measured before: loaded (not traced, not compiled) before the first song
        assert first["state"] == "used", first
        assert first["load_seconds"] < LOAD_SECONDS, first
        result, stems = separate(client, model_repo, source, tmp_path / "first")
        assert result.compiled, "the first song ran the compiled code"
        assert worst_snr(reference, stems) >= 35
        # killed: nothing of the cache changes; the next worker loads it again
        os.kill(client.pid or 0, signal.SIGKILL)
        wait_for(lambda: client.pid is None, 10, "the killed worker to be gone")
        restarted = client.ensure_model("tiny", str(model_repo)).compiled  # as the service does
        assert restarted["state"] == "used" and restarted["load_seconds"] < LOAD_SECONDS
        result, stems = separate(client, model_repo, source, tmp_path / "compiled")
        assert result.compiled, "the restarted worker's first song ran the compiled code"
        assert worst_snr(reference, stems) >= 35
        # another input shape than it was built for fails the guards and runs eager
        result, _ = separate(client, model_repo, source, tmp_path / "segment", segment=2.0)
        assert not result.compiled
        assert client.info()["compiled"]["state"] == "used"
    finally:
        client.close()
        eager.close()
    assert CompileCache(cache).entry(entry_key(cache, compiled_tiny.key)) is not None, "whole"


def test_a_compile_that_did_not_pay_is_never_tried_again(
    compiled_tiny: BuiltCompile, model_repo: Path, tmp_path: Path
) -> None:
    cache = compiled_tiny.copy_to(tmp_path)
    store = CompileCache(cache)
    key = entry_key(cache, compiled_tiny.key)
    store.record_verdict(key, Verdict(False, "not worth it: 1.02× (needs 1.15×)", 1.02, 60.0))
    client = client_for(cache, "auto", {CALIBRATE_ENV: "always"})
    try:
        compiled = client.ensure_model("tiny", str(model_repo)).compiled
        assert compiled["state"] == "not used" and "1.02×" in compiled["reason"]
        assert client.builder is not None and client.builder.info() is None, "no new build"
        result, _ = separate(client, model_repo, song(tmp_path), tmp_path / "out")
        assert not result.compiled
    finally:
        client.close()
    assert not (cache / compiled_tiny.key).exists()


def test_auto_skips_a_small_model_and_says_so_without_a_cxx_compiler(
    model_repo: Path, tmp_path: Path
) -> None:
    small = client_for(tmp_path / "a", "auto")
    missing = client_for(
        tmp_path / "b", "auto", {"CXX": str(tmp_path / "no-such-c++"), CALIBRATE_ENV: "always"}
    )
    try:
        compiled = small.ensure_model("tiny", str(model_repo)).compiled
        assert compiled["state"] == "not used" and "small model" in compiled["reason"]
        compiled = missing.ensure_model("tiny", str(model_repo)).compiled
        assert compiled["state"] == "unavailable" and "C++ compiler" in compiled["reason"]
        result, _ = separate(missing, model_repo, song(tmp_path), tmp_path / "out")
        assert not result.compiled
        assert small.builder.info() is None and missing.builder.info() is None  # type: ignore[union-attr]
    finally:
        small.close()
        missing.close()
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_a_build_killed_midway_leaves_no_entry_and_says_it_failed(
    model_repo: Path, tmp_path: Path
) -> None:
    require_compiler()
    cache = tmp_path / "compiled"
    client = client_for(cache)
    try:
        assert client.ensure_model("tiny", str(model_repo)).compiled["state"] == "building"
        assert client.builder is not None
        wait_for(lambda: list(cache.glob(".build-*/inductor")), 120, "the build to start")
        info = client.builder.info()  # the build's own process (it has said so by now)
        assert info is not None
        with client.builder.held():  # as while the worker separates: the build is stopped
            wait_for(lambda: process_state(info["pid"]) == "T", 10, "the build to stop")
        wait_for(lambda: process_state(info["pid"]) != "T", 10, "the build to go on")
        os.kill(info["pid"], signal.SIGKILL)
        wait_for(lambda: client.builder.info() is None, 30, "the builder to see it end")  # type: ignore[union-attr]
        compiled = client.ensure_model("tiny", str(model_repo)).compiled
        assert compiled["state"] == "failed" and "build failed" in compiled["reason"]
    finally:
        client.close()
    assert sorted(p.name[:7] for p in cache.iterdir()) == [".build-"]


def test_a_build_the_builder_was_too_busy_to_start_is_asked_for_again_at_the_next_song(
    model_repo: Path, tmp_path: Path
) -> None:
    """One build runs at a time (a recipe's RoFormer may be building when a model loads):
    the load's request is dropped then, and the next song's asks again."""
    require_compiler()
    client = client_for(tmp_path / "compiled")
    try:
        assert client.builder is not None
        busy = {"key": "another model's", "model": "x", "pid": 0, "started": 0.0}
        client.builder._building = busy  # another build runs
        assert client.ensure_model("tiny", str(model_repo)).compiled["state"] == "building"
        assert client.builder.info() == busy, "dropped while the other ran"
        client.builder._building = None  # it ended
        model = client.ensure_model("tiny", str(model_repo))  # the next song
        info = client.builder.info()
        assert info is not None and info["key"] == model.compiled["key"], info
    finally:
        client.close()


def process_state(pid: int) -> str:
    """The state letter of process `pid` (T: stopped)."""
    return proc_stat(pid)[0]


def test_a_call_its_guards_refuse_runs_eager_and_is_counted(
    compiled_tiny: BuiltCompile,
    model_repo: Path,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    torch = pytest.importorskip("torch")
    tqdm = pytest.importorskip("tqdm")
    # in this process, not a worker's: tqdm's monitor thread (Inductor's progress) stays off
    monkeypatch.setattr(tqdm.tqdm, "monitor_interval", 0)
    from stemdeck_watch.workers.compiled.model import open_compiled, using
    from stemdeck_watch.workers.compiled.graph import modes, segment_input
    from stemdeck_watch.workers.worker import load_model

    cache = compiled_tiny.copy_to(tmp_path)
    model = load_model("tiny", str(model_repo))
    pairs = open_compiled(model, cache / compiled_tiny.key, "cpu", "float32")
    fits = segment_input(model, "cpu")
    with using(pairs) as calls, modes("cpu", "float32"):
        model(fits)
        assert (calls.compiled, calls.eager) == (len(pairs), 0), "every part, compiled"
    with using(pairs) as calls, modes("cpu", "bfloat16"):  # another mode than it was built for
        out = model(fits)
        assert calls.eager >= 1, "the parts the guards refused ran eager"
    with modes("cpu", "bfloat16"):
        assert torch.equal(out, model(fits))  # the eager model's own answer
    # the part named by its saved file, as a network holds several of one class
    assert re.search(
        r"a part ran eager: network-0\.t?encoder\.\d \(HEncLayer\): verbose_code_parts", caplog.text
    )


def test_routing_a_second_model_gives_the_first_its_own_methods_back(model_repo: Path) -> None:
    torch = pytest.importorskip("torch")
    from stemdeck_watch.workers.compiled.graph import ROUTED, modes, prepare, release, segment_input
    from stemdeck_watch.workers.worker import load_model

    first, second = load_model("tiny", str(model_repo)), load_model("tiny6", str(model_repo))
    silence = segment_input(first, "cpu")
    with modes("cpu", "float32"):
        before = first(silence)
    prepare([first])
    assert "_get_pos_embedding" in vars(first.crosstransformer)
    with modes("cpu", "float32"):
        assert torch.equal(first(silence), before), "routed, the same stems"
    prepare([second])
    assert not any(ROUTED in vars(module) for module in first.modules())
    assert "_get_pos_embedding" in vars(second.crosstransformer)
    with modes("cpu", "float32"):
        assert torch.equal(first(silence), before)
    release()  # the worker lets its model go: nothing routed, no module kept
    assert not any(ROUTED in vars(module) for module in second.modules())


def test_a_part_file_the_build_did_not_name_makes_the_entry_unusable(
    compiled_tiny: BuiltCompile, tmp_path: Path
) -> None:
    """A saved part is code the worker unpickles: one planted beside the built ones is never
    loaded; the entry is removed and built again."""
    cache = compiled_tiny.copy_to(tmp_path)
    key = entry_key(cache, compiled_tiny.key)
    store = CompileCache(cache)
    assert store.problem(key) is None
    (cache / compiled_tiny.key / "network-0.planted.bin").write_bytes(b"not a compiled part")
    assert store.problem(key) == "network-0.planted.bin is not named in entry.json"
    assert store.entry(key) is None and not (cache / compiled_tiny.key).exists()


def test_a_compiled_model_that_cannot_be_loaded_is_not_tried_again_and_says_what_to_delete(
    compiled_tiny: BuiltCompile,
    model_repo: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    pytest.importorskip("torch")
    tqdm = pytest.importorskip("tqdm")
    monkeypatch.setattr(tqdm.tqdm, "monitor_interval", 0)  # as in the guards test above
    from stemdeck_watch.workers.compiled import model as compiled
    from stemdeck_watch.workers.worker import load_model

    cache = compiled_tiny.copy_to(tmp_path)
    model = load_model("tiny", str(model_repo))

    def broken(*_args: object) -> None:
        raise OSError("the disk said no")

    monkeypatch.setattr(compiled, "open_compiled", broken)
    first = compiled.CompiledSlot("on", CompileCache(cache), "cpu")
    report = first.refresh(model, "tiny", "float32")
    verdict_file = cache / f"{compiled_tiny.key}.verdict.json"
    assert report["state"] == "failed" and "the disk said no" in report["reason"]
    assert f"delete {verdict_file} to build it anew" in report["reason"]
    assert not first.pairs and verdict_file.is_file()

    def never(*_args: object) -> None:
        raise AssertionError("a later worker loaded it again")

    monkeypatch.setattr(compiled, "open_compiled", never)
    later = compiled.CompiledSlot("on", CompileCache(cache), "cpu").refresh(
        model, "tiny", "float32"
    )
    assert later["state"] == "failed" and later["reason"] == report["reason"]


@pytest.mark.parametrize("outcome", ["not used", "failed"])
def test_a_compiled_model_not_adopted_leaves_the_eager_model_its_own_methods(
    compiled_tiny: BuiltCompile,
    model_repo: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    outcome: str,
) -> None:
    """Loading routes the model's position embedding through the compiled graphs' operator;
    a compiled model the worker does not keep gives the eager model its own methods back."""
    pytest.importorskip("torch")
    tqdm = pytest.importorskip("tqdm")
    monkeypatch.setattr(tqdm.tqdm, "monitor_interval", 0)  # as in the guards test above
    from stemdeck_watch.workers.compiled import model as compiled
    from stemdeck_watch.workers.compiled.graph import ROUTED
    from stemdeck_watch.workers.worker import Worker

    def measured(*_args: object) -> compiled.Measured:
        if outcome == "failed":
            raise ValueError("the guards of a compiled part refused a segment")
        return compiled.Measured(1.2, 20.0, 1.2, 1.0)  # fast, not accurate enough

    monkeypatch.setattr(compiled, "measure", measured)
    cache = compiled_tiny.copy_to(tmp_path)
    (cache / f"{compiled_tiny.key}.verdict.json").unlink()  # to be measured again
    worker = Worker("cpu", io.StringIO())
    model = worker.model("tiny", str(model_repo))
    slot = worker.compiled("tiny", str(model_repo), "float32", {"setting": "on", "cache": cache})
    assert slot.state == outcome
    assert not slot.pairs
    assert not [m for m in model.modules() if ROUTED in vars(m)], "nothing left routed"


def test_a_model_other_than_htdemucs_is_not_compiled_and_says_why(tmp_path: Path) -> None:
    """HDemucs (hdemucs_mmi, the mdx models) has LSTMs and pads its last segment to its own
    length: it separates eager, and no build is started for it."""
    torch = pytest.importorskip("torch")
    from demucs.hdemucs import HDemucs

    torch.manual_seed(0)
    model = HDemucs(sources=["drums", "bass", "other", "vocals"], channels=4)
    args, kwargs = model._init_args_kwargs
    repo = tmp_path / "models"
    repo.mkdir()
    state = {"klass": HDemucs, "args": args, "kwargs": kwargs, "state": model.state_dict()}
    torch.save(state, repo / "hybrid.th")
    client = client_for(tmp_path / "compiled", "on")
    try:
        compiled = client.ensure_model("hybrid", str(repo)).compiled
        assert compiled["state"] == "unavailable", compiled
        assert "for HTDemucs models" in compiled["reason"] and "HDemucs" in compiled["reason"]
        assert client.builder is not None and client.builder.info() is None, "no build"
    finally:
        client.close()
    assert not (tmp_path / "compiled").exists()


def test_reaping_a_build_left_behind_spares_a_process_that_got_its_pid(tmp_path: Path) -> None:
    """The pid file of a build an earlier service could not end names a process group and
    its leader's start time: a process that got the same pid later is not that build."""
    from stemdeck_watch.workers.compiled.build import PID_FILE, reap, started_at

    # a stand-in with what reap looks for in a command line ("torch"), in a group of its own,
    # looked at once it runs (it says so); it lives until its stdin closes
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys; print('up', flush=True); sys.stdin.read()  # torch"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline() == b"up\n"
        start = started_at(proc.pid)
        assert start is not None
        (tmp_path / PID_FILE).write_text(f"{proc.pid} {start - 1}")
        reap(tmp_path)
        assert proc.poll() is None, "a process with the same pid, started later, was killed"
        (tmp_path / PID_FILE).write_text(f"{proc.pid} {start}")
        reap(tmp_path)

        def seen() -> str:  # what /proc shows of it when the wait gives up
            with contextlib.suppress(OSError):
                return " ".join(proc_stat(proc.pid))
            return "gone"

        wait_for(
            lambda: proc.poll() is not None,
            30,
            lambda: f"the build's stand-in to die ({seen()})",
        )
        assert proc.returncode == -signal.SIGKILL
    finally:
        proc.kill()
        proc.wait()
        proc.stdin.close()  # type: ignore[union-attr]
        proc.stdout.close()  # type: ignore[union-attr]


def test_a_build_whose_service_died_before_it_started_watching_ends_at_once(
    model_repo: Path, tmp_path: Path
) -> None:
    """A service killed between starting a build and the build asking to die with it leaves
    the build with another parent: it notices by the service's pid it was given, and ends
    before it compiles anything (it would run for minutes, an orphan)."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a pid that is not this build's parent: the service it names is gone
    build = subprocess.run(
        [
            sys.executable,
            "-m",
            "stemdeck_watch.workers.compiled.build",
            "--model",
            "tiny",
            "--repo",
            str(model_repo),
            "--cache",
            str(tmp_path / "compiled"),
            "--parent",
            str(gone.pid),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert build.returncode == 0 and build.stdout == "", build.stderr[-2000:]
    assert not any((tmp_path / "compiled").rglob(f"*{PART_SUFFIX}")), "it compiled"


def test_a_build_is_stopped_for_a_song_only_once_it_dies_with_the_service(tmp_path: Path) -> None:
    """A build stopped before it asked to be killed with the service would outlive a service
    killed meanwhile, stopped for ever: until it says so, a song does not stop it."""
    from stemdeck_watch.workers.compiled.build import CompileBuilder

    builder = CompileBuilder(tmp_path, 100.0, dict(os.environ))
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"],
        stdin=subprocess.PIPE,
        start_new_session=True,
        text=True,
    )

    def state() -> str:
        return proc_stat(proc.pid)[0]

    try:
        builder._proc = proc
        with builder.held():
            assert state() != "T", "stopped before it said it dies with the service"
        builder._armed.set()
        with builder.held():
            wait_for(lambda: state() == "T", 10, "the armed build to be stopped")
        wait_for(lambda: state() != "T", 10, "the build to go on after the song")
    finally:
        proc.kill()
        proc.wait()
        proc.stdin.close()  # type: ignore[union-attr]


def test_another_thread_count_builds_its_own_and_leaves_the_first_in_use(
    compiled_tiny: BuiltCompile, model_repo: Path, tmp_path: Path
) -> None:
    """A saved part refuses to run under another thread count than it was built with: a
    worker with other `separation.threads` needs a build of its own, and the first build
    stays whole and in use for the threads it was built with."""
    cache = compiled_tiny.copy_to(tmp_path)
    built = int(entry_key(cache, compiled_tiny.key).threads)
    other = 1 if built > 1 else 2
    for threads, state in ((other, "building"), (0, "used")):
        client = client_for(cache, threads=threads, builds=False)
        try:
            compiled = client.ensure_model("tiny", str(model_repo)).compiled
            assert compiled["state"] == state, (threads, compiled)
        finally:
            client.close()
    assert CompileCache(cache).entry(entry_key(cache, compiled_tiny.key)) is not None, "whole"


def test_a_second_precision_that_fails_leaves_the_first_compiled(
    compiled_tiny: BuiltCompile, model_repo: Path, tmp_path: Path
) -> None:
    """Two precisions of one model in one worker (a preset with its own): the compiled
    float32 model stays in use after a bfloat16 build fails to load."""
    cache = compiled_tiny.copy_to(tmp_path)
    source = song(tmp_path)
    client = client_for(cache)
    try:
        assert client.ensure_model("tiny", str(model_repo)).compiled["state"] == "used"
        float32 = entry_key(cache, compiled_tiny.key)
        bfloat16 = dataclasses.replace(float32, precision="bfloat16")
        store = CompileCache(cache)
        build = store.new_build(bfloat16)
        (build / "network-0.encoder.0.bin").write_bytes(b"not a compiled part")
        store.commit(build, bfloat16, {"compile_seconds": 1.0})
        failed = client.ensure_model("tiny", str(model_repo), precision="bfloat16").compiled
        assert failed["state"] == "failed", failed
        assert client.ensure_model("tiny", str(model_repo)).compiled["state"] == "used"
        result, _ = separate(client, model_repo, source, tmp_path / "after")
        assert result.compiled, "the float32 song ran every part compiled"
    finally:
        client.close()
