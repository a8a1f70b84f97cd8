"""How containers get the GPU through containerd, decided per containerd version (pure).

- **CDI in the CRI plugin.** containerd 1.6 has no CDI at all (it came with 1.7.0, commit
  c9b4ccf83 "add configuration for CDI"; 1.6's `config dump` drops `enable_cdi`). 1.7 has it
  off by default (`EnableCDI: false`, pkg/cri/config/config_unix.go). 2.0 turns it on by
  default (internal/cri/config/config_unix.go), 2.3 deprecates the key (commit c49379c38,
  RELEASES.md's table: deprecated in the 2.2 cycle, removed in 2.4). So `enable_cdi = "auto"`
  writes `enable_cdi = true` (and the default `cdi_spec_dirs`, where the file sets none) only
  for a 1.7 (`cdi_wanted` says what happens when the version cannot be asked).
- **The toolkit's mode runtimes.** The GPU Operator's installer (nvidia-container-toolkit
  cmd/nvidia-ctk-installer/container/operator/operator.go, `modeRuntime`) adds `nvidia-cdi`
  running `nvidia-container-runtime.cdi` and `nvidia-legacy` running
  `nvidia-container-runtime.legacy`, beside `nvidia-container-runtime`; gpu-operator's
  RuntimeClasses name them (assets/pre-requisites/0210/0220_runtime_class_*.yaml).
- **CDI mode** (`containerd.gpu_access = "cdi"`): no NVIDIA runtime at all; containerd itself
  injects the devices of the CDI spec a pod asks for. The edit is then only what CDI needs.
"""

from __future__ import annotations

import copy
import dataclasses
import posixpath
from collections.abc import Mapping
from typing import Any

from gpunode.config import ContainerdConfig
from gpunode.containerd import edit, schema, tomltext
from gpunode.containerd.tomltext import Change
from gpunode.errors import EditError

CDI_FROM: schema.Daemon = (1, 7)  # the first containerd with CDI
CDI_ALWAYS_FROM: schema.Daemon = (2, 0)  # CDI on by default; the key deprecated from 2.3
DEFAULT_SPEC_DIRS = ("/etc/cdi", "/var/run/cdi")
SPEC_DIR = "/var/run/cdi"  # where gpunode writes its spec (gpunode/cdi/spec.py SPEC_PATH)
MODE_RUNTIMES = (("nvidia-cdi", "nvidia-container-runtime.cdi"),
                 ("nvidia-legacy", "nvidia-container-runtime.legacy"))
NO_CDI_HINT = ("upgrade containerd to 1.7 or later, or use the nvidia runtime handler "
               '(containerd.gpu_access = "runtime", the default)')


def cdi_wanted(setting: bool | str, daemon: schema.Daemon | None, version: int,
               cdi_mode: bool = False) -> bool:
    """Whether gpunode writes `enable_cdi = true`: as configured, or ("auto") where containerd
    needs it to use CDI at all. A version nobody can ask (under --root, a binary that does not
    run): beside the nvidia runtime, which needs no CDI, nothing is written; in CDI mode, which
    needs it, a file a 1.x may read gets it (2.0-2.3 read true as their own default)."""
    if isinstance(setting, bool):
        return setting
    if daemon is not None:
        return CDI_FROM <= daemon < CDI_ALWAYS_FROM
    return cdi_mode and version != 3


def runtime_spec(config: ContainerdConfig, daemon: schema.Daemon | None,
                 doc: Mapping[str, Any]) -> edit.RuntimeSpec:
    """The edit's spec with the CDI keys decided for this containerd and this file."""
    version = schema.config_version(doc)
    cdi = cdi_wanted(config.enable_cdi, daemon, version, not config.runtime_wanted)
    dirs = config.cdi_spec_dirs
    if cdi and not dirs and config.enable_cdi == "auto":
        try:
            current = schema.lookup(doc, (*schema.cri_path(version), "cdi_spec_dirs"))
        except schema.SchemaError:
            current = None
        dirs = DEFAULT_SPEC_DIRS if current is None else ()  # the file's own list is kept
    return edit.RuntimeSpec(name=config.runtime_name, binary=config.runtime_path,
                            set_as_default=config.set_as_default, enable_cdi=cdi,
                            cdi_spec_dirs=dirs)


