"""Building the NVIDIA modules once per kernel and caching them, on fixture hosts.

Downloads are real (UrlFetcher) but read file:// URLs from a mirror inside the fixture root;
the compiler is a fake that writes fake .ko files, counts its calls, and can crash half-way
(tests/helpers/driver_build.py). NspawnBuilder itself needs a Flatcar node: here its argv and
build.sh are pinned. Two processes building at once, downloads from a local HTTP server, bash
and shellcheck on build.sh, and the command template run for real with a stand-in program:
tests/integration/test_driver_build_real.py.
"""

from __future__ import annotations

import bz2
import fcntl
import io
import json
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from conftest import HostFactory
from gpunode import log
from gpunode.config import BuildConfig, DriverConfig
from gpunode.driver import build as b
from gpunode.driver import builders, cache
from gpunode.platform import command
from gpunode.platform.command import CommandFailed
from gpunode.platform.host import Host
from gpunode_testing.driver_files import ELF64_LIBRARY
from helpers.driver_build import (
    BUILD_SH,
    DRIVER,
    FACTS,
    IMAGE,
    INSTALLER,
    KERNEL,
    MIRROR,
    MODULES,
    FakeBuilder,
    inputs,
    mirror_host,
    sha,
)

OLD_KERNEL = "6.6.88-flatcar"


@dataclass
class CountingFetcher:
    """The real UrlFetcher, counted."""

    inner: builders.UrlFetcher
    urls: list[str] = field(default_factory=list)

    def fetch(self, url: str, dest_path: Path) -> None:
        self.urls.append(url)
        self.inner.fetch(url, dest_path)


@pytest.fixture
def host(make_host: HostFactory) -> Host:
    return mirror_host(make_host)


@pytest.fixture
def log_events(monkeypatch: pytest.MonkeyPatch) -> Callable[[], list[dict[str, Any]]]:
    """The JSON log events emitted so far in the test, parsed."""
    monkeypatch.setattr(log, "_logger", log.get())  # the test's logger is undone afterwards
    stream = io.StringIO()
    log.configure("json", stream=stream)
    return lambda: [json.loads(line) for line in stream.getvalue().splitlines()]


def run_build(host: Host, builder: FakeBuilder, **changes: object) -> b.BuildResult:
    return b.build(host, inputs(**changes), builders.UrlFetcher(host), builder, FACTS)


def cache_listing(host: Host) -> list[str]:
    """Every path under the cache, relative to it, except the lock file."""
    root = host.path(cache.CACHE_ROOT)
    if not root.exists():
        return []
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.name != ".lock")


def entry_dir(host: Host, kernel: str = KERNEL, flavour: str = "open") -> Path:
    return host.path(cache.entry_path(kernel, DRIVER, flavour))


# -- a build, and the cache hit after it ---------------------------------------------------------


def test_a_build_leaves_exactly_the_modules_a_manifest_of_what_it_used_and_a_stamp(
        host: Host) -> None:
    """What a build leaves in the cache: the modules, the user-space, the manifest, and the
    stamp of the full verification made once it was published (cache.STAMP)."""
    result = run_build(host, FakeBuilder())

    assert not result.cache_hit
    files = sorted(f"{KERNEL}/{DRIVER}-open/{name}"
                   for name in (*MODULES, "manifest.json", cache.STAMP))
    listing = cache_listing(host)
    assert [p for p in listing if p.count("/") <= 2 and not p.endswith(("/lib", "/bin",
                                                                        "/firmware"))] == [
        KERNEL, f"{KERNEL}/{DRIVER}-open", *files]
    manifest = json.loads((entry_dir(host) / "manifest.json").read_text())
    assert manifest["schema_version"] == 2
    assert (manifest["kernel"], manifest["driver"], manifest["flavour"]) == (KERNEL, DRIVER, "open")
    assert manifest["flatcar_version"] == "4459.2.1"
    assert manifest["modules"] == {name: sha((entry_dir(host) / name).read_bytes(), "sha256")
                                   for name in MODULES}
    assert manifest["inputs"] == {
        "dev_container": {"url": f"file://{MIRROR}/amd64-usr/4459.2.1/"
                                 "flatcar_developer_container.bin.bz2",
                          "sha512": sha(bz2.compress(IMAGE), "sha512"), "verified": True},
        "driver": {"url": f"{MIRROR}/NVIDIA-Linux-x86_64-{DRIVER}.run",
                   "sha256": sha(INSTALLER, "sha256"), "verified": True},
    }
    assert manifest["built_at"].endswith("Z") and manifest["build_seconds"] >= 0
    assert result.entry.path == cache.entry_path(KERNEL, DRIVER, "open")
    assert result.entry.modules == tuple(f"{result.entry.path}/{n}" for n in sorted(MODULES))


