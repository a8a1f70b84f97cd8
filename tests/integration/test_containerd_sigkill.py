"""SIGKILL at random points of `containerd configure` and `revert` on the Flatcar layout (a copy of
/usr's config in /etc, a containerd.service.d drop-in, the ledger): whatever prefix of the
write a kill leaves, the next configure succeeds and gives exactly the configured node, and the
next revert exactly the untouched one, with no temp file left.

Where the kills land: a plain `python -m gpunode ...` spends most of its ~80 ms importing
Python, so uniform delays over its whole run rarely hit the few milliseconds of writing. Most
kills therefore go to a *warm* worker: the same interpreter and `gpunode.cli.main.main` with the
command's modules already imported, waiting for a go line; the delay is uniform over the
command's own measured duration from that go. A few kills of the plain `-m gpunode` run keep
the real entry point honest. The RNG seed is printed (set GPUNODE_KILL_SEED to replay one).
"""

from __future__ import annotations

import os
import random
import signal
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from conftest import REPO, HostFactory
from gpunode.containerd import journal
from hostile.support import Cli, snapshot

WARM_KILLS = 110  # half during configure, half during revert
COLD_KILLS = 16
WORKER = (
    "import sys\n"
    "import gpunode.cli.main, gpunode.containerd.step, gpunode.containerd.edit\n"
    "import gpunode.platform.systemd\n"
    "import tomlkit\n"
    "sys.stdout.write('ready\\n'); sys.stdout.flush()\n"
    "sys.stdin.readline()\n"
    "sys.exit(gpunode.cli.main.main(sys.argv[1:]))\n"
)


def argv(root: Path, command: str) -> list[str]:
    return ["--root", str(root), "--log-format", "json", "containerd", command]


