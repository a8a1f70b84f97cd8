"""gpunode's shipped containerd drop-in (units/containerd-env.conf, in the sysext): where it is
in place, the writable copy of Flatcar's read-only config is named in /etc/gpunode/containerd.env,
which systemd reads at every containerd start, so the first boot needs no daemon-reload. On
fixture hosts with a recording systemd; tests/integration/test_boot_systemd.py boots a real
systemd with the drop-in and has containerd read the copy without one."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import HostFactory, with_runtime_binary
from gpunode.config import ContainerdConfig
from gpunode.containerd import ledger, revert, step
from gpunode.containerd.discover import active_config
from gpunode.platform.host import Host
from gpunode.platform.systemd import UnitExec
from helpers.fake_containerd import RecordingSystemd

REPO = Path(__file__).resolve().parents[2]
SHIPPED = (REPO / "gpunode/delivery/units/containerd-env.conf").read_text()
ENV_TEXT = ("# Written by gpunode: containerd reads a writable copy of its config, which has the "
            "NVIDIA runtime.\nCONTAINERD_CONFIG=/etc/containerd/config.toml\n")


def shipped_host(make_host: HostFactory) -> Host:
    """A Flatcar T4 node with its driver up, the toolkit, and gpunode's shipped drop-in."""
    host = with_runtime_binary(make_host("nc4as-t4-v3", "driver"))
    path = host.root / ledger.SHIPPED_DROPIN.lstrip("/")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(SHIPPED)
    return host


def configure(host: Host) -> None:
    step.apply(host, step.plan(host, ContainerdConfig(), None),
               RecordingSystemd(state="inactive", host=host), 5)


def test_the_shipped_drop_in_reads_the_env_file_the_step_writes() -> None:
    assert f"EnvironmentFile=-{ledger.ENV_FILE}\n" in SHIPPED


def test_the_copy_is_named_in_the_env_file_not_a_drop_in_and_nothing_reloads(
        make_host: HostFactory) -> None:
    host = shipped_host(make_host)
    systemd = RecordingSystemd(state="inactive", host=host)
    the_plan = step.plan(host, ContainerdConfig(), systemd)
    assert f"write {ledger.ENV_FILE} so containerd reads /etc/containerd/config.toml" in \
        the_plan.describe()
    step.apply(host, the_plan, systemd, 5)
    assert (host.root / "etc/gpunode/containerd.env").read_text() == ENV_TEXT
    assert not (host.root / ledger.DROPIN.lstrip("/")).exists()
    assert "daemon-reload" not in systemd.calls
    record = json.loads((host.root / ledger.LEDGER.lstrip("/")).read_text())
    assert record["dropin"] == ledger.ENV_FILE


def test_after_the_env_file_containerd_reads_the_copy_and_a_second_run_changes_nothing(
        make_host: HostFactory) -> None:
    host = shipped_host(make_host)
    configure(host)
    assert active_config(host).path == "/etc/containerd/config.toml"
    assert not step.plan(host, ContainerdConfig(), None).changed


def test_a_live_systemd_s_environment_files_are_read_for_the_config_path(
        make_host: HostFactory) -> None:
    host = shipped_host(make_host)
    (host.root / "etc/gpunode").mkdir(parents=True, exist_ok=True)
    (host.root / "etc/gpunode/containerd.env").write_text(ENV_TEXT)

    class Live(RecordingSystemd):
        def exec_start(self, unit: str) -> UnitExec:  # type: ignore[override]
            return UnitExec(("/usr/bin/containerd", "--config", "${CONTAINERD_CONFIG}"),
                            {"CONTAINERD_CONFIG": "/usr/share/containerd/config.toml"},
                            (ledger.ENV_FILE,))

    active = active_config(host, Live(host=host))
    assert active.path == "/etc/containerd/config.toml"
    assert active.env_files == (ledger.ENV_FILE,)


def test_an_env_file_overrides_environment_set_after_it_as_systemd_does(
        make_host: HostFactory) -> None:
    host = shipped_host(make_host)
    (host.root / "etc/gpunode").mkdir(parents=True, exist_ok=True)
    (host.root / "etc/gpunode/containerd.env").write_text(ENV_TEXT)
    later = host.root / "etc/systemd/system/containerd.service.d/90-other.conf"
    later.parent.mkdir(parents=True, exist_ok=True)
    later.write_text("[Service]\nEnvironment=CONTAINERD_CONFIG=/etc/other.toml\n")
    assert active_config(host).path == "/etc/containerd/config.toml"