def test_the_builder_gets_the_unpacked_developer_container(host: Host) -> None:
    builder = FakeBuilder()
    run_build(host, builder)
    assert builder.seen_image == IMAGE


def _mirror_image(host: Host, data: bytes) -> str:
    """Replace the mirror's developer container with `data`; its sha512."""
    (host.root / MIRROR.lstrip("/") / "amd64-usr/4459.2.1/"
     "flatcar_developer_container.bin.bz2").write_bytes(data)
    return sha(data, "sha512")


def test_a_developer_container_of_several_bzip2_streams_is_unpacked_whole(host: Host) -> None:
    """lbzip2 and pbzip2 write several streams one after another; bz2.open reads them all."""
    half = len(IMAGE) // 2
    digest = _mirror_image(host, bz2.compress(IMAGE[:half]) + bz2.compress(IMAGE[half:]))
    builder = FakeBuilder()
    run_build(host, builder, dev_container_sha512=digest)
    assert builder.seen_image == IMAGE


@pytest.mark.parametrize(("data", "reason"), [
    (bz2.compress(IMAGE)[:-10], "Compressed file ended before the end-of-stream marker"),
    (b"not bzip2 at all", "Invalid data stream"),
    (b"", "the file is empty"),
], ids=["truncated", "not-bzip2", "empty"])
def test_a_developer_container_that_is_not_whole_bzip2_is_refused_and_leaves_nothing(
        host: Host, data: bytes, reason: str) -> None:
    digest = _mirror_image(host, data)
    builder = FakeBuilder()
    with pytest.raises(b.DriverBuildError, match=rf"^Failed to unpack '.*\.bz2': {reason}") as info:
        run_build(host, builder, dev_container_sha512=digest)
    assert info.value.hint == "the download is truncated or not bzip2"
    assert builder.calls == 0
    assert cache_listing(host) == [KERNEL]


def test_the_build_inputs_are_those_of_driver_build_for_the_kernel_and_flavour() -> None:
    config = DriverConfig(version=DRIVER, build=BuildConfig(
        dev_container_url="file:///d.bz2", dev_container_sha512="a" * 128,
        driver_url="/i.run", driver_sha256="b" * 64, allow_unverified=True))
    assert b.inputs_for(config, KERNEL, "grid") == b.BuildInputs(
        kernel=KERNEL, driver=DRIVER, flavour="grid", dev_container_url="file:///d.bz2",
        dev_container_sha512="a" * 128, driver_url="/i.run", driver_sha256="b" * 64,
        allow_unverified=True)


def test_a_second_build_of_the_same_inputs_is_a_cache_hit_that_runs_no_builder(
        host: Host) -> None:
    builder = FakeBuilder()
    first = run_build(host, builder)
    fetcher = CountingFetcher(builders.UrlFetcher(host))

    second = b.build(host, inputs(), fetcher, builder, FACTS)

    assert second.cache_hit and builder.calls == 1 and fetcher.urls == []
    assert second.entry == first.entry
    assert cache.find_usable(host, KERNEL, DRIVER, "open") == first.entry


def test_a_cache_hit_needs_no_write_access_and_takes_no_lock(host: Host) -> None:
    run_build(host, FakeBuilder())
    lock = host.path(cache.LOCK_FILE)
    lock.unlink()
    assert run_build(host, FakeBuilder()).cache_hit
    assert not lock.exists()


