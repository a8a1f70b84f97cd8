"""gpunode where no systemd answers on the system bus (an image build, a chroot, a container,
CI): `containerd configure` and `boot` do their work on the live root `/`, say what they could
not ask or reload, exit 0, and never show a traceback.

The tests run gpunode in a private mount and PID namespace (`unshare`) whose /run
is an empty tmpfs — so no /run/dbus/system_bus_socket and no /run/systemd, whatever the machine
has — and whose /etc, /usr, /var/lib and /dev are copy-on-write overlays with their upper layers
on a private tmpfs: gpunode runs with `Host("/")` (`is_live` is true, the real D-Bus adapter is
used) while every write lands in the namespace and vanishes with it. A fixture GPU node is
bind-mounted over /sys/bus/pci/devices, /sys/module, /proc/driver and /proc/devices inside, as
the real-systemd boot test does. No systemd is started; the test asserts the machine's own
files are as they were afterwards. (Boot's preflight without a bus, in-process:
tests/unit/test_boot_nobus.py.)
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from gpunode_testing import fixtures
from gpunode_testing.driver_files import install_lines

GPUNODE = Path(sys.executable).with_name("gpunode")
OVERLAYS = ("etc", "usr", "var/lib", "dev")
# What the namespace must leave alone on the machine (content, or absence).
MACHINE_FILES = ("/etc/containerd/config.toml", "/var/lib/gpunode/containerd.json",
                 "/run/gpunode/state.json", "/usr/bin/nvidia-container-runtime",
                 "/etc/gpunode/config.toml", "/dev/nvidiactl",
                 "/etc/systemd/system/kubelet.service.d/20-gpunode-registration.conf")


def _machine_state() -> dict[str, bytes | None]:
    state: dict[str, bytes | None] = {}
    for path in MACHINE_FILES:
        try:
            state[path] = Path(path).read_bytes()
        except (FileNotFoundError, NotADirectoryError):
            state[path] = None
        except OSError as exc:  # e.g. a device node
            state[path] = str(exc).encode()
    return state


def in_namespace_without_bus(work: Path, lines: list[str]) -> subprocess.CompletedProcess[str]:
    """Run shell `lines` as PID 1 of a private PID+mount namespace with no system bus."""
    q = shlex.quote
    layers = work / "layers"
    layers.mkdir()
    script = [
        "set -eu",
        "mount -n -t tmpfs -o mode=755 tmpfs /run  # no bus socket, no /run/systemd",
        f"mount -n -t tmpfs -o mode=700 tmpfs {q(str(layers))}",
        f"for dir in {' '.join(OVERLAYS)}; do",
        f'    upper={q(str(layers))}/$(echo "$dir" | tr / -)',
        '    mkdir "$upper-upper" "$upper-work"',
        '    mount -n -t overlay -o "lowerdir=/$dir,upperdir=$upper-upper,workdir=$upper-work" '
        'overlay "/$dir"',
        "done",
        "test ! -e /run/dbus/system_bus_socket",
        *lines,
    ]
    (work / "script.sh").write_text("\n".join(script) + "\n")
    machine = _machine_state()
    done = subprocess.run(["unshare", "--pid", "--fork", "--kill-child", "--mount",
                           "--propagation", "private", "--mount-proc", "/bin/sh",
                           str(work / "script.sh")], capture_output=True, text=True,
                          timeout=120, check=False, env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin",
                                                         "LANG": "C.UTF-8"})
    assert _machine_state() == machine, "the namespace changed the machine's files"
    return done


def gpunode(work: Path, name: str, *argv: str) -> str:
    """A shell line running gpunode, its stdout, stderr and exit code kept in `work`."""
    q = shlex.quote
    out = work / name
    return (f"{q(str(GPUNODE))} --log-format json {' '.join(map(q, argv))} "
            f">{q(str(out))}.out 2>{q(str(out))}.err; echo $? >{q(str(out))}.rc")


def result(work: Path, name: str) -> tuple[int, str, list[dict[str, object]]]:
    err = (work / f"{name}.err").read_text()
    assert "Traceback" not in err, err
    events = [json.loads(line) for line in err.splitlines()]  # every line JSON
    return int((work / f"{name}.rc").read_text()), (work / f"{name}.out").read_text(), events


@pytest.mark.allow_paths(*MACHINE_FILES)  # read before and after, to compare
def test_containerd_configure_of_a_file_without_a_bus_writes_it_and_exits_0(
    tmp_path: Path,
) -> None:
    config = tmp_path / "config.toml"
    original = ('version = 2\n[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]\n'
                '  runtime_type = "io.containerd.runc.v2"\n')
    config.write_text(original)
    runtime = tmp_path / "nvidia-container-runtime"
    runtime.write_text("#!/bin/sh\n")
    runtime.chmod(0o755)
    done = in_namespace_without_bus(tmp_path, [
        # (the overlays) the machine's containerd as a fresh node's: neither gpunode's
        # LimitMEMLOCK drop-in (an earlier run on this machine may have left one) nor the
        # sysext's shipped one, so the drop-in is always written
        "rm -f /etc/systemd/system/containerd.service.d/20-gpunode-memlock.conf "
        "/usr/lib/systemd/system/containerd.service.d/10-gpunode-env.conf",
        gpunode(tmp_path, "configure", "containerd", "configure", "--config", str(config),
                "--runtime-path", str(runtime)),
        gpunode(tmp_path, "revert", "containerd", "revert", "--config", str(config)),
        f"cp {shlex.quote(str(config))} {shlex.quote(str(tmp_path / 'after-revert.toml'))}",
        "rm -f /usr/bin/containerd  # (the /usr overlay) a tree whose containerd is elsewhere",
        gpunode(tmp_path, "no-binary", "containerd", "configure", "--config", str(config),
                "--runtime-path", str(runtime)),
    ])
    assert done.returncode == 0, done.stderr
    code, out, events = result(tmp_path, "configure")
    assert code == 0
    assert out == (f"{config}: add runtime 'nvidia' (a copy of 'runc')\n"
                   "write /etc/systemd/system/containerd.service.d/20-gpunode-memlock.conf "
                   "(LimitMEMLOCK=infinity for containerd)\n")
    assert [e["event"] for e in events if e["level"] == "warning"] == [
        "systemd.unavailable", "containerd.unmanaged"]
    assert "whoever runs it must restart it" in str(events[1]["note"])
    assert not [e for e in events if e["level"] == "error"]
    code, _, events = result(tmp_path, "revert")
    assert code == 0, events
    assert (tmp_path / "after-revert.toml").read_text() == original
    # Without a containerd binary the runtime is copied from the file alone, and the warning
    # says what happened to the program.
    code, _, events = result(tmp_path, "no-binary")
    assert code == 0, events
    [dump] = [e for e in events if e["event"] == "containerd.dump_unavailable"]
    assert dump["error"] == (f"'/usr/bin/containerd --config {config} config dump' could not "
                             "be started: No such file or directory")
    assert 'BinaryName = "' in config.read_text()


@pytest.mark.allow_paths(*MACHINE_FILES)  # read before and after, to compare
def test_boot_on_the_live_root_without_a_bus_configures_and_notes_what_it_skipped(
    tmp_path: Path,
) -> None:
    """The whole pipeline on `/` (a T4 with its driver loaded, Flatcar's containerd layout,
    registration by the kubelet): every step runs, nothing can be reloaded, exit 0."""
    fixture = tmp_path / "fixture"
    fixtures.build(fixtures.MACHINES["nc4as-t4-v3"], fixture,
                   fixtures.Options(state="driver", flat_sysfs=True, dev_nodes="plain"))
    q = shlex.quote
    f = q(str(fixture))
    agent = '[detect]\\nsource = "sysfs"\\n[kubernetes]\\nregister_with = "kubelet"\\n'
    done = in_namespace_without_bus(tmp_path, [
        f"mount -n --bind {f}/sys/bus/pci/devices /sys/bus/pci/devices",
        f"mount -n --bind {f}/sys/module /sys/module",
        f"mount -n --bind {f}/proc/driver /proc/driver",
        f"mount -n --bind {f}/proc/devices /proc/devices",
        *install_lines(fixture),  # the driver's user-space, onto the /usr overlay
        "mkdir -p /usr/share/containerd /etc/gpunode /etc/systemd/system",
        f"cp {f}/usr/share/containerd/config.toml /usr/share/containerd/config.toml",
        f"cp {f}/usr/lib/systemd/system/containerd.service /etc/systemd/system/",
        "printf '[Service]\\nExecStart=/opt/bin/kubelet $KUBELET_ARGS\\n' "
        "> /etc/systemd/system/kubelet.service",
        "rm -rf /etc/containerd /var/lib/gpunode /var/lib/kubelet "
        "/etc/systemd/system/containerd.service.d /etc/systemd/system/kubelet.service.d",
        "printf '#!/bin/sh\\n' > /usr/bin/nvidia-container-runtime",
        "chmod 755 /usr/bin/nvidia-container-runtime",
        # the driver's user-space, as the driver sysext ships it (the CDI spec mounts it)
        f"mkdir -p /usr/lib64 /usr/lib/firmware && cp {f}/usr/lib64/lib*.so.* /usr/lib64/",
        f"cp -r {f}/lib/firmware/nvidia /usr/lib/firmware/ && cp {f}/usr/bin/nvidia-smi /usr/bin/",
        f"printf '{agent}' > /etc/gpunode/config.toml",
        gpunode(tmp_path, "boot", "boot"),
        gpunode(tmp_path, "status", "status", "--json"),
        f"cp /run/gpunode/state.json {q(str(tmp_path / 'state.json'))}",
        f"cat /etc/containerd/config.toml > {q(str(tmp_path / 'containerd.toml'))}",
        f"cat /var/run/cdi/nvidia.yaml > {q(str(tmp_path / 'nvidia.yaml'))}",
    ])
    assert done.returncode == 0, done.stderr
    code, _, events = result(tmp_path, "boot")
    assert code == 0, events
    assert not [e for e in events if e["level"] == "error"]
    warnings = [e["event"] for e in events if e["level"] == "warning"]
    assert warnings[:2] == ["systemd.unavailable", "boot.preflight_unchecked"]
    assert "containerd.unmanaged" in warnings
    record = json.loads((tmp_path / "state.json").read_text())
    assert record["outcome"] == "ok"
    steps = {s["name"]: s for s in record["steps"]}
    assert list(steps) == ["detect", "driver", "gpu_init", "cdi", "containerd",
                           "registration"]
    assert "nvidia.com/gpu" in (tmp_path / "nvidia.yaml").read_text()
    assert steps["containerd"]["config"] == "/etc/containerd/config.toml"
    assert str(steps["registration"]["daemon_reload"]).startswith(
        "skipped: no systemd on the system bus")
    assert 'BinaryName = "/usr/bin/nvidia-container-runtime"' in (
        tmp_path / "containerd.toml").read_text()

    code, out, events = result(tmp_path, "status")
    checks = {c["name"]: c for c in json.loads(out)["checks"]}
    assert checks["containerd_runtime"]["state"] == "ok", checks["containerd_runtime"]
    # containerd does not run in the namespace; had it, no start time could be known here
    assert checks["containerd_running"]["detail"] == "containerd is not running"
    assert checks["last_boot"]["state"] == "ok"
