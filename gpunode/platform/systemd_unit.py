"""Read a systemd unit the way systemd would: main file, drop-ins, resets, variable expansion.

Used under `--root`, where no systemd can be asked; settings are parsed from the unit files in
systemd's search paths, highest priority first.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field

from gpunode.errors import HostError
from gpunode.platform import envfile
from gpunode.platform.host import Host

SYSTEM_UNIT_PATHS = (
    "/etc/systemd/system",
    "/run/systemd/system",
    "/usr/local/lib/systemd/system",
    "/usr/lib/systemd/system",
    "/lib/systemd/system",
)


@dataclass(frozen=True)
class UnitSettings:
    """A unit's settings as its files give them, read the way systemd would."""

    name: str
    fragment: str | None  # the main unit file, None when the unit does not exist
    dropins: tuple[str, ...] = ()
    environment: dict[str, str] = field(default_factory=dict)
    exec_start: tuple[str, ...] = ()  # argv of the last ExecStart=, variables expanded
    exec_start_raw: tuple[str, ...] = ()  # the same words as written (${VAR} unexpanded)
    environment_files: tuple[str, ...] = ()  # EnvironmentFile= paths ("-" dropped)
    masked: bool = False


def enabled_by_links(host: Host, name: str) -> bool:
    """Enabled as the files say it, for a tree no systemd manages (--root): a `<target>.wants/`
    or `.requires/` link to the unit in any unit directory, and no mask (a link to /dev/null
    in a directory systemd reads first)."""
    if read_unit(host, name).masked:
        return False
    for directory in SYSTEM_UNIT_PATHS:
        for entry in host.list_dir(directory):
            if entry.endswith((".wants", ".requires")) and (
                    host.exists(f"{directory}/{entry}/{name}")
                    or host.read_link(f"{directory}/{entry}/{name}") is not None):
                return True
    return False


def read_unit(host: Host, name: str) -> UnitSettings:
    fragment = next((f"{d}/{name}" for d in SYSTEM_UNIT_PATHS if host.exists(f"{d}/{name}")
                     or host.read_link(f"{d}/{name}") is not None), None)
    if fragment is None:
        return UnitSettings(name=name, fragment=None)
    if host.read_link(fragment) == "/dev/null":
        return UnitSettings(name=name, fragment=fragment, masked=True)
    dropins = _dropins(host, name)
    env: dict[str, str] = {}
    env_files: list[str] = []
    exec_lines: list[str] = []
    for path in (fragment, *dropins):
        try:
            for key, value in _service_assignments(host.read_text(path)):
                if key == "Environment":
                    _apply_environment(env, value)
                elif key == "EnvironmentFile":
                    env_files = [] if not value else [*env_files, value.removeprefix("-")]
                elif key == "ExecStart":
                    exec_lines = [] if not value else [*exec_lines, value]
        except ValueError as exc:  # shlex: unbalanced quotes
            raise HostError("parse", host.display(path), str(exc)) from exc
    try:
        raw = shlex.split(exec_lines[-1]) if exec_lines else []
    except ValueError as exc:
        raise HostError("parse", host.display(fragment), f"ExecStart: {exc}") from exc
    # systemd.exec(5): "Settings from these files override settings made with Environment=".
    env.update(environment_files(host, env_files))
    argv = expand_words(raw, env)
    return UnitSettings(name=name, fragment=fragment, dropins=tuple(dropins), environment=env,
                        exec_start=tuple(argv), exec_start_raw=tuple(raw),
                        environment_files=tuple(env_files))


def _dropins(host: Host, name: str) -> list[str]:
    """`<unit>.d/*.conf` across the search paths; a higher-priority file shadows the same name."""
    chosen: dict[str, str] = {}
    for directory in SYSTEM_UNIT_PATHS:
        for entry in host.list_dir(f"{directory}/{name}.d"):
            if entry.endswith(".conf"):
                chosen.setdefault(entry, f"{directory}/{name}.d/{entry}")
    return [chosen[entry] for entry in sorted(chosen)]


def _service_assignments(text: str) -> list[tuple[str, str]]:
    """Key=value pairs of the [Service] section, continuation lines joined."""
    pairs: list[tuple[str, str]] = []
    section = ""
    logical = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not logical and (not line or line[0] in "#;"):
            continue
        if line.endswith("\\"):
            logical += line[:-1] + " "
            continue
        line, logical = logical + line, ""
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
        elif section == "Service" and "=" in line:
            key, _, value = line.partition("=")
            pairs.append((key.strip(), value.strip()))
    return pairs


def _apply_environment(env: dict[str, str], value: str) -> None:
    if not value:
        env.clear()  # an empty assignment resets the list
        return
    for word in shlex.split(value):
        key, sep, val = word.partition("=")
        if sep:
            env[key] = val


def environment_files(host: Host, paths: list[str] | tuple[str, ...]) -> dict[str, str]:
    """The variables of EnvironmentFile= files, later files overriding earlier ones; a file
    that is not there (systemd's "-" prefix) or not absolute gives none."""
    env: dict[str, str] = {}
    for path in paths:
        text = host.read_optional(path) if path.startswith("/") else None
        env.update(envfile.values(text or ""))
    return env


_VAR_RE = re.compile(r"\$\{(\w+)\}|\$(\w+)")


def expand_command(line: str, env: dict[str, str]) -> list[str]:
    """ExecStart line → argv, as systemd would run it (see expand_words)."""
    return expand_words(shlex.split(line), env)


def expand_words(words: list[str] | tuple[str, ...], env: dict[str, str]) -> list[str]:
    """Prefixes dropped, ${VAR} kept as one word, a lone $VAR split on white space."""
    argv: list[str] = []
    for word in words:
        whole = _VAR_RE.fullmatch(word)
        if whole and whole.group(2):
            argv.extend(env.get(whole.group(2), "").split())
        else:
            argv.append(_VAR_RE.sub(lambda m: env.get(m.group(1) or m.group(2), ""), word))
    if argv:
        argv[0] = strip_exec_prefix(argv[0])
    return argv


def strip_exec_prefix(word: str) -> str:
    """An Exec*= command's executable without systemd's special prefixes ("-", "@", "+", "!",
    "!!", ":"; systemd.service(5), "Command lines")."""
    return word.lstrip("-@+!:")
