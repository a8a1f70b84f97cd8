"""Benchmarks for gpunode's time budgets, measured in one run on this machine.

Run from the repository root as `.venv/bin/python benchmarks/run.py [--quick]` (`make bench`;
`--quick` shortens only the watch daemon's idle window, 60 s to 10 s: watch_daemon.py).

What it measures, on a fixture of the biggest machine we model (ND96amsr A100 v4: 8 GPUs,
6 NVSwitches and a NIC) plus 200 other PCI functions, as a busy bare-metal PCI tree would have:

1. `gpunode.gpu.detect.detect` in-process. The design budget is 20 ms: detect runs on every boot and
   on every `status`, so it must stay cheap even where sysfs lists hundreds of functions.
2. `gpunode --root <fixture> status --json` as a whole process, against `python -c pass` on the
   same interpreter (guardrail 12x).
3. `gpunode --root <fixture> detect --json` as a whole process, with the same comparison.
4. `cdi generate` in-process (budget 10 ms), and the cdi step's share of a whole
   `gpunode --root <fixture> boot` of the same machine with its driver loaded and nothing
   configured (a fresh copy per run, so every boot writes the spec and the runtime): the step's
   own `duration_ms` from its `step.done` event against the boot process's wall time.
5. The bundle nodes run: packaging/build_sysext.py's relocated Python, built and unpacked
   here, against the venv's console script, for `--version` and a CPU node's boot; and the
   bundled CPython's own `-IS -c pass` (another build than the venv's where the build machine
   has the distribution's python3.11, which the build takes; the ratios stay against the
   venv's `python -c pass`).
6. The boot path in a real systemd (benchmarks/boot_path.py; as root, where the systemd
   namespace harness runs; otherwise its keys are null and the reason is printed).
7. `gpunode watch`, the daemon (watch_daemon.py): an Xid line to its GPUReady PATCH (median,
   budget 1 s), its idle CPU over 60 s, its VmRSS before and after a flood of kernel lines.
8. The build strategy on NVIDIA's real 550 files (driver_cache.py): `driver status` on a
   node whose driver comes from a real build cache entry, the verification share of it (budget
   2x `python -c pass`), without the entry's stamp (every file hashed, as before), `driver
   verify`, a cache-hit boot's driver step, and the compile times of the real modules (cold).

Whole-process timings alternate the commands so drift on the machine hits both alike, and report
medians rather than means so one slow run does not move the result. The subprocesses run without
PYTHONDONTWRITEBYTECODE, so they use the bytecode `make setup` compiled, as a real install would.

The last line printed is one JSON object with every median (milliseconds) and ratio, for tools,
among them the keys one run is compared with another by: python_pass_ms, noop_boot_ratio (a CPU
node's `gpunode boot`: nothing to do), pipeline_boot_ratio (a GPU node's boot with nothing to
change: the whole pipeline), status_ratio, bundle_version_ratio_vs_venv,
bundle_noop_boot_ratio_vs_venv, boot_path_gpunode_ms, boot_path_peers_ms,
boot_path_gpunode_share_ms, driver_cache_verification_share_ratio (a reader's check of a real
550 build cache entry over python -c pass), driver_status_cache_ratio,
boot_path_gpunode_share_ratio (the share over
boot_path_python_pass_ms, `python -c pass` timed between the boots; before 2026-12-04 over
python_pass_ms, timed minutes earlier: boot_path.py says why) and cpu_node_noop_ratio;
boot_path_gpunode_share_with_spawn_ms and its ratio are the share as runs before 2026-12-04
measured it, with systemd's spawn of containerd (boot_path.py says why).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import driver_cache  # beside this file (a script's directory is on sys.path)
import watch_daemon

from gpunode.gpu.detect import detect
from gpunode.platform.host import Host
from gpunode_testing.fixtures import MACHINES, Machine, Options, build, with_extra_functions

REPO = Path(__file__).resolve().parents[1]
DETECT_BUDGET_MS = 20.0
DETECT_WARMUP = 5
DETECT_RUNS = 50
CDI_BUDGET_MS = 10.0  # gpunode cdi generate in-process on the ND96 fixture
PROCESS_RUNS = 15
EXTRA_FUNCTIONS = 200


def median_ms(samples: Sequence[float]) -> float:
    return statistics.median(samples) * 1000.0


def time_call(call: Callable[[], object]) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def bench_detect_in_process(host: Host) -> list[float]:
    """Seconds per detect(host) call, after a sanity check that it finds the real hardware."""
    result = detect(host)
    if len(result.gpus) != 8 or len(result.nvswitches) != 6:
        raise SystemExit(f"detect found {len(result.gpus)} GPUs and {len(result.nvswitches)} "
                         "NVSwitches on the fixture, expected 8 and 6")
    for _ in range(DETECT_WARMUP):
        detect(host)
    return [time_call(lambda: detect(host)) for _ in range(DETECT_RUNS)]


def bench_cdi_in_process(host: Host) -> list[float]:
    """Seconds per spec made and rendered as YAML (what boot's cdi step does), ND96 fixture."""
    from gpunode.cdi import node as cdinode
    from gpunode.cdi import spec as cdi

    def generate() -> None:
        cdi.render(cdinode.generate(host), "yaml")

    for _ in range(DETECT_WARMUP):
        generate()
    return [time_call(generate) for _ in range(DETECT_RUNS)]


def bench_boot_cdi_share(machine: Machine, parent: Path,
                         env: dict[str, str]) -> list[dict[str, float]]:
    """Per `gpunode --root <fresh copy> --log-format json boot` of `machine` with its driver
    loaded and nothing configured: the whole process's milliseconds ("boot") and each step's
    duration_ms from its step.done event."""
    template = build(machine, parent / "boot-template", Options(state="driver"))
    toolkit = template / "usr/bin/nvidia-container-runtime"  # the toolkit, so the step configures
    toolkit.write_text("#!/bin/sh\n")
    toolkit.chmod(0o755)
    runs = []
    for i in range(PROCESS_RUNS):
        fresh = parent / f"boot-{i}"
        # cp -a keeps the fixture's character devices (shutil.copytree would read them)
        subprocess.run(["cp", "-a", str(template), str(fresh)], check=True)
        argv = [*gpunode_command(), "--root", str(fresh), "--log-format", "json", "boot"]
        start = time.perf_counter()
        done = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              env=env, check=False)
        wall = time.perf_counter() - start
        events = [json.loads(line) for line in done.stderr.splitlines() if line.startswith("{")]
        steps = {e["step"]: e for e in events if e.get("event") == "step.done"}
        if done.returncode != 0 or not steps.get("cdi", {}).get("changed"):
            raise SystemExit(f"{' '.join(argv)} exited {done.returncode} without writing the "
                             f"CDI spec, expected 0 and a written spec\nstderr:\n{done.stderr}")
        runs.append({"boot": wall * 1000.0,
                     **{name: float(e["duration_ms"]) for name, e in steps.items()}})
        shutil.rmtree(fresh)
    return runs


