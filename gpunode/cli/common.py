"""What every `gpunode` command shares: the exit codes (docs/cli.md, "Exit codes"), a command's
signature, and the node lock a command that changes the node holds (`changes_node`)."""

from __future__ import annotations

import functools
from collections.abc import Callable

from gpunode.config import AgentConfig
from gpunode.platform.host import Host

TYPE_CHECKING = False  # typing for type checkers only (docs/design.md, the boot path)
if TYPE_CHECKING:
    import argparse  # a plain boot runs without it (clirun.boot_plain)

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2

Command = Callable[[Host, AgentConfig, "argparse.Namespace"], int]


Settings = Callable[[AgentConfig, "argparse.Namespace"], AgentConfig]


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
