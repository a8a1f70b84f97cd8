"""The bake manifest /etc/gpunode/baked.json, read back: what `gpunode image bake` placed, and
what the node sees of it now (for `plan`, `status` and the driver step).

Cheap to import (no urllib, no tomllib): status reads it on every call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gpunode.errors import BakeManifestError
from gpunode.platform import envfile, records
from gpunode.platform.host import Host

MANIFEST = "/etc/gpunode/baked.json"
VERSIONED = ("gpunode-sysext", "toolkit-sysext")  # described with their version
# The artifacts of one kernel (gpunode/bake/optional.py's kinds), as describe() names them.
_DESCRIBED = {"prebuilt-modules": "prebuilt modules for {a.kernel}",
              "driver-build": "NVIDIA {a.name} built for {a.kernel}"}
SCHEMA_VERSION = 1
OS_RELEASES = ("/usr/lib/os-release", "/etc/os-release")  # the initramfs reads the first


@dataclass(frozen=True)
class Artifact:
    """One entry of the bake manifest: an artifact the bake placed, where, and from which source."""

    what: str
    name: str
    version: str | None
    path: str
    sha512: str
    source: str
    kernel: str | None = None  # a prebuilt set's or a build's (gpunode/bake/optional.py)


@dataclass(frozen=True)
class Baked:
    """The manifest's facts: the image it was baked for, and the artifacts."""

    os_version: str | None
    kernel: str | None
    artifacts: tuple[Artifact, ...]
    document: dict[str, Any]

    def drivers(self) -> tuple[Artifact, ...]:
        return tuple(a for a in self.artifacts if a.what == "driver-sysext")

    def describe(self) -> str:
        """'gpunode 0.2.0, nvidia-drivers-570-open (Flatcar 4459.2.1)'"""
        parts = [f"{a.name} {a.version}" if a.what in VERSIONED and a.version else a.name
                 for a in self.artifacts if a.what.endswith("-sysext")]
        parts += [_DESCRIBED[a.what].format(a=a) for a in self.artifacts if a.what in _DESCRIBED]
        return ", ".join(parts) + (f" (Flatcar {self.os_version})" if self.os_version else "")

    def kernel_bound(self) -> tuple[Artifact, ...]:
        """The prebuilt sets and builds: modules for one kernel each."""
        return tuple(a for a in self.artifacts if a.what in _DESCRIBED and a.kernel)


def read(host: Host) -> dict[str, Any] | None:
    """The manifest as a JSON object, None when there is none; BakeManifestError when damaged."""
    data = host.read_optional_bytes(MANIFEST, limit=1 << 20)
    if data is None:
        return None
    document = records.loads_json(data, host.display(MANIFEST), BakeManifestError)
    if not isinstance(document, dict):
        raise BakeManifestError(f"{host.display(MANIFEST)}: not a JSON object")
    return document


def load(host: Host) -> Baked | None:
    """The manifest checked key by key (BakeManifestError names the key); None: none."""
    document = read(host)
    if document is None:
        return None
    shown = host.display(MANIFEST)
    reader = records.Reader(document, shown, BakeManifestError)
    reader.schema("schema_version", SCHEMA_VERSION)
    os_info = document.get("os")
    if not isinstance(os_info, dict):
        reader.fail("os", f"is {records.kind(os_info)}, expected an object")
    os_reader = records.Reader(os_info, shown, BakeManifestError)
    entries = document.get("artifacts")
    if not isinstance(entries, list):
        reader.fail("artifacts", f"is {records.kind(entries)}, expected a list")
    artifacts = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict):
            reader.fail(f"artifacts[{i}]", f"is {records.kind(entry)}, expected an object")
        r = records.Reader(entry, f"{shown} (artifacts[{i}])", BakeManifestError)
        artifacts.append(Artifact(r.text("what"), r.text("name"), r.text("version", True),
                                  r.path("path"), r.text("sha512"), r.text("source"),
                                  r.text("kernel", True, True)))
    return Baked(os_reader.text("version", True, True), os_reader.text("kernel", True, True),
                 tuple(artifacts), document)


def baked_driver(baked: Baked | None, merged: tuple[str, ...]) -> Artifact | None:
    """The baked driver sysext among the merged ones (`flatcar-nvidia-drivers-570-open`)."""
    if baked is None:
        return None
    return next((a for a in baked.drivers() if f"flatcar-{a.name}" in merged), None)


def os_version(host: Host) -> str | None:
    """The Flatcar version the node runs now (VERSION of its os-release)."""
    release = next((t for p in OS_RELEASES if (t := host.read_optional(p)) is not None), "")
    return envfile.values(release).get("VERSION") or None


def usable_drivers(baked: Baked | None, host: Host) -> tuple[Artifact, ...]:
    """The baked driver sysexts a boot can merge: for the OS version the node runs, in place."""
    if baked is None:
        return ()
    version = os_version(host)
    return tuple(a for a in baked.drivers()
                 if version is not None and a.version == version and host.exists(a.path))
