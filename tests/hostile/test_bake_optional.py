"""Hostile inputs of `gpunode image bake`'s optional artifacts ([toolkit], [[prebuilt]],
[build]): every bad section gets one clear message naming its key and line (exit 2,
bake-config-invalid); an artifact that is not the one pinned, that is no regular file, or a
prebuilt archive with a member gpunode refuses (an escape, a link, a device, a FIFO, a
file too large) gets one naming it (exit 1) — and every one leaves the image root as it was:
nothing half-placed, no temporary file, no directory made."""

from __future__ import annotations

import os
import tarfile
from pathlib import Path

import pytest

from conftest import HostFactory
from gpunode.bake import archive
from helpers.bake import make_inputs, sha512
from helpers.bake_extras import (
    KERNEL,
    TOOLKIT_FILE,
    image_kernel,
    member,
    module_set,
    prebuilt_section,
    tar_bytes,
    toolkit_section,
)
from hostile.support import Cli, check_refusal

GOOD = "0" * 128
G256 = "0" * 64
BUILD = (f'[build]\nenabled = true\ndriver_sha256 = "{G256}"\n'
         f'dev_container_sha512 = "{GOOD}"\n')
PINNED = '\n[agent]\nconfig = "pinned.toml"\n'  # driver.flavour = "open"
# An optional section → the refusal it must give (exit 2); {T}: a good [toolkit] source.
BAD_SECTIONS: dict[str, tuple[str, str]] = {
    "toolkit-not-a-table": ('toolkit = 3\n', r"key 'toolkit': must be a table \(\[toolkit\]\)"),
    "toolkit-unknown-key": (f'[toolkit]\nsource = "{{T}}"\nsha512 = "{GOOD}"\nmode = 1\n',
                            r"key 'toolkit.mode': unknown key; valid keys in \[toolkit\] are "
                            r"name, source, sha512"),
    "toolkit-no-sha512": ('[toolkit]\nsource = "{T}"\n', r"key 'toolkit.sha512': missing"),
    "toolkit-sha512-a-number": ('[toolkit]\nsource = "{T}"\nsha512 = 5\n',
                                r":\d+: key 'toolkit.sha512': must be a string, not int"),
    "toolkit-sha512-short": ('[toolkit]\nsource = "{T}"\nsha512 = "abc"\n',
                             r"key 'toolkit.sha512': must be 128 lowercase hex digits"),
    "toolkit-named-gpunode": (f'[toolkit]\nname = "gpunode"\nsource = "{{T}}"\n'
                              f'sha512 = "{GOOD}"\n',
                              r"key 'toolkit.name': 'gpunode' is not a sysext name"),
    "toolkit-name-with-slash": (f'[toolkit]\nname = "a/b"\nsource = "{{T}}"\nsha512 = "{GOOD}"\n',
                                r"key 'toolkit.name': 'a/b' is not a sysext name"),
    "toolkit-name-a-list": (f'[toolkit]\nname = ["x"]\nsource = "{{T}}"\nsha512 = "{GOOD}"\n',
                            r"key 'toolkit.name': must be a string, not list"),
    "toolkit-not-a-bakery-file": (f'[toolkit]\nsource = "runtime.raw"\nsha512 = "{GOOD}"\n',
                                  r"key 'toolkit.source': must name a file like "
                                  r"nvidia-runtime-v1\.17\.5-x86-64\.raw"),
    "toolkit-ftp-source": (f'[toolkit]\nsource = "ftp://h/{TOOLKIT_FILE}"\nsha512 = "{GOOD}"\n',
                           r"key 'toolkit.source'.*fetches http, https or file URLs"),
    "prebuilt-not-an-array": ('prebuilt = "x"\n',
                              r"key 'prebuilt': must be an array of tables \(\[\[prebuilt\]\]\)"),
    "prebuilt-a-single-table": (f'[prebuilt]\nsource = "s.tar"\nsha512 = "{GOOD}"\n',
                                r"key 'prebuilt': must be an array of tables"),
    "prebuilt-kernel-a-number": (f'[[prebuilt]]\nkernel = 5\nsource = "s.tar"\n'
                                 f'sha512 = "{GOOD}"\n',
                                 r":\d+: key 'prebuilt\[1\].kernel': must be a string, not int"),
    "prebuilt-kernel-climbs": (f'[[prebuilt]]\nkernel = "../etc"\nsource = "s.tar"\n'
                               f'sha512 = "{GOOD}"\n',
                               r"key 'prebuilt\[1\].kernel': '\.\./etc' is not a kernel release"),
    "prebuilt-no-source": (f'[[prebuilt]]\nsha512 = "{GOOD}"\n',
                           r"key 'prebuilt\[1\].source': missing"),
    "prebuilt-unknown-key": (f'[[prebuilt]]\nsource = "s.tar"\nsha512 = "{GOOD}"\ndir = "/x"\n',
                             r"key 'prebuilt\[1\].dir': unknown key"),
    "prebuilt-same-kernel-twice": (f'[[prebuilt]]\nsource = "a.tar"\nsha512 = "{GOOD}"\n'
                                   f'[[prebuilt]]\nsource = "b.tar"\nsha512 = "{GOOD}"\n',
                                   r"key 'prebuilt\[2\].kernel': names the same kernel as "
                                   r"prebuilt\[1\]"),
    "prebuilt-unknown-placeholder": (f'[[prebuilt]]\nsource = "{{{{kernel}}}}.tar"\n'
                                     f'sha512 = "{GOOD}"\n',
                                     r"key 'prebuilt\[1\].source': unknown placeholder "
                                     r"\{kernel\}"),
    "prebuilt-no-prebuilt-dirs": (f'[[prebuilt]]\nsource = "s.tar"\nsha512 = "{GOOD}"\n'
                                  '\n[agent]\nconfig = "no-dirs.toml"\n',
                                  r"key 'prebuilt\[1\].kernel': the agent config's "
                                  r"driver.prebuilt_dirs is empty"),
    "build-not-a-table": ('build = true\n', r"key 'build': must be a table"),
    "build-enabled-a-string": (BUILD.replace("enabled = true", 'enabled = "yes"'),
                               r"key 'build.enabled': must be true or false, not str"),
    "build-without-enabled": (BUILD.replace("enabled = true\n", ""),
                              r"key 'build.enabled': missing"),
    "build-without-driver-checksum": (BUILD.replace(f'driver_sha256 = "{G256}"\n', ""),
                                      r"key 'build.driver_sha256': missing"),
    "build-sha256-of-128-digits": (BUILD.replace(f'"{G256}"', f'"{GOOD}"'),
                                   r"key 'build.driver_sha256': must be 64 lowercase hex"),
    "build-flavours-a-string": (BUILD + 'flavours = "open"\n',
                                r"key 'build.flavours': must be an array of strings"),
    "build-flavour-unknown": (BUILD + 'flavours = ["fast"]\n',
                              r"key 'build.flavours': 'fast' is not a driver flavour"),
    "build-flavour-twice": (BUILD + 'flavours = ["open", "open"]\n',
                            r"key 'build.flavours': names a flavour twice"),
    "build-auto-flavour-unnamed": (BUILD, r"key 'build.flavours': missing: the agent config's "
                                   r"driver.flavour is auto"),
    "build-flavour-against-the-pin": (BUILD + 'flavours = ["proprietary"]\n' + PINNED,
                                      r"key 'build.flavours': the agent config pins "
                                      r"driver.flavour = 'open'"),
    "build-command-not-strings": (BUILD + 'flavours = ["open"]\ncommand = [1]\n',
                                  r"key 'build.command': must be an array of strings"),
    "build-command-unknown-placeholder": (
        BUILD + 'flavours = ["open"]\ncommand = ["nspawn", "--image={{image}}"]\n',
        r"key 'build':.*unknown placeholder \{image\}"),
    "build-url-unknown-placeholder": (BUILD + 'flavours = ["open"]\n'
                                      'driver_url = "https://h/{{release}}.run"\n',
                                      r"key 'build':.*unknown placeholder \{release\}"),
    "build-kernel-climbs": (BUILD + 'flavours = ["open"]\nkernel = "a/../b"\n',
                            r"key 'build.kernel': 'a/\.\./b' is not a kernel release"),
}


