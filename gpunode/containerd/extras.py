"""The files beside containerd's config that GPU containers need: a containerd.service drop-in
with `LimitMEMLOCK=infinity`, and the NVIDIA Container Toolkit's own `mode`.

- **LimitMEMLOCK.** CUDA's pinned host memory, NCCL and GPUDirect RDMA lock memory; a
  container inherits containerd's RLIMIT_MEMLOCK, and systemd's default (8 MiB) is far too
  small for GPU serving. gpunode writes its own drop-in (`containerd.limit_memlock`, default
  on) and removes it again when switched off, only while it is still gpunode's (its first
  line). A changed drop-in needs a daemon-reload, and a restart when containerd runs; at first
  boot gpunode runs before containerd starts, so it starts once, with the limit. Where
  gpunode's sysext put its shipped drop-in (ledger.SHIPPED_DROPIN, units/containerd-env.conf:
  LimitMEMLOCK=infinity among its lines), there is nothing to write and so no daemon-reload at
  first boot; `containerd.limit_memlock = false` then writes the drop-in with systemd's default
  (8M since systemd 253), which, named after it, wins.
- **The toolkit's mode.** `/etc/nvidia-container-runtime/config.toml`, `[nvidia-container-
  runtime] mode` (e.g. "cdi", as Giant Swarm's gpu-node-pool sets it): only when
  `containerd.toolkit_mode` is set, only that key changed (tomlkit; every other byte kept,
  proven by parsing the result back), written atomically, and nothing when it already says
  so. Flatcar's sysext-bakery `nvidia-runtime` sysext puts the file there with a tmpfiles `C`
  line (copied once, never over an existing file), so gpunode's change stays. The runtime
  reads the file for each container: no restart.

Both are planned (read, decided) before anything is written, and written in the containerd
step's one journalled transaction (writes.py), recorded in its ledger: a kill leaves neither
half-done, a refused restart puts them back, `containerd revert` removes the drop-in (while it
is as gpunode wrote it) and says that it keeps the toolkit's mode.
"""

from __future__ import annotations

import copy
import stat
from dataclasses import dataclass
from typing import Any

from gpunode.config import ContainerdConfig
from gpunode.containerd import tomltext
from gpunode.containerd.ledger import MEMLOCK_DROPIN, SHIPPED_DROPIN, TOOLKIT_CONFIG
from gpunode.containerd.tomltext import Change
from gpunode.errors import ContainerdStepError, EditError, GpunodeError
from gpunode.platform.host import Host
from gpunode.platform.tomlread import loads_toml

MEMLOCK_HEADER = "# Written by gpunode (containerd.limit_memlock): GPU containers lock memory."
MEMLOCK_TEXT = f"{MEMLOCK_HEADER}\n[Service]\nLimitMEMLOCK=infinity\n"
MEMLOCK_OFF_TEXT = f"{MEMLOCK_HEADER}\n[Service]\nLimitMEMLOCK=8M\n"  # over the shipped one
TOOLKIT_TABLE = "nvidia-container-runtime"
MAX_TOOLKIT_BYTES = 1 << 20
TOOLKIT_HINT = ("install the NVIDIA Container Toolkit (on Flatcar: sysext-bakery's "
                "nvidia-runtime sysext, which puts the file there), or unset "
                "containerd.toolkit_mode")


@dataclass(frozen=True)
class FileChange:
    """One file gpunode writes (data) or removes (data None) beside containerd's config."""

    path: str
    data: bytes | None
    description: str
    restarts: bool  # containerd must be reloaded (systemd) and restarted to see it
    before: bytes | None = None  # the file as the plan read it


def plan(host: Host, config: ContainerdConfig) -> tuple[FileChange, ...]:
    """The changes to make, decided from the files as they are; nothing written."""
    changes = [_memlock(host, config.limit_memlock)]
    if config.toolkit_mode is not None:
        changes.append(_toolkit_mode(host, config.toolkit_mode))
    return tuple(c for c in changes if c is not None)


def _regular(host: Host, path: str, what: str) -> bytes | None:
    """The file's bytes, None when absent; a link, FIFO, directory or unreadable file refused."""
    shown = host.display(path)
    try:
        st = host.lstat(path)
        if st is not None and not stat.S_ISREG(st.st_mode):
            kind = "a symlink" if stat.S_ISLNK(st.st_mode) else "not a regular file"
            raise ContainerdStepError(
                f"{shown} ({what}) is {kind}; gpunode writes only a regular file of its own "
                "there, never through a link or over something else",
                f"remove {shown} (or replace it with a regular file), then run gpunode again")
        return host.read_optional_bytes(path, limit=MAX_TOOLKIT_BYTES)
    except ContainerdStepError:
        raise
    except GpunodeError as exc:
        raise ContainerdStepError(f"{shown} ({what}) cannot be read: {exc}",
                                  f"fix or remove {shown}, then run gpunode again") from None


