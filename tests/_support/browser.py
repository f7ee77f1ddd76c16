"""Headless Chromium driven by selenium, for the playground page's tests.

Debian's ``chromium`` and ``chromium-driver`` (``make install`` puts them in place when it runs as
root with apt); the binaries are named explicitly, so selenium never tries to download a driver.
Every wait here is bounded: a page that never gets there fails the test, it does not hang it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from typing import Any, Callable, Iterator

import pytest

WAIT_S = 60.0  # the longest any one wait may take (a run of the tiny model takes well under a second)


def _binary(names: tuple[str, ...], env: str) -> str | None:
    given = os.environ.get(env)
    if given:
        return given
    for name in names:
        found = shutil.which(name)
        if found:
            return found
    for path in (f"/usr/bin/{n}" for n in names):
        if os.path.exists(path):
            return path
    return None


def chromium() -> Iterator[Any]:
    """A headless Chromium session (a generator for a fixture); skips, saying why, when the
    browser or selenium is missing."""
    browser = _binary(("chromium", "chromium-browser"), "PREHEAT_CHROMIUM")
    driver_bin = _binary(("chromedriver",), "PREHEAT_CHROMEDRIVER")
    if browser is None or driver_bin is None:
        pytest.skip("no chromium/chromedriver: run `make install` as root (it apt-gets chromium chromium-driver)")
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.skip("selenium is not installed: pip install -e '.[test]'")
    profile = tempfile.mkdtemp(prefix="preheat-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--no-first-run",
                "--window-size=1200,800", f"--user-data-dir={profile}", "--disable-extensions",
                "--disable-background-networking"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(executable_path=driver_bin), options=options)
    driver.set_page_load_timeout(WAIT_S)
    driver.set_script_timeout(WAIT_S)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def wait_for(driver: Any, predicate: Callable[[Any], Any], what: str, timeout: float = WAIT_S) -> Any:
    """``predicate(driver)``'s first truthy value; an AssertionError naming ``what`` (and what the
    page says) after ``timeout``."""
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = predicate(driver)
            if value:
                return value
        except Exception as err:  # an element not there yet, a stale one
            last_error = err
        time.sleep(0.05)
    body = driver.execute_script("return document.body ? document.body.innerText : ''")
    raise AssertionError(f"timed out after {timeout:g}s waiting for {what}; the page says:\n{body[:2000]}"
                         + (f"\n(last error: {last_error})" if last_error else ""))


def visible_text(driver: Any, element_id: str) -> str:
    """The text of ``#element_id`` when it is shown, else ''."""
    return driver.execute_script(
        "const e = document.getElementById(arguments[0]); return e && !e.hidden ? e.textContent : '';", element_id)
