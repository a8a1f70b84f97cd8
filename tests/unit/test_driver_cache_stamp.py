"""The build cache's stamp: a full verification once, cheap checks after, and tampering still
caught (driver/cache.py), and `gpunode driver verify`, which hashes every file on demand.

Files in a test are always fresh, and the cheap check never trusts a file changed within
cache.SETTLED_NS of its stamp (a second write in the same clock tick could hide), so the tests
that need a settled entry set SETTLED_NS to 0; one test keeps it as it is.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from conftest import HostFactory
from gpunode.driver import build as b
from gpunode.driver import builders, cache
from gpunode.platform.host import Host
from helpers.driver_build import DRIVER, FACTS, KERNEL, FakeBuilder, inputs, mirror_host
from hostile.support import Cli


@dataclass(frozen=True)
class CountingHost(Host):
    """A Host that counts the files it hashes."""

    hashed: list[str] = field(default_factory=list)

    def digest(self, path: str, algorithm: str = "sha256") -> str:
        self.hashed.append(path)
        return super().digest(path, algorithm)


@pytest.fixture
def settled(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cache, "SETTLED_NS", 0)


def built(make_host: HostFactory) -> tuple[Host, str]:
    """A node whose cache has one entry, just built (fetched from its mirror, FakeBuilder)."""
    host = mirror_host(make_host)
    result = b.build(host, inputs(), builders.UrlFetcher(host), FakeBuilder(), FACTS)
    return host, result.entry.path


def entry_dir(host: Host) -> Path:
    return host.path(cache.entry_path(KERNEL, DRIVER, "open"))


def check(host: Host, path: str) -> tuple[cache.CacheEntry | None, str | None, list[str]]:
    """check_entry through a counting Host of the same root: the entry, why not, and the
    files it hashed (a file hashed unchanged earlier in the process is not hashed again)."""
    counting = CountingHost(host.root)
    entry, problem = cache.check_entry(counting, path, KERNEL, DRIVER, "open")
    return entry, problem, counting.hashed


def test_after_a_build_a_check_reads_the_stamp_and_hashes_nothing(
        make_host: HostFactory, settled: None) -> None:
    """The build verified its entry fully and stamped it: the next check (a boot's, status')
    vouches for every file from its lstat alone."""
    host, path = built(make_host)
    assert (entry_dir(host) / cache.STAMP).is_file()
    entry, problem, hashed = check(host, path)
    assert problem is None and entry is not None and entry.verified == "stamp"
    assert hashed == []


def test_a_file_changed_just_before_its_stamp_is_hashed_not_trusted(
        make_host: HostFactory) -> None:
    """With the default SETTLED_NS a file written in the two seconds before the stamp (as a
    build's just were) is never taken on the stamp's word: the check is a full one."""
    host, path = built(make_host)
    entry, _, hashed = check(host, path)
    assert entry is not None and entry.verified == "full" and len(hashed) > 3


@pytest.mark.parametrize("how", ["same-size", "mtime-restored", "replaced"])
def test_a_tampered_module_is_caught_by_the_next_cheap_check(
        make_host: HostFactory, settled: None, how: str) -> None:
    """A module rewritten (same size, even with its mtime set back) or replaced by another
    file changes its ctime or inode: the stamp no longer vouches, the full check hashes it and
    refuses the entry."""
    host, path = built(make_host)
    module = entry_dir(host) / "nvidia.ko"
    before = module.stat()
    tampered = bytes(b ^ 1 for b in module.read_bytes())
    if how == "replaced":
        module.unlink()
        module.write_bytes(tampered)
    else:
        module.write_bytes(tampered)
    if how == "mtime-restored":
        os.utime(module, ns=(before.st_atime_ns, before.st_mtime_ns))
    entry, problem, hashed = check(host, path)
    assert entry is None and problem is not None
    assert problem.startswith("nvidia.ko has sha256")
    assert f"{path}/nvidia.ko" in hashed


def test_a_changed_manifest_voids_the_stamp(make_host: HostFactory, settled: None) -> None:
    """The stamp names the manifest it was made for: another manifest (here, one digest
    changed) is checked fully, and refused."""
    host, path = built(make_host)
    manifest_file = entry_dir(host) / cache.MANIFEST
    manifest = json.loads(manifest_file.read_text())
    manifest["modules"]["nvidia.ko"] = "0" * 64
    manifest_file.write_text(json.dumps(manifest))
    entry, problem, _ = check(host, path)
    actual = cache.digest(host, path + "/nvidia.ko")
    assert entry is None
    assert problem == f"nvidia.ko has sha256 {actual}, the manifest says {'0' * 64}"


def test_a_forged_stamp_fools_the_cheap_check_but_not_driver_verify(
        make_host: HostFactory, settled: None, cli: Cli) -> None:
    """Whoever can rewrite the entry can rewrite its stamp too (a cache of a verdict, not a
    signature): `gpunode driver verify` ignores it, hashes every file, names the tampered one,
    exits 1 and removes the stamp, so that the next boot's check is a full one that refuses."""
    host, path = built(make_host)
    module = entry_dir(host) / "nvidia.ko"
    stamp_file = entry_dir(host) / cache.STAMP
    module.write_bytes(bytes(b ^ 1 for b in module.read_bytes()))
    stamp = json.loads(stamp_file.read_text())
    st = module.stat()
    stamp["files"]["nvidia.ko"] = [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns,
                                   st.st_ctime_ns]
    stamp["stamped_ns"] = st.st_ctime_ns + 1
    stamp_file.write_text(json.dumps(stamp))
    assert check(host, path)[0] is not None  # fooled: the documented limit
    done = cli("--root", str(host.root), "driver", "verify")
    assert done.code == 1
    assert done.out == f"{path}: UNUSABLE: nvidia.ko has sha256 " \
        f"{cache.digest(host, path + '/nvidia.ko')}, the manifest says " \
        f"{json.loads((entry_dir(host) / cache.MANIFEST).read_text())['modules']['nvidia.ko']}\n"
    assert not stamp_file.exists()
    assert check(host, path)[0] is None


def test_driver_verify_hashes_every_file_and_stamps_the_entry(
        make_host: HostFactory, settled: None, cli: Cli) -> None:
    """`gpunode driver verify --json`: each entry with the number of files whose sha256 is
    the manifest's, exit 0, and a fresh stamp the next check uses."""
    host, path = built(make_host)
    (entry_dir(host) / cache.STAMP).unlink()
    done = cli("--root", str(host.root), "driver", "verify", "--json")
    assert done.code == 0, done.err
    manifest = json.loads((entry_dir(host) / cache.MANIFEST).read_text())
    files = len(manifest["modules"]) + len(manifest["userspace"])
    assert json.loads(done.out)["entries"] == [{
        "entry": path, "kernel": KERNEL, "driver": DRIVER, "flavour": "open", "usable": True,
        "problem": None, "files": files}]
    assert check(host, path)[0] is not None and check(host, path)[2] == []


def test_driver_verify_on_an_empty_cache_says_so(make_host: HostFactory, cli: Cli) -> None:
    """No entries: nothing to verify, exit 0, and a line that says where it looked."""
    host = make_host("nc4as-t4-v3", "bare")
    done = cli("--root", str(host.root), "driver", "verify")
    assert (done.code, done.out) == (0, f"no build cache entries in {cache.CACHE_ROOT}\n")


def test_a_boot_that_verified_fully_restamps_and_status_does_not(
        make_host: HostFactory, settled: None, tmp_path: Path) -> None:
    """A stale stamp (here: none) makes the check full; `refresh` (what boot calls after it
    loaded the entry's modules) writes a new one, while the readers' checks write nothing."""
    host, path = built(make_host)
    stamp = entry_dir(host) / cache.STAMP
    stamp.unlink()
    entry, _, _ = check(host, path)
    assert entry is not None and entry.verified == "full" and not stamp.exists()
    cache.refresh(host, path, KERNEL, DRIVER)
    assert stamp.is_file()
    assert check(host, path)[2] == []
