"""The build strategy's costs on NVIDIA's real 550 files: cold (compiling the modules) and warm
(a boot and a `status` that find the build cache entry).

Run alone as `.venv/bin/python benchmarks/driver_cache.py [--cold]`, or through run.py (`make
bench`), whose JSON summary gets the keys report() returns. The real files come from the test
cache (tests/real: `make fetch-nvidia` fills it; fetched here if missing).

Warm, on fixture nodes running Debian's 6.1.0-50-amd64 (the modules' kernel) whose driver is
Debian's 550.163.01, as gpunode_testing.real_driver lays it out:
- `driver status --json` as a whole process, the driver loaded from a real cache entry
  (libraries, binaries, firmware and the real open modules: ~340 MB) whose stamp is valid,
  against the same node with the same user-space in /usr/lib64 (no cache entry to verify) and
  `python -c pass`, alternating. Their difference is the verification share: what checking
  the entry costs a reader (budget 2x `python -c pass`). The same on the entry without its
  stamp is what every boot and `status` paid before stamps: a full verification each time.
- `gpunode driver verify` (every file hashed, once per process) on that entry.
- A cache-hit boot's driver step, in-process: `step.plan` on a node whose driver is not
  loaded (the entry checked, the real modules' .modinfo read by the real modinfo, the firmware
  path decided), and `step.apply` with the kmod calls recorded instead of made.

Cold: what tests/real/nvidia_modules.py recorded when it compiled the real modules here (wall
and CPU seconds, cores, sizes before and after stripping); with `--cold`, the open modules are
compiled again in a temporary directory and timed. A build-strategy first boot adds the
downloads (the Flatcar developer container and the installer, not reachable here) to that
compile; Flatcar's own nvidia.service takes 5-10 minutes for its (proprietary) build.
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # the real-file fetchers (tests/real)

from gpunode.config import DriverConfig  # noqa: E402
from gpunode.driver import cache, modinfo, modules, step  # noqa: E402
from gpunode.gpu.detect import detect  # noqa: E402
from gpunode.platform.host import Host  # noqa: E402
from gpunode_testing import fixtures, real_driver  # noqa: E402
from real.nvidia_driver import ensure_driver  # noqa: E402
from real.nvidia_modules import ensure_modules  # noqa: E402

MACHINE = "nc24ads-a100-v4"
RUNS = 15
IN_PROCESS_RUNS = 20
SHARE_BUDGET = 2.0  # the verification share, in `python -c pass`es
FLATCAR_NVIDIA_SERVICE_S = (300, 600)  # Flatcar's own nvidia.service's first boot


@dataclass
class RecordingKernel:
    """The real modinfo; insmod and modprobe recorded, and loading nvidia makes the fixture
    show the loaded driver (no module can be loaded here)."""

    root: Path
    machine: fixtures.Machine
    calls: list[tuple[str, ...]] = field(default_factory=list)

    def modinfo(self, paths: list[str]) -> dict[str, modinfo.ModuleInfo]:
        return modules.KmodTools().modinfo(paths)

    def run(self, argv: tuple[str, ...]) -> None:
        self.calls.append(argv)
        if argv[0] == "insmod" and Path(argv[1]).name == "nvidia.ko":
            fixtures.load_driver(self.root, self.machine)


def _time(argv: list[str]) -> float:
    started = time.perf_counter()
    subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL, check=False)
    return time.perf_counter() - started


def _alternate(commands: dict[str, list[str]]) -> dict[str, float]:
    """Median milliseconds of each command, run alternately, after one checked run each."""
    for argv in commands.values():
        done = subprocess.run(argv, capture_output=True, text=True, check=False)
        if done.returncode not in (0, 1):
            raise SystemExit(f"{' '.join(argv)} exited {done.returncode}:\n{done.stderr}")
    samples: dict[str, list[float]] = {name: [] for name in commands}
    for _ in range(RUNS):
        for name, argv in commands.items():
            samples[name].append(_time(argv))
    return {name: statistics.median(values) * 1000.0 for name, values in samples.items()}


def _nodes(work: Path) -> dict[str, Any]:
    driver = ensure_driver("550")
    source = real_driver.read_source(driver.root, driver.version)
    built = ensure_modules("open")
    kw = {"modules": built.directory, "flavour": "open", "kernel": built.kernel}
    nodes = {
        "cache": real_driver.build_node(MACHINE, work / "cache", source, "build", **kw),
        "unstamped": real_driver.build_node(MACHINE, work / "unstamped", source, "build", **kw),
        "system": real_driver.build_node(MACHINE, work / "system", source, "sysext", **kw),
        "bare": real_driver.build_node(MACHINE, work / "bare", source, "build", state="bare",
                                       **kw),
    }
    entry = cache.entry_path(built.kernel, source.version, "open")
    # Hard links into the test cache changed the files' ctimes just now: a stamp taken within
    # cache.SETTLED_NS of that would not be trusted. Wait, as a boot minutes after its build.
    time.sleep(cache.SETTLED_NS / 1e9 + 0.5)
    for name in ("cache", "bare"):
        found, problem = cache.verify(Host(nodes[name]), entry, built.kernel, source.version,
                                      "open")
        if found is None:
            raise SystemExit(f"the real cache entry of {nodes[name]} is not usable: {problem}")
    size = sum(p.stat().st_size for p in Host(nodes["cache"]).path(entry).rglob("*")
               if p.is_file() and not p.is_symlink())
    return {"nodes": nodes, "entry": entry, "built": built, "source": source, "bytes": size}


def _driver_step(root: Path) -> dict[str, float]:
    """Median milliseconds of the driver step's plan, and plan + apply, on a bare node whose
    driver comes from the cache entry (a fresh copy of the node per apply)."""
    host = Host(root)
    config = DriverConfig(version=ensure_driver("550").version)
    machine = fixtures.MACHINES[MACHINE]
    plans = []
    for _ in range(IN_PROCESS_RUNS):
        kernel = RecordingKernel(root, machine)
        started = time.perf_counter()
        the_plan = step.plan(host, config, detect(host), kernel)
        plans.append(time.perf_counter() - started)
    if the_plan.choice.action != "load" or the_plan.firmware is None:
        raise SystemExit(f"expected a cache hit with a firmware path, planned: "
                         f"{the_plan.describe()}")
    # Fresh copies to load into, each stamped once settled (a copy is new inodes, which its
    # stamp would not vouch for: copied caches are verified fully, by design).
    copies = [root.parent / f"apply-{i}" for i in range(5)]
    for copy in copies:
        subprocess.run(["cp", "-a", str(root), str(copy)], check=True)
    time.sleep(cache.SETTLED_NS / 1e9 + 0.5)
    entry = the_plan.choice.source
    assert entry is not None
    for copy in copies:
        cache.verify(Host(copy), entry, the_plan.kernel, config.version, "open")
    applies = []
    for copy in copies:
        copied = Host(copy)
        kernel = RecordingKernel(copy, machine)
        started = time.perf_counter()
        step.apply(copied, step.plan(copied, config, detect(copied), kernel), config, kernel)
        applies.append(time.perf_counter() - started)
        shutil.rmtree(copy)
    return {"driver_step_plan_cache_hit_ms": statistics.median(plans) * 1000.0,
            "driver_step_cache_hit_ms": statistics.median(applies) * 1000.0}


def _cold(again: bool) -> dict[str, Any]:
    """The compile figures the test cache recorded, or (`again`) a fresh compile timed now."""
    figures: dict[str, Any] = {}
    for flavour in ("open", "proprietary"):
        build = ensure_modules(flavour).build
        sizes = build["modules"]
        assert isinstance(sizes, dict)
        figures[flavour] = {
            "compile_s": build["compile_seconds"], "compile_cpu_s": build["compile_cpu_seconds"],
            "cpus": build["cpus"], "fetch_headers_s": build["fetch_seconds"],
            "unstripped_mb": sum(s["unstripped"] for s in sizes.values()) / 1e6,
            "stripped_mb": sum(s["stripped"] for s in sizes.values()) / 1e6}
    if again:
        from real.kmod_tree import ensure_module_tree
        from real.nvidia_modules import _build, _headers_version

        tree = ensure_module_tree()
        driver = ensure_driver("550")
        with tempfile.TemporaryDirectory(prefix="gpunode-bench-compile-") as tmp:
            started = time.monotonic()
            fresh = _build(Path(tmp) / "open", tree.kver, _headers_version(
                tree.root / "BUILD", tree.kver), driver.kernel_source("open"), driver.version,
                "open")
            figures["open"]["compile_s"] = fresh.build["compile_seconds"]
            figures["open"]["compile_cpu_s"] = fresh.build["compile_cpu_seconds"]
            figures["open"]["cpus"] = fresh.build["cpus"]
            figures["open"]["recompiled_wall_s"] = round(time.monotonic() - started, 1)
    return figures


def measure(cold_again: bool = False) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="gpunode-bench-cache-") as tmp:
        made = _nodes(Path(tmp))
        nodes = made["nodes"]
        gpunode = [sys.executable, "-m", "gpunode"]
        status = _alternate({
            "pass": [sys.executable, "-c", "pass"],
            "system": [*gpunode, "--root", str(nodes["system"]), "driver", "status", "--json"],
            "cache": [*gpunode, "--root", str(nodes["cache"]), "driver", "status", "--json"],
            "unstamped": [*gpunode, "--root", str(nodes["unstamped"]), "driver", "status",
                          "--json"],
            "node_status": [*gpunode, "--root", str(nodes["cache"]), "status", "--json"],
            "verify": [*gpunode, "--root", str(nodes["cache"]), "driver", "verify"],
        })
        step_ms = _driver_step(nodes["bare"])
    return {"status": status, "step": step_ms, "entry_mb": made["bytes"] / 1e6,
            "cold": _cold(cold_again)}


def report(result: dict[str, Any]) -> dict[str, float]:
    """Print the lines of make bench; the numbers for its JSON summary."""
    ms = result["status"]
    base = ms["pass"]
    share = ms["cache"] - ms["system"]
    print(f"  driver cache, real 550 entry ({result['entry_mb']:.0f} MB): driver status "
          f"{ms['cache']:.1f} ms ({ms['cache'] / base:.1f}x python -c pass {base:.1f} ms), the "
          f"same node without a cache entry {ms['system']:.1f} ms: verification share "
          f"{share:.1f} ms = {share / base:.2f}x python -c pass (budget {SHARE_BUDGET:.0f}x: "
          f"{'OK' if share <= SHARE_BUDGET * base else 'OVER'}); without the stamp (every file "
          f"hashed, as before) {ms['unstamped']:.1f} ms ({ms['unstamped'] / base:.1f}x); "
          f"status {ms['node_status']:.1f} ms; driver verify {ms['verify']:.1f} ms")
    steps = result["step"]
    print(f"  driver step on a cache hit, in-process (entry checked, real modinfo, firmware "
          f"path): plan {steps['driver_step_plan_cache_hit_ms']:.1f} ms, plan + apply (kmod "
          f"calls recorded) {steps['driver_step_cache_hit_ms']:.1f} ms")
    cold = result["cold"]
    for flavour, c in cold.items():
        print(f"  cold: the real {flavour} modules compiled in {c['compile_s']:.0f} s "
              f"({c['compile_cpu_s']:.0f} s CPU on {c['cpus']} cores) after {c['fetch_headers_s']}"
              f" s fetching the headers; {c['unstripped_mb']:.0f} MB -> {c['stripped_mb']:.0f} MB "
              "stripped" + (f"; compiled again now in {c['recompiled_wall_s']} s"
                            if "recompiled_wall_s" in c else ""))
    low, high = FLATCAR_NVIDIA_SERVICE_S
    print(f"  cold: a build-strategy first boot = downloads (not reachable here) + the compile "
          f"above; Flatcar's nvidia.service: {low // 60}-{high // 60} min")
    return {
        "driver_status_cache_ms": ms["cache"], "driver_status_cache_ratio": ms["cache"] / base,
        "driver_status_system_ms": ms["system"],
        "driver_cache_verification_share_ms": share,
        "driver_cache_verification_share_ratio": share / base,
        "driver_status_unstamped_ms": ms["unstamped"],
        "driver_status_unstamped_ratio": ms["unstamped"] / base,
        "status_cache_entry_ms": ms["node_status"],
        "driver_verify_ms": ms["verify"], "driver_cache_entry_mb": result["entry_mb"],
        "driver_cache_python_pass_ms": base, **steps,
        "cold_open_compile_s": cold["open"]["compile_s"],
        "cold_open_compile_cpu_s": cold["open"]["compile_cpu_s"],
        "cold_open_compile_cpus": cold["open"]["cpus"],
        "cold_proprietary_compile_s": cold["proprietary"]["compile_s"],
        "cold_open_stripped_mb": cold["open"]["stripped_mb"],
        "cold_open_unstripped_mb": cold["open"]["unstripped_mb"],
    }


def main() -> int:
    import json

    summary = report(measure(cold_again="--cold" in sys.argv[1:]))
    print(json.dumps({k: round(v, 4) for k, v in summary.items()}, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