@pytest.mark.parametrize("case", BAD_SECTIONS, ids=BAD_SECTIONS.keys())
def test_a_bad_optional_section_is_refused_naming_key_and_line(
        make_host: HostFactory, tmp_path: Path, cli: Cli, case: str) -> None:
    body, pattern = BAD_SECTIONS[case]
    root = make_host("nc4as-t4-v3", "driver").root
    image_kernel(root)
    inputs = make_inputs(tmp_path / "in")
    (tmp_path / "in/pinned.toml").write_text('[driver]\nflavour = "open"\n')
    (tmp_path / "in/no-dirs.toml").write_text("[driver]\nprebuilt_dirs = []\n")
    text = body.replace("{T}", TOOLKIT_FILE).replace("{{", "{").replace("}}", "}")
    config = inputs.config(extra="\n" + text)
    if not text.startswith("["):  # a key of the top level: before the first table
        config.write_text(text + inputs.config().read_text())
    result = check_refusal(cli, root, ["image", "bake", "--root", str(root), "--config",
                                       str(config)], 2, pattern)
    assert result.errors[0]["error_code"] == "bake-config-invalid"


def test_a_prebuilt_set_for_an_image_without_one_kernel_must_name_its_kernel(
        make_host: HostFactory, tmp_path: Path, cli: Cli) -> None:
    root = make_host("nc4as-t4-v3", "driver").root  # no /usr/lib/modules/<release>
    inputs = make_inputs(tmp_path / "in")
    config = inputs.config(extra=prebuilt_section(inputs))
    check_refusal(cli, root, ["image", "bake", "--root", str(root), "--config", str(config)],
                  2, r"key 'prebuilt\[1\].kernel': missing: the image has no single "
                  r"/usr/lib/modules/<release>")


