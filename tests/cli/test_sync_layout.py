"""`doctor` recognises an inbox inside a synced folder by the marks each client leaves, and
warns when outbox/ or processed/ are outside it."""

from __future__ import annotations

from pathlib import Path

import pytest

from stemdeck_watch.cli.doctor import check_sync_layout
from stemdeck_watch.intake.syncfolders import find_sync_folder, nextcloud_roots


def layout(make_settings, root: Path, inside: tuple[str, ...]):
    """Settings with the inbox under `root/StemDeck` and the named folders beside it; the
    others on the local disk."""
    local = root.parent / "local"
    folders = {
        name: str((root / "StemDeck" if name in inside else local) / name)
        for name in ("outbox", "processed", "failed")
    }
    folders["inbox"] = str(root / "StemDeck" / "inbox")
    return make_settings(folders=folders)


@pytest.mark.parametrize(
    "client,mark,is_dir",
    [
        ("Dropbox", ".dropbox.cache", True),
        ("Syncthing", ".stfolder", True),
        ("Resilio Sync", ".sync", True),
        ("Nextcloud", "._sync_0a1b2c3d4e5f.db", False),
        ("Nextcloud", ".sync_0a1b2c3d4e5f.db", False),
    ],
)
def test_marks_at_the_top_of_a_synced_folder(tmp_path, make_settings, client, mark, is_dir):
    root = tmp_path / "Sync"
    (root / "StemDeck" / "inbox").mkdir(parents=True)
    (root / mark).mkdir() if is_dir else (root / mark).write_bytes(b"")
    found = find_sync_folder(root / "StemDeck" / "inbox")
    assert found is not None and (found.client, found.root) == (client, root)

    warned = check_sync_layout(layout(make_settings, root, ("failed",)), [])
    assert warned.warning and client in warned.detail
    assert "outbox/" in warned.detail and "processed/" in warned.detail
    assert str(root) in warned.detail

    half = check_sync_layout(layout(make_settings, root, ("outbox",)), [])
    assert half.warning and "processed/" in half.detail and "outbox/" not in half.detail

    fine = check_sync_layout(layout(make_settings, root, ("outbox", "processed")), [])
    assert not fine.warning and client in fine.detail


@pytest.mark.parametrize(
    "client,root",
    [
        ("iCloud Drive", "Library/Mobile Documents/com~apple~CloudDocs"),
        ("OneDrive", "OneDrive - Contoso"),
        ("OneDrive", "Library/CloudStorage/OneDrive-Personal"),
        ("Google Drive", "Library/CloudStorage/GoogleDrive-me@example.com/My Drive"),
    ],
)
def test_well_known_sync_roots_by_name(tmp_path, client, root):
    inbox = tmp_path / root / "StemDeck" / "inbox"
    found = find_sync_folder(inbox)  # need not exist yet
    assert found is not None and found.client == client
    assert found.holds(tmp_path / root / "StemDeck" / "outbox")
    assert not found.holds(tmp_path / "elsewhere")


def test_nextcloud_folders_from_the_clients_config(tmp_path, make_settings):
    config = tmp_path / "config"
    config.mkdir()
    synced = tmp_path / "Cloud Files"
    (config / "nextcloud.cfg").write_text(
        "[General]\nclientVersion=3.14.1\n\n[Accounts]\n0\\Folders\\1\\ignoreHiddenFiles=false\n"
        f"0\\Folders\\1\\localPath={synced}/\n0\\Folders\\1\\paused=false\n"
    )
    roots = nextcloud_roots([config])
    assert roots == [synced]
    warned = check_sync_layout(
        layout(make_settings, synced, ()), [("Nextcloud", root) for root in roots]
    )
    assert warned.warning and "Nextcloud" in warned.detail


def test_a_local_inbox_is_not_a_sync_folder(tmp_path, make_settings):
    home = tmp_path / "home"
    (home / ".dropbox").mkdir(parents=True)  # Dropbox's own settings, not a synced folder
    (home / "StemDeck" / "inbox").mkdir(parents=True)
    assert find_sync_folder(home / "StemDeck" / "inbox") is None
    assert check_sync_layout(layout(make_settings, home, ()), []) is None