def gpunode_command() -> list[str]:
    """The venv's console script next to the interpreter, else `python -m gpunode`."""
    script = Path(sys.executable).with_name("gpunode")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "gpunode"]


def subprocess_env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def run_once(argv: Sequence[str], env: dict[str, str]) -> int:
    return subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL, env=env, check=False).returncode


def check_exit_zero(argv: Sequence[str], env: dict[str, str]) -> None:
    result = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                            env=env, check=False)
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} exited {result.returncode}, expected 0\n"
                         f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}")


def bench_processes(commands: dict[str, list[str]],
                    env: dict[str, str]) -> dict[str, list[float]]:
    """Seconds per run of each command, run alternately, after one untimed checked round."""
    for argv in commands.values():
        check_exit_zero(argv, env)
    samples: dict[str, list[float]] = {name: [] for name in commands}
    for _ in range(PROCESS_RUNS):
        for name, argv in commands.items():
            samples[name].append(time_call(lambda argv=argv: run_once(argv, env)))
    return samples


def configure_fixture(parent: Path) -> Path:
    """A T4 node with the driver up and Flatcar's read-only containerd config, toolkit present."""
    # plain-file device nodes: copytree cannot copy character devices, and configure needs none
    root = build(MACHINES["nc4as-t4-v3"], parent / "configure-template",
                 Options(state="driver", dev_nodes="plain"))
    runtime = root / "usr/bin/nvidia-container-runtime"
    runtime.write_text("#!/bin/sh\n")
    runtime.chmod(0o755)
    return root


