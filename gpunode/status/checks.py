"""`status.evaluate`: pure, facts in, checks out (each non-ok check with a hint), so every
verdict can be tested from data alone. The containerd checks live in status/containerd.py."""

from __future__ import annotations

import re

from gpunode.driver import devices, nouveau
from gpunode.errors import DriverError, GpuInitError
from gpunode.gpu import driverinfo
from gpunode.gpu.detect import (
    COSMETIC_ATTRIBUTES,
    Detection,
    PciFunction,
    UndecidedError,
    undecided_reason,
)
from gpunode.pipeline.state import BootRecord
from gpunode.status import baked, containerd, toolkit
from gpunode.status.facts import FAIL, OK, SKIP, WARN, Check, Report, StatusFacts, wanted_labels


def evaluate(facts: StatusFacts) -> Report:
    detection = facts.detection
    if detection is None:
        failure = facts.detection_error
        checks = [Check("gpus", FAIL, f"PCI detection failed: {failure}",
                        "check that sysfs is mounted and readable",
                        failure.code if failure else None)]
        return Report(tuple(checks), "not-ready")
    if not detection.gpus:
        checks = [_gpus(detection, facts), _pci_scan(detection, facts.driver_flavour)]
        skipped = ("GPU detection undecided (see gpus)" if detection.undecided
                   else "no NVIDIA GPU on this host")
        checks += [Check(name, SKIP, skipped) for name in _GPU_CHECKS]
        checks += [*baked.check(facts.bake), _last_boot_check(facts)]
        verdict = "not-ready" if any(c.state == FAIL for c in checks) else "no-gpu"
        return Report(tuple(checks), verdict)
    driver = driverinfo.parse_version(facts.driver_version_text or "")
    checks = [
        _gpus(detection, facts),
        _pci_scan(detection, facts.driver_flavour),
        _nouveau(detection),
        _binding(detection),
        _driver(facts, driver),
        _driver_gpus(facts, detection, driver),
        _gpu_init(facts, driver),
        _device_nodes(facts, driver),
        _cdi_spec(facts, driver),
        containerd.runtime_check(facts),
        toolkit.check(facts),
        containerd.process_check(facts, "containerd"),
        containerd.process_check(facts, "kubelet"),
        _device_plugin(facts),
        _watch(facts),
        *baked.check(facts.bake),
        _last_boot_check(facts),
    ]
    verdict = "not-ready" if any(c.state == FAIL for c in checks) else "ready"
    checks.insert(-1, _node(facts, detection, verdict == "ready"))
    return Report(tuple(checks), verdict)


_GPU_CHECKS = ("nouveau", "gpu_binding", "driver", "driver_gpus", "gpu_init", "device_nodes",
               "cdi_spec",
               "containerd_runtime", "toolkit", "containerd_running", "kubelet_running",
               "device_plugin", "watch", "node")


def _describe(functions: tuple[PciFunction, ...], models: dict[str, str]) -> str:
    products: dict[str, int] = {}
    for f in functions:
        name = f.product_name or models.get(f.address) or f"10de:{f.device_id or 'unknown'}"
        products[name] = products.get(name, 0) + 1
    return ", ".join(f"{n}x {p}" for p, n in products.items())


def _gpus(d: Detection, facts: StatusFacts) -> Check:
    undecided = undecided_reason(d)
    if undecided is not None:
        # Neither "no GPU" nor a GPU count to trust: the same refusal boot, plan and driver
        # load give (detect.require_decided).
        found = f"{_count(len(d.gpus), 'GPU')} identified, but " if d.gpus else ""
        return Check("gpus", FAIL, f"GPU detection undecided: {found}{undecided}",
                     UndecidedError.hint)
    if not d.gpus:
        return Check("gpus", SKIP, "no NVIDIA GPU on this host; gpunode has nothing to do")
    models = {a: i.model for a, i in facts.gpu_infos.items() if i.model}
    detail = f"{_count(len(d.gpus), 'GPU')}: {_describe(d.gpus, models)}"
    if d.nvswitches:
        detail += f"; {len(d.nvswitches)} NVSwitch"
    return Check("gpus", OK, detail)