def _memlock(host: Host, wanted: bool) -> FileChange | None:
    current = _regular(host, MEMLOCK_DROPIN, "gpunode's LimitMEMLOCK drop-in")
    ours = current is not None and current.startswith(MEMLOCK_HEADER.encode())
    shipped = b"\nLimitMEMLOCK=infinity\n" in (host.read_optional_bytes(SHIPPED_DROPIN) or b"")
    if shipped:  # the sysext's drop-in sets the limit: only switching it off is a write
        if current is not None and not ours:
            raise ContainerdStepError(
                f"{host.display(MEMLOCK_DROPIN)} is not gpunode's (it lacks gpunode's first "
                "line); it overrides the LimitMEMLOCK of gpunode's shipped drop-in, and "
                "gpunode will not overwrite it", "remove it")
        if wanted:
            if current is None or current == MEMLOCK_TEXT.encode():
                return None
            return FileChange(MEMLOCK_DROPIN, None, f"remove {MEMLOCK_DROPIN} (the shipped "
                              f"{SHIPPED_DROPIN} sets LimitMEMLOCK=infinity)", True, current)
        if current == MEMLOCK_OFF_TEXT.encode():
            return None
        return FileChange(MEMLOCK_DROPIN, MEMLOCK_OFF_TEXT.encode(), f"write {MEMLOCK_DROPIN} "
                          "(LimitMEMLOCK=8M: containerd.limit_memlock = false)", True, current)
    if wanted:
        if current == MEMLOCK_TEXT.encode():
            return None
        if current is not None and not ours:
            raise ContainerdStepError(
                f"{host.display(MEMLOCK_DROPIN)} is not gpunode's (it lacks gpunode's first "
                "line); gpunode will not overwrite it",
                "remove it, or set containerd.limit_memlock = false to keep it as it is")
        return FileChange(MEMLOCK_DROPIN, MEMLOCK_TEXT.encode(),
                          f"write {MEMLOCK_DROPIN} (LimitMEMLOCK=infinity for containerd)", True,
                          current)
    if ours:
        return FileChange(MEMLOCK_DROPIN, None, f"remove {MEMLOCK_DROPIN} "
                          "(containerd.limit_memlock = false)", True, current)
    return None


def _toolkit_mode(host: Host, mode: str) -> FileChange | None:
    shown = host.display(TOOLKIT_CONFIG)
    data = _regular(host, TOOLKIT_CONFIG, "the NVIDIA Container Toolkit's config")
    if data is None:
        raise ContainerdStepError(f"{shown} does not exist: the NVIDIA Container Toolkit is "
                                  f"not installed, so its mode cannot be set to {mode!r}",
                                  TOOLKIT_HINT)
    text = _decoded(data, shown)
    doc = loads_toml(text, shown, lambda file, reason, line: EditError(
        file, reason, line, f"fix {shown} by hand (gpunode changes only its mode)"))
    table = doc.get(TOOLKIT_TABLE)
    if table is not None and not isinstance(table, dict):
        raise ContainerdStepError(f"{shown}: '{TOOLKIT_TABLE}' is not a table",
                                  f"fix {shown} by hand; gpunode changes only its mode")
    current = (table or {}).get("mode")
    if current == mode:
        return None
    change = Change((TOOLKIT_TABLE, "mode"), current, mode)
    expected: dict[str, Any] = copy.deepcopy(doc)
    tomltext.set_path(expected, change.path, mode)
    new_text = tomltext.tomlkit_edit(text, [change], None, shown)
    tomltext.verify(new_text, expected, shown)
    was = f" (was {current!r})" if current is not None else ""
    return FileChange(TOOLKIT_CONFIG, new_text.encode(),
                      f"{TOOLKIT_CONFIG}: set [{TOOLKIT_TABLE}] mode = {mode!r}{was}", False,
                      data)


def _decoded(data: bytes, shown: str) -> str:
    from gpunode.platform import safeio

    try:
        return safeio.decode(data)
    except safeio.Refused as exc:
        raise ContainerdStepError(f"{shown}: {exc}", f"fix {shown} by hand") from None


def diff(change: FileChange) -> str:
    """The change as a unified diff, for `--dry-run`."""
    before = change.before.decode("utf-8", "replace") if change.before is not None else ""
    after = change.data.decode() if change.data is not None else ""
    return tomltext.unified_diff(before, after, change.path if change.before is not None
                                 else "/dev/null", change.path if change.data is not None
                                 else "/dev/null")
