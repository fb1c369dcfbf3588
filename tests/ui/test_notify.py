"""Notifications for real: apprise posting to a loopback HTTP receiver (`json://127.0.0.1:PORT/`),
bursts coalesced, a dead target (a closed port) that costs the publisher nothing and is logged
once per failure streak, bad URLs and event names as config errors, and the running service
announcing done and failed songs."""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
import time

import pytest

from stemdeck_watch.core.config import settings_from_dict
from stemdeck_watch.ui.desktop.notify import Channel, Note, Notifier, Target, check_urls
from stemdeck_watch.core.errors import ConfigError
from stemdeck_watch.core.events import (
    DiskLow,
    EventBus,
    JobChanged,
    JobsRestored,
    QueueDrained,
    QueueFull,
)
from stemdeck_watch.core.jobs import Job, JobKind, JobState
from stemdeck_watch.util.synth import write_song

from support.helpers import wait_for, write_config
from support.notify_receiver import Receiver, closed_port


def job(settings, name: str, state: JobState = JobState.DONE, **fields) -> Job:
    folders = settings.paths
    if state is JobState.DONE:
        fields.setdefault("output", str(folders.outbox / name))
        fields.setdefault("source", str(folders.processed / f"{name}.wav"))
    else:
        fields.setdefault("error", f"{name}.wav is not an audio or video file that can be read")
        fields.setdefault("source", str(folders.failed / f"{name}.wav"))
    return Job(
        id=f"id-{name}", name=name, kind=JobKind.FILE, state=state, rel_path=f"{name}.wav", **fields
    )


def notifier(
    settings, bus: EventBus, urls: list[str], window: float = 60.0, events: list[str] | None = None
) -> Notifier:
    data = {
        "folders": {
            k: str(getattr(settings.paths, k))
            for k in ("inbox", "outbox", "processed", "failed", "state")
        },
        "notify": {"urls": urls, **({"events": events} if events is not None else {})},
    }
    n = Notifier(bus, settings_from_dict(data), window=window)
    n.start()
    return n


def test_done_and_failed_name_the_song_the_folder_and_the_reason(settings):
    bus = EventBus()
    with Receiver() as receiver:
        n = notifier(settings, bus, [receiver.url])
        try:
            bus.publish(JobChanged(job(settings, "Blue Monday")))
            bus.publish(JobChanged(job(settings, "Broken", JobState.FAILED)))
            bus.publish(JobChanged(job(settings, "Blue Monday")))  # a later update: not again
            bus.publish(QueueFull("file", 20))
            bus.publish(JobsRestored(3, paused=True))
            bus.publish(DiskLow(str(settings.paths.outbox), 200 * 1024 * 1024))
            got = receiver.wait(5)
        finally:
            n.stop()
    done, failed, full, restored, disk = got[:5]
    assert done["title"] == "Stems ready: Blue Monday" and done["type"] == "success"
    assert str(settings.paths.outbox / "Blue Monday") in done["message"]
    assert failed["title"] == "Failed: Broken" and failed["type"] == "failure"
    assert "is not an audio or video file that can be read" in failed["message"]
    assert str(settings.paths.failed / "Broken.wav.error.txt") in failed["message"]
    assert "20 songs are queued" in full["message"]
    assert "3 job(s)" in restored["message"] and "wait for Start" in restored["message"]
    assert "200.0 MB" in disk["message"] and disk["type"] == "warning"
    assert len(receiver.snapshot()) == 5


def test_a_song_name_never_becomes_markup_in_an_html_or_markdown_target(settings):
    """A file's name is anyone's text: in an HTML email or a Markdown chat it must read as the
    name, never as a link or an image (the target's format set as a user sets it in its URL)."""
    name = '<a href="https://evil.example/">READY, click</a><img src="https://t.example/p.gif">'
    with Receiver() as receiver:
        for form in ("html", "markdown"):
            target = Target(f"{receiver.url}?format={form}")
            assert target.send(Note("done", "Stems ready", f"{name} is separated")) == (True, "")
        html, markdown = (m["message"] for m in receiver.wait(2))
    assert "<a" not in html and "<img" not in html and "&lt;a" in html, html
    assert 'href="' not in markdown and 'src="' not in markdown, markdown


