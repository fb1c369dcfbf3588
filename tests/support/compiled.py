"""The tiny model's compiled form, built once per test session (by the first of its processes to ask, under pytest-xdist) the
way the service builds it:
a worker reports it missing, its client starts the background build (a process at idle
priority: Inductor and a C++ compiler), and the worker adopts and measures it. Tests copy the
cache into their own state folder."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from stemdeck_watch.workers.compiled.cache import CompileKey, CompileSettings
from stemdeck_watch.workers.compiled.model import cxx_compiler
from stemdeck_watch.workers.local import WorkerClient

from support.helpers import wait_for

# a cold build of the tiny model: about 90 s on 2 quiet cores of an AMD Zen 5, 165 s on a
# Zen 3, and over 180 s (the suite's time limit per test) beside the other process's tests
BUILD_TIMEOUT = 900.0


@dataclasses.dataclass(frozen=True)
class BuiltCompile:
    root: Path  # a compiled-model cache: tiny, float32, CPU, built and measured
    key: str
    policies: frozenset[int]  # the scheduling policies the build process was seen in
    before: dict[str, Any]  # the worker's report while it was being built
    after: dict[str, Any]  # ...and once it adopted it

    def copy_to(self, state: Path) -> Path:
        """This cache as `<state>/compiled` (where the service keeps it)."""
        target = state / "compiled"
        shutil.copytree(self.root, target, symlinks=True)
        return target


def entry_key(cache: Path, digest: str) -> CompileKey:
    """The key the entry `digest` in `cache` names."""
    key = CompileKey.from_dict(json.loads((cache / digest / "entry.json").read_text())["key"])
    assert key is not None
    return key


def require_compiler() -> None:
    """Skip (locally) or fail (CI=true) where Inductor has no C++ compiler."""
    if cxx_compiler() is not None:
        return
    reason = "no C++ compiler for Inductor (apt install g++, or set $CXX)"
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason}; CI must run the compiled-model tests")
    pytest.skip(reason)


def build_tiny(model_repo: Path, root: Path) -> BuiltCompile:
    require_compiler()
    client = WorkerClient("cpu", precision="float32", compiling=CompileSettings("on", root))
    try:
        before = dict(client.ensure_model("tiny", str(model_repo)).compiled)
        assert client.builder is not None
        builder, policies = client.builder, set()

        def ended() -> bool:
            """Whether the build ended; until then, the scheduling policy it runs in."""
            info = builder.info()
            if info is None:
                return True
            if builder._armed.is_set():  # the build itself (not its keeper) is known
                with contextlib.suppress(OSError):  # it ended meanwhile
                    policies.add(os.sched_getscheduler(info["pid"]))
            return False

        wait_for(ended, BUILD_TIMEOUT, "the tiny model's compile", interval=0.2)
        result = client.builder.result(before["key"])
        assert result and result.get("ok"), f"the tiny model's compile failed: {result}"
        after = dict(client.ensure_model("tiny", str(model_repo)).compiled)
    finally:
        client.close()
    return BuiltCompile(root, before["key"], frozenset(policies), before, after)


def built_once(model_repo: Path, factory: pytest.TempPathFactory) -> BuiltCompile:
    """`build_tiny` once for all the processes of a pytest-xdist session: the first to take the
    lock builds and writes down what it built; the others wait for it (a minute of idle
    waiting instead of a second build beside the first) and read that. The key is a
    digest of the model's weights, which every process saves alike, so one cache fits all.
    STEMDECK_TEST_COMPILED=DIR keeps it in DIR for later sessions too: `make mutants` runs
    the seams test once per mutant and builds it once."""
    import fcntl

    base = factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    if os.environ.get("STEMDECK_TEST_COMPILED"):  # kept across sessions (`make mutants`)
        shared = Path(os.environ["STEMDECK_TEST_COMPILED"])
        shared.mkdir(parents=True, exist_ok=True)
    record = shared / "compiled-tiny.json"
    with open(shared / "compiled-tiny.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if record.is_file():
            data = json.loads(record.read_text())
            return BuiltCompile(
                Path(data["root"]),
                data["key"],
                frozenset(data["policies"]),
                data["before"],
                data["after"],
            )
        built = build_tiny(model_repo, shared / "compiled-tiny")
        record.write_text(
            json.dumps(
                {
                    "root": str(built.root),
                    "key": built.key,
                    "policies": sorted(built.policies),
                    "before": built.before,
                    "after": built.after,
                }
            )
        )
        return built
