"""The queue page in a real headless browser against the real service (API, scheduler, worker).

Each test starts its own Chromium (about a second) after its own service, and quits it before
the service stops. Set STEMDECK_SCREENSHOTS=/some/dir to keep screenshots of the page at
desktop and phone size.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from support import browser as chrome
from stemdeck_watch.core.jobs import JobState
from stemdeck_watch.util.synth import write_song

from support.behind import publishing_behind
from support.helpers import outbox_entries, wait_for

REASON = chrome.missing()
if REASON and os.environ.get("CI") != "true":
    pytest.skip(REASON, allow_module_level=True)

try:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
except ImportError:  # only under CI=true: every test then fails in chrome.require() with why
    By = Keys = None  # type: ignore[assignment,misc]

pytestmark = pytest.mark.slow

# What the page shows, read in one call: the tests compare it with the live service.
PAGE_STATE = """
const text = (sel) => { const el = document.querySelector(sel); return el ? el.textContent : null; };
const visible = (sel) => { const el = document.querySelector(sel); return !!el && !el.closest('[hidden]'); };
const running = document.getElementById('running');
return {
  connection: document.getElementById('connection').dataset.state,
  toggle: document.getElementById('pause-toggle').dataset.action,
  toggleText: text('#pause-toggle'),
  reason: visible('#pause-reason') ? text('#pause-reason') : null,
  queue: [...document.querySelectorAll('#queue > li[data-job-id]')].map(li => li.dataset.jobId),
  names: [...document.querySelectorAll('#queue > li .name')].map(el => el.textContent),
  running: running.hidden ? null : running.dataset.jobId,
  runningState: running.hidden ? null : running.dataset.state,
  stage: running.hidden ? null : text('#running-stage'),
  progress: Number(document.getElementById('running-progress').value),
  also: visible('#also') ? [...document.querySelectorAll('#also > li[data-job-id]')]
    .map(li => [li.dataset.jobId, li.dataset.state]) : [],
  recent: Object.fromEntries([...document.querySelectorAll('#recent > li[data-job-id]')]
    .map(li => [li.dataset.jobId, [li.dataset.state, li.querySelector('.detail').textContent]])),
  waiting: visible('#waiting') ? Number(document.getElementById('waiting').dataset.count) : 0,
  notices: [...document.querySelectorAll('#notices .notice-text')].map(el => el.textContent),
  help: visible('#no-token') ? text('#no-token') : null,
  hash: location.hash,
};
"""


def page(driver: Any) -> dict[str, Any]:
    return driver.execute_script(PAGE_STATE)


def wait_page(
    driver: Any, predicate: Callable[[dict[str, Any]], Any], what: str, timeout: float = 20.0
) -> dict[str, Any]:
    """Wait until the page's state satisfies `predicate`; returns that state."""
    seen: dict[str, Any] = {}

    def check() -> Any:
        seen.update(page(driver))
        return predicate(seen) and dict(seen)

    try:
        return wait_for(check, timeout, what)
    except AssertionError as exc:
        raise AssertionError(f"{exc}; the page shows {seen}") from None


def page_url(service: Any, token: str | None = None) -> str:
    assert service.api is not None, "the service's local API did not start"
    return service.api.url + (f"#token={token}" if token else "")


def token_of(service: Any) -> str:
    return (service.settings.paths.state / "api.token").read_text().strip()


def open_page(driver: Any, service: Any) -> dict[str, Any]:
    """Open the page as `stemdeck-watch open` and the tray do (a one-time code in the
    address, traded for the token) and wait for the first frame."""
    driver.get(service.api.page_url())
    return wait_page(driver, lambda p: p["connection"] == "live", "the page to go live")


def click(driver: Any, selector: str) -> None:
    driver.find_element(By.CSS_SELECTOR, selector).click()


def screenshot(driver: Any, name: str) -> None:
    folder = os.environ.get("STEMDECK_SCREENSHOTS")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(str(Path(folder) / f"{name}.png"))


@pytest.fixture
def driver(tmp_path: Path, service_factory: Any) -> Iterator[Any]:
    """A headless Chromium. Depends on service_factory so that it quits before the services
    stop (a page still streaming from a stopping service would only reconnect in vain)."""
    with chrome.chromium(tmp_path / "chromium") as instance:
        yield instance
        errors = chrome.page_errors(instance)
        assert not errors, f"the page logged errors: {errors}"


@pytest.fixture
def start(make_settings: Any, service_factory: Any, tmp_path: Path) -> Callable[..., Any]:
    """start(paused=…, **settings sections) → a running service, paused by the user if asked
    (before any song arrives, so songs stay queued in the order they were dropped)."""

    def run(paused: bool = False, **sections: Any) -> Any:
        service, _jobs = service_factory(make_settings(**sections))
        if paused:
            service.scheduler.pause()
        return service

    return run


