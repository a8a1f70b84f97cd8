"""Hostile inputs to the runtime wiring: the agent config's new containerd keys, the toolkit's
config.toml gpunode sets the mode in, and the LimitMEMLOCK drop-in's place. Each is refused
with one clear event, the documented exit code (2: the agent config; 1: the step), and every
file as it was."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from conftest import HostFactory, with_runtime_binary
from gpunode.containerd.ledger import MEMLOCK_DROPIN, TOOLKIT_CONFIG
from hostile.support import Cli, check_refusal

AGENT_CONFIG = "etc/gpunode/config.toml"
TOOLKIT = TOOLKIT_CONFIG.lstrip("/")
MEMLOCK = MEMLOCK_DROPIN.lstrip("/")
GOOD_TOOLKIT = '[nvidia-container-runtime]\nmode = "auto"\n'

# The agent config's [containerd] body → the refusal it must give (exit 2).
BAD_KEYS: dict[str, tuple[str, str]] = {
    "enable-cdi-a-word": ('enable_cdi = "yes"',
                          r'containerd\.enable_cdi.*must be true, false or "auto"'),
    "enable-cdi-an-integer": ("enable_cdi = 1", r"containerd\.enable_cdi.*must be true, false "
                              r"or a string, not an integer"),
    "gpu-access-unknown": ('gpu_access = "nvidia"',
                           r"containerd\.gpu_access.*must be one of runtime, cdi"),
    "gpu-access-a-boolean": ("gpu_access = true", r"containerd\.gpu_access.*must be a string"),
    "mode-runtimes-a-string": ('mode_runtimes = "true"',
                               r"containerd\.mode_runtimes.*must be a boolean"),
    "toolkit-mode-unknown": ('toolkit_mode = "cdi-only"',
                             r"containerd\.toolkit_mode.*must be one of auto, legacy, cdi"),
    "limit-memlock-a-number": ("limit_memlock = 1",
                               r"containerd\.limit_memlock.*must be a boolean"),
    "cdi-mode-with-mode-runtimes": ('gpu_access = "cdi"\nmode_runtimes = true',
                                    r'containerd\.mode_runtimes.*gpu_access = "cdi" writes no'),
    "cdi-mode-with-a-default-runtime": ('gpu_access = "cdi"\nset_as_default = true',
                                        r"containerd\.set_as_default.*an NVIDIA default"),
    "cdi-mode-with-cdi-off": ('gpu_access = "cdi"\nenable_cdi = false',
                              r"containerd\.enable_cdi.*CDI switched off"),
    "cdi-mode-with-a-toolkit-mode": ('gpu_access = "cdi"\ntoolkit_mode = "cdi"',
                                     r"containerd\.toolkit_mode.*the NVIDIA Container Toolkit"),
}


@pytest.mark.parametrize("case", BAD_KEYS, ids=BAD_KEYS.keys())
def test_a_bad_containerd_key_is_refused_naming_key_and_line(
    make_host: HostFactory, cli: Cli, case: str,
) -> None:
    body, pattern = BAD_KEYS[case]
    root = with_runtime_binary(make_host("nc4as-t4-v3", "driver")).root
    (root / AGENT_CONFIG).parent.mkdir(parents=True, exist_ok=True)
    (root / AGENT_CONFIG).write_text(f"[containerd]\n{body}\n")
    result = check_refusal(cli, root, ["--root", str(root), "containerd", "configure"], 2,
                           pattern)
    assert "line" in result.err


def _write(path: str, data: str | bytes) -> Callable[[Path], None]:
    def write(root: Path) -> None:
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_bytes(data.encode() if isinstance(data, str) else data)

    return write


def _symlink(path: str, target: str) -> Callable[[Path], None]:
    def link(root: Path) -> None:
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / target).parent.mkdir(parents=True, exist_ok=True)
        (root / target).write_text(GOOD_TOOLKIT)
        (root / path).symlink_to(root / target)

    return link


def _fifo(path: str) -> Callable[[Path], None]:
    def make(root: Path) -> None:
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        os.mkfifo(root / path)

    return make


def _directory(path: str) -> Callable[[Path], None]:
    return lambda root: (root / path).mkdir(parents=True)


# What is found at the toolkit's config.toml or the memlock drop-in → the refusal (exit 1).
BAD_FILES: dict[str, tuple[Callable[[Path], None], str]] = {
    "toolkit-config-broken-toml": (_write(TOOLKIT, "[nvidia-container-runtime\nmode = 1\n"),
                                   r"config\.toml.*not valid TOML"),
    "toolkit-config-not-utf8": (_write(TOOLKIT, b'[nvidia-container-runtime]\nx = "\xff"\n'),
                                r"config\.toml"),
    "toolkit-config-table-a-string": (_write(TOOLKIT, 'nvidia-container-runtime = "cdi"\n'),
                                      r"'nvidia-container-runtime' is not a table"),
    "toolkit-config-a-symlink": (_symlink(TOOLKIT, "usr/share/flatcar/etc/toolkit.toml"),
                                 r"config\.toml \(the NVIDIA Container Toolkit's config\) is "
                                 "a symlink"),
    "toolkit-config-a-fifo": (_fifo(TOOLKIT), r"is not a regular file"),
    "toolkit-config-a-directory": (_directory(TOOLKIT), r"is not a regular file"),
    "toolkit-config-missing": (lambda root: None,
                               r"does not exist: the NVIDIA Container Toolkit is not installed"),
    "memlock-dropin-a-symlink": (_symlink(MEMLOCK, "etc/elsewhere.conf"), r"is a symlink"),
    "memlock-dropin-a-fifo": (_fifo(MEMLOCK), r"memlock\.conf .*is not a regular file"),
    "memlock-dropin-a-directory": (_directory(MEMLOCK), r"is not a regular file"),
    "memlock-dropin-not-gpunodes": (_write(MEMLOCK, "[Service]\nLimitMEMLOCK=64M\n"),
                                    r"is not gpunode's .*will not overwrite it"),
}


@pytest.mark.parametrize("case", BAD_FILES, ids=BAD_FILES.keys())
def test_a_bad_file_beside_the_config_is_refused_and_nothing_is_written(
    make_host: HostFactory, cli: Cli, case: str,
) -> None:
    change, pattern = BAD_FILES[case]
    root = with_runtime_binary(make_host("nc4as-t4-v3", "driver")).root
    (root / AGENT_CONFIG).parent.mkdir(parents=True, exist_ok=True)
    (root / AGENT_CONFIG).write_text('[containerd]\ntoolkit_mode = "cdi"\n'
                                     if case.startswith("toolkit") else "")
    if not case.startswith("toolkit"):
        _write(TOOLKIT, GOOD_TOOLKIT)(root)
    change(root)
    check_refusal(cli, root, ["--root", str(root), "containerd", "configure"], 1, pattern)