def test_only_the_chosen_events_notify(settings):
    bus = EventBus()
    with Receiver() as receiver:
        n = notifier(settings, bus, [receiver.url], events=["failed"])
        try:
            bus.publish(JobChanged(job(settings, "fine")))
            bus.publish(JobChanged(job(settings, "bad", JobState.FAILED)))
            assert [m["title"] for m in receiver.wait(1)] == ["Failed: bad"]
            bus.publish(QueueDrained())  # a batch of two, but queue_drained was not chosen
        finally:
            n.stop()
    assert len(receiver.snapshot()) == 1


def test_a_burst_of_fifty_songs_is_one_message_that_counts_them(settings):
    """The first song is announced at once; the other 49, done within the minute, become one
    message — sent before "queue finished" when the queue drains."""
    bus = EventBus()
    with Receiver() as receiver:
        n = notifier(settings, bus, [receiver.url])
        try:
            for i in range(50):
                bus.publish(JobChanged(job(settings, f"song {i:02d}")))
            assert receiver.wait(1)[0]["title"] == "Stems ready: song 00"
            bus.publish(QueueDrained())
            first, burst, drained = receiver.wait(3)
        finally:
            n.stop()
    assert burst["title"] == "Stems ready: 49 more songs"
    assert burst["message"].startswith("49 more songs are separated: song 01, song 02")
    assert "and 44 more" in burst["message"] and str(settings.paths.outbox) in burst["message"]
    assert drained["title"] == "Queue finished"
    assert drained["message"].startswith("50 songs separated")
    assert len(receiver.snapshot()) == 3


def test_held_messages_go_out_when_the_window_ends(settings):
    bus = EventBus()
    with Receiver() as receiver:
        n = notifier(settings, bus, [receiver.url], window=0.3)
        try:
            started = time.monotonic()
            for name in ("a", "b", "c"):
                bus.publish(JobChanged(job(settings, name, JobState.FAILED)))
            first, rest = receiver.wait(2)
        finally:
            n.stop()
    assert first["title"] == "Failed: a"
    assert rest["title"] == "Failed: 2 more songs" and "b: b.wav is not" in rest["message"]
    assert rest["received_at"] - started >= 0.3 - 0.05


def test_a_dead_target_costs_the_publisher_nothing_and_is_logged_once(settings, caplog):
    """A closed port next to a live receiver: every publish returns at once, the live target
    gets every message, the dead one is logged once for its whole failure streak, and once
    something listens there again, "works again" is logged."""
    caplog.set_level(logging.INFO, "stemdeck_watch.ui.desktop.notify")
    port = closed_port()
    dead = f"json://127.0.0.1:{port}/"
    bus = EventBus()
    with Receiver() as receiver:
        n = notifier(settings, bus, [dead, receiver.url], window=0.0)
        try:
            costs = []
            for i in range(20):
                started = time.perf_counter()
                bus.publish(JobChanged(job(settings, f"song {i}")))
                costs.append(time.perf_counter() - started)
            receiver.wait(20)
            channel = next(c for c in n.channels if str(port) in c.target.label)
            wait_for(lambda: channel.failed == 20, 10, "20 failed sends to the dead target")
            warnings = [
                r
                for r in caplog.records
                if r.levelno == logging.WARNING and r.name.startswith("stemdeck_watch")
            ]
            assert len(warnings) == 1 and f"127.0.0.1:{port}" in warnings[0].getMessage()
            assert "Connection error" in warnings[0].getMessage()
            with Receiver(port) as revived:
                bus.publish(JobChanged(job(settings, "after")))
                revived.wait(1)
                wait_for(
                    lambda: any(
                        "work again (20 failed meanwhile)" in r.getMessage() for r in caplog.records
                    ),
                    5,
                    "the 'works again' line",
                )
        finally:
            n.stop()
    # the listener only composes and hands over: far below a millisecond per event
    assert max(costs) < 0.05 and sum(costs) < 0.1, costs
    # apprise's own line for every failed send stays out of the service's log
    assert logging.getLogger("apprise").propagate is False


