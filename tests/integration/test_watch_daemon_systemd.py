"""gpunode-watch.service from units/ in a real systemd (PID+mount namespace,
gpunode_testing.systemd_ns), reporting to the TLS test API server (gpunode_testing.kube_api)
with the kubelet's client certificate, a FIFO bind-mounted over /dev/kmsg standing in for the
kernel's log, and the T4 fixture node's sysfs and /proc/driver bind-mounted as in the boot test.

The namespace has its own network: the daemon's https://127.0.0.1:6443 inside is a socket unit
running systemd-socket-proxyd to a Unix socket in the work directory, which a thread of this
test relays to the API server's port (Relay). Stopping the socket unit is "the API server is
down" as the daemon sees it: connection refused.

One namespace serves the module's tests, in order (module-scoped fixture): READY and the
watchdog, an Xid 79, the API server down and back, a flood, and SIGTERM last. What is not
real: the GPU (a fixture) and the kernel's /dev/kmsg (a FIFO gives lines, not records; the
record device itself is read in tests/integration/test_watch_kmsg_live.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import KUBE_NODE
from gpunode_testing import fixtures
from gpunode_testing.boot_harness import CONTAINERD_UNIT, UNITS, WORK_PARENT, node_prepare
from gpunode_testing.kube_api import KUBELET_CLIENT, KUBELET_KUBECONFIG, FakeApiServer
from gpunode_testing.kube_objects import make_node
from gpunode_testing.pki import Pki, make_pki
from gpunode_testing.systemd_ns import MACHINE_PATHS, SystemdNamespace

pytestmark = pytest.mark.allow_paths(*MACHINE_PATHS)

UNIT = "gpunode-watch.service"
WATCHDOG_SECONDS = 4  # the test's drop-in: the unit's 3 min would make the test minutes long
PORT = 6443
XID = "PCI:0001:00:00"  # the T4 fixture's GPU, as the driver names it
PROXY_SOCKET = f"""[Socket]
ListenStream=127.0.0.1:{PORT}
"""


def proxy_service(path: Path) -> str:
    return f"""[Service]
ExecStart=/lib/systemd/systemd-socket-proxyd {path}
"""


class Relay:
    """A Unix socket in the work directory whose connections are pumped to 127.0.0.1:port of
    this test's network, both ways, each direction in its own thread."""

    def __init__(self, path: Path, port: int) -> None:
        self.port = port
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(str(path))
        self.listener.listen(16)
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while True:
            try:
                inner, _ = self.listener.accept()
            except OSError:
                return
            outer = socket.create_connection(("127.0.0.1", self.port), timeout=10)
            for a, b in ((inner, outer), (outer, inner)):
                threading.Thread(target=_pump, args=(a, b), daemon=True).start()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()


def _pump(source: socket.socket, sink: socket.socket) -> None:
    try:
        while data := source.recv(65536):
            sink.sendall(data)
    except OSError:
        pass
    finally:
        for s in (source, sink):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)


@dataclass
class Node:
    ns: SystemdNamespace
    api: FakeApiServer
    kmsg: Path  # the FIFO the daemon reads as /dev/kmsg
    fixture: Path  # the fixture's tree, whose sysfs the namespace has bound
    seq: int = 100

    def feed(self, *messages: str, level: int = 3) -> None:
        """Write each message as one kmsg record line, numbered on from the last."""
        lines = []
        for message in messages:
            self.seq += 1
            lines.append(f"{level},{self.seq},{self.seq * 1_000_000},-;{message}\n")
        with open(self.kmsg, "w") as fifo:  # blocks until the daemon has it open
            fifo.write("".join(lines))

    def patches(self) -> list[dict[str, object]]:
        return [r.json for r in self.api.requests
                if r.method == "PATCH" and r.path.endswith("/status") and r.status == 200]

    def wait_for(self, what: str, check: object, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while not check():  # type: ignore[operator]
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}\n{self.ns.diagnose(UNIT)}")
            time.sleep(0.1)

    def events(self) -> list[dict[str, object]]:
        out = []
        for entry in self.ns.journal(UNIT):
            message = str(entry.get("MESSAGE", ""))
            if message.startswith("{"):
                out.append(json.loads(message))
        return out

    def props(self, *names: str) -> dict[str, str]:
        return self.ns.unit_properties(UNIT, *names)


