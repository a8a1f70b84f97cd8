"""The cluster-azure path on a node, in a real systemd (PID+mount namespace): the units exactly
as a real helm renders them from `gpunode ignition --format cluster-azure` over the pinned
chart (the GPU pool's Container Linux Config; gpunode_testing.charts), the directories and
Secret-backed files of that render as Ignition leaves them, Flatcar's containerd.service, and
an HTTP server on the namespace's 127.0.0.1 serving an `ID=_any` system extension whose
/usr/bin/gpunode runs this checkout's gpunode.

On the GPU fixture the bootstrap unit fetches the image, verifies it, merges it, gpunode runs
from it and containerd starts once after it; a wrong sha512 merges nothing and fails loudly;
on the CPU fixture the server sees no request at all. Also here, without a namespace: the GPU
condition itself against fixture sysfs trees.

What is not real: the image is a minimal one (the release file and a /usr/bin/gpunode that
execs this virtualenv's gpunode; the real image's merge is tests/integration/test_sysext.py),
the GPU is a fixture (gpunode_testing.boot_harness), and the step from the Container Linux
Config to Ignition (Cluster API's kubeadm bootstrap runs Flatcar's transpiler, which no
registry the tests reach packages: the units, masks, directories and files are placed as it
would place them)."""

from __future__ import annotations

import hashlib
import json
import secrets
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpunode import __version__
from gpunode.delivery import chart, chartunit, ignition
from gpunode_testing import charts, fixtures
from gpunode_testing.boot_harness import (
    CONTAINERD_UNIT,
    KUBELET_UNIT,
    UNITS,
    WORK_PARENT,
    node_prepare,
)
from gpunode_testing.systemd_ns import MACHINE_PATHS, SystemdNamespace
from real.helm_bins import ensure_helm

pytestmark = pytest.mark.allow_paths(*MACHINE_PATHS, str(charts.SHARED_CHARTS.resolve()))

PORT = 8642
IMAGE = f"gpunode-{__version__}-x86-64.raw"
STORED = f"/opt/extensions/gpunode/{IMAGE}"
AGENT = '[detect]\nsource = "sysfs"\n'  # the fixture's PCI functions are plain directories
WRONG = hashlib.sha512(b"not the image").hexdigest()

SERVER = """\
import http.server, os, socket, sys
port, root, log = int(sys.argv[1]), sys.argv[2], sys.argv[3]
class Handler(http.server.SimpleHTTPRequestHandler):
    def __init__(self, *a, **k):
        super().__init__(*a, directory=root, **k)
    def log_request(self, code="-", size="-"):
        with open(log, "a") as f:
            f.write(f"{self.command} {self.path} {code}\\n")
server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
s.sendto(b"READY=1", os.environ["NOTIFY_SOCKET"])
server.serve_forever()
"""


@pytest.fixture
def workdir() -> Iterator[Path]:
    path = WORK_PARENT / f"chart-{secrets.token_hex(4)}"
    path.mkdir(parents=True)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def build_image(workdir: Path) -> Path:
    """An ID=_any extension holding /usr/bin/gpunode (this virtualenv's), served from www/."""
    tree = workdir / "image"
    release = tree / "usr/lib/extension-release.d/extension-release.gpunode"
    release.parent.mkdir(parents=True)
    release.write_text("ID=_any\nSYSEXT_LEVEL=1.0\nARCHITECTURE=x86-64\n")
    program = tree / "usr/bin/gpunode"
    program.parent.mkdir(parents=True)
    program.write_text(f"#!/bin/sh\nexec {Path(sys.executable).with_name('gpunode')} \"$@\"\n")
    program.chmod(0o755)
    image = workdir / "www" / IMAGE
    image.parent.mkdir()
    subprocess.run(["mksquashfs", str(tree), str(image), "-quiet", "-noappend", "-all-root"],
                   check=True, capture_output=True)
    return image