def bench_configure(template: Path, work: Path, env: dict[str, str]) -> dict[str, list[float]]:
    """`containerd configure` on a fresh copy of the template (change) and on an already
    configured copy (no change), alternating with `python -c pass`."""
    configured = work / "configured"
    shutil.copytree(template, configured, symlinks=True)
    configure = [*gpunode_command(), "containerd", "configure"]
    check_exit_zero([*configure[:-2], "--root", str(configured), *configure[-2:]], env)
    samples: dict[str, list[float]] = {"pass": [], "change": [], "no-change": []}
    for i in range(PROCESS_RUNS):
        fresh = work / f"fresh-{i}"
        shutil.copytree(template, fresh, symlinks=True)
        argv = [*gpunode_command(), "--root", str(fresh), "containerd", "configure"]
        samples["change"].append(time_call(lambda argv=argv: run_once(argv, env)))
        argv = [*gpunode_command(), "--root", str(configured), "containerd", "configure"]
        samples["no-change"].append(time_call(lambda argv=argv: run_once(argv, env)))
        samples["pass"].append(time_call(lambda: run_once([sys.executable, "-c", "pass"], env)))
    return samples


def cpu_node_fixture(parent: Path) -> Path:
    """A CPU-only node (Standard_D4s_v5): its boot is answered before the pipeline loads."""
    return build(MACHINES["azure-d4s-v5"], parent / "cpu", Options(state="bare"))


def warm_boot_fixture(parent: Path) -> Path:
    """A T4 node after its first boot: driver loaded, runtime configured; one boot run first,
    so the measured boots find nothing to do."""
    root = build(MACHINES["nc4as-t4-v3"], parent / "warm", Options(state="ready"))
    check_exit_zero([*gpunode_command(), "--root", str(root), "boot"], subprocess_env())
    return root


def bench_label(parent: Path, env: dict[str, str]) -> tuple[dict[str, list[float]], list[str]]:
    """`gpunode label` with nothing to change against the tests' local HTTPS API server;
    returns the samples and the requests the timed runs made (one GET each, no PATCH)."""
    from gpunode_testing.kube_api import FakeApiServer
    from gpunode_testing.kube_objects import make_node
    from gpunode_testing.pki import make_pki

    node = "nc4as-t4-v3-vmss000000"
    pki = make_pki(parent / "pki", node_name=node)
    root = build(MACHINES["nc4as-t4-v3"], parent / "labelled", Options(state="ready"))
    client = root / "var/lib/kubelet/pki/kubelet-client-current.pem"
    client.parent.mkdir(parents=True)
    shutil.copy(pki.kubelet_client_current, client)
    (root / "etc/kubernetes").mkdir(parents=True)
    with FakeApiServer(pki, nodes=[make_node(node, gpus=1)]) as api:
        api.write_kubeconfig(root / "etc/kubernetes/kubelet.conf",
                             Path("/var/lib/kubelet/pki/kubelet-client-current.pem"),
                             Path("/var/lib/kubelet/pki/kubelet-client-current.pem"))
        label = [*gpunode_command(), "--root", str(root), "label"]
        check_exit_zero(label, env)  # the first run labels the node
        api.requests.clear()
        samples = bench_processes({"pass": [sys.executable, "-c", "pass"], "label": label}, env)
        calls = sorted({f"{r.method} {r.path}" for r in api.requests})
    return samples, calls


def bench_bundle(parent: Path, cpu: Path, env: dict[str, str]) -> dict[str, list[float]]:
    """Seconds per run of the bundled and the venv's gpunode, `--version` and a CPU node's
    boot, alternating; the bundle built by packaging/build_sysext.py, unpacked."""
    from boot_path import build_bundle

    bundled = build_bundle(parent) / "usr/lib/gpunode"
    bundle = [str(bundled / "gpunode")]
    venv = gpunode_command()
    plain = {"PATH": "/usr/bin:/bin"}  # as systemd runs it: no virtualenv, no PYTHON*
    return bench_processes({
        "bundle_python_pass": [str(bundled / "bin/python3.11"), "-IS", "-c", "pass"],
        "bundle_version": [*bundle, "--version"], "venv_version": [*venv, "--version"],
        "bundle_noop": [*bundle, "--root", str(cpu), "boot"],
        "venv_noop": [*venv, "--root", str(cpu), "boot"],
    }, {**plain, **{k: v for k, v in env.items() if k == "HOME"}})


