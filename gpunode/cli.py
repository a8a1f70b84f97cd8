"""The `gpunode` command line: parse, load the agent config, run one command, map errors to exits.

Exit codes are a contract (README, "Command line"): 0 success, 1 a failed step or a node that is
not ready, 2 a usage error or an invalid agent config.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from gpunode import __version__, log
from gpunode.config import AgentConfig, load_config
from gpunode.errors import ConfigError, GpunodeError, UsageError
from gpunode.host import Host

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gpunode", description="Make an NVIDIA GPU node ready "
                                     "for Kubernetes at boot, and explain its state.")
    parser.add_argument("--version", action="version", version=f"gpunode {__version__}")
    parser.add_argument("--root", default="/", metavar="DIR",
                        help="host root to observe and change (default: /)")
    parser.add_argument("--config", metavar="FILE",
                        help="agent config (default: <root>/etc/gpunode/config.toml; missing "
                        "means defaults)")
    parser.add_argument("--log-format", choices=("console", "json"),
                        help="log format (default: console on a TTY, json otherwise)")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    detect = commands.add_parser("detect", help="list NVIDIA PCI functions")
    detect.add_argument("--json", action="store_true", help="print a JSON document")
    detect.set_defaults(run=_detect)

    status = commands.add_parser("status", help="live checks and the last boot record")
    status.add_argument("--json", action="store_true", help="print a JSON document")
    status.set_defaults(run=_status)
    return parser


def _detect(host: Host, _config: AgentConfig, args: argparse.Namespace) -> int:
    from gpunode.detect import detect

    with log.step("detect") as fields:
        detection = detect(host)
        fields.update(gpus=len(detection.gpus), functions=len(detection.functions))
    if args.json:
        _print_json({"schema_version": 1, "root": str(host.root), **detection.to_json()})
    else:
        from gpunode import render

        print(render.detection(detection))
    return EXIT_OK


def _status(host: Host, config: AgentConfig, args: argparse.Namespace) -> int:
    from gpunode import status

    with log.step("status") as fields:
        facts = status.observe(host, config)
        report = status.evaluate(facts)
        fields.update(verdict=report.verdict,
                      failed=[c.name for c in report.checks if c.state == status.FAIL])
    if args.json:
        _print_json(status.to_json(facts, report))
    else:
        from gpunode import render

        print(render.status(report, str(host.root), colour=sys.stdout.isatty()))
    return EXIT_OK if report.ready else EXIT_FAILED


def _print_json(document: object) -> None:
    print(json.dumps(document, indent=2, sort_keys=False))


def _host(root: str) -> Host:
    path = Path(root)
    if not path.is_absolute():
        path = Path.cwd() / path
    if not path.is_dir():
        raise UsageError(f"--root {root}: not a directory")
    return Host(path.resolve())


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    log.configure(args.log_format)
    run: Callable[[Host, AgentConfig, argparse.Namespace], int] = args.run
    try:
        host = _host(args.root)
        config = _load_config(host, args.config)
        log.configure(args.log_format, config.log.level)
        return run(host, config, args)
    except (ConfigError, UsageError) as exc:
        print(f"gpunode: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except GpunodeError as exc:
        if log.LOGGED not in getattr(exc, "__notes__", ()):
            log.get().error("command.failed", command=args.command, exc=exc)
        return EXIT_FAILED


def _load_config(host: Host, config: str | None) -> AgentConfig:
    """--config names a file on the machine gpunode runs on, not under --root."""
    if config is None:
        return load_config(host)
    return load_config(Host(), str(Path(config).absolute()))


if __name__ == "__main__":
    sys.exit(main())
