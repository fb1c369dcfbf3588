"""A real headless browser for the page tests: Debian's chromium + chromium-driver, via Selenium.

Per the field notes: an explicit chromedriver path (so Selenium Manager never reaches for the
network), host resolver rules that leave only loopback resolvable (Chromium otherwise looks up
update hosts in the background), and TMPDIR/HOME in a folder of the test's own (Chromium's
profile and crash folders go there). That folder has a short path under the system's temp dir,
not under pytest's tmp_path: Chromium puts a Unix socket in it, and a socket path over ~107
bytes makes it exit at once ("Socket path too long"). `driver.quit()` always runs and ends
every Chromium process; the folder is removed after it.

Locally the tests skip, with the reason, when the browser, the driver or selenium is missing;
under CI=true they fail instead (`.ci/run` installs what they need).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator

import pytest

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
INSTALL = (
    "apt-get install --no-install-recommends chromium chromium-driver; "
    "pip install 'selenium>=4.20' (or `pip install -e '.[test]'`)"
)
DESKTOP = (1100, 900)
PHONE = (390, 844)


def missing() -> str | None:
    """Why a browser test cannot run here, or None."""
    absent = [str(path) for path in (CHROMIUM, CHROMEDRIVER) if not path.exists()]
    if importlib.util.find_spec("selenium") is None:
        absent.append("the selenium package")
    if absent:
        return f"no real browser: {', '.join(absent)} missing ({INSTALL})"
    return None


def require() -> None:
    """Skip (locally) or fail (CI=true) when the browser stack is missing."""
    reason = missing()
    if reason is None:
        return
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason}; CI must run the browser tests")
    pytest.skip(reason)


def set_viewport(driver: Any, width: int, height: int) -> None:
    """An exact viewport (--window-size sets the outer window)."""
    driver.execute_cdp_cmd(
        "Emulation.setDeviceMetricsOverride",
        {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False},
    )


@contextlib.contextmanager
def chromium(
    logs: Path,
    size: tuple[int, int] = DESKTOP,
    arguments: tuple[str, ...] = (),
    reachable: tuple[str, ...] = (),
) -> Iterator[Any]:
    """A headless Chromium driven by chromedriver (its log in `logs`), with `arguments` added
    to its command line; it reaches loopback and the `reachable` addresses only. Quit on exit."""
    require()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service as DriverService

    logs.mkdir(parents=True, exist_ok=True)
    base = tempfile.gettempdir()
    home = Path(tempfile.mkdtemp(prefix="chromium-", dir=base if len(base) < 40 else "/tmp"))
    try:
        options = webdriver.ChromeOptions()
        options.binary_location = str(CHROMIUM)
        for argument in (
            "--headless=new",
            "--no-sandbox",
            "--disable-dev-shm-usage",
            "--host-resolver-rules=MAP * ~NOTFOUND , EXCLUDE 127.0.0.1 , EXCLUDE localhost"
            + "".join(f" , EXCLUDE {address}" for address in reachable),
            f"--window-size={size[0]},{size[1]}",
            *arguments,
        ):
            options.add_argument(argument)
        options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "TMPDIR": str(home),
            "HOME": str(home),
            "LANG": "C.UTF-8",
        }
        service = DriverService(
            executable_path=str(CHROMEDRIVER), env=env, log_output=str(logs / "chromedriver.log")
        )
        driver = webdriver.Chrome(options=options, service=service)
        try:
            set_viewport(driver, *size)
            yield driver
        finally:
            driver.quit()
    finally:
        shutil.rmtree(home, ignore_errors=True)


def page_errors(driver: Any) -> list[str]:
    """Errors the page's own code caused: uncaught exceptions, CSP violations. Not the
    browser's network lines ("Failed to load resource: … 409"): a refused request is part of
    what the tests do, and so is the favicon the page does not have."""
    return [
        entry["message"]
        for entry in driver.get_log("browser")
        if entry["level"] == "SEVERE" and entry.get("source") != "network"
    ]