class Worker:
    """A warm interpreter that runs one gpunode command when told to."""

    def __init__(self, args: list[str]) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-c", WORKER, *args], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, cwd=REPO)
        assert self.process.stdout is not None
        assert self.process.stdout.readline() == b"ready\n"

    def go(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(b"go\n")
        self.process.stdin.flush()

    def kill_after(self, delay: float) -> None:
        self.go()
        time.sleep(delay)
        self.process.send_signal(signal.SIGKILL)
        self.process.wait()
        self.close()

    def close(self) -> None:
        for stream in (self.process.stdin, self.process.stdout):
            if stream is not None:
                stream.close()


def state(root: Path, pristine: dict[str, object], configured: dict[str, object]) -> str:
    """Where a kill left the node: untouched, configured, or somewhere in between."""
    now = snapshot(root)
    if now == pristine:
        return "untouched"
    if now == configured:
        return "configured"
    if (root / journal.JOURNAL.lstrip("/")).exists():
        return "journal pending"
    if any(p.endswith(".gpunode-tmp") for p in now):
        return "temp file left"
    return "other"


def seeded_node(make_host: HostFactory) -> tuple[int, random.Random, Path]:
    """A seeded RNG (GPUNODE_KILL_SEED replays a run; the seed is printed) and a Flatcar
    fixture node with the driver loaded and the NVIDIA runtime installed."""
    seed = int(os.environ.get("GPUNODE_KILL_SEED", time.time_ns() % 2**31))
    print(f"GPUNODE_KILL_SEED={seed}")
    root = make_host("nc4as-t4-v3", "driver").root
    runtime = root / "usr/bin/nvidia-container-runtime"
    runtime.write_text("#!/bin/sh\n")
    runtime.chmod(0o755)
    (root / "var/lib").mkdir(parents=True, exist_ok=True)
    return seed, random.Random(seed), root


def test_sigkill_anywhere_in_configure_or_revert_is_always_recovered(
    make_host: HostFactory, cli: Cli,
) -> None:
    seed, rng, root = seeded_node(make_host)
    pristine = snapshot(root)
    assert cli(*argv(root, "configure")).code == 0
    configured = snapshot(root)
    assert (root / "etc/systemd/system/containerd.service.d/10-gpunode.conf").exists()
    assert cli(*argv(root, "revert")).code == 0
    assert snapshot(root) == pristine

    durations = {command: calibrate(root, command, cli) for command in ("configure", "revert")}
    print(f"command durations after 'go' (s): {durations}")
    seen: Counter[str] = Counter()
    recovered = 0
    spare: Worker | None = None
    for i in range(WARM_KILLS + COLD_KILLS):
        command = "configure" if i % 2 == 0 else "revert"
        if command == "revert":
            assert cli(*argv(root, "configure")).code == 0
        if i < WARM_KILLS:
            worker = spare or Worker(argv(root, command))
            # the next worker starts while this one is killed and checked (2 cores)
            spare = Worker(argv(root, "revert" if command == "configure" else "configure")) \
                if i + 1 < WARM_KILLS else None
            worker.kill_after(rng.uniform(0, durations[command]))
        else:
            kill_cold(root, command, rng.uniform(0, 0.15))
        seen[f"{command}: {state(root, pristine, configured)}"] += 1
        done = cli(*argv(root, "configure"))
        assert done.code == 0, (seed, i, done.err)
        recovered += sum(e["event"] == "containerd.interrupted_change_undone"
                         for e in done.events)
        assert snapshot(root) == configured, (seed, i, command)
        done = cli(*argv(root, "revert"))
        assert done.code == 0, (seed, i, done.err)
        assert snapshot(root) == pristine, (seed, i, command)
    print(f"states a kill left: {dict(sorted(seen.items()))}; rolled back: {recovered}")
    # The kills really landed inside the writes, not only before or after them.
    assert recovered >= 3, (seed, seen)


def calibrate(root: Path, command: str, cli: Cli) -> float:
    """The command's own duration in a warm worker, from 'go' to its exit (median of 3)."""
    times = []
    for _ in range(3):
        if command == "revert":
            assert cli(*argv(root, "configure")).code == 0
        worker = Worker(argv(root, command))
        start = time.perf_counter()
        worker.go()
        assert worker.process.wait() == 0
        times.append(time.perf_counter() - start)
        worker.close()
        if command == "configure":
            assert cli(*argv(root, "revert")).code == 0
    return statistics.median(times)


def kill_cold(root: Path, command: str, delay: float) -> None:
    """The plain entry point, `python -m gpunode ...`, killed after `delay`."""
    process = subprocess.Popen([sys.executable, "-m", "gpunode", *argv(root, command)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               cwd=REPO)
    time.sleep(delay)
    process.send_signal(signal.SIGKILL)
    process.wait()


BOOT_KILLS = 40
RECORDS = ("run/gpunode/state.json",)  # timestamps: compared by kind


def booted_state(root: Path) -> dict[str, object]:
    """The node after a boot: every entry, the boot record by presence only."""
    return {path: (entry if path not in RECORDS else "present")
            for path, entry in snapshot(root).items()}


def test_sigkill_anywhere_in_boot_on_flatcar_is_recovered_by_the_next_boot(
    make_host: HostFactory, cli: Cli,
) -> None:
    """Device nodes, the containerd copy and drop-in, the boot record, the stamp: wherever a
    kill lands in `gpunode boot`, the next boot gives exactly the node an uninterrupted boot
    gives, no temp file and no journal left."""
    seed, rng, root = seeded_node(make_host)
    boot = ["--root", str(root), "--log-format", "json", "boot"]
    pristine = snapshot(root)

    def reset() -> None:
        """Back to the pristine node: revert, then remove what boot made besides."""
        assert cli(*argv(root, "revert")).code == 0
        for name in sorted(snapshot(root).keys() - pristine.keys(), reverse=True):
            path = root / name
            path.rmdir() if path.is_dir() and not path.is_symlink() else path.unlink()
        assert snapshot(root) == pristine

    assert cli(*boot).code == 0
    booted = booted_state(root)
    assert (root / "etc/systemd/system/containerd.service.d/10-gpunode.conf").exists()
    reset()
    times = []
    for _ in range(3):
        worker = Worker(boot)
        start = time.perf_counter()
        worker.go()
        assert worker.process.wait() == 0
        times.append(time.perf_counter() - start)
        worker.close()
        reset()
    duration = statistics.median(times)
    seen: Counter[str] = Counter()
    spare: Worker | None = None
    for i in range(BOOT_KILLS):
        worker = spare or Worker(boot)
        spare = Worker(boot) if i + 1 < BOOT_KILLS else None
        worker.kill_after(rng.uniform(0, duration))
        left = snapshot(root)
        seen["temp file left" if any(p.endswith(".gpunode-tmp") for p in left) else
             "journal pending" if (root / journal.JOURNAL.lstrip("/")).exists() else
             "booted" if booted_state(root) == booted else "partway"] += 1
        done = cli(*boot)
        assert done.code == 0, (seed, i, done.err)
        assert booted_state(root) == booted, (seed, i)
        reset()
    if spare is not None:
        spare.process.kill()
        spare.close()
    print(f"duration {duration:.3f} s; states a kill left: {dict(sorted(seen.items()))}")
    assert seen["partway"] + seen["journal pending"] + seen["temp file left"] >= 3, (seed, seen)
