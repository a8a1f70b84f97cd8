"""The one place that knows where things live in a containerd config, per config version.

Nobody else spells `doc["plugins"][...]`: callers ask for the CRI plugin table or the runtimes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# version → name of the CRI plugin table that holds runtimes (containerd#5837 and the v3 split)
CRI_PLUGIN: dict[int, str] = {
    1: "cri",
    2: "io.containerd.grpc.v1.cri",
    3: "io.containerd.cri.v1.runtime",
}


class SchemaError(ValueError):
    """The document is not a containerd config gpunode understands; the message says why."""


def config_version(doc: Mapping[str, Any]) -> int:
    """No `version` key means 1; 2 and 3 are what containerd 1.x and 2.x write."""
    version = doc.get("version", 1)
    if isinstance(version, bool) or not isinstance(version, int) or version not in CRI_PLUGIN:
        raise SchemaError(f"'version' is {version!r}; gpunode understands 1 (or no version), 2 "
                          "and 3")
    return version


def cri_path(version: int) -> tuple[str, ...]:
    return ("plugins", CRI_PLUGIN[version])


def runtimes_path(version: int) -> tuple[str, ...]:
    return (*cri_path(version), "containerd", "runtimes")


def lookup(doc: Mapping[str, Any], path: tuple[str, ...]) -> Any:
    """The value at `path`, or None when any part is missing; a non-table on the way is an error."""
    node: Any = doc
    for depth, key in enumerate(path):
        if not isinstance(node, Mapping):
            raise SchemaError(f"'{'.'.join(path[:depth])}' is not a table")
        node = node.get(key)
        if node is None:
            return None
    return node


def runtimes(doc: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    """name → runtime table of the document's CRI plugin (empty when there are none)."""
    path = runtimes_path(config_version(doc))
    table = lookup(doc, path)
    if table is None:
        return {}
    if not isinstance(table, Mapping):
        raise SchemaError(f"'{'.'.join(path)}' is not a table")
    return {name: rt for name, rt in table.items() if isinstance(rt, Mapping)}


def binary_name(runtime: Mapping[str, Any]) -> str | None:
    options = runtime.get("options")
    value = options.get("BinaryName") if isinstance(options, Mapping) else None
    return value if isinstance(value, str) and value else None
