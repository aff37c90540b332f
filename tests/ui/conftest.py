"""A headless Chromium driven through Debian's chromedriver (Selenium), for the dashboard.

The browser is Debian's ``chromium`` and ``chromium-driver`` (``.ci/run`` and the README's
test command install them); the tests skip, saying so, where they are missing. Screenshots go
to ``test-artifacts/ui/`` at the repository root (ignored by git; ``FLASHPOINT_UI_ARTIFACTS``
overrides it), one PNG per view and test, kept after the run.

Selenium's calls block: the tests run them in a thread (``asyncio.to_thread``) so the cluster,
which serves the page in the test's own event loop, keeps answering.
"""

from __future__ import annotations

import os
import shutil
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
ARTIFACTS = Path(os.environ.get("FLASHPOINT_UI_ARTIFACTS")
                 or Path(__file__).resolve().parents[2] / "test-artifacts" / "ui")
WAIT_S = 30.0  # the longest any one wait for the page lasts


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    status = Path(f"/proc/{pid}/status")
    return status.exists() and "zombie" not in status.read_text().lower()


@pytest.fixture
def browser() -> Iterator[Any]:
    """A headless Chromium with its console log readable (``get_log("browser")``); quit
    and its driver's process stopped by PID at the end."""
    if not (os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER)):
        pytest.skip("needs Debian's chromium and chromium-driver "
                    "(apt-get install -y chromium chromium-driver)")
    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1400,1000", "--no-first-run", "--disable-extensions",
                "--disable-background-networking", "--disable-component-update"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    service = Service(executable_path=CHROMEDRIVER)
    driver = webdriver.Chrome(service=service, options=opts)
    driver.set_page_load_timeout(WAIT_S)
    driver.set_script_timeout(WAIT_S)
    pid = service.process.pid
    try:
        yield driver
    finally:
        try:
            driver.quit()
        finally:
            deadline = time.monotonic() + 10
            while _pid_alive(pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            if _pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
            assert not _pid_alive(pid), f"chromedriver {pid} outlived the test"


def wait_until(driver: Any, what: str, cond: Callable[[Any], Any],
               timeout_s: float = WAIT_S) -> Any:
    """``cond(driver)`` once truthy (its value), polled every 0.1 s for at most
    ``timeout_s``; on timeout, say what was awaited and what the page showed."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = cond(driver)
        if value:
            return value
        if time.monotonic() > deadline:
            body = driver.find_element("tag name", "body").text[:1500]
            raise AssertionError(f"timed out after {timeout_s}s waiting for: {what}; "
                                 f"the page showed: {body!r}")
        time.sleep(0.1)  # a blocking thread's pacing, not a synchronisation


def console_errors(driver: Any) -> list[dict[str, Any]]:
    """The browser console's SEVERE entries since the last call (failed loads, uncaught
    exceptions, console.error)."""
    return [e for e in driver.get_log("browser") if e.get("level") == "SEVERE"]


def screenshot(driver: Any, name: str) -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    assert driver.save_screenshot(str(path)), f"screenshot {path} failed"
    return path
