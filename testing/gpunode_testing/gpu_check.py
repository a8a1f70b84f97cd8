"""The GPU-machine check: gpunode against a machine with a real NVIDIA GPU and driver, read-only.

    make gpu-check                                     # = python -m gpunode_testing.gpu_check
    python -m gpunode_testing.gpu_check [--root /] [--probe DIR] [--json]

It runs, as a user would, `gpunode detect --json`, `status --json`, `plan --json` and `cdi
generate --format json` (to stdout: no spec is written), and then, where there are a driver
and podman, the CUDA program of gpunode_testing.cuda_probe in a podman container given
`nvidia.com/gpu=0` and `nvidia.com/gpu=all` by that spec (gpunode_testing.podman: podman in a
private mount and PID namespace, its storage in a temporary directory, the spec directory bound
over /run/cdi there; nothing of the machine changes). Where nvidia-smi is there, `nvidia-smi -L`
is asked which UUID each index has, and the spec must agree. It prints one line per check and
what it saw, and exits 0 when every check that could run passed.

It changes nothing: no `boot`, no `--output`, no image pulled or imported, no unit started.
containerd is not used even where it runs: its CRI would need the image in the node's own
content store (tests/integration/test_cuda_cri.py does that in a namespace of its own).
The CUDA program comes from the test cache (`make fetch-cuda`) or `--probe DIR` (a directory
with `cuda-probe` and `libcudart.so.12`, e.g. copied from the cache to a machine that cannot
download: `make gpu-check-bundle` puts them in build/gpu-check/).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

TIMEOUT_S = 120


@dataclass
class Step:
    """One check: its name, whether it passed (None: it could not run here), and what it saw."""

    name: str
    ok: bool | None
    detail: str
    output: Any = None


@dataclass
class Report:
    root: str
    steps: list[Step] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(s.ok is not False for s in self.steps)

    def add(self, name: str, ok: bool | None, detail: str, output: Any = None) -> None:
        self.steps.append(Step(name, ok, detail, output))
        print(f"{'ok  ' if ok else 'FAIL' if ok is False else 'skip'} {name}: {detail}",
              file=sys.stderr, flush=True)


def gpunode(root: str, *args: str) -> tuple[int, str, str]:
    done = subprocess.run([sys.executable, "-m", "gpunode", "--root", root, "--log-format",
                           "json", *args], capture_output=True, text=True, timeout=TIMEOUT_S,
                          check=False, stdin=subprocess.DEVNULL)
    return done.returncode, done.stdout, done.stderr


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _last_event(stderr: str) -> str:
    """What gpunode's last error (or else last) JSON event says."""
    events = [e for e in map(_json, stderr.splitlines()) if isinstance(e, dict)]
    chosen = (next((e for e in reversed(events) if e.get("level") == "error"), None)
              or next((e for e in reversed(events) if e.get("note")), None)
              or (events[-1] if events else {}))
    return str(chosen.get("error") or chosen.get("note") or chosen.get("event") or
               stderr.strip()[-400:])


def check(root: str, probe_dir: Path | None) -> Report:
    report = Report(root)
    rc, out, err = gpunode(root, "detect", "--json")
    detected = _json(out) or {}
    gpus = [f for f in detected.get("functions", []) if f.get("kind") == "gpu"]
    said = (f"{len(gpus)} GPU(s): " + ", ".join(
        f"{g.get('address')} {g.get('product_name') or g.get('device_id')}" for g in gpus)
        if gpus else "no NVIDIA GPU: this is no GPU machine")
    report.add("detect", rc == 0 and bool(gpus), said if rc == 0
               else f"exit {rc}: {err.strip()[-400:]}", detected)
    rc, out, err = gpunode(root, "status", "--json")
    status = _json(out) or {}
    bad = [f"{c['name']}={c['state']}: {c['detail']}" for c in status.get("checks", [])
           if c.get("state") in ("fail", "warn")]
    report.add("status", rc == 0, f"verdict {status.get('verdict')}" + (
        f"; {'; '.join(bad)}" if bad else ""), status)
    rc, out, err = gpunode(root, "plan", "--json")
    planned = _json(out) or {}
    report.add("plan", rc == 0, f"{len(planned.get('actions', []))} action(s), problems: "
               + (", ".join(f"{p['step']}: {p['error']}" for p in planned.get("problems", []))
                  or "none") if rc == 0 else f"exit {rc}: {err.strip()[-400:]}", planned)
    rc, out, err = gpunode(root, "cdi", "generate", "--format", "json")
    spec = _json(out) if rc == 0 else None
    names = [str(d.get("name")) for d in (spec or {}).get("devices", [])]
    report.add("cdi generate", spec is not None, f"devices {', '.join(names)}" if spec
               else f"exit {rc}, no spec: {_last_event(err)}", spec)
    if spec is not None:
        _nvidia_smi(report, root, spec)
        _cuda(report, root, spec, probe_dir)
    return report


