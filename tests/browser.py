"""Headless Chromium for the tests that open a page: a screenshot or the DOM
after the page's scripts have run. `.ci/run` installs Chromium (the Debian
package) when it is missing; `chromium()` is None where it could not be."""

import os
import shutil
import subprocess
import tempfile

import numpy as np

# Flags that run here as root in a container, with no network, GPU or D-Bus.
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--hide-scrollbars")
NO_CHROMIUM = "no chromium or chromium-browser on PATH (.ci/run installs the Debian package)"


def chromium():
    return shutil.which("chromium") or shutil.which("chromium-browser")


def _run(url, *flags, timeout=120):
    with tempfile.TemporaryDirectory(prefix="chromium-profile-") as profile:
        done = subprocess.run([chromium(), *FLAGS, f"--user-data-dir={profile}", *flags, url],
                              capture_output=True, text=True, timeout=timeout)
    return done


def dump_dom(url, budget_ms=3000):
    """The page's DOM, serialized after its scripts ran (virtual time budget)."""
    done = _run(url, f"--virtual-time-budget={budget_ms}", "--dump-dom")
    assert done.returncode == 0 and "<html" in done.stdout, done.stderr[-3000:]
    return done.stdout


def screenshot(url, path, size=(1000, 900), budget_ms=3000):
    """A PNG of the page at `size`; returns it as an `(H, W, 3)` uint8 array."""
    from PIL import Image

    done = _run(url, f"--virtual-time-budget={budget_ms}", f"--window-size={size[0]},{size[1]}",
                f"--screenshot={os.fspath(path)}")
    assert done.returncode == 0 and os.path.isfile(path), done.stderr[-3000:]
    return np.asarray(Image.open(path).convert("RGB"))


def ink(image):
    """The share of pixels that are not the background (the commonest colour)."""
    colours, counts = np.unique(image.reshape(-1, image.shape[-1]), axis=0, return_counts=True)
    background = colours[np.argmax(counts)]
    return float(np.mean(np.any(np.abs(image.astype(int) - background) > 16, axis=-1)))