def test_another_flavour_of_the_same_kernel_is_its_own_entry(host: Host) -> None:
    builder = FakeBuilder()
    run_build(host, builder)
    assert not run_build(host, builder, flavour="proprietary").cache_hit
    assert builder.calls == 2
    assert cache.find_usable(host, KERNEL, DRIVER, "open") is not None
    assert cache.find_usable(host, KERNEL, DRIVER, "proprietary") is not None


# -- downloads: checksums ------------------------------------------------------------------------


@pytest.mark.parametrize("wrong", ["dev_container_sha512", "driver_sha256"])
def test_a_checksum_mismatch_is_refused_with_both_digests_and_leaves_nothing(
        host: Host, wrong: str) -> None:
    length = 128 if wrong.endswith("512") else 64
    builder = FakeBuilder()

    with pytest.raises(b.DriverBuildError) as refused:
        run_build(host, builder, **{wrong: "0" * length})

    actual = (sha(bz2.compress(IMAGE), "sha512") if wrong.endswith("512")
              else sha(INSTALLER, "sha256"))
    assert str(refused.value).startswith("Failed to verify '")
    assert actual in str(refused.value) and "0" * length in str(refused.value)
    assert refused.value.hint
    assert builder.calls == 0
    assert cache_listing(host) == [KERNEL]  # the kernel dir, empty: no download, no staging
    assert cache.find_usable(host, KERNEL, DRIVER, "open") is None


@pytest.mark.parametrize("missing", ["dev_container_sha512", "driver_sha256"])
def test_a_missing_checksum_is_refused_before_anything_is_fetched(host: Host,
                                                                   missing: str) -> None:
    fetcher = CountingFetcher(builders.UrlFetcher(host))
    with pytest.raises(b.DriverBuildError, match=r"no sha(256|512) checksum") as refused:
        b.build(host, inputs(**{missing: None}), fetcher, FakeBuilder(), FACTS)
    assert "allow_unverified" in refused.value.hint
    assert fetcher.urls == [] and not host.exists(cache.CACHE_ROOT)


def test_a_missing_checksum_is_a_logged_warning_when_unverified_builds_are_allowed(
        host: Host, log_events: Callable[[], list[dict[str, Any]]]) -> None:
    result = run_build(host, FakeBuilder(), driver_sha256=None, allow_unverified=True)

    digest = sha(INSTALLER, "sha256")
    assert result.entry.manifest["inputs"]["driver"] == {
        "url": f"{MIRROR}/NVIDIA-Linux-x86_64-{DRIVER}.run", "sha256": digest, "verified": False}
    warnings = [e for e in log_events() if e["level"] == "warning"]
    assert [(w["event"], w["input"], w["sha256"]) for w in warnings] == [
        ("driver.build.unverified", "driver", digest)]


@pytest.mark.parametrize(("changes", "message"), [
    ({"kernel": "../../etc"}, "not a kernel"),
    ({"driver": "570/../x"}, "not a driver version"),
    ({"flavour": "nouveau"}, "not a driver flavour"),
    ({"driver_sha256": "ABC"}, "not 64 hex digits"),
    ({"driver_url": "ftp://mirror/NVIDIA.run"}, "not an http"),
    ({"driver_url": "https://x/{release}.run"}, "unknown placeholder {release}"),
], ids=["kernel-climbs", "driver-climbs", "flavour", "digest", "scheme", "placeholder"])
def test_bad_inputs_are_refused_by_the_plan(changes: dict[str, object], message: str) -> None:
    with pytest.raises(b.DriverBuildError, match=message):
        b.plan_build(inputs(**changes), FACTS)


