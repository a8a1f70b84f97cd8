"""KEY=VALUE files, read the one way: os-release and Flatcar's release files, update.conf,
systemd EnvironmentFile= files, the kubelet's kubeadm-flags.env and /etc/default/kubelet.

A line is `KEY=VALUE`; blank lines and comments (`#` or `;`, as systemd.exec(5) reads an
EnvironmentFile) are skipped, and so is a line without `=`. White space around the key and the
value is dropped, and one pair of matching quotes around the whole value (os-release(5):
"Variable assignment values must be enclosed in double or single quotes if they include
spaces").
"""

from __future__ import annotations

from collections.abc import Iterator


def assignments(text: str) -> Iterator[tuple[int, str, str]]:
    """(line number from 1, key, value) of each assignment, in file order."""
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        key, sep, value = line.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key:
            continue
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
            value = value[1:-1]
        yield number, key, value


def values(text: str) -> dict[str, str]:
    """KEY → VALUE; a key assigned twice keeps its last value (as systemd and a shell do)."""
    return {key: value for _, key, value in assignments(text)}