# -- artifacts that are not what the bake config pins (exit 1) ----------------------------------


def _refused(make_host: HostFactory, tmp_path: Path, cli: Cli, extra: str, pattern: str,
             code: str = "bake-failed") -> None:
    root = make_host("nc4as-t4-v3", "driver").root
    image_kernel(root)
    inputs = make_inputs(tmp_path / "in")
    config = inputs.config(extra=extra)
    result = check_refusal(cli, root, ["image", "bake", "--root", str(root), "--config",
                                       str(config)], 1, pattern)
    assert result.errors[0]["error_code"] == code
    for placed in ("opt/extensions", "opt/nvidia", "etc/gpunode/baked.json"):
        assert not (root / placed).exists()  # not even the good artifacts


@pytest.mark.parametrize("which", ["toolkit", "prebuilt"])
def test_a_corrupt_optional_artifact_is_refused_and_nothing_is_placed(
        make_host: HostFactory, tmp_path: Path, cli: Cli, which: str) -> None:
    inputs = make_inputs(tmp_path / "in")
    wrong = sha512(b"what the publisher signed")
    extra = (toolkit_section(inputs, sha=wrong) if which == "toolkit"
             else prebuilt_section(inputs, sha=wrong))
    _refused(make_host, tmp_path, cli, extra,
             r"its sha512 is .*, not the .* the bake config pins; nothing was placed")


@pytest.mark.parametrize("which", ["toolkit", "prebuilt"])
def test_a_fifo_as_an_optional_source_is_refused_without_waiting(
        make_host: HostFactory, tmp_path: Path, cli: Cli, which: str) -> None:
    inputs = make_inputs(tmp_path / "in")
    extra = (toolkit_section(inputs) if which == "toolkit" else prebuilt_section(inputs))
    source = tmp_path / "in" / (TOOLKIT_FILE if which == "toolkit" else "set.tar.gz")
    source.unlink()
    os.mkfifo(source)
    _refused(make_host, tmp_path, cli, extra, r"Failed to bake .* from .*: .*FIFO")


