"""Two computers, one synced inbox: the heartbeat in inbox/.stemdeck/ decides who separates.

Another machine is imitated the way the sync client would show it here: its heartbeat file,
written with its host name, its service id and a recent time. Staleness comes from an
injected clock, never from sleeping minutes.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from stemdeck_watch.intake.ownership import FOLDER, InboxOwned, InboxOwnership, read_heartbeats
from stemdeck_watch.service import Service
from stemdeck_watch.util.synth import write_song

from support.helpers import wait_for


class Clock:
    """Wall time plus an offset the test moves forward."""

    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.time() + self.offset


def other_machine(
    inbox: Path,
    *,
    updated: float,
    host: str = "studio-mac",
    service_id: str = "a1b2c3d4e5f6",
    pid: int = 4242,
) -> Path:
    """The heartbeat another computer's service left in the synced inbox."""
    folder = inbox / FOLDER
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"owner-{service_id}.json"
    path.write_text(
        json.dumps(
            {
                "host": host,
                "service_id": service_id,
                "pid": pid,
                "started": updated - 600,
                "updated": updated,
            }
        )
    )
    return path


def test_a_live_owner_elsewhere_makes_the_service_refuse_and_say_who(make_settings):
    settings = make_settings(api={"enabled": False})
    other_machine(settings.paths.inbox, updated=time.time() - 20)
    service = Service(settings)
    with pytest.raises(InboxOwned) as refused:
        service.start()
    message = str(refused.value)
    assert "studio-mac" in message and "a1b2c3d4e5f6" in message and "watch.standby" in message
    assert not service._started
    # nothing was claimed: the other machine's heartbeat is the only one
    assert [b.host for b in read_heartbeats(settings.paths.inbox / FOLDER)] == ["studio-mac"]


def test_stale_dead_and_unreadable_heartbeats_are_no_owner(tmp_path):
    inbox = tmp_path / "inbox"
    now = time.time()
    other_machine(inbox, updated=now - 181, service_id="stale")  # too old
    crashed = other_machine(
        inbox,
        updated=now,
        host="me",
        service_id="crashed",  # this host,
        pid=2**22 + 7,
    )  # gone
    (inbox / FOLDER / "owner-half.json").write_text('{"host": "x", "serv')  # half synced
    ownership = InboxOwnership(inbox, host="me", service_id="mine")
    assert ownership.live_owners() == []
    assert ownership.claim()
    [mine] = [b for b in read_heartbeats(inbox / FOLDER) if b.service_id == "mine"]
    assert mine.host == "me" and abs(mine.updated - now) < 60
    assert not crashed.exists()  # a crashed run's heartbeat on this computer is cleaned up
    ownership.stop()
    assert not mine.path.exists()


def test_standby_waits_for_the_owner_to_go_stale_then_takes_over(make_settings):
    settings = make_settings(api={"enabled": False}, watch={"standby": True})
    inbox = settings.paths.inbox
    clock = Clock()
    theirs = other_machine(inbox, updated=time.time())
    write_song(inbox / "dropped meanwhile.wav", 1.0)
    service = Service(settings, clock=clock)
    stop = threading.Event()
    starter = threading.Thread(target=service.start, args=(stop,))
    starter.start()
    try:
        wait_for(lambda: service.ownership is not None, 30, "the standby service to look")
        assert not service._started
        assert [b.service_id for b in read_heartbeats(inbox / FOLDER)] == ["a1b2c3d4e5f6"]
        clock.offset = 200.0  # the other machine has not beaten for over three minutes
        starter.join(60)
        assert service._started
        hosts = {b.service_id: b.host for b in read_heartbeats(inbox / FOLDER)}
        assert hosts[service.ownership.service_id] != "studio-mac" and theirs.exists()
        wait_for(lambda: service.registry.jobs(), 30, "the song dropped meanwhile to be seen")
    finally:
        stop.set()
        starter.join(60)
        service.shutdown()


@pytest.mark.slow
def test_two_services_on_one_inbox_one_refuses_then_the_standby_takes_over(make_settings, tmp_path):
    first_settings = make_settings(api={"enabled": False})
    second_settings = make_settings(
        api={"enabled": False}, folders={"state": str(tmp_path / "state-2")}
    )
    first = Service(first_settings)
    first.start()
    second = Service(second_settings)
    standby = Service(
        make_settings(
            api={"enabled": False},
            watch={"standby": True},
            folders={"state": str(tmp_path / "state-3")},
        )
    )
    stop = threading.Event()
    starter = threading.Thread(target=standby.start, args=(stop,))
    try:
        with pytest.raises(InboxOwned) as refused:
            second.start()
        assert first.ownership.service_id in str(refused.value)
        starter.start()
        wait_for(lambda: standby.ownership is not None, 30, "the standby service to look")
        assert not standby._started
        first.shutdown()  # a clean stop removes the heartbeat: no need to wait for staleness
        starter.join(60)
        assert standby._started
        write_song(first_settings.paths.inbox / "after.wav", 1.0)
        wait_for(lambda: standby.registry.jobs(), 30, "the new owner to take the song")
    finally:
        stop.set()
        if starter.is_alive() or starter.ident is not None:
            starter.join(60)
        first.shutdown()
        standby.shutdown()
