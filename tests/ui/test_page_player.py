"""The page's player in a real headless Chromium against the real service: a finished song's
stems fetched by HTTP Range request, mixed by one Web Audio clock, checked sample by sample
against the files on disk; mute, solo, the keyboard and a phone-sized window.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import pytest

from support import browser as chrome
from stemdeck_watch.core.jobs import JobState
from stemdeck_watch.stages.manifest import MANIFEST
from stemdeck_watch.util.synth import write_song

from support.helpers import wait_for

REASON = chrome.missing()
if REASON and os.environ.get("CI") != "true":
    pytest.skip(REASON, allow_module_level=True)

try:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
except ImportError:  # only under CI=true: every test then fails in chrome.require() with why
    By = Keys = None  # type: ignore[assignment,misc]

pytestmark = pytest.mark.slow


@pytest.fixture
def driver(tmp_path: Path, service_factory: Any) -> Iterator[Any]:
    """A headless Chromium that quits before the services stop."""
    with chrome.chromium(tmp_path / "chromium") as instance:
        yield instance
        errors = chrome.page_errors(instance)
        assert not errors, f"the page logged errors: {errors}"


def separated(service: Any, name: str, seconds: float, seed: int = 0) -> Any:
    inbox = service.settings.paths.inbox
    staging = inbox.parent / "staging"
    staging.mkdir(exist_ok=True)
    path = write_song(staging / f"{name}.wav", seconds, seed=seed)
    os.replace(path, inbox / path.name)
    return wait_for(
        lambda: next(
            (job for job in service.registry.jobs([JobState.DONE]) if job.name == name), None
        ),
        120,
        f"{name} to be separated",
    )


def player_state(driver: Any) -> dict[str, Any] | None:
    return driver.execute_script("return window.StemdeckPlayer.state()")


def wait_player(
    driver: Any, predicate: Callable[[dict[str, Any]], Any], what: str, timeout: float = 30.0
) -> dict[str, Any]:
    seen: dict[str, Any] = {}

    def check() -> Any:
        seen.clear()
        seen.update(player_state(driver) or {})
        return predicate(seen) and dict(seen)

    try:
        return wait_for(check, timeout, what)
    except AssertionError as exc:
        brief = {k: v for k, v in seen.items() if k != "requests"}
        raise AssertionError(f"{exc}; the player shows {brief}") from None


def probe(driver: Any) -> dict[str, Any]:
    """The next quantum the audio thread mixes: its frame, each stem's samples, the output."""
    driver.set_script_timeout(30)
    result = driver.execute_async_script(
        "const done = arguments[arguments.length - 1];window.StemdeckPlayer.probe().then(done);"
    )
    assert result is not None, "the player closed before it played"
    return result


def stems_on_disk(job: Any) -> dict[str, np.ndarray]:
    """Every stem of the song as (frames, channels) float32, as a WAV reader gives it."""
    import soundfile

    folder = Path(job.output)
    manifest = json.loads((folder / MANIFEST).read_text())
    return {
        entry["name"]: soundfile.read(folder / entry["file"], dtype="float32", always_2d=True)[0]
        for entry in manifest["stems"]
        if entry["kind"] == "stem"
    }


def check_aligned(
    sample: dict[str, Any], files: dict[str, np.ndarray], names: list[str]
) -> np.ndarray:
    """Each stem's samples in the quantum are the file's at the same frame; returns the mix
    the stems add up to with the gains the player used."""
    frame, count = sample["frame"], sample["count"]
    assert count > 0
    mix = np.zeros((2, count), np.float64)
    for name, played, gain in zip(names, sample["stems"], sample["gains"]):
        expected = files[name][frame : frame + count].T
        np.testing.assert_array_equal(
            np.asarray(played, np.float32),
            expected,
            err_msg=f"{name} at frame {frame} is not the file's",
        )
        mix += gain * expected
    return mix