def drop(service: Any, name: str, seconds: float = 1.0, seed: int = 0, suffix: str = ".wav") -> str:
    """Write a song beside the inbox, move it in whole, and wait until it is a job; its id."""
    inbox = service.settings.paths.inbox
    staging = inbox.parent / "staging"
    staging.mkdir(exist_ok=True)
    path = write_song(staging / f"{name}{suffix}", seconds, seed=seed)
    os.replace(path, inbox / path.name)
    return wait_for(lambda: job_for(service, inbox / path.name), 20, f"{name} to be queued")


def job_for(service: Any, source: Path) -> str | None:
    job = service.registry.latest_for_source(str(source))
    return job.id if job is not None else None


def state_of(service: Any, job_id: str) -> JobState:
    return service.registry.get(job_id).state


# ------------------------------------------------------------------ tests


def test_the_queue_appears_live_in_order_and_the_token_leaves_the_address(start, driver):
    service = start(paused=True)
    shown = open_page(driver, service)
    assert shown["hash"] == "", "the token must leave the visible address"
    assert shown["queue"] == [] and shown["toggle"] == "start"
    assert shown["reason"] == "Paused by you."

    ids = [drop(service, name, seed=i) for i, name in enumerate(["alpha", "bravo", "charlie"])]
    assert service.queue.order() == ids
    shown = wait_page(driver, lambda p: p["queue"] == ids, "the three songs on the page")
    assert shown["names"] == ["alpha", "bravo", "charlie"]
    assert shown["running"] is None and shown["waiting"] == 0

    driver.refresh()  # the token was kept for this tab: a reload works without it in the URL
    shown = wait_page(
        driver,
        lambda p: p["connection"] == "live" and p["queue"] == ids,
        "the page to come back after a reload",
    )
    assert shown["hash"] == ""
    screenshot(driver, "queue-desktop")


def test_the_progress_bar_moves_while_a_song_separates_and_cancel_stops_it(start, driver):
    service = start()
    open_page(driver, service)
    job = drop(service, "long song", seconds=40.0)
    first = wait_page(
        driver,
        lambda p: p["running"] == job and p["runningState"] == "separating" and p["progress"] > 0,
        "the song to separate on the page",
        timeout=60,
    )
    assert first["stage"].startswith("Separating")
    later = wait_page(
        driver,
        lambda p: p["progress"] > first["progress"] + 0.02,
        "the progress bar to move",
        timeout=30,
    )
    assert later["running"] == job
    assert state_of(service, job) is JobState.SEPARATING
    screenshot(driver, "running-desktop")

    click(driver, "#running-cancel")
    wait_for(lambda: state_of(service, job) is JobState.CANCELLED, 10, "the song to be cancelled")
    wait_page(
        driver,
        lambda p: p["running"] is None and p["recent"].get(job, [None])[0] == "cancelled",
        "the cancelled song under Recent",
    )
    assert (service.settings.paths.inbox / "long song.wav").exists()
    assert not outbox_entries(service.settings.paths.outbox), "a cancelled song has no output"


def test_a_song_publishing_behind_is_listed_under_the_running_one_and_can_be_cancelled(
    request, make_settings, service_factory, monkeypatch, driver
):
    service, jobs, a, b, held, separating = publishing_behind(
        request, make_settings, service_factory, monkeypatch
    )
    open_page(driver, service)
    wait_page(
        driver,
        lambda p: p["running"] == b and p["also"] == [[a, "publishing"]],
        "a listed as publishing under b",
    )
    click(driver, f'#also li[data-job-id="{a}"] [data-action="cancel"]')
    wait_for(lambda: jobs.latest[a].state is JobState.CANCELLED, 30, "a cancelled from the page")
    wait_page(driver, lambda p: p["also"] == [], "a gone from under b")
    held.open()
    separating.open()


def test_pause_and_start_steer_the_live_service(start, driver):
    service = start()
    shown = open_page(driver, service)
    assert shown["toggle"] == "pause" and shown["reason"] is None

    click(driver, "#pause-toggle")
    wait_for(lambda: service.queue.paused, 10, "the service to pause")
    assert service.queue.pause_reason == "user"
    shown = wait_page(driver, lambda p: p["toggle"] == "start", "the button to say Start")
    assert shown["toggleText"] == "Start" and shown["reason"] == "Paused by you."
    # the button kept the keyboard focus through the re-render: Enter presses it again
    assert driver.switch_to.active_element.get_attribute("id") == "pause-toggle"

    driver.switch_to.active_element.send_keys(Keys.ENTER)
    wait_for(lambda: not service.queue.paused, 10, "the service to start")
    shown = wait_page(driver, lambda p: p["toggle"] == "pause", "the button to say Pause")
    assert shown["toggleText"] == "Pause" and shown["reason"] is None