def test_the_plan_names_the_downloads_and_their_checks() -> None:
    plan = b.plan_build(inputs(driver_sha256=None, allow_unverified=True), FACTS)
    assert plan.describe() == [
        f"build NVIDIA {DRIVER} (open) modules and user-space for kernel {KERNEL} into "
        f"{cache.CACHE_ROOT}/{KERNEL}/{DRIVER}-open",
        f"download file://{MIRROR}/amd64-usr/4459.2.1/flatcar_developer_container.bin.bz2 "
        f"(sha512 {sha(bz2.compress(IMAGE), 'sha512')})",
        f"download {MIRROR}/NVIDIA-Linux-x86_64-{DRIVER}.run (UNVERIFIED)",
    ]


def test_a_missing_download_is_refused_and_leaves_nothing(host: Host) -> None:
    with pytest.raises(b.DriverBuildError, match=r"Failed to download .*No such file"):
        run_build(host, FakeBuilder(), driver_url="/srv/mirror/gone.run")
    assert cache_listing(host) == [KERNEL]


# -- crashes and failed builds -------------------------------------------------------------------


def test_a_crash_mid_build_leaves_no_usable_entry_and_the_next_build_cleans_up(
        host: Host) -> None:
    with pytest.raises(RuntimeError, match="half-way"):
        run_build(host, FakeBuilder(crash=True))

    assert cache.find_usable(host, KERNEL, DRIVER, "open") is None
    assert not entry_dir(host).exists()
    leftovers = list(host.path(f"{cache.CACHE_ROOT}/{KERNEL}").iterdir())
    assert [p.name.startswith(f".staging-{DRIVER}-open-") for p in leftovers] == [True]
    assert (leftovers[0] / "nvidia.ko").exists() and not (leftovers[0] / "manifest.json").exists()

    result = run_build(host, FakeBuilder())

    assert not result.cache_hit
    assert [p.name for p in host.path(f"{cache.CACHE_ROOT}/{KERNEL}").iterdir()] == [
        f"{DRIVER}-open"]


def test_a_failed_builder_command_keeps_only_its_log_until_the_next_build(host: Host) -> None:
    class Failing(FakeBuilder):
        def build(self, workdir: Path, *args: object) -> None:
            (workdir / "build.log").write_text("make: *** [modules] Error 2\n")
            (workdir / "extract").mkdir()
            raise CommandFailed(["systemd-nspawn", "..."], 2, "make: *** [modules] Error 2")

    with pytest.raises(b.DriverBuildError) as failed:
        run_build(host, Failing())

    assert str(failed.value).startswith(
        f"Failed to build 'NVIDIA {DRIVER} (open) for kernel {KERNEL}': 'systemd-nspawn ...' "
        "exited 2")
    log_file = Path(failed.value.hint.split(" stays in ")[1].split(" (if")[0])
    assert log_file.read_text().startswith("make: ***")
    assert [p.name for p in log_file.parent.iterdir()] == ["build.log"]  # no image, no tree
    run_build(host, FakeBuilder())
    assert not log_file.exists()


def test_a_build_without_nvidia_ko_is_refused(host: Host) -> None:
    with pytest.raises(b.DriverBuildError, match=r"left no nvidia.ko \(nvidia-uvm.ko\)"):
        run_build(host, FakeBuilder(modules=("nvidia-uvm.ko",)))
    assert cache.find_usable(host, KERNEL, DRIVER, "open") is None


# -- corrupted entries ---------------------------------------------------------------------------


def _corrupt_module(entry: Path) -> None:
    (entry / "nvidia-uvm.ko").write_bytes(b"\x7fELF tampered")


def _drop_module(entry: Path) -> None:
    (entry / "nvidia.ko").unlink()


def _drop_manifest(entry: Path) -> None:
    (entry / "manifest.json").unlink()


def _garble_manifest(entry: Path) -> None:
    (entry / "manifest.json").write_text('{"schema_version": 1, "kernel": ')


def _deep_manifest(entry: Path) -> None:
    (entry / "manifest.json").write_text("[" * 100000 + "]" * 100000)


def _other_driver_manifest(entry: Path) -> None:
    manifest = json.loads((entry / "manifest.json").read_text())
    (entry / "manifest.json").write_text(json.dumps({**manifest, "driver": "550.127.08"}))


