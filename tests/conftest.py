"""Shared fixtures: test hygiene, the tiny model, settings on temporary folders, a service.

Hygiene (after watchdog's own tests/conftest.py): every test must leave no thread and no
child process behind — a leaked worker would hold a model in memory long after the service
that owned it stopped.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from stemdeck_watch.core.config import Settings, default_toml, settings_from_dict
from stemdeck_watch.core.events import EventBus
from stemdeck_watch.workers import zygote
from stemdeck_watch.workers.faultseam import FAULTS_ENV
from stemdeck_watch.workers.worker import ONEDNN_ENV
from stemdeck_watch.service import Service

from support.compiled import BUILD_TIMEOUT, BuiltCompile, built_once
from support.helpers import JobLog, child_pids, config_data, wait_for

# every worker the tests start (directly, through a service, or a service the CLI starts)
# inherits this: without oneDNN the tiny model's first separation takes 0.4 s instead of 2.5 s
# (see workers/worker.py); the precision tests turn it back on for themselves
os.environ.setdefault(ONEDNN_ENV, "0")
# `make test` runs the suite in two processes (pytest-xdist): two workers separating at once
# on two cores, each with OpenMP threads that spin while they wait for work, took CPU from
# each other and from the services (the UI tests ran slower in two processes than in one);
# passive threads sleep instead
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A test that needs the tiny model's compiled form may wait for its build (minutes of
    CPU, at idle priority beside the other process's tests): its time limit includes the
    build's."""
    limit = BUILD_TIMEOUT + float(config.getini("timeout") or 0)
    for item in items:
        if "compiled_tiny" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.timeout(limit))


@pytest.fixture(scope="session", autouse=True)
def worker_zygote() -> None:
    """The zygote the workers fork from lives as long as this process: started before any
    test counts its children (workers/zygote.py)."""
    zygote.ready()


@pytest.fixture(autouse=True)
def no_leaks() -> Iterator[None]:
    threads_before = set(threading.enumerate())
    children_before = child_pids() if sys.platform == "linux" else set()
    yield

    def leaks() -> tuple[list[threading.Thread], set[int]]:
        threads = [t for t in threading.enumerate() if t not in threads_before and t.is_alive()]
        children = (child_pids() - children_before) if sys.platform == "linux" else set()
        if zygote.pid() in children:  # a zygote that replaced a lost one, and its reader
            children.discard(zygote.pid() or 0)
            threads = [t for t in threads if t.name != zygote.READER]
        return threads, children

    try:
        wait_for(lambda: leaks() == ([], set()), 10, "threads and child processes to end")
    except AssertionError:
        raise AssertionError(f"test leaked threads / child processes: {leaks()!r}") from None


@pytest.fixture(scope="session")
def model_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder with tiny untrained models `tiny` (4 stems) and `tiny6` (6 stems), saved in
    demucs's local-repo format by the project's own code, in a subprocess (no torch here)."""
    folder = tmp_path_factory.mktemp("models")
    for args in (["--name", "tiny"], ["--name", "tiny6", "--six"]):
        subprocess.run(
            [sys.executable, "-m", "stemdeck_watch.workers.tinymodel", str(folder), *args],
            check=True,
            stdout=subprocess.DEVNULL,
        )
    return folder


@pytest.fixture(scope="session")
def recipe_repo(model_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model_repo folder for the recipe `best`: a tiny BS-RoFormer with random weights saved
    as the published `bs_roformer_viperx_1297` (its `.ckpt` and YAML under their published
    names), and `htdemucs_ft` as the tiny Demucs model (a bag of `tiny`)."""
    folder = tmp_path_factory.mktemp("recipe-models")
    shutil.copy(model_repo / "tiny.th", folder / "tiny.th")
    (folder / "htdemucs_ft.yaml").write_text("models: ['tiny']\n")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "stemdeck_watch.workers.tinymodel",
            str(folder),
            "--roformer",
            "bs_roformer_viperx_1297",
        ],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    return folder


@pytest.fixture(scope="session")
def compiled_tiny(model_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> BuiltCompile:
    """The tiny model's compiled form (float32, CPU), built and measured once per session as
    the service does it (tests/support/compiled.py): minutes of CPU, so shared, by every
    process of the session too."""
    return built_once(model_repo, tmp_path_factory)


@pytest.fixture
def make_settings(tmp_path: Path, model_repo: Path) -> Callable[..., Settings]:
    """Settings on temporary folders with the tiny model (see config_data)."""

    def make(**sections: dict[str, Any]) -> Settings:
        return settings_from_dict(
            config_data(tmp_path, model_repo, **sections), source=tmp_path / "stemdeck.toml"
        )

    return make


@pytest.fixture
def service_factory() -> Iterator[Callable[[Settings], tuple[Service, JobLog]]]:
    """Start real services (watcher, registry, worker process); all are shut down after."""
    started: list[Service] = []

    def start(settings: Settings) -> tuple[Service, JobLog]:
        bus = EventBus()
        jobs = JobLog(bus)
        service = Service(settings, bus=bus)
        service.start()
        started.append(service)
        return service, jobs

    yield start
    for service in started:
        service.shutdown()


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    """Default settings on temporary folders (created), for tests without a service."""
    data = default_toml()
    data["folders"] = {
        n: str(tmp_path / n) for n in ("inbox", "outbox", "processed", "failed", "state")
    }
    data["links"]["allow_private"] = True  # the media servers listen on 127.0.0.1
    settings = settings_from_dict(data)
    for folder in ("inbox", "outbox", "processed", "failed", "state"):
        getattr(settings.paths, folder).mkdir()
    return settings


@pytest.fixture
def faults(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The fault seam's folder, handed to every worker the test's services start."""
    folder = tmp_path / "faults"
    folder.mkdir()
    monkeypatch.setenv(FAULTS_ENV, str(folder))
    return folder