def test_the_player_plays_every_stem_aligned_from_range_requests(
    make_settings: Any, service_factory: Any, driver: Any
) -> None:
    service, _ = service_factory(make_settings())
    job = separated(service, "listen to me", seconds=30.0, seed=4)
    files = stems_on_disk(job)
    sizes = {name: os.path.getsize(Path(job.output) / f"{name}.wav") for name in files}

    driver.get(service.api.page_url())
    listen = wait_for(
        lambda: driver.find_elements(
            By.CSS_SELECTOR, 'button[aria-label="Listen to listen to me"]'
        ),
        30,
        "the Listen button",
    )
    listen[0].click()
    state = wait_player(driver, lambda s: s.get("ready"), "the player to be ready")
    names = [stem["name"] for stem in state["stems"]]
    assert names == list(files) and all(stem["wav"] for stem in state["stems"])
    assert state["contextRate"] == 44100
    assert driver.switch_to.active_element.get_attribute("id") == "player-play"

    # played from the keyboard: Enter on Play, then the seek bar's arrows (+5 s each)
    driver.switch_to.active_element.send_keys(Keys.ENTER)
    wait_player(
        driver, lambda s: s["playing"] and s["contextState"] == "running", "the player to play"
    )
    seek = driver.find_element(By.ID, "player-seek")
    driver.execute_script("arguments[0].focus()", seek)
    for _ in range(3):
        seek.send_keys(Keys.ARROW_RIGHT)
    sample = probe(driver)
    assert sample["frame"] >= 15 * 44100, sample["frame"]
    mix = check_aligned(sample, files, names)
    np.testing.assert_allclose(sample["output"], mix, atol=1e-6)
    assert seek.get_attribute("aria-valuenow") in {str(n) for n in range(15, 31)}

    # every stem arrived by Range request, in pieces, never whole
    state = player_state(driver)
    for name in names:
        asked = [r for r in state["requests"] if r["stem"] == name]
        assert len(asked) >= 3, (name, asked)
        assert all(r["status"] == 206 for r in asked), asked
        for r in asked:
            first, last = map(int, r["range"].split(" ")[1].split("/")[0].split("-"))
            assert r["range"].endswith(f"/{sizes[name]}") and last - first + 1 < sizes[name]

    # mute one stem, solo another: the mix follows, the stems stay aligned
    driver.find_element(By.CSS_SELECTOR, f'button[aria-label="Mute {names[0]}"]').click()
    probe(driver)  # the quantum the gain ramps in
    sample = probe(driver)
    assert sample["gains"][0] == 0 and all(g == 1 for g in sample["gains"][1:])
    np.testing.assert_allclose(sample["output"], check_aligned(sample, files, names), atol=1e-6)
    solo = driver.find_element(By.CSS_SELECTOR, f'button[aria-label="Solo {names[1]}"]')
    solo.click()
    assert solo.get_attribute("aria-pressed") == "true"
    probe(driver)
    sample = probe(driver)
    assert sample["gains"] == [0.0, 1.0] + [0.0] * (len(names) - 2)
    np.testing.assert_allclose(sample["output"], check_aligned(sample, files, names), atol=1e-6)

    # a seek back (Home) while playing: the same frame from every stem again
    driver.execute_script("arguments[0].focus()", seek)
    seek.send_keys(Keys.HOME)
    sample = probe(driver)
    assert sample["frame"] < 10 * 44100
    check_aligned(sample, files, names)

    # space pauses; Escape closes the player and gives the focus back to Listen
    driver.execute_script("arguments[0].focus()", seek)
    seek.send_keys(" ")
    wait_player(driver, lambda s: not s["playing"], "the player to pause")
    seek.send_keys(Keys.ESCAPE)
    wait_for(
        lambda: driver.execute_script("return !window.StemdeckPlayer.isOpen()"),
        10,
        "the player to close",
    )
    assert driver.switch_to.active_element.get_attribute("aria-label") == "Listen to listen to me"