def _corrupt_library(entry: Path) -> None:
    (entry / f"lib/libcuda.so.{DRIVER}").write_bytes(ELF64_LIBRARY + b"tampered")


def _drop_library(entry: Path) -> None:
    (entry / f"lib/libnvidia-ml.so.{DRIVER}").unlink()


def _fifo_library(entry: Path) -> None:
    (entry / f"lib/libcuda.so.{DRIVER}").unlink()
    os.mkfifo(entry / f"lib/libcuda.so.{DRIVER}")


def _library_as_link(entry: Path) -> None:
    """The recorded library replaced by a link to a file with its bytes: never followed."""
    library = entry / f"lib/libcuda.so.{DRIVER}"
    (entry / "copy").write_bytes(library.read_bytes())
    library.unlink()
    library.symlink_to("../copy")


def _repointed_soname_link(entry: Path) -> None:
    (entry / "lib/libcuda.so.1").unlink()
    (entry / "lib/libcuda.so.1").symlink_to(f"libnvidia-ml.so.{DRIVER}")


def _corrupt_firmware(entry: Path) -> None:
    (entry / f"firmware/nvidia/{DRIVER}/gsp_ga10x.bin").write_bytes(b"other firmware")


def _modules_only_manifest(entry: Path) -> None:
    """A manifest as gpunode wrote it before builds carried the user-space."""
    manifest = json.loads((entry / "manifest.json").read_text())
    for key in ("userspace", "links"):
        del manifest[key]
    (entry / "manifest.json").write_text(json.dumps({**manifest, "schema_version": 1}))


def _climbing_userspace_path(entry: Path) -> None:
    manifest = json.loads((entry / "manifest.json").read_text())
    manifest["userspace"]["lib/../../../../etc/passwd"] = "0" * 64
    (entry / "manifest.json").write_text(json.dumps(manifest))