def gpu_pool(workdir: Path, snippet: ignition.Snippet) -> tuple[
        list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    """gpunode's units, directories and Secret-backed files in the GPU pool's bootstrap config
    as helm v3 renders the pinned cluster-azure with the snippet's values (the GPU pool alone:
    with a second pool the pinned chart loses that pool's machine template, which is beside
    the point here; tests/integration/test_chart_helm.py)."""
    reason = charts.missing()
    if reason:
        pytest.skip(reason)
    given = workdir / "gpunode-values.yaml"
    given.write_text(chart.render(snippet, "cluster-azure", chart.Pool(default_pool=False)))
    text = charts.template(ensure_helm("3").helm, charts.CHARTS["cluster-azure"].path,
                           [charts.ci_values_without_pools("cluster-azure", workdir), given])
    manifests = charts.Manifests(text)
    ours = {u["name"] for u in chart.units(snippet)}
    paths = {d["path"] for d in chart.directories(snippet)}
    clc = manifests.clc(chart.DEFAULT_POOL)
    return ([u for u in clc["systemd"]["units"] if u["name"] in ours],
            [d for d in clc["storage"]["directories"] if d["path"] in paths],
            [f for f in manifests.bootstrap(chart.DEFAULT_POOL)["files"]
             if (f.get("contentFrom") or {}).get("secret", {}).get("name") == chart.SECRET_NAME])


def node(workdir: Path, machine: str, state: str, sha512: str | None = None
         ) -> SystemdNamespace:
    """A node the chart made from gpunode's cluster-azure values: units as the chart writes
    them (masks as /dev/null links, `enabled` units wanted by multi-user.target), directories
    and files as Ignition leaves them, the fixture's PCI functions over the machine's."""
    image = build_image(workdir)
    sha512 = sha512 or hashlib.sha512(image.read_bytes()).hexdigest()
    snippet = ignition.snippet(f"http://127.0.0.1:{PORT}/{IMAGE}", sha512, AGENT, UNITS)
    rendered, directories, files = gpu_pool(workdir, snippet)
    units = {u["name"]: u["contents"] for u in rendered if "contents" in u}
    (workdir / "server.py").write_text(SERVER)
    units["sysext-server.service"] = (
        "[Unit]\nBefore=gpunode-sysext.service\n[Service]\nType=notify\nNotifyAccess=main\n"
        f"ExecStart={sys.executable} {workdir / 'server.py'} {PORT} {workdir / 'www'} "
        f"{workdir / 'requests.log'}\n")
    (workdir / "requests.log").write_text("")
    units |= {"containerd.service": CONTAINERD_UNIT, "kubelet.service": KUBELET_UNIT}
    fixture = workdir / "fixture"
    fixtures.build(fixtures.MACHINES[machine], fixture,
                   fixtures.Options(state=state, flat_sysfs=True, dev_nodes="plain"))
    secret = chart.secret(snippet)["stringData"]
    (workdir / "files").mkdir()
    prepare = [*node_prepare(fixture, gpunode_on_usr=False),
               # systemd-sysext merges in a child mount namespace and relies on the overlay
               # propagating back (test_sysext.py's flatcar_boot says why this is needed here).
               "mount -n --make-rshared /",
               *(f"ln -sf /dev/null /etc/systemd/system/{u['name']}" for u in rendered
                 if u.get("mask"))]
    for d in directories:
        prepare.append(f"mkdir -p -m {d['mode']:o} {d['path']}")
    for f in files:
        source = workdir / "files" / f["contentFrom"]["secret"]["key"]
        source.write_text(secret[f["contentFrom"]["secret"]["key"]])
        prepare += [f"mkdir -p {Path(f['path']).parent}", f"cp {source} {f['path']}",
                    f"chmod {f['permissions']} {f['path']}"]
    enabled = [u["name"] for u in rendered if u.get("enabled")]
    return SystemdNamespace(units, workdir, overlays=("usr", "opt", "var/lib"),
                            enable=(*enabled, "sysext-server.service", "containerd.service",
                                    "kubelet.service"),
                            prepare=prepare)


def requests(workdir: Path) -> list[str]:
    return (workdir / "requests.log").read_text().splitlines()


def props(ns: SystemdNamespace, unit: str, *names: str) -> dict[str, str]:
    return ns.unit_properties(unit, *names)


def test_gpu_node_fetches_verifies_and_merges_then_gpunode_runs_before_containerd(
        workdir: Path) -> None:
    with node(workdir, "nc4as-t4-v3", "driver") as ns:
        ns.wait_active("gpunode.service", timeout=60)
        ns.wait_active("containerd.service")
        assert requests(workdir) == [f"GET /{IMAGE} 200"]
        stored = ns.run(["sha512sum", STORED]).stdout.split()[0]
        assert stored == hashlib.sha512((workdir / "www" / IMAGE).read_bytes()).hexdigest()
        assert ns.run(["readlink", "/etc/extensions/gpunode.raw"]).stdout.strip() == STORED
        assert "gpunode" in ns.run(["systemd-sysext", "status"]).stdout
        assert ns.run(["/usr/bin/gpunode", "--version"]).stdout == f"gpunode {__version__}\n"

        sysext = props(ns, chartunit.SYSEXT_UNIT, "Result", "ActiveEnterTimestampMonotonic")
        gpunode = props(ns, "gpunode.service", "Result", "InactiveExitTimestampMonotonic",
                        "ActiveEnterTimestampMonotonic")
        containerd = props(ns, "containerd.service", "NRestarts",
                           "ExecMainStartTimestampMonotonic")
        assert (sysext["Result"], gpunode["Result"]) == ("success", "success")
        assert int(sysext["ActiveEnterTimestampMonotonic"]) <= \
            int(gpunode["InactiveExitTimestampMonotonic"])
        assert int(gpunode["ActiveEnterTimestampMonotonic"]) <= \
            int(containerd["ExecMainStartTimestampMonotonic"])
        started = [e for e in ns.journal("containerd.service")
                   if str(e.get("MESSAGE", "")).startswith("Started ")]
        assert len(started) == 1 and containerd["NRestarts"] == "0"
        dump = ns.run(["containerd", "--config", "/etc/containerd/config.toml", "config",
                       "dump"]).stdout
        assert 'BinaryName = "/usr/bin/nvidia-container-runtime"' in dump
        # gpunode ran its whole pipeline from the merged image, with the Secret's config.
        events = [json.loads(str(e["MESSAGE"])) for e in ns.journal("gpunode.service")
                  if str(e.get("MESSAGE", "")).startswith("{")]
        assert {e["step"] for e in events if e["event"] == "step.done"} >= {
            "detect", "driver", "gpu_init", "cdi", "containerd"}
        assert ns.run(["cat", "/etc/gpunode/config.toml"]).stdout == AGENT

        # A later boot finds the image verified and merged: nothing is downloaded again.
        ns.systemctl("restart", chartunit.SYSEXT_UNIT)
        assert props(ns, chartunit.SYSEXT_UNIT, "Result")["Result"] == "success"
        assert requests(workdir) == [f"GET /{IMAGE} 200"]

        # systemd itself accepts every unit as the chart wrote it.
        names = (chartunit.SYSEXT_UNIT, "gpunode.service", "gpunode-label.service",
                 "gpunode-watch.service")
        for name in names:
            ns.run(["cp", f"/run/systemd/system/{name}", f"/run/verify-{name}"])
        verify = ns.run(["systemd-analyze", "verify", *(f"/run/verify-{n}" for n in names)],
                        check=False)
        assert verify.returncode == 0, verify.stderr


def test_a_wrong_sha512_merges_nothing_and_fails_loudly(workdir: Path) -> None:
    with node(workdir, "nc4as-t4-v3", "driver", sha512=WRONG) as ns:
        ns.wait_active("containerd.service", timeout=60)  # ordering only: the node stays up
        ns.wait_active("kubelet.service")
        ns.wait_for(lambda: props(ns, "gpunode.service", "ActiveState")["ActiveState"]
                    == "failed", 30, "gpunode.service to fail")
        assert props(ns, chartunit.SYSEXT_UNIT, "ActiveState", "Result") == {
            "ActiveState": "failed", "Result": "exit-code"}
        messages = [str(e.get("MESSAGE", "")) for e in ns.journal(chartunit.SYSEXT_UNIT)]
        assert any(f"does not have sha512 {WRONG}: refused, nothing merged" in m
                   for m in messages), messages
        assert requests(workdir) == [f"GET /{IMAGE} 200"]
        assert ns.run(["ls", "-A", "/opt/extensions/gpunode"]).stdout == ""
        assert ns.run(["test", "-e", "/etc/extensions/gpunode.raw"], check=False).returncode
        assert ns.run(["test", "-e", "/usr/bin/gpunode"], check=False).returncode
        assert "gpunode" not in ns.run(["systemd-sysext", "status"]).stdout


def test_cpu_node_downloads_nothing_and_runs_nothing(workdir: Path) -> None:
    with node(workdir, "azure-d4s-v5", "bare") as ns:
        ns.wait_active("containerd.service", timeout=60)
        ns.wait_active("kubelet.service")
        for name in (chartunit.SYSEXT_UNIT, "gpunode.service", "gpunode-label.service",
                     "gpunode-watch.service"):
            ns.wait_for(lambda n=name: props(ns, n, "Result")["Result"] == "exec-condition",
                        30, f"{name} to be skipped by its ExecCondition=", unit=name)
            assert props(ns, name, "ActiveState")["ActiveState"] == "inactive"
        assert requests(workdir) == []
        assert ns.run(["ls", "-A", "/opt/extensions/gpunode"]).stdout == ""
        assert ns.main_argv("containerd.service")[1:3] == [
            "--config", "/usr/share/containerd/config.toml"]


# -- the GPU condition itself ---------------------------------------------------------------


def condition(devices: Path) -> int:
    """GPU_CONDITION's script as systemd runs it (`$$` is `$`), on `devices` for sysfs's PCI
    functions."""
    command = chartunit.GPU_CONDITION.partition("=")[2]
    script = command.split("'", 1)[1].rsplit("'", 1)[0].replace("$$", "$")
    script = script.replace(chartunit.PCI_DEVICES, str(devices))
    return subprocess.run(["/bin/sh", "-c", script], capture_output=True, check=False,
                          timeout=10).returncode


def machine_devices(tmp_path: Path, machine: str, flat: bool) -> Path:
    root = fixtures.build(fixtures.MACHINES[machine], tmp_path / "root",
                          fixtures.Options(state="bare", flat_sysfs=flat))
    return root / "sys/bus/pci/devices"


@pytest.mark.parametrize(("machine", "code"), [
    ("nc4as-t4-v3", 0), ("nd96amsr-a100-v4", 0), ("azure-d4s-v5", 1)])
@pytest.mark.parametrize("flat", [True, False], ids=["directories", "sysfs-links"])
def test_the_gpu_condition_passes_only_a_machine_with_an_nvidia_display_controller(
        tmp_path: Path, machine: str, code: int, flat: bool) -> None:
    assert condition(machine_devices(tmp_path, machine, flat)) == code


def test_the_gpu_condition_skips_nvidia_functions_that_are_not_gpus(tmp_path: Path) -> None:
    for address, cls in (("0000:00:01.0", "0x068000"), ("0000:00:02.0", "0x040300")):
        function = tmp_path / address
        function.mkdir()
        (function / "vendor").write_text("0x10de\n")
        (function / "class").write_text(f"{cls}\n")
    assert condition(tmp_path) == 1


def test_the_gpu_condition_fails_loudly_without_a_pci_bus_to_read(tmp_path: Path) -> None:
    assert condition(tmp_path / "missing") == 255
