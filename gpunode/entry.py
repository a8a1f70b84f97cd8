"""The `gpunode` command's entry point: a no-op boot is answered before the CLI is imported."""

from __future__ import annotations

import sys


def main() -> int:
    from gpunode import __version__, fastpath

    parsed = fastpath.boot_args(sys.argv[1:])
    if parsed is not None:
        root, config, log_format = parsed
        if config is None and fastpath.unchanged(root, __version__, config):
            fastpath.report_unchanged(log_format)
            return 0
    from gpunode.cli import main as cli_main

    return cli_main()


if __name__ == "__main__":
    sys.exit(main())