def boot_path_figures() -> dict[str, float | None]:
    """benchmarks/boot_path.py's figures; None for each where the harness cannot run."""
    keys = ("boot_path_gpunode_ms", "boot_path_peers_ms", "boot_path_peers_ratio",
            "boot_path_gpunode_share_ms", "boot_path_containerd_spawn_ms",
            "boot_path_control_spawn_ms", "boot_path_gpunode_share_with_spawn_ms",
            "boot_path_python_pass_ms",
            "cpu_node_gpunode_unit_ms",
            "cpu_node_python_unit_ms", "cpu_node_noop_ratio", "cpu_node_configured_unit_ms",
            "cpu_node_configured_ratio")
    if os.geteuid() != 0:
        print("  boot path in a real systemd: skipped, it needs root (a systemd namespace)")
        return dict.fromkeys(keys)
    import boot_path

    figures = boot_path.measure()
    boot_path.report(figures)
    return {key: figures[key] for key in keys}


HEAVY = ("tomlkit", "pystemd")


def heavy_imports(argv: list[str], env: dict[str, str]) -> list[str]:
    """Which of tomlkit and pystemd the command imports (python -X importtime)."""
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "gpunode", *argv],
                          capture_output=True, text=True, env=env, check=False)
    imported = {line.split("|")[-1].strip() for line in done.stderr.splitlines()
                if line.startswith("import time:")}
    return [name for name in HEAVY if name in imported]