def unit_drop_in(fixture: Path) -> str:
    """What the test changes in the unit, as printf text: the venv lives under /root (and maybe
    /var/tmp), as for gpunode.service in the boot test; a short watchdog; and the fixture's
    /proc/driver again on the fresh /proc that ProtectKernelTunables= and
    ProtectControlGroups= mount for the service (on a node /proc/driver is the kernel's)."""
    return ("[Service]\\nProtectHome=no\\nPrivateTmp=no\\n"
            f"WatchdogSec={WATCHDOG_SECONDS}s\\n"
            f"BindReadOnlyPaths={fixture}/proc/driver:/proc/driver\\n")


def kubelet_files(workdir: Path, api: FakeApiServer, pki: Pki) -> Path:
    """The kubelet's kubeconfig (its server the namespace's proxy) and client credential."""
    files = workdir / "kubelet"
    files.mkdir()
    shutil.copy(pki.kubelet_client_current, files / "kubelet-client-current.pem")
    config = api.write_kubeconfig(files / "kubelet.conf", KUBELET_CLIENT, KUBELET_CLIENT)
    config.write_text(config.read_text().replace(api.url, f"https://127.0.0.1:{PORT}"))
    return files


@pytest.fixture(scope="module")
def node() -> Iterator[Node]:
    with watched_node() as booted:
        yield booted


@contextlib.contextmanager
def watched_node(agent: str = "", containerd: bool = False) -> Iterator[Node]:
    """A namespace running the watch, its API server and relay; `agent`: agent config lines to
    add; `containerd`: Flatcar's containerd.service, configured by `gpunode containerd
    configure` before the watch starts."""
    workdir = WORK_PARENT / f"watch-{secrets.token_hex(4)}"
    workdir.mkdir(parents=True)
    try:
        pki = make_pki(workdir / "pki", node_name=KUBE_NODE)
        with FakeApiServer(pki, nodes=[make_node(KUBE_NODE, gpus=1)]) as api:
            relay = Relay(workdir / "api.sock", api.port)
            try:
                yield from _boot(workdir, api, pki, agent, containerd)
            finally:
                relay.close()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _boot(workdir: Path, api: FakeApiServer, pki: Pki, agent: str = "",
          containerd: bool = False) -> Iterator[Node]:
    fixture = workdir / "fixture"
    fixtures.build(fixtures.MACHINES["nc4as-t4-v3"], fixture,
                   fixtures.Options(state="ready", flat_sysfs=True, dev_nodes="plain"))
    kubelet = kubelet_files(workdir, api, pki)
    kmsg = workdir / "kmsg"
    os.mkfifo(kmsg)
    units = {UNIT: (UNITS / UNIT).read_text(), "kube-api-proxy.socket": PROXY_SOCKET,
             "kube-api-proxy.service": proxy_service(workdir / "api.sock"),
             **({"containerd.service": CONTAINERD_UNIT} if containerd else {})}
    prepare = [*node_prepare(fixture),
               f"printf '[kubernetes]\\nnode_name = \"{KUBE_NODE}\"\\n{agent}' >> "
               "/etc/gpunode/config.toml",
               f"mkdir -p {os.path.dirname(KUBELET_KUBECONFIG)} "
               f"{os.path.dirname(KUBELET_CLIENT)}",
               f"cp {kubelet}/kubelet.conf {KUBELET_KUBECONFIG}",
               f"cp {kubelet}/kubelet-client-current.pem {KUBELET_CLIENT}",
               f"mkdir -p /run/systemd/system/{UNIT}.d",
               f"printf '{unit_drop_in(fixture)}' > /run/systemd/system/{UNIT}.d/50-test.conf"]
    with SystemdNamespace(units, workdir, overlays=("usr", "var/lib"),
                          enable=("kube-api-proxy.socket",), prepare=prepare) as ns:
        if containerd:  # as boot's containerd step does: the writable copy and the ledger
            ns.run(["/usr/bin/gpunode", "--log-format", "json", "containerd", "configure"])
        # After the boot (and the configure's daemon-reload: systemd logs to /dev/kmsg), so
        # nothing but the watch writes to (and blocks on) the FIFO.
        ns.run(["mount", "-n", "--bind", str(kmsg), "/dev/kmsg"])
        ns.systemctl("start", UNIT)
        yield Node(ns, api, kmsg, fixture)