def _pci_scan(d: Detection, flavour: str = "auto") -> Check:
    if not d.problems:
        return Check("pci_scan", OK, f"{_count(len(d.functions), 'NVIDIA PCI function')} read via "
                     f"{d.source}; names from {d.names_source}")
    # Serious: a problem with the PCI tree as a whole or a function that may be an unreadable
    # GPU (both undecided), or an NVIDIA function attribute gpunode decides by (detect.
    # COSMETIC_ATTRIBUTES are the others). A GPU's device id decides the driver flavour,
    # unless driver.flavour is pinned: the driver step refuses exactly then (flavour.choose).
    def decides(f: PciFunction, name: str) -> bool:
        if name == "device":
            return f.kind == "gpu" and flavour == "auto"
        if name == "driver":  # whether the GPU is usable (vfio-pci) or not
            return f.kind == "gpu"
        return name not in COSMETIC_ATTRIBUTES

    serious = {f.address for f in d.functions if any(decides(f, a) for a in f.unreadable)}
    serious |= set(d.undecided)
    where = [p.split(": ", 1)[0] for p in d.problems]
    serious |= {w for w in where if not _PCI_ADDRESS.fullmatch(w)}
    check = "check the device with 'lspci -nn -vvv -s ADDRESS' and the kernel log"
    hint = f"a PCI function's sysfs attributes could not be read or parsed: {check}"
    if any("device" in f.unreadable and f.address in serious for f in d.gpus):
        hint = ("the driver flavour (open or proprietary modules) follows the GPU's device id, "
                f"which cannot be read: set driver.flavour in the agent config, or {check}")
    elif not serious:
        hint += "; gpunode does not need these attributes to make the node ready"
    return Check("pci_scan", FAIL if serious else WARN, "; ".join(d.problems), hint)


_PCI_ADDRESS = re.compile(r"[0-9a-f]{4,}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]")


def _nouveau(d: Detection) -> Check:
    if d.nouveau_loaded:
        return Check("nouveau", FAIL, "the nouveau module is loaded and blocks the NVIDIA driver",
                     nouveau.BLACKLIST_HINT)
    return Check("nouveau", OK, "nouveau not loaded")


def _binding(d: Detection) -> Check:
    by_driver: dict[str, list[str]] = {}
    for gpu in d.gpus:
        by_driver.setdefault(gpu.driver or "none", []).append(gpu.address)
    if set(by_driver) <= {"nvidia", "none"}:
        return Check("gpu_binding", OK, _bindings(by_driver))
    if "nouveau" in by_driver:
        return Check("gpu_binding", FAIL, _bindings(by_driver), nouveau.BLACKLIST_HINT)
    if set(by_driver) == {"vfio-pci"}:
        return Check("gpu_binding", FAIL, _bindings(by_driver) + "; no GPU is left for containers",
                     "these GPUs are reserved for VM passthrough; unbind them from vfio-pci "
                     "(driver_override) if this node should run GPU pods")
    return Check("gpu_binding", WARN, _bindings(by_driver),
                 "GPUs bound to another driver are not usable by containers; bind them to nvidia "
                 "if that is not intended")


def _bindings(by_driver: dict[str, list[str]]) -> str:
    return "; ".join(f"{drv}: {', '.join(addrs)}" for drv, addrs in sorted(by_driver.items()))


def _driver(facts: StatusFacts, driver: driverinfo.DriverVersion | None) -> Check:
    if facts.driver_error is not None:
        return Check("driver", FAIL, f"cannot read what the driver reports: {facts.driver_error}",
                     f"{driverinfo.PROC_NVIDIA} and /proc/devices are the kernel's; under --root, "
                     "check the tree (is /proc the node's?)", facts.driver_error.code)
    if facts.driver_version_text is None:
        return Check("driver", FAIL, f"{driverinfo.PROC_NVIDIA}/version is missing: the NVIDIA "
                     "driver is not loaded",
                     "run 'gpunode driver load' (gpunode boot does this at boot); 'gpunode "
                     "driver status' says which way it would load them")
    if driver is None:
        first = facts.driver_version_text.strip().splitlines()[:1] or ["(empty)"]
        return Check("driver", FAIL, f"cannot parse {driverinfo.PROC_NVIDIA}/version: {first[0]!r}",
                     "the loaded module is not an NVIDIA driver gpunode knows; check 'modinfo "
                     "nvidia'")
    return Check("driver", OK, f"NVIDIA {driver.version} ({driver.flavour} kernel modules)"
                 + _how_loaded(facts.last_boot))


def _how_loaded(record: BootRecord | None) -> str:
    """How the last boot got the driver, from its record: strategy, source, modules, time."""
    step = record.step("driver") if record else None
    if step is None or step.get("outcome") != "ok" or not step.get("strategy"):
        return ""
    how = f"; last boot: {step['strategy']}"
    if step.get("source"):
        how += f" from {step['source']}"
    if step.get("modules_loaded"):
        how += f", loaded {', '.join(step['modules_loaded'])}"
    return how + f" in {step.get('duration_ms', 0):.0f} ms"


