"""Fetch (once, into the test cache) the real containerd binaries the integration tests use.

CI runs this before pytest so that download time is not charged to a test:

    .venv/bin/python tests/real/fetch_containerd.py 1.6 1.7 2

With --write-defaults DIR it also regenerates the golden files: DIR/containerd-<version>.toml
(`config default` of each binary) and DIR/VERSIONS (the `--version` line of each).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

# Run as a script: make `tests/` importable so the module is the one the tests import.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from real.containerd_bins import VERSIONS, default_config, ensure_binary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("versions", nargs="*", default=list(VERSIONS), choices=VERSIONS)
    parser.add_argument("--write-defaults", type=Path, metavar="DIR")
    args = parser.parse_args(argv)

    lines = []
    for version in args.versions:
        started = time.monotonic()
        binary = ensure_binary(version)
        took = time.monotonic() - started
        print(f"{version}\t{binary.path}\t{binary.version_line}\t({took:.1f}s)")
        lines.append(f"{version}\t{binary.version_line}\n")
        if args.write_defaults:
            args.write_defaults.mkdir(parents=True, exist_ok=True)
            target = args.write_defaults / f"containerd-{version}.toml"
            target.write_text(default_config(binary.path))
    if args.write_defaults:
        (args.write_defaults / "VERSIONS").write_text("".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
