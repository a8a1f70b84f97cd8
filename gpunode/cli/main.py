"""The `gpunode` command: parse the command line (argparse, cli/args.py), load the agent config,
run one command (cli/commands.py), and turn its errors into one report and an exit code.

Exit codes are a contract (docs/cli.md, "Exit codes"): 0 success, 1 a failed step or a node that
is not ready, 2 a usage error or an invalid agent config.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from gpunode import log
from gpunode.cli import args as cliargs
from gpunode.cli.common import EXIT_FAILED, EXIT_USAGE, agent_config, console, host_for
from gpunode.config import AgentConfig
from gpunode.errors import ArgumentsError, ConfigError, GpunodeError, UsageError

EXIT_BROKEN_PIPE = 141  # what a shell reports for a command killed by SIGPIPE (128 + 13)


def run() -> None:
    """The installed command's entry point (console script, the sysext's launcher,
    `python -m gpunode`)."""
    _standard_streams()
    try:
        code = main()
        sys.stdout.flush()
    except BrokenPipeError:
        # The reader went away (`gpunode status --json | head -1`): what it wanted it has;
        # no traceback, and nothing more written to a closed pipe at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = EXIT_BROKEN_PIPE
    sys.exit(code)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = cliargs.parse(argv)
    except ArgumentsError as exc:
        chosen = cliargs.log_format(argv)
        log.configure(chosen)
        return refused(exc, None, console(chosen))
    log.configure(args.log_format)
    from gpunode.cli.commands import COMMANDS

    name = cliargs.command_name(args)
    try:
        host = host_for(args.root)
        # image bake replaces the image's agent config, or checks it itself (bake/image.py)
        config = AgentConfig() if name == "image bake" else agent_config(host, args.config)
        log.configure(args.log_format, config.log.level)
        return COMMANDS[name](host, config, args)
    except (ConfigError, UsageError) as exc:
        return refused(exc, args.command, console(args.log_format))
    except GpunodeError as exc:
        if log.LOGGED not in getattr(exc, "__notes__", ()):
            log.get().error("command.failed", command=args.command, exc=exc)
        return EXIT_FAILED


def refused(exc: UsageError | ConfigError, command: str | None, on_console: bool) -> int:
    """A usage or agent-config error: exit 2, on a console the plain `gpunode: …` line
    (argparse's usage first, as it prints it) and a hint line, else one JSON event."""
    if log.LOGGED in getattr(exc, "__notes__", ()):
        return EXIT_USAGE  # its step already logged it (in the chosen format)
    hint = exc.hint or "see 'gpunode --help'"
    if on_console:
        if isinstance(exc, ArgumentsError):
            print(f"{exc.usage}{exc.prog}: error: {exc}", file=sys.stderr)
        else:
            print(f"gpunode: {exc}", file=sys.stderr)
        print(f"gpunode: hint: {hint}", file=sys.stderr)
        return EXIT_USAGE
    fields: dict[str, object] = {"command": command, "exit_code": EXIT_USAGE, "hint": hint}
    if isinstance(exc, ConfigError):
        fields.update(file=exc.file, key=exc.key, line=exc.line)
    if isinstance(exc, ArgumentsError):
        fields.update(usage=exc.usage.strip())
    log.get().error("command.refused", exc=exc, **fields)
    return EXIT_USAGE


def _standard_streams() -> None:
    """Descriptors 0, 1 and 2, when one was closed at the start (sys.stdout is then None), are
    /dev/null from now on: what gpunode writes there goes nowhere, as print() sends it, instead
    of failing, and no file gpunode opens takes the number (nor a program's writes to it)."""
    for fd, name, mode in ((0, "stdin", "r"), (1, "stdout", "w"), (2, "stderr", "w")):
        if getattr(sys, name) is None:
            null = os.open(os.devnull, os.O_RDWR)  # the lowest free number: `fd` itself
            if null != fd:
                os.dup2(null, fd)
                os.close(null)
            setattr(sys, name, open(fd, mode, closefd=False))  # noqa: SIM115  # for good


if __name__ == "__main__":
    run()
