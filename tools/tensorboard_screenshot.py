"""Screenshots of a run's TensorBoard report, taken in a real (headless) browser.

Starts ``tensorboard`` on localhost over ``--logdir``, opens the default tab (TIME SERIES),
the custom-scalars tab and the text tab in Chromium and writes one PNG each. The charts are
drawn as SVG (TensorBoard's ``?forceSVG=true``): its default WebGL renderer draws in a worker
that headless Chromium's virtual time does not wait for, so cards came out empty. Nothing
leaves the machine: Chromium runs with every background network feature off and a fresh
profile. Needs ``chromium`` (Debian: ``apt-get install -y chromium``), which CI does not have;
the tests check the event files instead (tests/test_metric_logging.py,
tests/test_recipe_profiling.py). See docs/profiling.md, "Checking the report
in a browser".

    python tools/tensorboard_screenshot.py --logdir outputs/tiny/full_single_device/logs \\
        --out docs/images
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

# The tabs to shoot: (file name, URL fragment, window height: the default tab's five Overview
# cards take three rows).
TABS = [
    ("tensorboard_time_series.png", "timeseries", 1700),
    ("tensorboard_custom_scalars.png", "custom_scalars", 1200),
    ("tensorboard_text.png", "text", 1200),
]
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    # No --hide-scrollbars: a scroll bar in the TEXT card says that the report does not fit.
]


def wait_until_serving(url: str, timeout_s: float) -> None:
    """Poll ``url`` until it answers, or fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"TensorBoard did not answer at {url}") from None
            time.sleep(0.5)


def screenshot(chromium: str, url: str, path: Path, height: int, args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as profile:
        subprocess.run(
            [
                chromium,
                *CHROMIUM_FLAGS,
                f"--user-data-dir={profile}",
                f"--window-size={args.width},{height}",
                f"--virtual-time-budget={args.virtual_time_ms}",
                f"--screenshot={path}",
                url,
            ],
            check=True,
            capture_output=True,
            timeout=180,
        )
    print(f"wrote {path}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--logdir", required=True, help="what tensorboard --logdir gets")
    parser.add_argument("--out", default="docs/images", help="folder for the PNGs")
    parser.add_argument("--port", type=int, default=6123)
    parser.add_argument("--chromium", default="chromium")
    parser.add_argument("--width", type=int, default=1600)
    parser.add_argument("--virtual-time-ms", type=int, default=15000)
    args = parser.parse_args()

    chromium = shutil.which(args.chromium)
    if chromium is None:
        sys.exit(f"no {args.chromium!r} on PATH (Debian: apt-get install -y chromium)")
    tensorboard = Path(sys.executable).parent / "tensorboard"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    base = f"http://localhost:{args.port}/"
    server = subprocess.Popen(
        [
            str(tensorboard),
            "--logdir",
            args.logdir,
            "--port",
            str(args.port),
            "--host",
            "localhost",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_until_serving(base, timeout_s=60)
        for name, tab, height in TABS:
            screenshot(chromium, f"{base}?forceSVG=true#{tab}", out / name, height, args)
    finally:
        server.terminate()
        server.wait(timeout=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
