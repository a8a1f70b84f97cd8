"""What every `gpunode` command shares: the exit codes (docs/cli.md, "Exit codes"), a command's
signature, the node lock a command that changes the node holds (`changes_node`), the host and
agent config a command runs with, and its JSON output."""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from collections.abc import Callable

from gpunode.config import AgentConfig, load_config
from gpunode.errors import UsageError
from gpunode.platform.files import plain_path
from gpunode.platform.host import Host

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2

Command = Callable[[Host, AgentConfig, argparse.Namespace], int]
Settings = Callable[[AgentConfig, argparse.Namespace], AgentConfig]


def changes_node(name: str, settings: Settings | None = None) -> Callable[[Command], Command]:
    """The command holds the node lock (gpunode/platform/nodelock.py) while it runs; `--dry-run`
    changes nothing and takes none. `boot` waits longer for it than the others.

    `settings` checks the command line and applies it to the agent config before the lock is
    taken: a refused argument (exit 2) is refused before any work, so it leaves the root as it
    was — not even /run/gpunode/lock is made."""

    def wrap(command: Command) -> Command:
        @functools.wraps(command)
        def locked(host: Host, config: AgentConfig, args: argparse.Namespace) -> int:
            from gpunode.platform import nodelock

            if settings is not None:
                config = settings(config, args)
            if getattr(args, "dry_run", False):
                return command(host, config, args)
            wait = nodelock.BOOT_WAIT_SECONDS if name == "boot" else nodelock.WAIT_SECONDS
            with nodelock.held(host, name, wait):
                return command(host, config, args)

        return locked

    return wrap


def print_json(document: object) -> None:
    print(json.dumps(document, indent=2, sort_keys=False))


def host_for(root: str) -> Host:
    """The Host of --root, refused (UsageError) where it names no directory."""
    if not root:
        raise UsageError("--root is empty: name the node's root directory (/ for this machine)")
    try:
        resolved = os.path.realpath(root, strict=True)
    except (FileNotFoundError, NotADirectoryError):
        raise UsageError(f"--root {root}: not a directory") from None
    except (OSError, ValueError) as exc:  # a symlink loop, a NUL byte, no permission
        raise UsageError(f"--root {root}: cannot be used ({exc})") from None
    if not os.path.isdir(resolved):
        raise UsageError(f"--root {root}: not a directory")
    return Host(resolved)


def agent_config(host: Host, config: str | None) -> AgentConfig:
    """The agent config: <root>/etc/gpunode/config.toml, or --config, which names a file on
    the machine gpunode runs on, not under --root."""
    if config is None:
        return load_config(host)
    return load_config(Host(), plain_path(config if config.startswith("/") else
                                          os.path.join(os.getcwd(), config)))


def console(log_format: str | None) -> bool:
    """As log.configure decides: console when asked, or by default on a terminal."""
    return log_format == "console" or (log_format is None and sys.stderr.isatty())