def vm_rss_kib(node: Node) -> int:
    pid = node.props("MainPID")["MainPID"]
    status = node.ns.run(["cat", f"/proc/{pid}/status"]).stdout
    return int(re.search(r"^VmRSS:\s+(\d+) kB", status, re.M).group(1))  # type: ignore[union-attr]


def test_the_unit_is_active_once_ready_and_keeps_its_watchdog_past_watchdog_sec(
        node: Node) -> None:
    node.ns.wait_active(UNIT)
    first = node.props("MainPID", "NRestarts", "WatchdogUSec", "StatusText")
    assert first["WatchdogUSec"] == f"{WATCHDOG_SECONDS}s"
    assert "kmsg records read" in first["StatusText"]
    time.sleep(WATCHDOG_SECONDS * 2.5)
    later = node.props("MainPID", "NRestarts", "ActiveState", "Result")
    assert (later["ActiveState"], later["Result"], later["NRestarts"]) == ("active", "success",
                                                                            "0")
    assert later["MainPID"] == first["MainPID"]  # not killed by the watchdog
    started = next(e for e in node.events() if e["event"] == "watch.started")
    assert started["kmsg_kind"] == "fifo" and started["watchdog_s"] == WATCHDOG_SECONDS / 2


def test_an_xid_79_fed_to_dev_kmsg_is_the_gpu_ready_false_patch_on_the_api_server(
        node: Node) -> None:
    node.feed(f"NVRM: Xid ({XID}): 79, pid=1122, name=python3, GPU has fallen off the bus.")
    node.wait_for("the GPUReady PATCH", lambda: node.patches())
    [patch] = node.patches()
    [condition] = patch["status"]["conditions"]  # type: ignore[index]
    assert (condition["type"], condition["status"], condition["reason"]) == (
        "GPUReady", "False", "GPUFellOffBus")
    assert "0001:00:00.0 (GPU-" in condition["message"]
    stored = node.api.node(KUBE_NODE)
    assert stored is not None
    ready = {c["type"]: c for c in stored["status"]["conditions"]}["GPUReady"]
    assert ready["reason"] == "GPUFellOffBus"
    assert {r.client_cn for r in node.api.requests} == {f"system:node:{KUBE_NODE}"}


def test_with_the_api_server_down_a_while_one_patch_brings_the_latest_state_after(
        node: Node) -> None:
    before = len(node.patches())
    node.ns.systemctl("stop", "kube-api-proxy.socket", "kube-api-proxy.service")
    node.feed(f"NVRM: Xid ({XID}): 48, An uncorrectable double bit error (DBE) has been "
              "detected on GPU in the framebuffer at partition 0, subpartition 0.")
    node.wait_for("the failed report", lambda: any(
        e["event"] == "watch.report_failed" for e in node.events()))
    node.feed(f"NVRM: Xid ({XID}): 62, Internal micro-controller halt")
    time.sleep(6)  # a few attempts, answered by nobody
    node.ns.systemctl("start", "kube-api-proxy.socket")
    node.wait_for("the PATCH after the API server returned",
                  lambda: len(node.patches()) > before, timeout=90)
    time.sleep(3)  # nothing else follows
    after = node.patches()[before:]
    assert len(after) == 1
    [condition] = after[0]["status"]["conditions"]  # type: ignore[index]
    assert "Xid 48" in condition["message"] and "Xid 62" in condition["message"]
    assert [e for e in node.events() if e["level"] == "error"
            and e["event"] == "watch.report_failed"].__len__() == 1  # said once
    assert node.props("NRestarts")["NRestarts"] == "0"