def _driver_gpus(facts: StatusFacts, d: Detection,
                 driver: driverinfo.DriverVersion | None) -> Check:
    if driver is None:
        return Check("driver_gpus", SKIP, "driver not loaded")
    missing = [g.address for g in d.usable_gpus if g.address not in facts.gpu_infos]
    if missing:
        return Check("driver_gpus", FAIL, f"the driver does not see {', '.join(missing)}",
                     "look for NVRM errors about these addresses in 'dmesg'; the GPU may need a "
                     "different driver flavour (open/proprietary) or be in a bad state")
    return Check("driver_gpus", OK, f"driver sees {_count(len(d.usable_gpus), 'GPU')}, all "
                 "it should")


def _device_nodes(facts: StatusFacts, driver: driverinfo.DriverVersion | None) -> Check:
    if driver is None:
        return Check("device_nodes", SKIP, "driver not loaded")
    nodes = facts.device_nodes
    problems = [*nodes.unknown_minors, *([nodes.error.message] if nodes.error else [])]
    problems += [_node_problem(path, why) for path, why in nodes.problems.items()
                 if why is not None]
    if nodes.unknown_minors:  # 'driver load' refuses it the same way (devices.for_host)
        return Check("device_nodes", FAIL, "; ".join(problems),
                     "the driver does not say which /dev/nvidiaN is the GPU's: look for NVRM "
                     "errors in 'dmesg'; reload the NVIDIA modules or reboot the node")
    if problems:
        return Check("device_nodes", FAIL, "; ".join(problems),
                     "run 'gpunode driver load', which makes them (majors from /proc/devices; "
                     "gpunode boot does this at boot)", nodes.error.code if nodes.error else None)
    return Check("device_nodes", OK, f"{_count(len(nodes.problems), 'device node')} present")


_CDI_HINT = ("run 'gpunode cdi generate --output /var/run/cdi/nvidia.yaml' (gpunode boot writes "
             "it after the driver step)")


def _gpu_init(facts: StatusFacts, driver: driverinfo.DriverVersion | None) -> Check:
    """Every GPU the driver sees initialized (its UUID known), as boot's gpu_init step leaves
    them (gpu/init.py); a GPU that is not is named with what the kernel log says of it."""
    if driver is None:
        return Check("gpu_init", SKIP, "driver not loaded")
    down = {a: i for a, i in sorted(facts.gpu_infos.items()) if not i.initialized}
    if down:
        said = "; ".join(f"{a}: {facts.gpu_failures.get(a) or i.uuid_problem}"
                         for a, i in down.items())
        return Check("gpu_init", FAIL, f"{_count(len(down), 'GPU')} not initialized: {said}"
                     [:1024], "run 'gpunode boot' (it starts nvidia-persistenced, or opens each "
                     "GPU once, and waits); a GPU whose RmInitAdapter fails ('dmesg | grep "
                     "NVRM') needs a reset or a reboot", GpuInitError.code)
    persistence = (f"nvidia-persistenced runs ({facts.persistenced})" if facts.persistenced
                   else "no nvidia-persistenced runs (no persistence mode)")
    return Check("gpu_init", OK, f"{_count(len(facts.gpu_infos), 'GPU')} initialized (UUIDs "
                 f"known); {persistence}")