def test_bad_urls_and_event_names_are_config_errors(tmp_path, model_repo):
    with pytest.raises(ConfigError) as info:
        settings_from_dict({"notify": {"events": ["done", "finished"]}})
    message = str(info.value)
    assert 'notify.events = ["done", "finished"]' in message.replace("'", '"')
    for valid in ("done", "failed", "queue_drained", "queue_full", "restored", "disk_low"):
        assert f'"{valid}"' in message
    assert 'unknown: "finished"' in message
    with pytest.raises(ConfigError, match='not a URL: "desktp"'):
        settings_from_dict({"notify": {"urls": ["desktp"]}})
    bad = settings_from_dict({"notify": {"urls": ["desktop", "nosuchservice://x/y"]}})
    with pytest.raises(
        ConfigError, match="notify.urls: 'nosuchservice://x/y' is not a URL apprise can use"
    ):
        check_urls(bad.notify)
    check_urls(settings_from_dict({"notify": {"urls": ["json://127.0.0.1:9/", "desktop"]}}).notify)
    # `run` refuses it before anything starts: exit 2, the key and the URL named
    config = write_config(tmp_path, model_repo, notify={"urls": ["json://"]})
    result = subprocess.run(
        [sys.executable, "-m", "stemdeck_watch", "--config", str(config), "run", "--no-tray"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2, result.stderr
    assert "configuration error: notify.urls: 'json://'" in result.stderr
    assert not (tmp_path / "state" / "registry.sqlite3").exists()


def test_a_bad_notify_url_is_reported_without_its_password(settings, tmp_path, model_repo, caplog):
    secrets = ("hunter2", "s3cret", "Abc123Def456Ghi789", "pw0rd")
    bad = "nosuchservice://admin:s3cret@example.invalid/x?token=Abc123Def456Ghi789&mode=a"
    good = "json://user:hunter2@127.0.0.1:9/"
    # `run` refuses it before anything starts: the entry is named, its secrets are not
    config = write_config(tmp_path, model_repo, notify={"urls": [good, bad]})
    result = subprocess.run(
        [sys.executable, "-m", "stemdeck_watch", "--config", str(config), "run", "--no-tray"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2, result.stderr
    assert (
        "configuration error: notify.urls: 'nosuchservice://admin:***@example.invalid/x?"
        "token=***&mode=a' is not a URL apprise can use"
    ) in result.stderr
    # a value the configuration refuses (no scheme) is shown with the list it is in
    with pytest.raises(ConfigError) as info:
        settings_from_dict({"notify": {"urls": [good, "mailto:me:pw0rd@example.org"]}})
    assert "json://user:***@127.0.0.1:9/" in str(info.value)
    assert "mailto:me:***@example.org" in str(info.value)
    # an entry refused at run time is logged, never fatal, and never with its password
    with caplog.at_level(logging.INFO, logger="stemdeck_watch"):
        n = notifier(settings, EventBus(), [bad, "json://127.0.0.1:9/"])
        try:
            assert [c.target.label for c in n.channels] == ["json://127.0.0.1:9/"]
        finally:
            n.stop()
    logged = caplog.text
    assert "nosuchservice://admin:***@example.invalid" in logged
    for secret in secrets:
        assert secret not in result.stderr + str(info.value) + logged, secret


def test_a_target_apprise_refuses_at_run_time_is_never_fatal(settings):
    channel = Channel(Target("json://127.0.0.1:9/"), window=0)
    assert channel.target.label == "json://127.0.0.1:9/"
    with pytest.raises(ValueError, match="apprise cannot use"):
        Target("json://")


@pytest.mark.slow
def test_the_service_announces_done_and_failed_songs(make_settings, service_factory, tmp_path):
    """The running service, a live receiver and a dead target: a good song's notification
    names it and its outbox folder, a broken file's names the reason and its error file, and
    after the two, the queue's end is announced; the dead target holds nothing up."""
    with Receiver() as receiver:
        dead = f"json://127.0.0.1:{closed_port()}/"
        settings = make_settings(notify={"urls": [dead, receiver.url]})
        service, jobs = service_factory(settings)
        inbox = settings.paths.inbox
        # bytes no demuxer takes: random ones are now and then probed as a subtitle stream
        (inbox / "broken.wav").write_bytes(b"not audio at all" * 1250)
        shutil.copy(write_song(tmp_path / "Good Song.flac", 2.0), inbox / "Good Song.flac")
        finished = {j.name: j for j in jobs.wait_final(2)}
        got = receiver.wait(3, timeout=30)
        service.shutdown()
    titles = {m["title"]: m for m in got}
    done = titles["Stems ready: Good Song"]
    assert finished["Good Song"].output and finished["Good Song"].output in done["message"]
    failed = titles["Failed: broken"]
    report = settings.paths.failed / "broken.wav.error.txt"
    assert report.is_file() and str(report) in failed["message"]
    assert "not an audio or video file" in failed["message"]
    assert titles["Queue finished"]["message"].startswith("1 song separated, 1 failed")
    assert got[-1]["title"] == "Queue finished"
