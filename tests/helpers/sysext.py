"""The system extension packaging/build_sysext.py builds, once per session, for the tests that
need the real image (tests/integration/test_sysext.py, test_bake_systemd.py,
test_image_pipeline.py), and small extension images built the same way (mksquashfs through
the build script's own `squash`).

`built` is a session fixture registered for the whole suite by `pytest_plugins` in
tests/conftest.py, so one session builds the image once however many files ask for it (a
fixture imported into two test files would be two fixtures, built twice).
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pytest

import gpunode

REPO = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = REPO / "packaging" / "build_sysext.py"
IMAGE_NAME = f"gpunode-{gpunode.__version__}-x86-64.raw"

# Flatcar's ensure-sysext.service (it ships in /usr/lib/systemd/system there): after
# systemd-sysext.service merged the images, reload the units and re-reach the targets.
FLATCAR_ENSURE_SYSEXT = """\
[Unit]
BindsTo=systemd-sysext.service
After=systemd-sysext.service
DefaultDependencies=no
ConditionDirectoryNotEmpty=|/etc/extensions
ConditionDirectoryNotEmpty=|/run/extensions
ConditionDirectoryNotEmpty=|/var/lib/extensions
[Service]
Type=oneshot
RemainAfterExit=yes
ExecStart=/usr/bin/systemctl daemon-reload
ExecStart=/usr/bin/systemctl restart --no-block sockets.target timers.target multi-user.target
[Install]
WantedBy=sysinit.target
"""


def load_build_script() -> ModuleType:
    """packaging/build_sysext.py as a module (once: later calls return the same one)."""
    if "build_sysext" in sys.modules:
        return sys.modules["build_sysext"]
    spec = importlib.util.spec_from_file_location("build_sysext", BUILD_SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    # registered first, as an import does: its dataclass looks its module up there
    sys.modules["build_sysext"] = module
    # Not packaging/__pycache__: a test writes only where it says (the boundary guard), and
    # where PYTHONDONTWRITEBYTECODE is unset the import would write the script's bytecode.
    writes, sys.dont_write_bytecode = sys.dont_write_bytecode, True
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules["build_sysext"]
        raise
    finally:
        sys.dont_write_bytecode = writes
    return module


@dataclass(frozen=True)
class Built:
    dir: Path  # build output and scratch; outside /tmp so a namespace sees it
    image: Path
    tree: Path  # the image unpacked by unsquashfs -d
    stdout: str


@pytest.fixture(scope="session")
def built() -> Iterator[Built]:
    """One build of the default (ID=flatcar) image per session, unpacked."""
    from gpunode_testing.boot_harness import WORK_PARENT

    WORK_PARENT.mkdir(parents=True, exist_ok=True)
    base = Path(tempfile.mkdtemp(prefix="sysext-", dir=WORK_PARENT))
    try:
        done = subprocess.run(
            [sys.executable, str(BUILD_SCRIPT), "--out", str(base / "out"),
             "--work", str(base / "work")],
            capture_output=True, text=True, timeout=1200, check=False)
        assert done.returncode == 0, done.stdout + done.stderr
        image = base / "out" / IMAGE_NAME
        tree = base / "tree"
        subprocess.run(["unsquashfs", "-no-progress", "-d", str(tree), str(image)],
                       capture_output=True, check=True)
        yield Built(base, image, tree, done.stdout)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def extension(tree: Path, image: Path, name: str, files: dict[str, str],
              os_id: str = "_any") -> Path:
    """An extension image `image` whose release file is extension-release.`name` (systemd-sysext
    wants the image's own name there) with `os_id`, holding `files` (path under / → text);
    squashed as packaging/build_sysext.py squashes gpunode's."""
    script = load_build_script()
    release = tree / "usr/lib/extension-release.d" / f"extension-release.{name}"
    release.parent.mkdir(parents=True)
    release.write_text(script.release_text(os_id))
    for path, text in files.items():
        target = tree / path.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
    image.parent.mkdir(parents=True, exist_ok=True)
    script.squash(tree, image, 0)
    return image