def mode_runtime_binaries(runtime_path: str) -> list[tuple[str, str]]:
    """(runtime name, binary) of the toolkit's mode runtimes, beside the nvidia runtime."""
    directory = posixpath.dirname(runtime_path)
    return [(name, posixpath.join(directory, binary)) for name, binary in MODE_RUNTIMES]


def with_mode_runtimes(result: edit.Edit, runtime_path: str, file: str,
                       daemon: schema.Daemon | None, imports: edit.Imports,
                       effective: Mapping[str, Any] | None) -> edit.Edit:
    """`result` plus the `nvidia-cdi` and `nvidia-legacy` runtimes, each added (a copy of the
    same source runtime) or reconciled as the nvidia one is: one edit, its new tables recorded
    as changes (so the ledger and a revert know them)."""
    text, changes = result.text, list(result.changes)
    for name, binary in mode_runtime_binaries(runtime_path):
        more = edit.configure(text, edit.RuntimeSpec(name=name, binary=binary), file,
                              effective, daemon, imports)
        if more.added_runtime:
            path = (*schema.runtimes_path(more.version), name)
            table = tomltext.get_path(edit.parse(more.text.removeprefix(schema.BOM), file), path)
            changes.append(Change(path, None, table))
        changes += more.changes
        text = more.text
    return dataclasses.replace(result, text=text, changes=tuple(changes))


def cdi_problem(view: schema.View) -> str | None:
    """Why containerd `view` would not inject gpunode's CDI devices, or None when it would."""
    if view.problem is not None:
        return view.problem
    who = schema.show(view.daemon)
    if view.daemon < CDI_FROM:
        return f"{who} has no CDI support (it came with containerd 1.7)"
    value = view.cri.get("enable_cdi")
    on = value is True if view.daemon < CDI_ALWAYS_FROM else value is not False
    if not on:
        shown = tomltext.show(value) if value is not None else "unset: off by default"
        return f"{who} has CDI off (enable_cdi = {shown})"
    dirs = view.cri.get("cdi_spec_dirs")
    if isinstance(dirs, list):
        scanned = {posixpath.normpath(str(d)) for d in dirs}
        if not scanned & {SPEC_DIR, SPEC_DIR.removeprefix("/var")}:
            return (f"{who} scans cdi_spec_dirs {tomltext.show(dirs)}, which does not include "
                    f"{SPEC_DIR}, where gpunode writes its spec")
    return None


def configure_cdi(text: str, spec: edit.RuntimeSpec, file: str, daemon: schema.Daemon | None,
                  imports: edit.Imports = ()) -> edit.Edit:
    """CDI mode: only the CRI keys CDI needs (none on 2.x), no runtime. Refused for a
    containerd that has no CDI, or a layout in which the keys would not take effect."""
    if daemon is not None and daemon < CDI_FROM:
        raise EditError(file, f'containerd.gpu_access = "cdi" needs CDI, which '
                        f"{schema.show(daemon)} does not have (it came with containerd 1.7)",
                        hint=NO_CDI_HINT)
    bom = text.startswith(schema.BOM)
    body = text.removeprefix(schema.BOM)
    doc = edit.parse(body, file)
    version = schema.config_version(doc)
    changes: list[Change] = []
    if not doc and (spec.enable_cdi or spec.cdi_spec_dirs):
        changes.append(Change(("version",), None, 2))  # as edit.configure: every version reads 2
        version = 2
    changes += edit.cri_settings(doc, dataclasses.replace(spec, set_as_default=False), version)
    expected: dict[str, Any] = copy.deepcopy(doc)
    for change in changes:
        tomltext.set_path(expected, change.path, change.after)
    daemons = edit.readers(version, daemon)
    for view in edit.views_of(schema.Layer(file, expected, bom), imports, daemons, file):
        problem = None if view.daemon < CDI_FROM else cdi_problem(view)
        if problem is not None:
            raise EditError(file, f"CDI would not take effect: {problem}",
                            hint="set enable_cdi = true and cdi_spec_dirs (with /var/run/cdi) "
                            "in the file containerd reads, or let gpunode write them "
                            '(containerd.enable_cdi = "auto")')
    if not changes:
        return edit.Edit(text=text, version=version)
    new_text = tomltext.tomlkit_edit(body, changes, None, file)
    tomltext.verify(new_text, expected, file)
    return edit.Edit(text=schema.BOM + new_text if bom else new_text, version=version,
                     changes=tuple(changes))