def _huge_header() -> bytes:
    """A tar whose one member claims 2 GiB (and holds none of them): refused by its header."""
    info = member("nvidia.ko", size=2 << 30)
    return info.tobuf(tarfile.GNU_FORMAT) + b"\0" * 1024


# A prebuilt archive → the member the refusal names.
BAD_ARCHIVES: dict[str, tuple[bytes, str]] = {
    "parent-dir-member": (tar_bytes(module_set(), [member("../evil.ko", size=4)]),
                          r"member '\.\./evil\.ko' climbs out of the directory"),
    "nested-parent-dir-member": (tar_bytes(module_set(), [member("lib/../../x", size=1)]),
                                 r"member 'lib/\.\./\.\./x' climbs out"),
    "absolute-member": (tar_bytes(module_set(), [member("/etc/passwd", size=3)]),
                        r"member '/etc/passwd' has an absolute name"),
    "symlink-member": (tar_bytes(module_set(), [member("lib/libx.so", tarfile.SYMTYPE,
                                                       linkname="/etc/shadow")]),
                       r"member 'lib/libx\.so' is a link \(to '/etc/shadow'\)"),
    "hardlink-member": (tar_bytes(module_set(), [member("x.ko", tarfile.LNKTYPE,
                                                        linkname="nvidia.ko")]),
                        r"member 'x\.ko' is a link"),
    "device-member": (tar_bytes(module_set(), [member("dev/sda", tarfile.BLKTYPE)]),
                      r"member 'dev/sda' is a device, a FIFO or another special file"),
    "fifo-member": (tar_bytes(module_set(), [member("fifo", tarfile.FIFOTYPE)]),
                    r"member 'fifo' is a device, a FIFO"),
    "huge-member": (_huge_header(), r"member 'nvidia\.ko' is 2147483648 bytes, larger than "
                    r"any driver file"),
    "member-twice": (tar_bytes(module_set(), [member("nvidia.ko", size=2)]),
                     r"member 'nvidia\.ko' appears twice"),
    "member-below-a-file": (tar_bytes(module_set(), [member("nvidia.ko/x", size=2)]),
                            r"member 'nvidia\.ko/x' is below 'nvidia\.ko', which is a file"),
    "newline-in-a-name": (tar_bytes(module_set(), [member("a\nb.ko", size=1)]),
                          r"member 'a\\nb\.ko' has a name that is not a plain file name"),
    "not-a-tar-archive": (b"PK\x03\x04 a zip file" * 50, r"not a readable tar archive"),
    # cut inside the first member's data: where a cut falls in a gzip stream depends on the
    # members' bytes, and one at a member's end reads as a shorter, whole archive
    "truncated-archive": (tar_bytes(module_set(), mode="w")[:512 + 6],
                          r"not a readable tar archive"),
    "no-nvidia-ko": (tar_bytes({"lib/libcuda.so.1": b"x"}), r"holds no nvidia\.ko"),
}


@pytest.mark.parametrize("case", BAD_ARCHIVES, ids=BAD_ARCHIVES.keys())
def test_a_prebuilt_archive_with_a_refused_member_places_nothing(
        make_host: HostFactory, tmp_path: Path, cli: Cli, case: str) -> None:
    data, pattern = BAD_ARCHIVES[case]
    inputs = make_inputs(tmp_path / "in")
    _refused(make_host, tmp_path, cli, prebuilt_section(inputs, data), pattern,
             "bake-archive-refused")


@pytest.mark.parametrize(("limit", "value", "pattern"), [
    ("MAX_MEMBERS", 3, r"is past the 3th: too many members"),
    ("MAX_TOTAL_BYTES", 20, r"takes the archive past 0 GiB unpacked"),
], ids=["members", "unpacked-size"])
def test_an_archive_past_a_limit_is_refused(
        make_host: HostFactory, tmp_path: Path, cli: Cli, monkeypatch: pytest.MonkeyPatch,
        limit: str, value: int, pattern: str) -> None:
    monkeypatch.setattr(archive, limit, value)
    inputs = make_inputs(tmp_path / "in")
    _refused(make_host, tmp_path, cli, prebuilt_section(inputs), pattern,
             "bake-archive-refused")