def _cdi_spec(facts: StatusFacts, driver: driverinfo.DriverVersion | None) -> Check:
    """The CDI spec pods ask for devices by (nvidia.com/gpu=0, =GPU-…, =all): there, readable,
    each device name reaching the device node the driver says is that GPU's (cdi/node.py's
    spec_gpus, which boot's cdi step writes from), no other name, and every host path it names
    on the node."""
    from gpunode.cdi import node as cdinode

    spec = facts.cdi_spec
    if driver is None or spec is None:
        return Check("cdi_spec", SKIP, "driver not loaded")
    try:
        gpus, _ = cdinode.spec_gpus(facts.gpu_infos, facts.gpu_failures)
    except DriverError as exc:  # one device minor for several GPUs, or none known
        return Check("cdi_spec", FAIL, str(exc), exc.hint or _CDI_HINT, exc.code)
    if not spec.present:
        return Check("cdi_spec", WARN, f"{spec.path} missing: pods cannot request GPUs "
                     "through CDI (the nvidia runtime does not need it)", _CDI_HINT)
    if spec.error is not None:
        return Check("cdi_spec", FAIL, f"{spec.path}: {spec.error}", _CDI_HINT)
    wanted = {name: (f"/dev/nvidia{minor}",) for index, uuid, minor in gpus
              for name in (str(index), uuid) if name}
    wrong = [f"{name} gives {', '.join(spec.devices[name]) or 'no device node'}, the driver "
             f"says {wanted[name][0]}" for name in sorted(wanted)
             if name in spec.devices and spec.devices[name] != wanted[name]]
    wrong += [f"it lacks {name} ({wanted[name][0]})" for name in sorted(wanted)
              if name not in spec.devices]
    wrong += [f"it names {name}, which the driver does not report" for name in
              sorted(set(spec.devices) - set(wanted))]
    every = sorted(p for paths in wanted.values() for p in set(paths))
    if sorted(set(spec.every)) != sorted(set(every)) or len(spec.every) != len(set(every)):
        wrong.append(f"all gives {', '.join(spec.every) or 'nothing'}, the driver's GPUs are "
                     f"{', '.join(sorted(set(every))) or 'none'}")
    if wrong:
        return Check("cdi_spec", FAIL, f"{spec.path} disagrees with the driver: "
                     f"{'; '.join(wrong)}"[:1024], _CDI_HINT)
    if spec.missing:
        shown = ", ".join(spec.missing[:5]) + (", …" if len(spec.missing) > 5 else "")
        return Check("cdi_spec", FAIL, f"{spec.path} names what is not on the node: {shown}",
                     _CDI_HINT)
    by_uuid = sum(1 for _, uuid, _ in gpus if uuid)
    names = "index and UUID" if by_uuid == len(gpus) else f"index ({by_uuid} by UUID)"
    left_out = len(facts.gpu_infos) - len(gpus)
    out = f"; {_count(left_out, 'GPU')} left out (initialization failed)" if left_out else ""
    return Check("cdi_spec", OK, f"{spec.path}: {_count(len(gpus), 'GPU')} by {names}, and "
                 f"all, as the driver reports them{out}; every path it names is there")


def _node_problem(path: str, why: str) -> str:
    """'/dev/nvidia0 missing', '/dev/nvidiactl is not a character device', '/dev/nvidia0 has
    mode 600, expected 666'; a /dev/char link's problem names the link itself."""
    if why.startswith(("no /dev/char/", "/dev/char/")):
        return f"{path}: {why}"
    return f"{path} {'is ' if why == devices.NOT_CHAR else ''}{why}"


def _device_plugin(facts: StatusFacts) -> Check:
    node = facts.device_plugin_socket
    if node.kind == "socket":
        return Check("device_plugin", OK, f"{node.path} present: the device plugin registered")
    if node.kind == "missing":
        return Check("device_plugin", WARN, f"{node.path} missing: no NVIDIA device plugin "
                     "registered with the kubelet",
                     "the GPU Operator deploys it once its validator passed here: look at "
                     "the Operator's pods on this node" if facts.stack == "gpu-operator"
                     else "deploy the NVIDIA device plugin DaemonSet selecting "
                     "nvidia.com/gpu.present=true (deploy/)")
    return Check("device_plugin", WARN, f"{node.path} exists but is not a socket",
                 "restart the device plugin pod on this node")


def _node(facts: StatusFacts, detection: Detection, ready: bool) -> Check:
    """The Node as the scheduler sees it: gpunode's labels, GPUReady, nvidia.com/gpu."""
    node = facts.node
    if node is None:
        return Check("node", SKIP, "the API server was not asked")
    if node.kubeconfig is None and node.error is None:
        return Check("node", SKIP, f"node {node.name}: the kubelet has not joined yet (no "
                     "kubeconfig)")
    if node.error is not None or node.obj is None:
        return Check("node", WARN, f"node {node.name}: {node.error}",
                     node.hint or "gpunode-label.service retries until the API server answers",
                     node.error.code if node.error else None)
    wanted = wanted_labels(facts, ready)
    current = node.obj.get("metadata", {}).get("labels") or {}
    stale = sorted(k for k, v in wanted.items() if current.get(k) != v)
    conditions = (node.obj.get("status") or {}).get("conditions") or []
    gpu_ready = next((c.get("status") for c in conditions if c.get("type") == "GPUReady"), None)
    allocatable = ((node.obj.get("status") or {}).get("allocatable") or {}).get("nvidia.com/gpu")
    detail = (f"node {node.name}: labels {'current' if not stale else 'not current: '}"
              f"{', '.join(stale)}; GPUReady={gpu_ready or 'unset'}; nvidia.com/gpu "
              f"allocatable={allocatable or 0}")
    if stale or gpu_ready is None:
        return Check("node", WARN, detail, "run 'gpunode label' (gpunode-label.service does "
                     "this after the kubelet starts)")
    if not allocatable or allocatable == "0":
        return Check("node", WARN, detail, "the device plugin has not advertised nvidia.com/gpu;"
                     " is its DaemonSet scheduled here?")
    return Check("node", OK, detail)


