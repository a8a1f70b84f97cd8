"""Integers from the text of kernel files and records: ASCII digits only, and within bounds.

`str.isdigit()` is true for "²" and "¹⁹⁵", which `int()` refuses (ValueError), and `int()`
itself takes "٣" (Arabic-Indic three), "1_000" and " 7 "; none of these is a number the kernel
writes. Every place gpunode turns text into an int goes through here, so a bad value is
`None` (for the caller to report) and never an exception or a surprise.
"""

from __future__ import annotations

_DIGITS = frozenset("0123456789")
_SPACE = " \t\n\r\v\f"  # ASCII whitespace only; str.strip() would also take U+3000 and kin
_MAX_DIGITS = 40  # far above any value gpunode reads; int() of a huge string is quadratic

# Linux's dev_t: 12-bit major, 20-bit minor (include/linux/kdev_t.h, MINORBITS = 20).
MAX_MAJOR = (1 << 12) - 1
MAX_MINOR = (1 << 20) - 1


def parse_uint(text: str | None, maximum: int | None = None) -> int | None:
    """The non-negative integer `text` spells in ASCII digits (surrounding ASCII whitespace
    allowed), or None: empty, another character, or above `maximum`."""
    if text is None:
        return None
    digits = text.strip(_SPACE)
    if not digits or len(digits) > _MAX_DIGITS or not _DIGITS.issuperset(digits):
        return None
    value = int(digits)
    return None if maximum is not None and value > maximum else value


def parse_int(text: str | None, minimum: int | None = None,
              maximum: int | None = None) -> int | None:
    """Like parse_uint, with an optional leading '-' (e.g. numa_node's -1)."""
    if text is None:
        return None
    digits = text.strip(_SPACE)
    negative = digits.startswith("-")
    rest = digits[1:] if negative else digits
    value = parse_uint(rest) if rest == rest.strip(_SPACE) else None
    if value is None:
        return None
    value = -value if negative else value
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        return None
    return value
