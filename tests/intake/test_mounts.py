"""Network filesystems are found in the mount table, and a refused native watch falls back to
polling. The mount table is fed in /proc/self/mounts format (the shares themselves cannot be
mounted here); the watch-limit failure is the real OSError the inotify observer raises."""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path

import pytest
from watchdog.observers import Observer

from stemdeck_watch.core.config import WatchSettings
from stemdeck_watch.intake import watcher
from stemdeck_watch.intake.watcher import choose_mode
from stemdeck_watch.core.paths import filesystem_type, is_network_filesystem
from stemdeck_watch.util.synth import write_song

from support.intake_harness import IntakeRig

SHARES = [  # (fstype, device, options) as each kind of share appears in /proc/self/mounts
    ("cifs", "//nas/music", "rw,relatime,vers=3.1.1,cache=strict,username=me"),
    ("smb3", "//nas/music", "rw,relatime,vers=3.0"),
    ("nfs", "nas:/volume1/music", "rw,relatime,vers=3,rsize=131072"),
    ("nfs4", "nas:/music", "rw,relatime,vers=4.2,rsize=1048576"),
    ("fuse.sshfs", "me@box:/srv/music", "rw,nosuid,nodev,relatime,user_id=1000"),
    ("fuse.rclone", "gdrive:", "rw,nosuid,nodev,relatime,user_id=1000"),
    ("9p", "drvfs", "rw,noatime,dirsync,aname=drvfs;path=C:\\;uid=1000"),
    ("drvfs", "C:\\134", "rw,noatime,uid=1000,gid=1000,case=off"),
]


def mount_table(tmp_path: Path, mount_point: Path, fstype: str, device: str, options: str) -> Path:
    """A mount table with the usual local mounts and one share at `mount_point`."""

    def escape(text: str) -> str:
        return text.replace(" ", "\\040")

    lines = [
        "sysfs /sys sysfs rw,nosuid,nodev,noexec,relatime 0 0",
        "proc /proc proc rw,nosuid,nodev,noexec,relatime 0 0",
        "/dev/sda1 / ext4 rw,relatime,errors=remount-ro 0 0",
        f"tmpfs {tmp_path} tmpfs rw,nosuid,nodev 0 0",
        f"{escape(device)} {escape(str(mount_point))} {fstype} {options} 0 0",
    ]
    table = tmp_path / "mounts"
    table.write_text("\n".join(lines) + "\n")
    return table


@pytest.mark.parametrize("fstype,device,options", SHARES, ids=[s[0] for s in SHARES])
def test_an_inbox_on_a_network_share_is_polled(tmp_path, fstype, device, options):
    share = tmp_path / "Music Share"
    inbox = share / "stemdeck" / "inbox"
    table = mount_table(tmp_path, share, fstype, device, options)
    assert filesystem_type(inbox, table) == fstype
    assert is_network_filesystem(inbox, table)
    mode, why = choose_mode(WatchSettings(), inbox, table)
    assert mode == "polling" and fstype in why
    # a folder beside the share is on the local filesystem: native events
    assert choose_mode(WatchSettings(), tmp_path / "local", table)[0] == "native"
    # the user's choice wins over detection
    assert choose_mode(WatchSettings(mode="native"), inbox, table) == (
        "native",
        "watch.mode = 'native'",
    )


def test_a_polled_share_still_finds_dropped_songs(make_settings, tmp_path):
    settings = make_settings(watch={"poll_interval": 0.2})
    share = tmp_path / "elsewhere"
    table = mount_table(tmp_path, settings.paths.inbox, "nfs4", "nas:/music", "rw,vers=4.2")
    with IntakeRig(settings, mount_table=table) as rig:
        assert rig.intake.mode == "polling"
        assert type(rig.intake._observer).__name__ == "PollingObserver"
        write_song(share / "a.wav", 0.5)
        os.rename(share / "a.wav", rig.inbox / "a.wav")
        [job] = rig.wait_jobs(1)
        assert job.name == "a"


class LimitedObserver(Observer):  # type: ignore[misc, valid-type]
    """The platform's native observer on a machine whose inotify watch limit is used up:
    adding the watch fails as inotify_add_watch does (ENOSPC)."""

    def start(self) -> None:
        raise OSError(errno.ENOSPC, "inotify watch limit reached")


def test_the_watch_limit_falls_back_to_polling_and_says_so(
    make_settings, monkeypatch, tmp_path, caplog
):
    monkeypatch.setattr(watcher, "Observer", LimitedObserver)
    settings = make_settings(watch={"mode": "native", "poll_interval": 0.2})
    with caplog.at_level(logging.WARNING, logger="stemdeck_watch.intake.watcher"):
        with IntakeRig(settings) as rig:
            assert rig.intake.mode == "polling"
            assert "inotify watch limit reached" in rig.intake.mode_reason
            write_song(tmp_path / "b.wav", 0.5)
            os.rename(tmp_path / "b.wav", rig.inbox / "b.wav")
            [job] = rig.wait_jobs(1)
            assert job.name == "b"
    assert any("polling every 0.2 s instead" in r.getMessage() for r in caplog.records)
