"""What runs one command once its arguments are known: the host, the agent config, the log
and the exits (docs/cli.md, "Exit codes": 1 a failed step or a node that is not ready, 2 a
usage error or an invalid agent config).

The full command line (cli.py, argparse) and the short way in share it: entry.py runs a plain
`gpunode boot` or `gpunode status [--json]`, as fastpath.plain_args reads it, straight
through `plain` — argparse, the parser of every command and the modules it names cost ~15 ms
of every GPU node's boot, and as much of every `status`.
"""

from __future__ import annotations

import json
import os
import sys
from types import SimpleNamespace

from gpunode import log
from gpunode.cli.common import EXIT_FAILED, EXIT_OK, EXIT_USAGE, Command, changes_node
from gpunode.config import AgentConfig, load_config
from gpunode.errors import ArgumentsError, ConfigError, GpunodeError, UsageError
from gpunode.platform.host import Host, plain_path

TYPE_CHECKING = False  # typing for type checkers only (docs/design.md, the boot path)
if TYPE_CHECKING:
    from typing import Any

LOG_FORMATS = ("json", "console")  # cliargs' choices for --log-format


def execute(name: str, run: Command, args: Any) -> int:
    """Run command `name` with its parsed arguments (`args.root`, `args.config`,
    `args.log_format`, `args.command` and the command's own)."""
    try:
        host = host_for(args.root)
        # image bake replaces the image's agent config, or checks it itself (bake/image.py)
        config = AgentConfig() if name == "image bake" else _load_config(host, args.config)
        log.configure(args.log_format, config.log.level)
        return run(host, config, args)
    except (ConfigError, UsageError) as exc:
        return refused(exc, args.command, console(args.log_format))
    except GpunodeError as exc:
        if log.LOGGED not in getattr(exc, "__notes__", ()):
            log.get().error("command.failed", command=args.command, exc=exc)
        return EXIT_FAILED


def plain(words: tuple[str, ...], root: str, config: str | None,
          log_format: str | None) -> int | None:
    """`gpunode [--root R] [--config C] [--log-format F] boot|status [--json]` (one of
    fastpath.PLAIN) without the full parser; None where the log format is not one the CLI
    takes (the full CLI refuses it)."""
    if log_format is not None and log_format not in LOG_FORMATS:
        return None
    log.configure(log_format)
    args = SimpleNamespace(root=root, config=config, log_format=log_format, command=words[0],
                           dry_run=False, json=words[1:] == ("--json",))
    return execute(words[0], boot if words[0] == "boot" else status, args)


@changes_node("boot")
def boot(host: Host, config: AgentConfig, args: Any) -> int:
    from gpunode.pipeline import boot as pipeline

    run = pipeline.boot(host, config, pipeline.adapters_for(host, config), recorded=_ready)
    log.get().info("boot.done", outcome=run.outcome, steps=[s["name"] for s in run.steps])
    return EXIT_FAILED if run.outcome == "failed" else EXIT_OK


def _ready(run: Any) -> None:
    """gpunode.service (Type=notify) is done once the record is written: containerd and the
    kubelet start now, a failed boot's too (ordering only, as the unit says)."""
    from gpunode import cpushare
    from gpunode.platform import sdnotify

    problem = sdnotify.ready(f"boot {run.outcome}")
    cpushare.give_back()  # containerd's start now weighs as much as gpunode's exit
    if problem is not None:
        log.get().warning("boot.notify_failed", problem=problem,
                          note="systemd does not hear that the boot is done: gpunode.service "
                          "fails when gpunode exits, and containerd starts then")


def status(host: Host, config: AgentConfig, args: Any) -> int:
    from gpunode import status as checks

    with log.step("status") as fields:
        facts = checks.observe(host, config)
        report = checks.evaluate(facts)
        fields.update(verdict=report.verdict,
                      failed=[c.name for c in report.checks if c.state == checks.FAIL])
    if args.json:
        print_json(checks.to_json(facts, report))
    else:
        from gpunode.cli import render

        print(render.status(report, str(host.root), colour=sys.stdout.isatty()))
    return EXIT_OK if report.ready else EXIT_FAILED


def print_json(document: object) -> None:
    print(json.dumps(document, indent=2, sort_keys=False))


def host_for(root: str) -> Host:
    if not root:
        raise UsageError("--root is empty: name the node's root directory (/ for this machine)")
    try:  # os.path, not pathlib: pathlib is imported by no plain boot or status
        resolved = os.path.realpath(root, strict=True)
    except (FileNotFoundError, NotADirectoryError):
        raise UsageError(f"--root {root}: not a directory") from None
    except (OSError, ValueError) as exc:  # a symlink loop, a NUL byte, no permission
        raise UsageError(f"--root {root}: cannot be used ({exc})") from None
    if not os.path.isdir(resolved):
        raise UsageError(f"--root {root}: not a directory")
    return Host(resolved)


def refused(exc: UsageError | ConfigError, command: str | None, console: bool) -> int:
    """A usage or agent-config error: exit 2, on a console the plain `gpunode: …` line
    (argparse's usage first, as it prints it) and a hint line, else one JSON event."""
    if log.LOGGED in getattr(exc, "__notes__", ()):
        return EXIT_USAGE  # its step already logged it (in the chosen format)
    hint = exc.hint or "see 'gpunode --help'"
    if console:
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


def console(log_format: str | None) -> bool:
    """As log.configure decides: console when asked, or by default on a terminal."""
    return log_format == "console" or (log_format is None and sys.stderr.isatty())


def _load_config(host: Host, config: str | None) -> AgentConfig:
    """--config names a file on the machine gpunode runs on, not under --root."""
    if config is None:
        return load_config(host)
    return load_config(Host(), plain_path(config if config.startswith("/") else
                                          os.path.join(os.getcwd(), config)))
