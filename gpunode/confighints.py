"""The Python types of the agent config's keys, read from its dataclasses' annotations
(typing.get_type_hints), and what each means for the TOML value that sets it."""

from __future__ import annotations

import typing
from typing import Any


def hints_of(cls: type) -> dict[str, Any]:
    """Each field's type, by name."""
    return typing.get_type_hints(cls)


def args_of(hint: Any) -> tuple[Any, ...]:
    """`tuple[int, ...]` → (int, Ellipsis), a type → ()."""
    return typing.get_args(hint)


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
    origin = typing.get_origin(hint)
    if origin is tuple:
        return list
    if origin is dict:
        return dict
    args = [a for a in args_of(hint) if a is not type(None)]
    if tri_state(hint):
        return str  # true/false are accepted beside it (config._parse_section)
    return args[0] if args else hint
