"""A real browser for the tests: Debian's chromium, driven by Playwright's Python client with that executable
(no browser download). Installed from Debian's packages when missing — once, under a lock, so the suite can
start it in the background (`make test`, tests/suite.py) and a test waits for it."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
from pathlib import Path
from typing import AsyncIterator

INSTALL = Path(__file__).resolve().parent.parent / "scripts" / "chromium-install.sh"  # (under its lock)


def install_command() -> list[str]:
    return ["sh", str(INSTALL)]


def ensure_chromium() -> str:
    """The path of Debian's chromium, installed first if missing (under the install's lock: an install under way,
    whose binary may already be in place, is waited for)."""
    subprocess.run(install_command(), check=True, timeout=900)
    path = shutil.which("chromium")
    assert path, "chromium is not installed and could not be (apt-get install chromium)"
    return path


@contextlib.asynccontextmanager
async def chromium() -> AsyncIterator:
    from playwright.async_api import async_playwright

    executable = ensure_chromium()
    async with async_playwright() as p:
        browser = await p.chromium.launch(executable_path=executable, headless=True,
                                          args=["--no-sandbox", "--disable-dev-shm-usage"])
        try:
            yield browser
        finally:
            await browser.close()
