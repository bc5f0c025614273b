"""Screenshots of the built site for the README, with headless Chromium (Debian's package).

    python -m specdec.tools.docs.screenshots SITE_DIR OUT_DIR

`make docs-screenshots` builds the site first and runs this: the home page and the gRPC API
reference page, read from the built files (file:// URLs, no server, no network), each in
a fresh empty Chromium profile.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SHOTS = {  # output file -> (page of the built site, window size)
    "home.png": ("index.html", "1280,900"),
    "reference-grpc.png": ("reference/grpc.html", "1280,900"),
}


def chromium() -> str:
    for name in ("chromium", "chromium-browser"):
        if path := shutil.which(name):
            return path
    raise SystemExit("chromium is not installed (Debian: apt-get install chromium)")


def take(browser: str, url: str, out: Path, size: str) -> None:
    with tempfile.TemporaryDirectory(prefix="specdec-chromium-") as profile:
        subprocess.run(
            [
                browser,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--no-first-run",
                "--hide-scrollbars",
                f"--user-data-dir={profile}",
                f"--screenshot={out}",
                f"--window-size={size}",
                url,
            ],
            check=True,
            capture_output=True,
            timeout=120,
        )
    if not out.exists() or out.stat().st_size == 0:
        raise SystemExit(f"chromium wrote no screenshot to {out}")


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    site, out_dir = Path(args[0]).resolve(), Path(args[1])
    out_dir.mkdir(parents=True, exist_ok=True)
    browser = chromium()
    for name, (page, size) in SHOTS.items():
        take(browser, (site / page).as_uri(), out_dir / name, size)
        print(f"wrote {out_dir / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
