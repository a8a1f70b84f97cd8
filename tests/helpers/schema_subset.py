"""A JSON Schema (2020-12) validator for the few keywords the cluster-azure excerpt
(tests/data/cluster-azure/node-pools.schema.json) uses, for when the jsonschema library is not in
the virtualenv: type, properties, required, enum, items, additionalProperties (a boolean),
patternProperties, local $ref, minimum, exclusiveMinimum; annotations ($schema, $comment, title,
description, default) are ignored. A keyword outside that list is an error, never a silent pass,
so a schema that grows one needs this file (or jsonschema) first."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from conftest import TEST_DATA

CLUSTER_AZURE_SCHEMA = TEST_DATA / "cluster-azure" / "node-pools.schema.json"
ANNOTATIONS = {"$schema", "$comment", "title", "description", "default"}
KEYWORDS = {"type", "properties", "required", "enum", "items", "additionalProperties",
            "patternProperties", "$ref", "minimum", "exclusiveMinimum", "$defs"} | ANNOTATIONS
TYPES = {"object": dict, "array": list, "string": str, "boolean": bool}


def load(path: Path = CLUSTER_AZURE_SCHEMA) -> dict[str, Any]:
    return json.loads(path.read_text())


def errors(schema: dict[str, Any], instance: Any) -> list[str]:
    """Every way `instance` fails `schema`, as 'path: what' strings (empty: it is valid)."""
    found: list[str] = []
    _check(schema, schema, instance, "$", found)
    return found


def _is_type(value: Any, name: str) -> bool:
    if name == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if name == "number":
        return isinstance(value, int | float) and not isinstance(value, bool)
    return isinstance(value, TYPES[name]) and not (name != "boolean" and isinstance(value, bool))


def _check(root: dict[str, Any], schema: dict[str, Any], value: Any, where: str,
           found: list[str]) -> None:
    unknown = set(schema) - KEYWORDS
    if unknown:
        raise ValueError(f"{where}: keywords {sorted(unknown)} are not in this subset")
    if "$ref" in schema:
        target: Any = root
        for part in schema["$ref"].removeprefix("#/").split("/"):
            target = target[part]
        _check(root, target, value, where, found)
    if "type" in schema and not _is_type(value, schema["type"]):
        found.append(f"{where}: {value!r} is not of type {schema['type']!r}")
        return
    if "enum" in schema and value not in schema["enum"]:
        found.append(f"{where}: {value!r} is not one of {schema['enum']!r}")
    if "minimum" in schema and value < schema["minimum"]:
        found.append(f"{where}: {value!r} is less than {schema['minimum']}")
    if "exclusiveMinimum" in schema and value <= schema["exclusiveMinimum"]:
        found.append(f"{where}: {value!r} is not above {schema['exclusiveMinimum']}")
    if isinstance(value, dict):
        _check_object(root, schema, value, where, found)
    if isinstance(value, list) and "items" in schema:
        for index, item in enumerate(value):
            _check(root, schema["items"], item, f"{where}[{index}]", found)


def _check_object(root: dict[str, Any], schema: dict[str, Any], value: dict[str, Any],
                  where: str, found: list[str]) -> None:
    found.extend(f"{where}: {name!r} is a required property"
                 for name in schema.get("required", []) if name not in value)
    properties = schema.get("properties", {})
    patterns = schema.get("patternProperties", {})
    for name, item in value.items():
        matched = False
        if name in properties:
            matched = True
            _check(root, properties[name], item, f"{where}.{name}", found)
        for pattern, subschema in patterns.items():
            if re.search(_ecma(pattern), name):
                matched = True
                _check(root, subschema, item, f"{where}.{name}", found)
        if not matched and schema.get("additionalProperties", True) is False:
            found.append(f"{where}: additional property {name!r} is not allowed")


def _ecma(pattern: str) -> str:
    """An ECMA-262 pattern for Python's re: a final `$` matches only at the very end there (in
    Python also before a final newline)."""
    return pattern[:-1] + r"\Z" if pattern.endswith("$") and not pattern.endswith("\\$") \
        else pattern
