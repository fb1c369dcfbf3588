"""The container image (Containerfile) run as a NAS runs it: its entrypoint with the volumes
bind-mounted from folders a non-root user owns, PUID/PGID/UMASK set, the tiny model in a
mounted folder (no network). A dropped song becomes stems owned by PUID:PGID with the
umask's modes; `health` answers 0 while it runs; a SIGTERM mid-song stops it within a
runtime's 10 s with the song back in the queue, and the next start publishes it once. With a
password in its environment the config keeps only its hash and the page listens on every
address over HTTPS: this machine gets the page, a request naming another host is refused, and
another address (a network namespace's, see tests/support/netns.py) gets the sign-in page and,
with the password, the queue page.

`make image-test` builds the image and runs this file (STEMDECK_IMAGE names the image);
`make test` skips it. It runs the image with `buildah run --isolation chroot`, which needs no
daemon and no runtime that sets resource limits. Two things of that isolation shape the test:
it shares the host's process IDs and network, so the SIGTERM goes to the service's own pid
as a runtime's stop does, and the page listens on this machine's addresses (the test gives it a
free port) (`buildah run` itself answers a SIGTERM by killing its child outright), and its
`-v` does not cover a folder the image declares a VOLUME, so the test's working container
has the declarations taken off (the runtime's own volumes are what `-v` replaces elsewhere).
Without buildah the test skips with the reason, except under CI=true, where it fails.
"""

from __future__ import annotations

import http.client
import os
import shutil
import signal
import subprocess
import time
import urllib.parse
from pathlib import Path
from typing import IO, Iterator

import pytest
import tomli_w

from stemdeck_watch.cli.container import container_config
from stemdeck_watch.core.config import load_settings
from stemdeck_watch.core.jobs import JobState
from stemdeck_watch.core.lock import running_pid
from stemdeck_watch.store.registry import REGISTRY_FILE, Registry
from stemdeck_watch.ui.web.tls import client_context, fingerprint
from stemdeck_watch.util.passwords import verify_password
from stemdeck_watch.util.synth import write_song

from support.helpers import wait_for
from support.netns import inside, private_link
from support.sshfs_share import free_port

IMAGE = os.environ.get("STEMDECK_IMAGE")
if not IMAGE:
    pytest.skip(
        "the image test runs in `make image-test`, which builds it", allow_module_level=True
    )
MISSING = [tool for tool in ("buildah", "mmdebstrap") if shutil.which(tool) is None]
MISSING += ["root (to own the volumes as another user)"] if os.geteuid() != 0 else []
MISSING += ["ip (apt-get install iproute2)"] if shutil.which("ip") is None else []
if MISSING and os.environ.get("CI") != "true":
    pytest.skip(
        f"needs {' and '.join(MISSING)} (apt-get install buildah mmdebstrap)",
        allow_module_level=True,
    )

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

PUID = PGID = 1234
UMASK = 0o002
VOLUMES = ("inbox", "outbox", "processed", "failed", "config", "models")
STOP_LIMIT = 10.0  # seconds a container runtime waits after SIGTERM before it kills
PASSWORD = "couch potato 42"


