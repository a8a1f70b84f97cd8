"""The test cache's mechanics that every fetcher of tests/real shares.

    $GPUNODE_TEST_CACHE/<component>/…        (default /var/cache/gpunode-tests)

- `root()`: where the cache is; GPUNODE_TEST_CACHE moves it whole (CI may cache it).
- `locked(directory)`: an flock on directory/.lock, so that concurrent pytest processes fetch
  or build a component once; whoever comes second finds it done.
- For the fetchers that keep a tree with a BUILD marker (JSON, naming the recipe it was made
  by) and build it in a temporary directory beside it (nvidia_driver, kmod_tree,
  nvidia_modules): `remove_leftovers` of a killed build, `newest` complete tree of a recipe,
  `put_in_place` (a rename, so a tree that exists is complete), `drop_others`.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

DEFAULT_CACHE = Path("/var/cache/gpunode-tests")


def root() -> Path:
    """The test cache."""
    return Path(os.environ.get("GPUNODE_TEST_CACHE") or DEFAULT_CACHE)


@contextmanager
def locked(directory: Path) -> Iterator[None]:
    """Hold an exclusive flock on directory/.lock (the directory made first) for the block."""
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        yield


def file_recipe(path: str) -> str:
    """A recipe that is a hash of a fetcher's text: any edit of the file fetches again."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]


def read_build(directory: Path) -> dict[str, Any] | None:
    """directory/BUILD; None where there is none or it is not JSON."""
    try:
        build = json.loads((directory / "BUILD").read_text())
    except (OSError, ValueError):
        return None
    return build if isinstance(build, dict) else None


def newest(base: Path, recipe: str, name_key: str,
           time_key: str) -> tuple[Path, dict[str, Any]] | None:
    """The tree under `base` whose BUILD names `recipe`, whose directory is named as its BUILD's
    `name_key` says, and whose BUILD's `time_key` is the latest; None if there is none."""
    found = []
    for marker in base.glob("*/BUILD"):
        build = read_build(marker.parent)
        if (build is not None and build.get("recipe") == recipe
                and marker.parent.name == build.get(name_key)):
            found.append((build.get(time_key, 0), marker.parent, build))
    if not found:
        return None
    _, directory, build = max(found, key=lambda item: item[0])
    return directory, build


def remove_leftovers(directory: Path, *patterns: str) -> None:
    """Remove what a killed fetch or build left in `directory` (call it holding the lock)."""
    for pattern in patterns:
        for stale in directory.glob(pattern):
            shutil.rmtree(stale, ignore_errors=True)


def put_in_place(staging: Path, final: Path, stale_prefix: str = "stale-") -> None:
    """Rename `staging` to `final`; a `final` already there (an older recipe's) is first moved
    out of the way, then removed."""
    if final.exists():
        old = Path(tempfile.mkdtemp(dir=final.parent, prefix=stale_prefix))
        final.replace(old / final.name)
        shutil.rmtree(old, ignore_errors=True)
    staging.replace(final)


def drop_others(base: Path, keep: Path) -> None:
    """Remove every tree under `base` with a BUILD marker but `keep` (older recipes, versions)."""
    for marker in base.glob("*/BUILD"):
        if marker.parent != keep:
            shutil.rmtree(marker.parent, ignore_errors=True)
