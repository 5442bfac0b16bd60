"""A headless Chromium for the dashboard tests, driven by Selenium through the system
chromedriver.

It needs Debian's `chromium` and `chromium-driver` (scripts/install.sh installs them where it
can) and the `selenium` package; the test is skipped where any is missing, unless
SITS_REQUIRE_BROWSER=1 (then it fails).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest


def _browser_paths() -> tuple[str, str] | None:
    chromium = next(
        (p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p),
        None,
    )
    driver = shutil.which("chromedriver")
    return (chromium, driver) if chromium and driver else None


@contextmanager
def headless_chromium() -> Iterator[Any]:
    """A `selenium.webdriver.Chrome` (headless, 1400 x 1800, browser console logged); skips
    the test without a browser (see the module docstring)."""
    paths = _browser_paths()
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        paths = None
    if paths is None:
        if os.environ.get("SITS_REQUIRE_BROWSER") == "1":
            pytest.fail("SITS_REQUIRE_BROWSER=1 but chromium, chromedriver or selenium is missing")
        pytest.skip("no headless browser here (chromium + chromium-driver + selenium)")
    options = webdriver.ChromeOptions()
    options.binary_location = paths[0]
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
        options.add_argument(arg)
    options.add_argument("--window-size=1400,1800")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(paths[1]))
    driver.set_page_load_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()


# Reads the tenants table in one script run (the page re-renders on every poll, so element
# handles kept across calls would go stale): per row, its tenant and {data-key: text}.
READ_TENANTS_JS = """
return Array.from(document.querySelectorAll("#tenants tbody tr")).map((r) => [r.dataset.tenant,
  Object.fromEntries(Array.from(r.cells).map((c) => [c.dataset.key, c.textContent]))]);
"""