def test_the_player_fits_a_phone_its_picture_seeks_and_the_beat_grid_clicks(
    make_settings: Any, service_factory: Any, driver: Any
) -> None:
    service, _ = service_factory(make_settings(output={"beat_grid": True}))
    job = separated(service, "phone song", seconds=8.0, seed=5)
    beats = json.loads((Path(job.output) / "beats.json").read_text())["beats"]
    assert beats, "the synthetic song has a beat"
    chrome.set_viewport(driver, *chrome.PHONE)
    driver.get(service.api.page_url())
    wait_for(
        lambda: driver.find_elements(By.CSS_SELECTOR, '[data-action="listen"]'),
        30,
        "the Listen button",
    )[0].click()
    state = wait_player(driver, lambda s: s.get("ready"), "the player to be ready")
    assert state["job"] == job.id
    wait_for(
        lambda: (
            driver.find_element(By.ID, "player-picture").get_attribute("data-picture") == "preview"
        ),
        10,
        "the preview picture",
    )
    scroll, client = driver.execute_script(
        "return [document.documentElement.scrollWidth, document.documentElement.clientWidth]"
    )
    assert scroll <= client, f"horizontal overflow at phone size: {scroll} > {client} px"

    # a tap at three quarters of the picture seeks to three quarters of the song
    bar = driver.find_element(By.ID, "player-seek")
    driver.execute_script(
        """
        const bar = arguments[0];
        const box = bar.getBoundingClientRect();
        const at = {clientX: box.left + box.width * 0.75, clientY: box.top + box.height / 2,
                    pointerId: 1, bubbles: true, isPrimary: true};
        bar.dispatchEvent(new PointerEvent('pointerdown', at));
        bar.dispatchEvent(new PointerEvent('pointerup', at));
    """,
        bar,
    )
    state = player_state(driver)
    assert abs(state["frame"] / 44100 - 0.75 * 8.0) < 0.1, state["frame"]

    # the click: on at each beat's frame, nothing between beats
    click = driver.find_element(By.ID, "player-click")
    assert click.is_enabled()
    click.click()
    beat = round(beats[len(beats) // 2] * 44100)
    driver.execute_script("window.StemdeckPlayer.seek(arguments[0] / 44100)", beat - 64)
    sample = driver.execute_async_script("""
        const done = arguments[arguments.length - 1];
        const probed = window.StemdeckPlayer.probe();
        window.StemdeckPlayer.toggle();
        probed.then(done);
    """)
    assert sample["frame"] == beat - 64
    extra = np.asarray(sample["output"]) - check_aligned(
        sample, stems_on_disk(job), [s["name"] for s in state["stems"]]
    )
    assert np.abs(extra[:, :64]).max() < 1e-6, "a click before the beat"
    assert np.abs(extra[:, 64:]).max() > 0.05, "no click at the beat"
    folder = os.environ.get("STEMDECK_SCREENSHOTS")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(str(Path(folder) / "player-phone.png"))


def test_the_page_says_when_each_song_and_the_queue_will_be_done(
    make_settings: Any, service_factory: Any, driver: Any
) -> None:
    from support.helpers import SeparationGate

    service, _ = service_factory(make_settings())
    first = separated(service, "measured first", seconds=3.0, seed=1)
    service.scheduler.pause()
    inbox = service.settings.paths.inbox
    ids = []
    for i, seconds in enumerate([4.0, 6.0]):
        path = write_song(inbox.parent / f"next {i}.wav", seconds, seed=i)
        os.replace(path, inbox / path.name)
        ids.append(
            wait_for(
                lambda: getattr(
                    service.registry.latest_for_source(str(inbox / path.name)), "id", None
                ),
                20,
                "the song to be queued",
            )
        )
    gate = SeparationGate(service.client, ids[0])
    service.scheduler.start()
    wait_for(
        lambda: service.registry.get(ids[0]).state is JobState.SEPARATING,
        60,
        "the first song to separate",
    )
    driver.get(service.api.page_url())
    shown = wait_for(
        lambda: driver.execute_script(
            """
        const eta = document.getElementById('queue-eta');
        const queued = [...document.querySelectorAll('#queue > li')];
        const took = document.querySelector(`#recent > li[data-job-id="${arguments[0]}"] .time`);
        return !eta.hidden && queued.length === 1 && queued[0].dataset.finish && {
            eta: eta.textContent, finish: Number(eta.dataset.finish),
            queued: queued[0].querySelector('.meta').textContent,
            running: document.getElementById('running-stage').textContent,
            took: took ? took.textContent : null};
    """,
            first.id,
        ),
        30,
        "the estimate on the page",
    )
    eta = service.scheduler.snapshot()["eta"]
    assert shown["eta"].startswith("2 songs, done around ")
    assert abs(shown["finish"] - eta["finish"]) < 5
    assert "starts ~" in shown["queued"] and ", done ~" in shown["queued"]
    assert "done ~" in shown["running"]
    assert " · took " in shown["took"]
    gate.open()


DROP = """
const [name, b64, mime] = arguments;
const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
const data = new DataTransfer();
data.items.add(new File([bytes], name, {type: mime}));
const zone = document.getElementById('drop-zone');
for (const type of ['dragenter', 'dragover', 'drop']) {
  zone.dispatchEvent(new DragEvent(type, {bubbles: true, cancelable: true, dataTransfer: data}));
}
"""


def uploads(driver: Any) -> list[tuple[str, str, str]]:
    return driver.execute_script(
        "return [...document.querySelectorAll('#uploads > li')].map(li => "
        "[li.querySelector('.upload-name').textContent, li.dataset.state, "
        "li.querySelector('.upload-state').textContent]);"
    )


def test_a_song_dropped_on_the_page_is_separated_and_heard_stem_by_stem(
    make_settings: Any, service_factory: Any, driver: Any, tmp_path: Path
) -> None:
    import base64

    service, _ = service_factory(make_settings(api={"max_upload_mb": 1}))
    song = write_song(tmp_path / "dropped.wav", 5.0, seed=8)
    assert song.stat().st_size < 1 << 20
    driver.get(service.api.page_url())
    wait_for(
        lambda: driver.execute_script("return !document.getElementById('add-panel').hidden"),
        30,
        "the Add panel",
    )

    driver.execute_script(
        DROP, "../dropped\x1b.wav", base64.b64encode(song.read_bytes()).decode(), "audio/wav"
    )
    shown = wait_for(
        lambda: [u for u in uploads(driver) if u[1] in ("added", "refused")],
        30,
        "the upload to finish",
    )
    assert shown[0][1:] == ["added", "Added to the inbox as dropped.wav"], shown
    job = wait_for(
        lambda: next(
            (j for j in service.registry.jobs([JobState.DONE]) if j.name == "dropped"), None
        ),
        120,
        "the dropped song to be separated",
    )
    listen = wait_for(
        lambda: driver.find_elements(By.CSS_SELECTOR, 'button[aria-label="Listen to dropped"]'),
        30,
        "its Listen button",
    )
    listen[0].click()
    state = wait_player(driver, lambda s: s.get("ready"), "the player to be ready")
    assert state["job"] == job.id and len(state["stems"]) == 4
    driver.find_element(By.ID, "player-play").click()
    sample = probe(driver)
    check_aligned(sample, stems_on_disk(job), [s["name"] for s in state["stems"]])

    # over the limit: refused in the page with the reason, nothing sent
    big = os.urandom(3 << 19)
    driver.execute_script(DROP, "too big.wav", base64.b64encode(big).decode(), "audio/wav")
    shown = wait_for(
        lambda: [u for u in uploads(driver) if u[0] == "too big.wav"], 10, "the refusal"
    )
    assert shown[0][1] == "refused" and "api.max_upload_mb" in shown[0][2], shown
    inbox = service.settings.paths.inbox
    assert not (inbox / "too big.wav").exists()

    # a pasted link, with the queue paused so it is not fetched
    service.scheduler.pause()
    box = driver.find_element(By.ID, "link-url")
    box.send_keys("http://127.0.0.1:9/pasted%20song")
    box.send_keys(Keys.ENTER)
    shown = wait_for(
        lambda: [u for u in uploads(driver) if u[1] == "added" and u[0].startswith("http")],
        10,
        "the link to be added",
    )
    assert shown[0][2] == "Added to the inbox as 127.0.0.1 pasted song.url"
    assert (inbox / "127.0.0.1 pasted song.url").read_bytes().startswith(b"[InternetShortcut]")
    assert box.get_attribute("value") == ""
    wait_for(
        lambda: (
            driver.execute_script(
                "return [...document.querySelectorAll('#queue .name')].map(e => e.textContent)"
            )
            == ["127.0.0.1 pasted song"]
        ),
        20,
        "the link in the queue",
    )

    # chosen with the file button (the keyboard's and a phone's way)
    chooser = driver.find_element(By.ID, "add-files")
    chooser.send_keys(str(song))
    wait_for(
        lambda: [
            u
            for u in uploads(driver)
            if u[0] == "dropped.wav" and u[2] == "Added to the inbox as dropped.wav"
        ],
        30,
        "the chosen file to be added",
    )
    assert (inbox / "dropped.wav").exists()  # the first one left for processed/: a new copy