def test_cancel_really_cancels_and_retry_queues_the_song_again(start, driver):
    service = start(paused=True)
    first = drop(service, "first song", seed=1)
    second = drop(service, "second song", seed=2)
    open_page(driver, service)
    wait_page(driver, lambda p: p["queue"] == [first, second], "both songs on the page")

    click(driver, 'button[aria-label="Cancel first song"]')
    wait_for(lambda: state_of(service, first) is JobState.CANCELLED, 10, "the cancel")
    assert service.queue.order() == [second]
    assert (service.settings.paths.inbox / "first song.wav").exists(), "cancel keeps the input"
    shown = wait_page(
        driver,
        lambda p: p["queue"] == [second] and first in p["recent"],
        "the song to move from the queue to Recent",
    )
    assert shown["recent"][first][0] == "cancelled"

    click(driver, 'button[aria-label="Retry first song"]')
    again = wait_for(
        lambda: (
            job_for(service, service.settings.paths.inbox / "first song.wav") != first
            and job_for(service, service.settings.paths.inbox / "first song.wav")
        ),
        10,
        "the retry",
    )
    assert service.queue.order() == [second, again]
    wait_page(driver, lambda p: p["queue"] == [second, again], "the retried song queued last")


def test_moving_songs_changes_the_real_order(start, driver):
    service = start(paused=True)
    a, b, c = (drop(service, name, seed=i) for i, name in enumerate(["song a", "song b", "song c"]))
    open_page(driver, service)
    wait_page(driver, lambda p: p["queue"] == [a, b, c], "three songs on the page")

    click(driver, 'button[aria-label="Move song a down"]')  # = after song b
    wait_for(lambda: service.queue.order() == [b, a, c], 10, "a to move down")
    wait_page(driver, lambda p: p["queue"] == [b, a, c], "the new order on the page")

    # keyboard: focus "up" on song c and press Enter twice; the focus stays with the button
    up_c = driver.find_element(By.CSS_SELECTOR, 'button[aria-label="Move song c up"]')
    driver.execute_script("arguments[0].focus()", up_c)
    up_c.send_keys(Keys.ENTER)  # = after song b
    wait_for(lambda: service.queue.order() == [b, c, a], 10, "c to move up")
    wait_page(driver, lambda p: p["queue"] == [b, c, a], "the new order on the page")
    assert driver.switch_to.active_element == up_c, "the focus left the moved song's button"
    driver.switch_to.active_element.send_keys(Keys.ENTER)  # = first
    wait_for(lambda: service.queue.order() == [c, b, a], 10, "c to move first")
    wait_page(driver, lambda p: p["queue"] == [c, b, a], "the new order on the page")
    assert driver.switch_to.active_element == up_c
    assert up_c.get_attribute("aria-disabled") == "true", "the first song cannot move up"

    # drag song a onto the top half of song c: dropped before c, i.e. first
    drag_and_drop(driver, a, c, upper=True)
    wait_for(lambda: service.queue.order() == [a, c, b], 10, "a to be dragged first")
    wait_page(driver, lambda p: p["queue"] == [a, c, b], "the dragged order on the page")


def drag_and_drop(driver: Any, source_id: str, target_id: str, upper: bool) -> None:
    """HTML5 drag and drop as the browser dispatches it (WebDriver's pointer actions do not
    start a native drag in headless Chromium): dragstart, dragover, drop, dragend."""
    driver.execute_script(
        """
        const [sourceId, targetId, upper] = arguments;
        const source = document.querySelector(`#queue > li[data-job-id="${sourceId}"]`);
        const target = document.querySelector(`#queue > li[data-job-id="${targetId}"]`);
        const box = target.getBoundingClientRect();
        const at = {clientX: box.left + box.width / 2,
                    clientY: box.top + box.height * (upper ? 0.25 : 0.75)};
        const data = new DataTransfer();
        const fire = (el, type, extra) => el.dispatchEvent(new DragEvent(type,
            Object.assign({bubbles: true, cancelable: true, dataTransfer: data}, extra || {})));
        fire(source, 'dragstart');
        fire(target, 'dragover', at);
        fire(target, 'drop', at);
        fire(source, 'dragend');
    """,
        source_id,
        target_id,
        upper,
    )