def _nvidia_smi(report: Report, root: str, spec: dict[str, Any]) -> None:
    """The spec's index → UUID (the same device node) against what nvidia-smi -L numbers."""
    smi = shutil.which("nvidia-smi") if root == "/" else None
    if smi is None:
        report.add("nvidia-smi -L", None, "no nvidia-smi on PATH (or --root is not /)")
        return
    done = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=TIMEOUT_S,
                          check=False)
    said = dict(re.findall(r"^GPU (\d+): .*\(UUID: (GPU-[0-9a-fA-F-]+)\)", done.stdout, re.M))
    nodes = {str(d["name"]): d["containerEdits"]["deviceNodes"][0]["path"]
             for d in spec.get("devices", []) if d.get("name") != "all"}
    by_node = {path: name for name, path in nodes.items() if name.startswith("GPU-")}
    wrong = [f"index {i}: nvidia-smi says {uuid}, the spec {by_node.get(nodes.get(i, ''))}"
             for i, uuid in sorted(said.items()) if by_node.get(nodes.get(i, "")) != uuid]
    report.add("nvidia-smi -L", done.returncode == 0 and not wrong and bool(said),
               f"{len(said)} GPU(s), every index's UUID as the spec has it" if not wrong
               and said else "; ".join(wrong) or f"exit {done.returncode}: "
               f"{(done.stdout + done.stderr).strip()[-400:]}", done.stdout)


def _cuda(report: Report, root: str, spec: dict[str, Any], probe_dir: Path | None) -> None:
    from gpunode_testing import cuda_probe, podman

    if shutil.which("podman") is None or (missing := podman.missing_tools()):
        report.add("cuda in podman", None, "podman (and crun, conmon) not found: "
                   f"{', '.join(missing) if shutil.which('podman') else 'podman'}")
        return
    probe = _probe(probe_dir)
    if probe is None:
        report.add("cuda in podman", None, "no CUDA program: run 'make fetch-cuda' (or pass "
                   "--probe DIR holding cuda-probe and libcudart.so.12)")
        return
    gpus = len([d for d in spec["devices"] if str(d.get("name")).isdigit()])
    with tempfile.TemporaryDirectory(prefix="gpunode-gpu-check-") as tmp:
        work = Path(tmp)
        (work / "cdi").mkdir()
        document = spec if root == "/" else podman.rerooted(json.loads(json.dumps(spec)),
                                                            Path(root))
        (work / "cdi/nvidia.json").write_text(json.dumps(document))
        for device, expected in (("nvidia.com/gpu=0", 1), ("nvidia.com/gpu=all", gpus)):
            rootfs = cuda_probe.make_rootfs(work / f"rootfs-{device.partition('=')[2]}", probe)
            rc, out, err = podman.run_with_cdi(work / "cdi", device, cuda_probe.command(),
                                               rootfs, work / "podman")
            answer = cuda_probe.parse(out) if rc == 0 else None
            ok = (answer is not None and answer.devices == expected
                  and answer.devices_error == "cudaSuccess")
            report.add(f"cuda in podman ({device})", ok,
                       f"runtime {answer.runtime}, driver {answer.driver}, "
                       f"{answer.devices} device(s) {answer.devices_error} (expected {expected})"
                       if answer else f"podman exit {rc}: {(out + err).strip()[-600:]}",
                       asdict(answer) if answer else None)


def _probe(probe_dir: Path | None) -> Any:
    from gpunode_testing import cuda_probe

    directory = probe_dir or cuda_probe.cache_dir()
    binary, cudart = directory / "cuda-probe", directory / "runtime/lib/libcudart.so.12"
    if not cudart.is_file():
        cudart = directory / "libcudart.so.12"
    if not (binary.is_file() and cudart.is_file()):
        return None
    return cuda_probe.Probe(binary, cudart, {})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpunode_testing.gpu_check",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", default="/", help="the machine's root (default /)")
    parser.add_argument("--probe", type=Path, help="directory with cuda-probe and "
                        "libcudart.so.12 (default: the test cache's)")
    parser.add_argument("--json", action="store_true", help="the whole report as JSON on stdout")
    args = parser.parse_args(argv)
    report = check(args.root, args.probe)
    if args.json:
        print(json.dumps({"root": report.root, "ok": report.ok,
                          "steps": [asdict(s) for s in report.steps]}, indent=2))
    print(f"gpu-check: {'passed' if report.ok else 'FAILED'} on {report.root}", file=sys.stderr)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