def main() -> int:
    machine = with_extra_functions(MACHINES["nd96amsr-a100-v4"], EXTRA_FUNCTIONS)
    print(f"gpunode benchmarks: {sys.executable} (Python {sys.version.split()[0]}); "
          "subprocesses run with bytecode writing allowed (PYTHONDONTWRITEBYTECODE unset)")
    with tempfile.TemporaryDirectory(prefix="gpunode-bench-") as tmp:
        root = build(machine, Path(tmp) / "host", Options(state="ready"))

        detect_ms = median_ms(bench_detect_in_process(Host(root)))
        verdict = "OK" if detect_ms <= DETECT_BUDGET_MS else "OVER"
        print(f"  detect in-process (ND96 + {EXTRA_FUNCTIONS} other functions): median "
              f"{detect_ms:.1f} ms over {DETECT_RUNS} runs "
              f"(budget {DETECT_BUDGET_MS:.0f} ms: {verdict})")
        cdi_ms = median_ms(bench_cdi_in_process(Host(root)))
        print(f"  cdi generate in-process (ND96, YAML): median {cdi_ms:.1f} ms over "
              f"{DETECT_RUNS} runs (budget {CDI_BUDGET_MS:.0f} ms: "
              f"{'OK' if cdi_ms <= CDI_BUDGET_MS else 'OVER'})")
        boots = bench_boot_cdi_share(machine, Path(tmp), subprocess_env())
        share = statistics.median(run["cdi"] / run["boot"] for run in boots)
        boot_ms = statistics.median(run["boot"] for run in boots)
        step_ms = {name: statistics.median(run[name] for run in boots)
                   for name in boots[0] if name != "boot"}
        print(f"  cdi step's share of gpunode boot (same machine, driver loaded, nothing "
              f"configured; {len(boots)} runs): median {share:.0%}, cdi step "
              f"{step_ms['cdi']:.1f} ms of {boot_ms:.1f} ms for the whole process (steps: "
              + ", ".join(f"{name} {ms:.1f}" for name, ms in step_ms.items()) + " ms)")
        summary: dict[str, float | None] = {
            "detect_in_process_ms": detect_ms, "cdi_generate_in_process_ms": cdi_ms,
            "boot_nd96_ms": boot_ms, "boot_cdi_step_share": share,
            **{f"boot_step_{name}_ms": ms for name, ms in step_ms.items()}}

        gpunode = [*gpunode_command(), "--root", str(root)]
        samples = bench_processes({
            "pass": [sys.executable, "-c", "pass"],
            "status": [*gpunode, "status", "--json"],
            "detect": [*gpunode, "detect", "--json"],
        }, subprocess_env())

        warm = warm_boot_fixture(Path(tmp))
        cpu = cpu_node_fixture(Path(tmp))
        boot = bench_processes({
            "pass": [sys.executable, "-c", "pass"],
            "cpu": [*gpunode_command(), "--root", str(cpu), "boot"],
            "pipeline": [*gpunode_command(), "--root", str(warm), "boot"],
        }, subprocess_env())
        labelled, label_calls = bench_label(Path(tmp), subprocess_env())
        template = configure_fixture(Path(tmp))
        configure = bench_configure(template, Path(tmp), subprocess_env())
        heavy = heavy_imports(["--root", str(Path(tmp) / "configured"), "containerd",
                               "configure"], subprocess_env())
        bundle = bench_bundle(Path(tmp), cpu, subprocess_env())
        (Path(tmp) / "watch").mkdir()
        watched = watch_daemon.bench_watch(Path(tmp) / "watch", subprocess_env(),
                                           quick="--quick" in sys.argv[1:])

    base = median_ms(samples["pass"])
    summary["python_pass_ms"] = base
    print(f"  python -c pass: median {base:.1f} ms over {PROCESS_RUNS} runs")
    for name in ("status", "detect"):
        ms = median_ms(samples[name])
        summary[f"{name}_process_ms"], summary[f"{name}_process_ratio"] = ms, ms / base
        print(f"  gpunode {name} --json (whole process): median {ms:.1f} ms, "
              f"{ms / base:.1f}x python -c pass")
    base = median_ms(boot["pass"])
    ms = median_ms(boot["cpu"])
    summary["boot_cpu_node_ms"], summary["boot_cpu_node_ratio"] = ms, ms / base
    print(f"  gpunode boot, CPU node (nothing to do): median {ms:.1f} ms, {ms / base:.1f}x "
          f"python -c pass (guardrail 2x: {'OK' if ms <= 2 * base else 'OVER'})")
    ms = median_ms(boot["pipeline"])
    summary["boot_pipeline_ms"], summary["boot_pipeline_ratio"] = ms, ms / base
    print(f"  gpunode boot, GPU node after its first boot (the whole pipeline, nothing to "
          f"change): median {ms:.1f} ms, {ms / base:.1f}x python -c pass (guardrail 12x: "
          f"{'OK' if ms <= 12 * base else 'OVER'})")
    base = median_ms(labelled["pass"])
    ms = median_ms(labelled["label"])
    summary["label_ms"], summary["label_ratio"] = ms, ms / base
    print(f"  gpunode label, nothing to change (local HTTPS API server): median {ms:.1f} ms, "
          f"{ms / base:.1f}x python -c pass; requests made: {', '.join(label_calls)}")
    base = median_ms(configure["pass"])
    print(f"  containerd configure, Flatcar default (python -c pass in this loop: {base:.1f} ms)")
    for name in ("change", "no-change"):
        ms = median_ms(configure[name])
        summary[f"configure_{name.replace('-', '_')}_ms"] = ms
        summary[f"configure_{name.replace('-', '_')}_ratio"] = ms / base
        print(f"    {name}: median {ms:.1f} ms, {ms / base:.1f}x python -c pass")
    print(f"    no-change run imports {'/'.join(HEAVY)}: {', '.join(heavy) or 'none'}")
    for what in ("version", "noop"):
        ours, venv = median_ms(bundle[f"bundle_{what}"]), median_ms(bundle[f"venv_{what}"])
        summary[f"bundle_{what}_ms"], summary[f"venv_{what}_ms"] = ours, venv
        summary[f"bundle_{'version' if what == 'version' else 'noop_boot'}_ratio_vs_venv"] = \
            ours / venv
        print(f"  bundled gpunode ({'--version' if what == 'version' else 'CPU node boot'}): "
              f"median {ours:.1f} ms, {ours / venv:.2f}x the venv's {venv:.1f} ms")
    summary["bundle_python_pass_ms"] = median_ms(bundle["bundle_python_pass"])
    print(f"  bundled CPython, -IS -c pass: median {summary['bundle_python_pass_ms']:.1f} ms "
          f"(the venv's python -c pass, which the ratios are against: "
          f"{summary['python_pass_ms']:.1f} ms)")
    summary.update(watch_daemon.report(watched))
    summary.update(driver_cache.report(driver_cache.measure()))
    figures = boot_path_figures()
    pass_ms = figures["boot_path_python_pass_ms"]  # timed between the boots (boot_path.py)
    share = figures["boot_path_gpunode_share_ms"]
    with_spawn = figures["boot_path_gpunode_share_with_spawn_ms"]
    summary.update({
        "noop_boot_ratio": summary["boot_cpu_node_ratio"],
        "pipeline_boot_ratio": summary["boot_pipeline_ratio"],
        "status_ratio": summary["status_process_ratio"],
        **figures,
        "boot_path_gpunode_share_ratio": share / pass_ms if share and pass_ms else None,
        "boot_path_gpunode_share_with_spawn_ratio":
            with_spawn / pass_ms if with_spawn and pass_ms else None})
    print(json.dumps({name: None if value is None else round(value, 4)
                      for name, value in summary.items()}, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