@pytest.fixture(scope="module")
def container() -> Iterator[str]:
    """A working container of the image, its VOLUME declarations taken off (see above)."""
    assert not MISSING, f"needs {' and '.join(MISSING)} (apt-get install buildah mmdebstrap)"
    made = subprocess.run(
        ["buildah", "from", "--quiet", f"{IMAGE}"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert made.returncode == 0, f"no image {IMAGE} (`make image` builds it): {made.stderr}"
    name = made.stdout.strip()
    try:
        for volume in VOLUMES:
            _buildah("config", "--volume", f"/{volume}-", name)
        yield name
    finally:
        _buildah("rm", name)


def _buildah(*args: str) -> None:
    subprocess.run(["buildah", *args], check=True, capture_output=True, timeout=120)


@pytest.fixture
def share(tmp_path: Path, model_repo: Path) -> Path:
    """The volumes' folders as a share's user has them (PUID:PGID), but `failed`, which the
    runtime made (root's: the entrypoint hands it over); the tiny model in `repo`; the
    config the owner wrote, pointing at the mounted model folder."""
    for name in (*VOLUMES, "repo", "faults"):
        (tmp_path / name).mkdir()
    shutil.copy(model_repo / "tiny.th", tmp_path / "repo")
    data = container_config()
    data["separation"].update(model="tiny", model_repo="/repo", device="cpu")
    data["watch"]["settle_seconds"] = 0.3
    data["output"]["beat_grid"] = False  # librosa's import: seconds the test need not wait
    data["api"]["port"] = free_port()  # the host's network: not a port something else holds
    (tmp_path / "config" / "stemdeck.toml").write_text(tomli_w.dumps(data))
    for path in [tmp_path, *tmp_path.rglob("*")]:
        if path.name != "failed":
            os.chown(path, PUID, PGID)
    return tmp_path


class Started:
    """The image's entrypoint running under `buildah run`, its output in a file."""

    def __init__(self, container: str, share: Path, log: Path, extra: dict[str, str]):
        mounts = [f"--volume={share / v}:/{v}" for v in VOLUMES]
        mounts += [f"--volume={share / 'repo'}:/repo:ro", f"--volume={share / 'faults'}:/faults"]
        env = {
            "PUID": PUID,
            "PGID": PGID,
            "UMASK": f"{UMASK:03o}",
            "TZ": "Europe/Berlin",
            "STEMDECK_WORKER_FAULTS": "/faults",  # workers/faultseam.py: `slow` holds songs
            "STEMDECK_ONEDNN": "0",  # the tiny model's first song in 0.4 s, not 2.5 s
            **extra,
        }
        self.share, self.log = share, log
        self._output: IO[bytes] = open(log, "ab")
        self.proc = subprocess.Popen(
            [
                "buildah",
                "run",
                "--isolation",
                "chroot",
                *mounts,
                *(f"--env={k}={v}" for k, v in env.items()),
                container,
                "--",
                "stemdeck-entrypoint",
            ],
            stdout=self._output,
            stderr=subprocess.STDOUT,
        )
        self.pid: int = wait_for(self._service, 120, self.said)

    def _service(self) -> int | None:
        assert self.proc.poll() is None, f"the container ended: {self.said()}"
        return running_pid(self.share / "config" / "state")

    def said(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]

    def stop(self) -> float:
        """SIGTERM to the service, as a runtime's stop sends it; seconds until it ended."""
        started = time.monotonic()
        os.kill(self.pid, signal.SIGTERM)
        try:
            code = self.proc.wait(timeout=STOP_LIMIT + 20)
        finally:
            self.close()
        assert code == 0, f"the service exited {code}: {self.said()}"
        return time.monotonic() - started

    def close(self) -> None:
        """Whatever happened, nothing left running: the service killed, `buildah run` reaped."""
        if self.proc.poll() is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
        self._output.close()


@pytest.fixture
def start(container: str, share: Path, tmp_path_factory) -> Iterator:
    log = tmp_path_factory.mktemp("log") / "container.log"
    runs: list[Started] = []

    def started(**extra: str) -> Started:
        runs.append(Started(container, share, log, extra))
        return runs[-1]

    yield started
    for run in runs:
        run.close()


def health(container: str, share: Path) -> subprocess.CompletedProcess[str]:
    """The image's health check, as the runtime runs it beside the service (`docker exec`)."""
    return entrypoint(container, share, "health")


def entrypoint(container: str, share: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`stemdeck-entrypoint ARGS` beside the service, as `docker exec` runs it."""
    return subprocess.run(
        [
            "buildah",
            "run",
            "--isolation",
            "chroot",
            f"--volume={share / 'config'}:/config",
            f"--env=PUID={PUID}",
            f"--env=PGID={PGID}",
            container,
            "--",
            "stemdeck-entrypoint",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )


def drop(share: Path, name: str, seconds: float, seed: int) -> None:
    """A song copied into the inbox by the share's user: written beside it, renamed in."""
    aside = share / name
    write_song(aside, seconds, seed=seed)
    os.chown(aside, PUID, PGID)
    aside.rename(share / "inbox" / name)


def songs(outbox: Path) -> list[str]:
    """The song folders in the outbox (not the service's hidden staging folder)."""
    return sorted(p.name for p in outbox.iterdir() if p.is_dir() and not p.name.startswith("."))


def jobs(share: Path) -> list:
    registry = Registry.open_readonly(share / "config" / "state" / REGISTRY_FILE)
    if registry is None:
        return []
    try:
        return registry.jobs()
    finally:
        registry.close()


def test_a_dropped_song_becomes_stems_the_shares_user_owns_with_the_umask(container, share, start):
    config = (share / "config" / "stemdeck.toml").read_bytes()
    running = start()
    assert health(container, share).returncode == 0
    # no password: the page on the container's loopback, and the log says how to set one
    assert "docker exec -it stemdeck stemdeck-entrypoint password" in running.said()
    assert "other devices" not in entrypoint(container, share, "status").stdout
    drop(share, "First Song.wav", 6, seed=1)
    folder = share / "outbox" / "First Song"
    wait_for(lambda: (share / "processed" / "First Song.wav").exists(), 120, running.said)
    checked = health(container, share)
    assert checked.returncode == 0, checked.stderr
    assert "healthy" in checked.stdout
    assert running.stop() < STOP_LIMIT
    assert health(container, share).returncode == 1  # stopped: unhealthy

    assert {"vocals.wav", "drums.wav", "bass.wav", "other.wav"} <= {
        p.name for p in folder.iterdir()
    }
    for volume in VOLUMES:
        for path in [share / volume, *(share / volume).rglob("*")]:
            info = path.lstat()
            assert (info.st_uid, info.st_gid) == (PUID, PGID), f"{path} is {info.st_uid}"
    made = [folder, *folder.iterdir(), share / "outbox" / "STATUS.txt"]
    for path in made:  # what the service made in a share: the umask's modes
        want = (0o777 if path.is_dir() else 0o666) & ~UMASK
        assert path.stat().st_mode & 0o777 == want, f"{path}: {path.stat().st_mode & 0o777:o}"
    assert (share / "config" / "stemdeck.toml").read_bytes() == config  # the owner's, kept
    assert "Traceback" not in running.said()


def test_a_sigterm_mid_song_requeues_it_and_the_next_start_publishes_it_once(
    container, share, start
):
    (share / "faults" / "slow").write_text("1")  # every segment a second longer
    running = start()
    drop(share, "Long Song.wav", 16, seed=2)
    wait_for(
        lambda: any(j.state == JobState.SEPARATING and j.progress > 0 for j in jobs(share)),
        120,
        running.said,
    )
    assert running.stop() < STOP_LIMIT
    [job] = jobs(share)
    assert job.state == JobState.QUEUED, running.said()
    assert (share / "inbox" / "Long Song.wav").exists()
    assert not songs(share / "outbox")

    (share / "faults" / "slow").unlink()
    again = start()
    wait_for(lambda: [j.state for j in jobs(share)] == [JobState.DONE], 120, again.said)
    assert again.stop() < STOP_LIMIT
    assert songs(share / "outbox") == ["Long Song"]
    assert [p.name for p in (share / "processed").iterdir()] == ["Long Song.wav"]
    assert not list((share / "failed").iterdir())


def ask(
    address: str,
    port: int,
    path: str,
    cert: Path,
    *,
    host: str = "",
    method: str = "GET",
    form: dict[str, str] | None = None,
    cookie: str = "",
) -> tuple[int, http.client.HTTPResponse, str]:
    """One HTTPS request to the page, trusting exactly its certificate: (status, the answer,
    its body)."""
    connection = http.client.HTTPSConnection(
        address, port, timeout=20, context=client_context(cert)
    )
    origin = f"{address}:{port}"
    headers = {"Host": host or origin, "Origin": f"https://{origin}"}
    body = None
    if form is not None:
        body = urllib.parse.urlencode(form).encode()
        headers["Content-Type"] = "application/x-www-form-urlencoded"
    if cookie:
        headers["Cookie"] = cookie
    try:
        connection.request(method, path, body=body, headers=headers)
        answer = connection.getresponse()
        return answer.status, answer, answer.read(1 << 20).decode("utf-8", "replace")
    finally:
        connection.close()


def test_with_a_password_the_page_signs_in_another_address_and_refuses_other_names(
    container, share, start
):
    config = share / "config" / "stemdeck.toml"
    with private_link() as (namespace, here, _device):
        running = start(PASSWORD=PASSWORD, STEMDECK_HOSTS="nas.example, 192.0.2.7")
        text = config.read_text()
        assert PASSWORD not in text  # only its hash
        api = load_settings(config).api
        assert (api.host, api.https, api.hosts) == ("0.0.0.0", True, ("nas.example", "192.0.2.7"))
        assert verify_password(PASSWORD, api.password_hash)
        cert = share / "config" / "state" / "tls" / "cert.pem"
        wait_for(lambda: (share / "config" / "state" / "api.json").exists(), 60, running.said)
        assert (
            fingerprint(cert)
            in (share / "config" / "state" / "logs").joinpath("stemdeck-watch.log").read_text()
        )
        assert health(container, share).returncode == 0  # the CLI's token, over HTTPS
        said = entrypoint(container, share, "status").stdout  # where the page is reached
        assert f"https://nas.example:{api.port}/ (other devices, signed in)" in said, said
        assert f"certificate SHA-256 {fingerprint(cert)}" in said

        # this machine (loopback): the page itself; another name than the service's: refused
        status, _, body = ask("127.0.0.1", api.port, "/", cert)
        assert status == 200 and 'id="password"' not in body, body[:300]
        status, _, _ = ask("127.0.0.1", api.port, "/", cert, host=f"evil.example:{api.port}")
        assert status == 403

        # another address: the sign-in page only, then the queue page with the password
        def as_another_device() -> list[tuple[int, str]]:
            seen = [ask(here, api.port, path, cert)[::2] for path in ("/", "/api/jobs", "/signin")]
            status, answer, _ = ask(
                here, api.port, "/signin", cert, method="POST", form={"password": PASSWORD}
            )
            cookie = (answer.getheader("Set-Cookie") or "").split(";")[0]
            seen.append((status, cookie))
            seen.append(ask(here, api.port, "/", cert, cookie=cookie)[::2])
            return seen

        seen = inside(namespace, as_another_device)
        (unsigned, _), (api_status, _), (signin, form), (signed, cookie), (page, body) = seen
        assert (unsigned, api_status, signin) == (303, 401, 200) and 'id="password"' in form
        assert signed == 303 and cookie.startswith("__Host-stemdeck-session=")
        assert page == 200 and 'id="password"' not in body
        assert running.stop() < STOP_LIMIT
    assert "Traceback" not in running.said()
