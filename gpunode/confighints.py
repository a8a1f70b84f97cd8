"""The Python types of the agent config's keys, from its dataclasses' annotations, as
typing.get_type_hints, get_origin and get_args give them, without importing typing (~0.3x
Python's own start, on every boot that reads an agent config).

The annotations are text (`from __future__ import annotations`) made of builtin types, their
`|` and `[...]`, and the config module's own classes: evaluated in that module's namespace, as
get_type_hints does, they are the same objects. tests/unit/test_config.py compares the two.
"""

from __future__ import annotations

import dataclasses
import sys

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

_evaluated: dict[tuple[str, str], Any] = {}  # (module, annotation) -> its object, once


def hints_of(cls: type) -> dict[str, Any]:
    """Each field's type, by name (typing.get_type_hints for a config dataclass)."""
    namespace = vars(sys.modules[cls.__module__])
    hints = {}
    for f in dataclasses.fields(cls):
        key = (cls.__module__, f.type)
        if key not in _evaluated:
            _evaluated[key] = eval(f.type, namespace) if isinstance(f.type, str) else f.type
        hints[f.name] = _evaluated[key]
    return hints


def args_of(hint: Any) -> tuple[Any, ...]:
    """typing.get_args for these hints: `tuple[int, ...]` → (int, Ellipsis), a type → ()."""
    return getattr(hint, "__args__", ())


def item_type(hint: Any) -> type:
    """`tuple[int, ...]` → int: what an array's items must be (strings unless said)."""
    args = args_of(hint)
    return args[0] if args and isinstance(args[0], type) else str


def tri_state(hint: Any) -> bool:
    """`bool | str`: true, false or a word ("auto")."""
    return set(args_of(hint)) == {bool, str}


def expected_type(hint: Any) -> type:
    """`str | None` → str (None is only ever the absence of the key); `tuple[str, ...]` → list,
    the TOML array it is read from."""
    origin = getattr(hint, "__origin__", None)  # typing.get_origin's, for these hints
    if origin is tuple:
        return list
    if origin is dict:
        return dict
    args = [a for a in args_of(hint) if a is not type(None)]
    if tri_state(hint):
        return str  # true/false are accepted beside it (config._parse_section)
    return args[0] if args else hint