def test_a_refused_action_shows_the_reason_in_a_dismissable_notice(start, driver):
    service = start(paused=True)
    job = drop(service, "gone soon")
    open_page(driver, service)
    (service.settings.paths.inbox / "gone soon.wav").unlink()  # the user took the file away
    wait_for(lambda: state_of(service, job) is JobState.CANCELLED, 10, "the removal to cancel")
    wait_page(driver, lambda p: job in p["recent"], "the cancelled song under Recent")

    click(driver, 'button[aria-label="Retry gone soon"]')  # its input is gone: 409
    shown = wait_page(driver, lambda p: p["notices"], "a notice")
    assert "gone" in shown["notices"][0], shown["notices"]
    assert driver.find_element(By.ID, "notices").get_attribute("role") == "alert"
    assert state_of(service, job) is JobState.CANCELLED and service.queue.order() == []

    click(driver, "#notices button[data-action=dismiss]")
    wait_page(driver, lambda p: p["notices"] == [], "the notice to go")


def test_a_phone_sized_window_has_no_horizontal_scroll(start, driver):
    service = start()
    inbox = service.settings.paths.inbox
    (inbox / "not really a song.mp3").write_bytes(b"\0garbage" * 512)  # fails to decode
    done = drop(service, "a short song that finishes")
    wait_for(lambda: state_of(service, done) is JobState.DONE, 60, "the short song to finish")
    wait_for(
        lambda: [
            job
            for job in service.registry.jobs()
            if job.name == "not really a song" and job.state is JobState.FAILED
        ],
        30,
        "the bad file to fail",
    )
    service.scheduler.pause()
    drop(
        service,
        "an-extremely-long-song-file-name-without-any-spaces-that-must-wrap-"
        "somewhere-on-a-phone-2024-remaster-final-FINAL-v2",
        seed=3,
    )

    chrome.set_viewport(driver, *chrome.PHONE)
    shown = open_page(driver, service)
    shown = wait_page(
        driver,
        lambda p: len(p["queue"]) == 1 and len(p["recent"]) == 2,
        "the queued, done and failed songs",
    )
    assert shown["recent"][done][1].startswith("→ outbox/")
    scroll, client, inner = driver.execute_script(
        "return [document.documentElement.scrollWidth, document.documentElement.clientWidth,"
        " window.innerWidth]"
    )
    assert inner == chrome.PHONE[0]
    # clientWidth is the viewport less a (desktop-style) vertical scrollbar, if there is one
    assert scroll <= client, f"horizontal overflow at phone size: {scroll} > {client} px"
    screenshot(driver, "phone")
    chrome.set_viewport(driver, *chrome.DESKTOP)
    screenshot(driver, "recent-desktop")


def test_the_page_says_when_the_service_goes_away(start, driver):
    service = start()
    open_page(driver, service)
    service.shutdown()  # ends the stream; the page keeps trying to reconnect, with backoff
    wait_page(driver, lambda p: p["connection"] == "disconnected", "the disconnect")
    assert driver.find_element(By.ID, "connection").text == "disconnected — reconnecting…"


def test_the_page_without_a_token_says_how_to_open_it(start, driver):
    service = start()
    driver.get(page_url(service))
    shown = wait_page(driver, lambda p: p["help"], "the help text")
    assert "stemdeck-watch open" in shown["help"]
    assert shown["connection"] == "no-token"
    assert not driver.find_element(By.ID, "pause-toggle").is_displayed()
    screenshot(driver, "no-token")

    driver.get(page_url(service, "not-the-token"))  # a stale token, e.g. from before a restart
    shown = wait_page(driver, lambda p: p["connection"] == "refused", "the token to be refused")
    assert "wrong token" in shown["help"] and "stemdeck-watch open" in shown["help"]


def test_a_one_time_page_link_opens_the_page_once_and_is_useless_after(start, driver):
    service = start()
    link = service.api.page_url()
    assert token_of(service) not in link
    driver.get(link)
    shown = wait_page(driver, lambda p: p["connection"] == "live", "the page to go live")
    assert shown["hash"] == "" and shown["help"] is None  # the code left the address

    driver.get("about:blank")
    driver.get(link)  # the same link again (someone who read it off the command line)
    shown = wait_page(driver, lambda p: p["connection"] == "refused", "the used link refused")
    assert "already used or has expired" in shown["help"]
    assert "stemdeck-watch open" in shown["help"]
    screenshot(driver, "used-link")

    driver.get(page_url(service, token_of(service)))  # a #token= address still works as is
    wait_page(driver, lambda p: p["connection"] == "live", "the page to go live again")
