"""Build (once, into the test cache) the kernel module tree with the fake NVIDIA modules.

CI runs this before pytest so that download and build time is not charged to a test:

    .venv/bin/python tests/real/fetch_kmod_tree.py

It prints the tree's root and kernel version, the modules.dep lines of the NVIDIA modules and
how long it took (a cached tree: well under a second, no network).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

# Run as a script: make `tests/` importable so the module is the one the tests import.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from real.kmod_tree import NVIDIA_MODULES, dependency_lines, ensure_module_tree


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.parse_args(argv)

    started = time.monotonic()
    tree = ensure_module_tree()
    took = time.monotonic() - started
    print(f"root\t{tree.root}")
    print(f"kver\t{tree.kver}")
    print(f"package\t{tree.package}")
    lines = dependency_lines(tree.moddir)
    for name in NVIDIA_MODULES:
        print(lines.get(name, f"{name}: (missing from modules.dep)"))
    print(f"took\t{took:.1f}s")
    return 0 if all(name in lines for name in NVIDIA_MODULES) else 1


if __name__ == "__main__":
    sys.exit(main())