def test_a_refused_archive_over_an_earlier_set_leaves_that_set_as_it_was(
        make_host: HostFactory, tmp_path: Path, cli: Cli) -> None:
    root = make_host("nc4as-t4-v3", "driver").root
    image_kernel(root)
    inputs = make_inputs(tmp_path / "in")
    good = inputs.config(extra=prebuilt_section(inputs))
    assert cli("image", "bake", "--root", str(root), "--config", str(good)).code == 0
    bad = tar_bytes(module_set(), [member("../evil", size=1)])
    config = inputs.config(extra=prebuilt_section(inputs, bad, "bad.tar.gz"))
    check_refusal(cli, root, ["image", "bake", "--root", str(root), "--config", str(config)],
                  1, r"member '\.\./evil' climbs out")


def test_a_build_that_fails_places_nothing_of_the_bake(
        make_host: HostFactory, tmp_path: Path, cli: Cli,
        monkeypatch: pytest.MonkeyPatch) -> None:
    from gpunode.driver import builders
    from gpunode.errors import CommandFailed
    from gpunode.platform.host import Host
    from helpers.driver_build import IMAGE, INSTALLER, sha

    class Failing:
        def build(self, *args: object) -> None:
            raise CommandFailed(["systemd-nspawn"], 2, "make: *** [modules] Error 2")

    monkeypatch.setattr(builders, "default_adapters", lambda config, host=None: (
        builders.UrlFetcher(Host()), Failing()))
    root = make_host("nc4as-t4-v3", "driver").root
    image_kernel(root)
    inputs = make_inputs(tmp_path / "in")
    inputs.add("dev.bin", IMAGE)
    inputs.add("driver.run", INSTALLER)
    extra = toolkit_section(inputs) + (
        f'\n[build]\nenabled = true\nflavours = ["open"]\ndriver_url = "driver.run"\n'
        f'driver_sha256 = "{sha(INSTALLER, "sha256")}"\ndev_container_url = "dev.bin"\n'
        f'dev_container_sha512 = "{sha(IMAGE, "sha512")}"\n')
    result = cli("image", "bake", "--root", str(root), "--config",
                 str(inputs.config(extra=extra)))
    assert result.code == 1
    [error] = result.errors
    assert error["error_code"] == "driver-build-failed"
    assert "make: *** [modules] Error 2" in str(error["error"])
    for placed in ("opt/extensions", "etc/gpunode/baked.json", "etc/extensions"):
        assert not (root / placed).exists()  # the verified sysexts were not placed either
    assert not list(root.rglob("*.gpunode-tmp"))


def test_a_prebuilt_set_over_a_directory_no_bake_placed_is_refused(
        make_host: HostFactory, tmp_path: Path, cli: Cli) -> None:
    """driver.prebuilt_dirs naming the kernel's own module tree must not replace it."""
    root = make_host("nc4as-t4-v3", "driver").root
    image_kernel(root)
    (root / f"usr/lib/modules/{KERNEL}/kernel").mkdir()
    inputs = make_inputs(tmp_path / "in")
    (tmp_path / "in/gpunode.toml").write_text('[driver]\nprebuilt_dirs = ["/usr/lib/modules"]\n')
    config = inputs.config(extra=prebuilt_section(inputs) + '\n[agent]\nconfig = "gpunode.toml"\n')
    check_refusal(cli, root, ["image", "bake", "--root", str(root), "--config", str(config)], 1,
                  rf"usr/lib/modules/{KERNEL} exists and no earlier bake placed it")


def test_a_refused_archive_after_a_verified_toolkit_leaves_no_stage_of_either(
        make_host: HostFactory, tmp_path: Path, cli: Cli) -> None:
    inputs = make_inputs(tmp_path / "in")
    extra = toolkit_section(inputs) + prebuilt_section(
        inputs, tar_bytes(module_set(), [member("/abs", size=1)]))
    _refused(make_host, tmp_path, cli, extra, r"member '/abs' has an absolute name",
             "bake-archive-refused")