def test_rss_stays_flat_over_a_flood_of_100k_kmsg_lines(node: Node) -> None:
    noise = "usb 1-1: reset high-speed USB device number 2 using xhci_hcd"
    node.feed(*[noise] * 20_000, level=6)  # warm up: every path of a pass has run
    node.wait_for("the warm-up read", lambda: node.props("StatusText")["StatusText"]
                  .startswith(f"{node.seq - 100} kmsg records read"), timeout=60)
    rss_before = vm_rss_kib(node)
    started = time.monotonic()
    for _ in range(10):
        node.feed(*[noise] * 10_000, level=6)
    node.wait_for("the flood read", lambda: node.props("StatusText")["StatusText"]
                  .startswith(f"{node.seq - 100} kmsg records read"), timeout=120)
    took = time.monotonic() - started
    rss_after = vm_rss_kib(node)
    print(f"VmRSS {rss_before} kB before, {rss_after} kB after 100000 lines ({took:.1f} s)")
    assert rss_after - rss_before < 2048, (rss_before, rss_after)
    assert node.props("NRestarts")["NRestarts"] == "0"


def test_sigterm_is_a_clean_exit_0(node: Node) -> None:
    node.ns.systemctl("stop", UNIT)
    props = node.props("ActiveState", "Result", "ExecMainStatus", "ExecMainCode")
    assert (props["ActiveState"], props["Result"], props["ExecMainStatus"]) == (
        "inactive", "success", "0")
    assert [e["event"] for e in node.events()][-1] == "watch.stopped"


def test_a_gpu_gone_and_a_stripped_containerd_config_are_missing_and_repaired_unrestarted(
        ) -> None:
    # A namespace of its own: the module's node has a fatal Xid on record by now.
    with watched_node('[watch]\\ncontainerd_restart = "never"\\n', containerd=True) as node:
        node.ns.wait_active(UNIT)
        node.wait_for("the first pass", lambda: "kmsg records read" in node.props(
            "StatusText")["StatusText"])
        configured = node.ns.run(["cat", "/etc/containerd/config.toml"]).stdout
        assert "nvidia-container-runtime" in configured
        before = node.ns.unit_properties("containerd.service", "ActiveState", "InvocationID",
                                         "MainPID")
        # another tool writes Flatcar's default back over the copy, and the GPU goes
        node.ns.run(["cp", "/usr/share/containerd/config.toml", "/etc/containerd/config.toml"])
        shutil.rmtree(node.fixture / "sys/bus/pci/devices/0001:00:00.0")
        node.feed("usb 1-1: reset high-speed USB device number 2 using xhci_hcd", level=6)
        node.wait_for("the GPUMissing PATCH", lambda: node.patches(), timeout=60)
        [condition] = node.patches()[-1]["status"]["conditions"]  # type: ignore[index]
        assert (condition["status"], condition["reason"]) == ("False", "GPUMissing")
        assert "0 of the 1 GPUs" in condition["message"]
        node.wait_for("the repair's Event", lambda: repairs(node))
        repaired = node.ns.run(["cat", "/etc/containerd/config.toml"]).stdout
        assert "nvidia-container-runtime" in repaired
        # running, and restarted by nobody: watch.containerd_restart = "never"
        assert before["ActiveState"] == "active"
        assert "restart pending" in str(repairs(node)[0].get("message"))
        assert node.ns.unit_properties("containerd.service", "ActiveState", "InvocationID",
                                       "MainPID") == before
        assert node.props("NRestarts")["NRestarts"] == "0"


def repairs(node: Node) -> list[dict[str, object]]:
    return [r.json for r in node.api.requests if r.method == "POST" and "events" in r.path
            and (r.json or {}).get("reason") == "ContainerdConfigRepaired"]