def _climbing_module_name(entry: Path) -> None:
    manifest = json.loads((entry / "manifest.json").read_text())
    manifest["modules"]["../../../../etc/passwd.ko"] = "0" * 64
    (entry / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("corrupt", [_corrupt_module, _drop_module, _drop_manifest,
                                     _garble_manifest, _deep_manifest, _other_driver_manifest,
                                     _climbing_module_name, _corrupt_library, _drop_library,
                                     _fifo_library, _library_as_link, _repointed_soname_link,
                                     _corrupt_firmware, _modules_only_manifest,
                                     _climbing_userspace_path],
                         ids=lambda f: f.__name__.strip("_"))
def test_a_corrupted_entry_is_not_usable_and_gets_rebuilt(host: Host, corrupt: object) -> None:
    builder = FakeBuilder()
    run_build(host, builder)
    corrupt(entry_dir(host))  # type: ignore[operator]

    assert cache.find_usable(host, KERNEL, DRIVER, "open") is None
    result = run_build(host, builder)

    assert not result.cache_hit and builder.calls == 2
    assert cache.find_usable(host, KERNEL, DRIVER, "open") == result.entry
    assert sorted(p.name for p in host.path(f"{cache.CACHE_ROOT}/{KERNEL}").iterdir()) == [
        f"{DRIVER}-open"]


# -- kernels and prune ---------------------------------------------------------------------------


def test_a_different_kernel_triggers_a_new_build(host: Host) -> None:
    builder = FakeBuilder()
    run_build(host, builder, kernel=OLD_KERNEL)
    result = run_build(host, builder)
    assert not result.cache_hit and builder.calls == 2
    assert (entry_dir(host) / "nvidia.ko").read_bytes().endswith(f"{KERNEL} open".encode())


def test_installed_kernels_are_the_module_trees_and_the_running_kernel(host: Host) -> None:
    (host.root / "usr/lib/modules/6.1.0-old").mkdir(parents=True)
    assert cache.installed_kernels(host) == {KERNEL, "6.1.0-old"}


def test_prune_removes_entries_of_kernels_no_longer_installed_and_keeps_the_running_one(
        host: Host) -> None:
    builder = FakeBuilder()
    for kernel in (OLD_KERNEL, KERNEL):
        run_build(host, builder, kernel=kernel)

    removed = cache.prune(host, cache.installed_kernels(host))

    assert removed == [f"{cache.CACHE_ROOT}/{OLD_KERNEL}"]
    assert not host.path(f"{cache.CACHE_ROOT}/{OLD_KERNEL}").exists()
    assert cache.find_usable(host, KERNEL, DRIVER, "open") is not None
    assert cache.prune(host, cache.installed_kernels(host)) == []


def test_prune_also_removes_a_crashed_builds_staging_dir(host: Host) -> None:
    with pytest.raises(RuntimeError):
        run_build(host, FakeBuilder(crash=True))
    removed = cache.prune(host, {KERNEL})
    assert len(removed) == 1 and f"/{KERNEL}/.staging-{DRIVER}-open-" in removed[0]
    assert cache_listing(host) == [KERNEL]


def test_prune_without_any_known_kernel_is_refused(host: Host) -> None:
    run_build(host, FakeBuilder())
    with pytest.raises(b.DriverBuildError, match="no installed kernel is known"):
        cache.prune(host, set())
    assert cache.find_usable(host, KERNEL, DRIVER, "open") is not None


def test_prune_of_a_node_without_a_cache_does_nothing(host: Host) -> None:
    assert cache.prune(host, {KERNEL}) == []
    assert not host.exists(cache.CACHE_ROOT)


# -- concurrent builds ---------------------------------------------------------------------------


def test_flock_on_two_open_file_descriptions_excludes_even_within_one_process(
        tmp_path: Path) -> None:
    first = os.open(tmp_path / "lock", os.O_RDWR | os.O_CREAT)
    second = os.open(tmp_path / "lock", os.O_RDWR)
    try:
        fcntl.flock(first, fcntl.LOCK_EX)
        with pytest.raises(BlockingIOError):
            fcntl.flock(second, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.close(first)
        fcntl.flock(second, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(second)


def test_concurrent_builds_serialise_and_the_waiting_one_gets_the_cache_hit(
        host: Host, log_events: Callable[[], list[dict[str, Any]]]) -> None:
    builder = FakeBuilder(sleep=0.5)
    results: dict[str, b.BuildResult] = {}

    def run(name: str) -> None:
        results[name] = b.build(Host(host.root), inputs(), builders.UrlFetcher(host), builder,
                                FACTS)

    first = threading.Thread(target=run, args=("first",))
    first.start()
    assert builder.started.wait(10)  # the first is compiling now
    second = threading.Thread(target=run, args=("second",))
    second.start()
    first.join(20)
    second.join(20)

    assert builder.calls == 1 and builder.most_running == 1
    assert (results["first"].cache_hit, results["second"].cache_hit) == (False, True)
    assert results["second"].seconds >= 0.2  # it waited for the lock, then found the entry
    assert results["second"].entry == results["first"].entry
    assert [e["event"] for e in log_events() if e["event"].startswith("driver.build.")] == [
        "driver.build.start", "driver.build.download", "driver.build.download",
        "driver.build.waiting", "driver.build.done", "driver.build.cache_hit"]


# -- URLs from the host's facts ------------------------------------------------------------------


TEMPLATE = ("https://{group}.release.flatcar-linux.net/{board}/{version}/"
            "flatcar_developer_container.bin.bz2?k={kernel}&d={driver}")


def test_render_url_fills_placeholders_from_the_fixtures_os_release(host: Host) -> None:
    facts = b.host_facts(host)
    assert facts == b.FlatcarFacts(version="4459.2.1", board="amd64-usr", group="stable")
    assert b.render_url(TEMPLATE, facts, KERNEL, DRIVER) == (
        "https://stable.release.flatcar-linux.net/amd64-usr/4459.2.1/"
        f"flatcar_developer_container.bin.bz2?k={KERNEL}&d={DRIVER}")


def test_flatcar_release_and_the_etc_update_conf_come_first(make_host: HostFactory) -> None:
    host = make_host("nc4as-t4-v3", "bare", extra={
        "/usr/share/flatcar/release": "FLATCAR_RELEASE_VERSION=4593.0.0\n"
                                      "FLATCAR_RELEASE_BOARD=arm64-usr\n",
        "/etc/flatcar/update.conf": "# pinned\nGROUP=beta\n",
        "/usr/share/flatcar/update.conf": "SERVER=https://public.update.flatcar-linux.net/v1/update/"
                                          "\nGROUP=stable\n",
    })
    assert b.render_url(TEMPLATE, b.host_facts(host), KERNEL, DRIVER).startswith(
        "https://beta.release.flatcar-linux.net/arm64-usr/4593.0.0/")


def test_an_etc_update_conf_without_group_falls_back_to_the_one_in_usr(
        make_host: HostFactory) -> None:
    host = make_host("nc4as-t4-v3", "bare", extra={
        "/etc/flatcar/update.conf": "SERVER=https://mirror.example/update\n",
        "/usr/share/flatcar/update.conf": 'GROUP="alpha"\n',
    })
    assert b.host_facts(host).group == "alpha"


def test_off_flatcar_version_is_unknown_and_a_url_that_needs_it_is_refused(
        tmp_path: Path) -> None:
    facts = b.host_facts(Host(tmp_path))
    assert facts == b.FlatcarFacts(version=None, board="amd64-usr", group="stable")
    with pytest.raises(b.DriverBuildError, match=r"\{version\} is unknown on this host"):
        b.render_url(TEMPLATE, facts, KERNEL, DRIVER)
    assert b.render_url("https://mirror/{driver}.run", facts, KERNEL, DRIVER) == (
        f"https://mirror/{DRIVER}.run")


# -- the real fetcher on a file URL under the host's root ----------------------------------------


def test_url_fetcher_reads_file_urls_under_the_hosts_root(host: Host, tmp_path: Path) -> None:
    dest = tmp_path / "copy.run"
    builders.UrlFetcher(host).fetch(f"file://{MIRROR}/NVIDIA-Linux-x86_64-{DRIVER}.run", dest)
    assert dest.read_bytes() == INSTALLER


# -- NspawnBuilder: pinned here, run on a Flatcar node -------------------------------------------


def test_nspawn_builder_default_argv() -> None:
    argv = builders.NspawnBuilder().argv(Path("/c/w"), Path("/c/w/dev.bin"), Path("/c/w/i.run"),
                                         KERNEL, "open", Path("/c/s"))
    assert argv == ["systemd-nspawn", "--quiet", "--image=/c/w/dev.bin", "--bind=/c/w:/work",
                    "--bind=/c/s:/out", "/bin/bash", "/work/build.sh", KERNEL, "open"]


def test_nspawn_builder_refuses_an_unknown_placeholder_when_configured() -> None:
    with pytest.raises(b.DriverBuildError, match=r"unknown placeholder \{image\}"):
        builders.NspawnBuilder(command=["systemd-nspawn", "--image={image}"])


def test_nspawn_builder_writes_build_sh_and_runs_its_argv_with_a_long_timeout(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[list[str], float]] = []
    monkeypatch.setattr(command, "run", lambda argv, timeout: calls.append((argv, timeout)) or "")
    work = tmp_path / "work"
    work.mkdir()

    builders.NspawnBuilder().build(work, work / "dev.bin", work / b.INSTALLER_NAME, KERNEL, "grid",
                            tmp_path)

    assert (work / "build.sh").read_text() == builders.build_script()
    assert calls == [(builders.NspawnBuilder().argv(work, work / "dev.bin", work / b.INSTALLER_NAME,
                                             KERNEL, "grid", tmp_path), 3600.0)]


def test_build_sh_is_the_package_data_file_and_expects_the_installer_build_names() -> None:
    assert builders.build_script() == BUILD_SH.read_text()
    assert 'work="${GPUNODE_BUILD_WORK:-$root/work}"' in builders.build_script()
    assert f'sh "$work/{b.INSTALLER_NAME}" --extract-only' in builders.build_script()
    assert f'"$work/{b.WANTED_LIST}"' in builders.build_script()
