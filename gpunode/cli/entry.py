"""The `gpunode` command's entry point: a no-op boot, a CPU node's boot and `--version` are
answered before the CLI is imported (argparse and the command modules cost several times
Python's own start), and a plain `gpunode boot` or `gpunode status` runs without argparse
(clirun.plain)."""

from __future__ import annotations

import atexit
import gc
import os
import sys

EXIT_BROKEN_PIPE = 141  # what a shell reports for a command killed by SIGPIPE (128 + 13)


def main() -> int:
    _standard_streams()
    from gpunode import __version__

    if sys.argv[1:] == ["--version"]:  # as argparse's version action prints it (cliargs.py)
        print(f"gpunode {__version__}")
        return 0
    from gpunode.pipeline import fastpath

    parsed = fastpath.plain_args(sys.argv[1:])
    if parsed is not None and parsed[0] == ("boot",) and parsed[2] is None:
        _, root, _, log_format = parsed
        real = os.path.realpath(root)
        if fastpath.unchanged(real, __version__, None):
            fastpath.report_unchanged(log_format)
            return 0
        vendors = fastpath.pci_vendors(real)
        if fastpath.no_gpu_boot(real, log_format, vendors):
            return 0
        if fastpath.nvidia_listed(vendors):
            from gpunode import cpushare
            from gpunode.containerd import early

            cpushare.raise_for_boot(real)  # until READY=1 (cpushare.py says why)
            early.start(real)  # runs beside the imports below (early.py says why)
    if fastpath.command_word(sys.argv[1:]) != "watch":
        # Before the modules whose dataclass methods it has compiled; not for the daemon,
        # whose start is not waited for and which would keep the file's ~1 MB all its life.
        from gpunode import dataclass_cache, module_cache

        module_cache.install()
        dataclass_cache.install()
    try:
        code = None
        if parsed is not None:
            from gpunode.cli import run as clirun

            code = clirun.plain(*parsed)
        if code is None:
            from gpunode.cli.main import main as cli_main

            code = cli_main()
        sys.stdout.flush()
    except BrokenPipeError:
        # The reader went away (`gpunode status --json | head -1`): what it wanted it has;
        # no traceback, and nothing more written to a closed pipe at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    return code


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


def _command_word() -> str | None:
    from gpunode.pipeline import fastpath  # imported by main() already

    return fastpath.command_word(sys.argv[1:])


def run() -> None:
    """The installed command's entry point (console script, bundle, `python -m gpunode`):
    main(), then the interpreter's exit without its teardown. Freeing every module and object
    of a process that is about to end costs ~15 ms after a boot here (the whole no-op boot is
    ~3 ms over Python's start): what the exit must do is done first — stdout and stderr
    flushed, the atexit handlers run — and gpunode starts no threads that would be joined.
    An exception, SystemExit included (argparse's --help), takes Python's own way out.

    Every command but the daemon runs without the cyclic garbage collector: a one-shot command
    leaves little cyclic garbage (memory is reclaimed by reference counts), and its ~100
    modules' objects made the collector pass over them again and again, ~5 ms of a `status`
    here. `watch` runs for the node's lifetime and keeps it ("watch" anywhere in the command
    line keeps it: a false match only costs that time)."""
    if "watch" not in sys.argv[1:]:
        gc.disable()
    try:
        code = main()
    except BaseException:
        _discard_early()  # a probe leads its own session: a terminal's Ctrl-C does not reach it
        raise
    if code == 0 and "NOTIFY_SOCKET" in os.environ and _command_word() == "boot":
        # gpunode.service (Type=notify): READY=1, unless the pipeline has said it
        from gpunode.platform import sdnotify

        problem = sdnotify.ready("boot ok")
        if problem is not None:  # (clirun's `boot.notify_failed`, without its imports)
            sys.stderr.write(f"gpunode: READY=1 not sent ({problem}): systemd fails "
                             "gpunode.service as gpunode exits\n")
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:  # None: started with that descriptor closed
                stream.flush()
        except OSError:
            pass  # the reader went away (main() answers a closed stdout): nothing to add
    atexit._run_exitfuncs()
    _discard_early()  # a boot that ended before its containerd step asked (early.py)
    os._exit(code)


def _discard_early() -> None:
    """Stop and reap the containerd probe started early and never asked for, if one was."""
    early = sys.modules.get("gpunode.containerd.early")
    if early is not None:
        early.discard()


if __name__ == "__main__":
    run()