def _watch(facts: StatusFacts) -> Check:
    """What `gpunode watch` found this boot (/run/gpunode/watch.json): a fatal Xid or a GPU
    lost since it first looked fails the node, as GPUReady says."""
    if facts.watch_problem is not None:
        return Check("watch", WARN, f"watch state unreadable: {facts.watch_problem}",
                     "the next 'gpunode watch --once' rewrites it")
    found = facts.watch
    if found is None:
        return Check("watch", SKIP, "gpunode watch has not run since this host booted")
    if found.fatal:
        words = "; ".join(f"Xid {f.code} on GPU {f.address}" + (f" ({f.uuid})" if f.uuid else "")
                          + f": {f.text}" for f in found.fatal)
        return Check("watch", FAIL, f"fatal Xid this boot: {words}"[:1024],
                     "drain the node and reboot it (or reset the GPU); NVIDIA's Xid catalog "
                     "(docs.nvidia.com/deploy/xid-errors) says what each code needs")
    if found.missing:
        return Check("watch", FAIL, f"GPU missing since the watch first saw it: "
                     f"{', '.join(found.missing)}", "check 'lspci -d 10de:' and the kernel "
                     "log ('dmesg | grep NVRM'); the GPU may have fallen off the bus")
    condition = found.condition or {}
    if condition.get("reason") == "GPUMissing":  # fewer GPUs than the boot or VM size says
        return Check("watch", FAIL, condition.get("message", "GPU missing"), "check 'lspci -d "
                     "10de:' and the kernel log ('dmesg | grep NVRM')")
    detail = (f"no fatal Xid and no GPU lost this boot (kernel log read to record "
              f"{found.last_seq}, at {found.updated_at or 'an unknown time'})")
    return _watch_findings(found.findings, detail)


def _watch_findings(findings: dict[str, dict[str, str]], detail: str) -> Check:
    """The watch's last repairs and problems (watch/checks.py): a problem, or a containerd
    restart it left pending, is a warning."""
    said = [f"{f.get('message', '').removeprefix('gpunode watch: ')} (at {f.get('at', '?')})"
            for _, f in sorted(findings.items())]
    text = "; ".join([detail, *said])[:1024]
    if any(f.get("status") == "problem" for f in findings.values()):
        return Check("watch", WARN, text, "fix what it names; the watch looks again on its "
                     "next pass")
    if findings.get("containerd", {}).get("restart") in ("pending", "unknown"):
        return Check("watch", WARN, text, "restart containerd when the node's pods can take "
                     "it ('systemctl restart containerd'); containerd_running says whether it "
                     "still runs with the old config")
    return Check("watch", OK, text)


def _last_boot_check(facts: StatusFacts) -> Check:
    if facts.last_boot_error is not None:
        failure = facts.last_boot_error
        return Check("last_boot", WARN, f"boot record unreadable: {failure}",
                     failure.hint or "run 'gpunode boot' again to rewrite it", failure.code)
    record = facts.last_boot
    if record is None:
        return Check("last_boot", SKIP, "no boot record: gpunode boot has not run since this "
                     "host booted")
    when = f" at {record.finished_at}" if record.finished_at else ""
    if record.outcome == "failed":
        failed = record.failed_steps
        detail = "; ".join(f"{s.get('name')}: {s.get('error')}" for s in failed) or "no step named"
        hints = [str(s["hint"]) for s in failed if s.get("hint")]
        codes = [str(s["code"]) for s in failed if s.get("code")]
        return Check("last_boot", WARN, f"last boot failed{when}: {detail}",
                     hints[0] if hints else "see 'journalctl -u gpunode'",
                     codes[0] if codes else None)
    return Check("last_boot", OK, f"last boot {record.outcome}{when}, "
                 f"{_count(len(record.steps), 'step')}")


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


# The checks of the driver step alone (`gpunode driver status`), in status's order.
DRIVER_CHECKS = ("gpus", "pci_scan", "nouveau", "gpu_binding", "driver", "driver_gpus",
                 "device_nodes")


def driver_report(report: Report) -> Report:
    """The driver checks of a whole report: ready unless one of them failed."""
    checks = tuple(c for c in report.checks if c.name in DRIVER_CHECKS)
    failed = any(c.state == FAIL for c in checks)
    return Report(checks, "not-ready" if failed else "ready")
