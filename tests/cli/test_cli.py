"""The commands as a user types them: run (stopped with Ctrl-C, or killed), status, doctor, demo."""

from __future__ import annotations

import json
import os
import re
import signal
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from stemdeck_watch.util.synth import write_song

from support.helpers import outbox_entries, wait_for, write_config

SR = 44100


@pytest.fixture
def config(tmp_path: Path, model_repo: Path) -> Path:
    return write_config(tmp_path, model_repo)


def cli(config: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "stemdeck_watch", "--config", str(config), *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def status(config: Path) -> dict[str, Any]:
    result = cli(config, "status", "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


class RunningService:
    def __init__(self, config: Path):
        self.log = open(config.parent / f"run-{os.urandom(3).hex()}.log", "w+")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "stemdeck_watch", "--config", str(config), "run", "--no-tray"],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        self.state = config.parent / "state"

    def worker_pids(self) -> list[int]:
        log = (self.state / "logs" / "stemdeck-watch.log").read_text()
        return [int(p) for p in re.findall(r"started separation worker (\d+)", log)]

    def stop(self, sig: int = signal.SIGINT, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        code = self.proc.wait(timeout)
        self.log.close()
        return code


def gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def separating(config: Path) -> dict[str, Any] | None:
    running = status(config)["running"]
    return running if running and running["state"] == "separating" else None


@pytest.mark.slow
def test_ctrl_c_mid_job_leaves_no_partial_song_and_the_job_resumes(config: Path, tmp_path: Path):
    inbox, outbox = tmp_path / "inbox", tmp_path / "outbox"
    service = RunningService(config)
    try:
        long_song = write_song(tmp_path / "long.wav", 60.0)
        wait_for(inbox.is_dir, 60, "the service to make its inbox")
        os.replace(long_song, inbox / "long.wav")
        job = wait_for(lambda: separating(config), 90, "the job to start separating")
        worker = service.worker_pids()[-1]
        assert service.stop(signal.SIGINT) == 0
    finally:
        if service.proc.poll() is None:
            service.proc.kill()
            service.proc.wait()
    assert outbox_entries(outbox) == set()  # not even the hidden staging folder
    assert (inbox / "long.wav").exists()
    wait_for(lambda: gone(worker), 10, "the worker to exit")
    after = status(config)
    assert after["service"]["running"] is False
    assert [j["id"] for j in after["queued"]] == [job["id"]]
    assert after["queued"][0]["state"] == "queued"


@pytest.mark.slow
def test_a_killed_service_restores_its_job_paused_until_a_new_file_arrives(config, tmp_path):
    inbox, outbox = tmp_path / "inbox", tmp_path / "outbox"
    first = RunningService(config)
    try:
        song = write_song(tmp_path / "long.wav", 25.0)
        wait_for(inbox.is_dir, 60, "the service to make its inbox")
        os.replace(song, inbox / "long.wav")
        job = wait_for(lambda: separating(config), 90, "the job to start separating")
        worker = first.worker_pids()[-1]
        first.stop(signal.SIGKILL)  # power cut, OOM killer, kill -9
    finally:
        if first.proc.poll() is None:
            first.proc.kill()
            first.proc.wait()
    wait_for(lambda: gone(worker), 10, "the orphaned worker to exit on its own")
    second = RunningService(config)
    try:
        restored = wait_for(
            lambda: (
                (s := status(config))["service"]["running"] and s["pause_reason"] == "restore" and s
            ),
            60,
            "the restore pause",
        )
        assert [j["id"] for j in restored["queued"]] == [job["id"]]
        assert not list(outbox.glob("long*"))  # the partial result is gone
        os.replace(write_song(tmp_path / "short.wav", 2.0), inbox / "short.wav")
        wait_for(
            lambda: (
                {j["name"]: j["state"] for j in status(config)["jobs"]}
                == {"long": "done", "short": "done"}
            ),
            180,
            "both songs separated",
        )
        assert (outbox / "long" / "vocals.wav").is_file()
    finally:
        assert second.stop(signal.SIGTERM) == 0


def test_status_is_fast_and_never_imports_torch(config: Path) -> None:
    code = (
        "import sys, time; t = time.monotonic(); from stemdeck_watch.cli.main import main; "
        f"rc = main(['--config', {str(config)!r}, 'status']); "
        "assert rc == 0, rc; "
        "heavy = [m for m in ('torch', 'demucs', 'av', 'numpy') if m in sys.modules]; "
        "assert not heavy, heavy; print(time.monotonic() - t)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "service: stopped" in result.stdout


def test_status_json_has_the_documented_shape(config: Path) -> None:
    data = status(config)
    assert {"paused", "pause_reason", "running", "queued", "waiting", "jobs"} <= set(data)
    assert data["paused"] is False and data["running"] is None and data["jobs"] == []


@pytest.mark.slow
def test_doctor_checks_everything_and_fails_on_a_missing_model(config: Path, tmp_path: Path):
    result = cli(config, "doctor")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "[ok  ] model tiny" in result.stdout and "watcher: native" in result.stdout
    assert "decoding: PyAV" in result.stdout
    config.write_text(config.read_text().replace('model = "tiny"', 'model = "missing"'))
    result = cli(config, "doctor")
    assert result.returncode == 1
    assert "[FAIL] model missing" in result.stdout and "separation.model_repo" in result.stdout


@pytest.mark.slow
def test_demo_runs_offline_and_reports_where_the_stems_are(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "stemdeck_watch", "demo", "--dir", str(tmp_path / "demo")],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    for name in ("demo-song-1", "demo-song-2"):
        assert f"{name} → {tmp_path / 'demo' / 'outbox' / name}" in result.stdout
        assert (tmp_path / "demo" / "outbox" / name / "vocals.wav").is_file()
    assert "never been trained" in result.stdout and "htdemucs" in result.stdout


@pytest.mark.slow
@pytest.mark.skipif(sys.platform == "win32", reason="POSIX modes")
def test_the_state_folder_registry_and_log_are_private_even_under_umask_022(config, tmp_path):
    """The history names every song and link (URLs may carry share tokens): nobody else on
    the machine reads it, however permissive the umask, also when an older version left
    world-readable files behind."""
    state = tmp_path / "state"
    (state / "logs").mkdir(parents=True, mode=0o755)
    state.chmod(0o755)
    old_log = state / "logs" / "stemdeck-watch.log.1"  # a rotated log from before
    old_log.write_text("2024-01-01 INFO an old line\n")
    old_log.chmod(0o644)
    log = open(tmp_path / "run.log", "w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "stemdeck_watch", "--config", str(config), "run", "--no-tray"],
        stdout=log,
        stderr=subprocess.STDOUT,
        umask=0o022,
    )
    try:
        wait_for(lambda: (state / "api.json").is_file(), 90, "the service to start")
        modes = {
            path.relative_to(state).as_posix(): stat.S_IMODE(path.stat().st_mode)
            for path in [state, *state.rglob("*")]
        }
        assert modes["."] == 0o700 and modes["logs"] == 0o700, modes
        for name in (
            "registry.sqlite3",
            "registry.sqlite3-wal",
            "logs/stemdeck-watch.log",
            "logs/stemdeck-watch.log.1",
            "api.token",
            "service.lock",
        ):
            assert modes.get(name) == 0o600, (name, modes)
        assert not [name for name, mode in modes.items() if mode & 0o077 and name != "api.json"]
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
        log.close()