def test_revert_removes_the_copy_and_the_env_file_without_a_reload(
        make_host: HostFactory) -> None:
    host = shipped_host(make_host)
    configure(host)
    systemd = RecordingSystemd(state="inactive", host=host)
    outcome = revert.revert(host, systemd, 5)
    assert f"remove {ledger.ENV_FILE}" in outcome.descriptions
    assert not (host.root / "etc/gpunode/containerd.env").exists()
    assert not (host.root / "etc/containerd/config.toml").exists()
    assert "daemon-reload" not in systemd.calls
    assert active_config(host).path == "/usr/share/containerd/config.toml"


def test_without_the_shipped_drop_in_the_step_writes_its_own_and_reloads(
        make_host: HostFactory) -> None:
    host = with_runtime_binary(make_host("nc4as-t4-v3", "driver"))
    systemd = RecordingSystemd(state="inactive", host=host)
    step.apply(host, step.plan(host, ContainerdConfig(), systemd), systemd, 5)
    assert (host.root / ledger.DROPIN.lstrip("/")).exists()
    assert not (host.root / "etc/gpunode/containerd.env").exists()
    assert "daemon-reload" in systemd.calls


def test_a_ledger_naming_another_pointer_file_is_refused(make_host: HostFactory) -> None:
    host = shipped_host(make_host)
    configure(host)
    path = host.root / ledger.LEDGER.lstrip("/")
    record = json.loads(path.read_text())
    path.write_text(json.dumps({**record, "dropin": "/etc/passwd"}))
    try:
        ledger.read(host)
    except ledger.LedgerError as exc:
        assert "gpunode only writes '/etc/systemd/system/containerd.service.d/10-gpunode.conf' " \
            "or '/etc/gpunode/containerd.env' there" in str(exc)
    else:
        raise AssertionError("a ledger naming /etc/passwd was accepted")


def test_the_shipped_drop_in_sets_the_memlock_limit_so_none_is_written(
        make_host: HostFactory) -> None:
    host = shipped_host(make_host)
    assert "LimitMEMLOCK=infinity\n" in SHIPPED
    the_plan = step.plan(host, ContainerdConfig(), None)
    assert not any(f.path == ledger.MEMLOCK_DROPIN for f in the_plan.files)


def test_limit_memlock_false_writes_systemd_s_default_after_the_shipped_drop_in_and_back(
        make_host: HostFactory) -> None:
    host = shipped_host(make_host)
    systemd = RecordingSystemd(state="inactive", host=host)
    step.apply(host, step.plan(host, ContainerdConfig(limit_memlock=False), None), systemd, 5)
    memlock = host.root / ledger.MEMLOCK_DROPIN.lstrip("/")
    assert memlock.read_text().endswith("[Service]\nLimitMEMLOCK=8M\n")
    assert systemd.calls == ["daemon-reload"]  # a unit setting changed: systemd must read it
    step.apply(host, step.plan(host, ContainerdConfig(), None), systemd, 5)
    assert not memlock.exists()


def test_an_env_file_that_is_a_fifo_is_one_refusal_naming_it(
        make_host: HostFactory, tmp_path: Path) -> None:
    import os

    from gpunode.errors import GpunodeError

    host = shipped_host(make_host)
    (host.root / "etc/gpunode").mkdir(parents=True, exist_ok=True)
    os.mkfifo(host.root / "etc/gpunode/containerd.env")
    try:
        step.plan(host, ContainerdConfig(), None)
    except GpunodeError as exc:
        assert "etc/gpunode/containerd.env" in str(exc) and "FIFO" in str(exc)
    else:
        raise AssertionError("a FIFO as the env file was read as if it were a file")


def test_garbage_in_the_env_file_names_no_config_so_the_copy_is_made_again(
        make_host: HostFactory) -> None:
    host = shipped_host(make_host)
    (host.root / "etc/gpunode").mkdir(parents=True, exist_ok=True)
    (host.root / "etc/gpunode/containerd.env").write_text("\x00\x01 not = an env\n")
    assert active_config(host).path == "/usr/share/containerd/config.toml"
