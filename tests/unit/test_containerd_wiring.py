"""Runtime wiring on fixture hosts: enable_cdi by containerd version, CDI mode, the toolkit's
mode runtimes and mode, the LimitMEMLOCK drop-in and the restarts it costs, and what status
says of each. Real containerd's dumps: tests/integration/test_runtime_wiring_real.py."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from conftest import HostFactory, in_place_host, with_runtime_binary
from gpunode.config import AgentConfig, ContainerdConfig, parse_text
from gpunode.containerd import extras, revert, step, wiring
from gpunode.containerd.ledger import MEMLOCK_DROPIN, TOOLKIT_CONFIG
from gpunode.containerd.probe import NoProbe
from gpunode.errors import ConfigError
from gpunode.platform.host import Host
from gpunode.platform.systemd import NoSystemd
from gpunode.status import evaluate, observe
from gpunode_testing import fixtures
from helpers import fake_containerd
from helpers.fake_containerd import RecordingSystemd

TOOLKIT_TEXT = """# the sysext's copy
disable-require = false

[nvidia-container-runtime]
log-level = "info"
mode = "auto"
runtimes = ["docker-runc", "runc", "crun"]

[nvidia-container-runtime.modes.cdi]
default-kind = "nvidia.com/gpu"
"""


@dataclass
class Probe(NoProbe):
    """The containerd version a test says the node runs; no dump."""

    daemon: tuple[int, int] | None

    def version(self, binary: str) -> tuple[int, int] | None:
        return self.daemon

    def dump(self, binary: str, path: str) -> None:
        return None


# -- enable_cdi by version -----------------------------------------------------------------------


@pytest.mark.parametrize(("setting", "daemon", "version", "cdi_mode", "wanted"), [
    ("auto", (1, 6), 2, False, False),  # 1.6 has no CDI
    ("auto", (1, 7), 2, False, True),  # 1.7 has it off
    ("auto", (2, 1), 2, False, False),  # 2.x has it on
    ("auto", (2, 1), 3, True, False),
    ("auto", None, 2, False, False),  # unknown, beside the runtime: nothing
    ("auto", None, 2, True, True),  # unknown, CDI mode: a file 1.x may read gets it
    ("auto", None, 3, True, False),  # version 3: 2.x only
    (True, (2, 1), 3, False, True),  # as written
    (False, (1, 7), 2, False, False),
])
def test_enable_cdi_is_written_only_where_containerd_needs_it(
    setting: bool | str, daemon: tuple[int, int] | None, version: int, cdi_mode: bool,
    wanted: bool,
) -> None:
    assert wiring.cdi_wanted(setting, daemon, version, cdi_mode) is wanted


def test_containerd_1_7_gets_enable_cdi_and_the_default_spec_dirs(make_host: HostFactory) -> None:
    host, target = in_place_host(make_host, fixtures.FLATCAR_CONTAINERD_CONFIG)
    step.apply(host, step.plan(host, ContainerdConfig(), NoSystemd(), probe=Probe((1, 7))),
               NoSystemd(), 5)
    text = target.read_text()
    assert "enable_cdi = true" in text
    assert 'cdi_spec_dirs = ["/etc/cdi", "/var/run/cdi"]' in text


def test_a_files_own_cdi_spec_dirs_are_kept(make_host: HostFactory) -> None:
    own = fixtures.FLATCAR_CONTAINERD_CONFIG.replace(
        "enable_selinux = true", 'enable_selinux = true\ncdi_spec_dirs = ["/run/cdi"]')
    host, target = in_place_host(make_host, own)
    step.apply(host, step.plan(host, ContainerdConfig(), NoSystemd(), probe=Probe((1, 7))),
               NoSystemd(), 5)
    assert target.read_text().count("cdi_spec_dirs") == 1


@pytest.mark.parametrize("daemon", [(2, 1), (1, 6)])
def test_containerd_2_and_1_6_get_no_cdi_key(make_host: HostFactory,
                                             daemon: tuple[int, int]) -> None:
    host, target = in_place_host(make_host, fixtures.FLATCAR_CONTAINERD_CONFIG)
    step.apply(host, step.plan(host, ContainerdConfig(), NoSystemd(), probe=Probe(daemon)),
               NoSystemd(), 5)
    assert "cdi" not in target.read_text()


@pytest.mark.parametrize(("text", "value"), [("enable_cdi = true", True),
                                             ("enable_cdi = false", False),
                                             ('enable_cdi = "auto"', "auto"), ("", "auto")])
def test_enable_cdi_reads_true_false_and_auto(text: str, value: bool | str) -> None:
    assert parse_text(f"[containerd]\n{text}\n", "c.toml").containerd.enable_cdi == value


def test_cdi_mode_refuses_keys_that_ask_for_a_runtime() -> None:
    with pytest.raises(ConfigError, match=r"c\.toml:3: key 'containerd\.mode_runtimes'"):
        parse_text('[containerd]\ngpu_access = "cdi"\nmode_runtimes = true\n', "c.toml")


# -- CDI mode ------------------------------------------------------------------------------------


def test_cdi_mode_needs_no_runtime_binary_and_writes_no_runtime(make_host: HostFactory) -> None:
    host = make_host("nc4as-t4-v3", "driver")  # no nvidia-container-runtime on it
    the_plan = step.plan(host, ContainerdConfig(gpu_access="cdi"), NoSystemd())
    step.apply(host, the_plan, NoSystemd(), 5)
    text = (host.root / "etc/containerd/config.toml").read_text()
    assert "enable_cdi = true" in text  # version unknown under --root: a 1.7 may read it
    assert "nvidia" not in text


def test_cdi_mode_on_containerd_2_is_already_as_needed(make_host: HostFactory) -> None:
    host, _ = in_place_host(make_host, fixtures.FLATCAR_CONTAINERD_CONFIG)
    (host.root / MEMLOCK_DROPIN.lstrip("/")).write_text(extras.MEMLOCK_TEXT)
    the_plan = step.plan(host, ContainerdConfig(gpu_access="cdi"), NoSystemd(),
                         probe=Probe((2, 1)))
    assert not the_plan.changed
    assert the_plan.describe() == [
        "/etc/containerd/config.toml: CDI is already as containerd needs it"]


def test_cdi_mode_refuses_a_file_that_switches_cdi_off_on_2x(make_host: HostFactory) -> None:
    off = "version = 3\n[plugins.'io.containerd.cri.v1.runtime']\nenable_cdi = false\n"
    host, _ = in_place_host(make_host, off)
    with pytest.raises(Exception, match=r"CDI would not take effect: containerd 2\.1 has CDI "
                       "off"):
        step.plan(host, ContainerdConfig(gpu_access="cdi"), NoSystemd(), probe=Probe((2, 1)))


def _status(host: Host, config: AgentConfig) -> dict[str, tuple[str, str]]:
    report = evaluate(observe(host, config, contact_api=False))
    return {c.name: (c.state, c.detail) for c in report.checks}


def test_status_in_cdi_mode_does_not_demand_the_runtime(make_host: HostFactory) -> None:
    host = make_host("nc4as-t4-v3", "driver")
    config = AgentConfig(containerd=ContainerdConfig(gpu_access="cdi"))
    step.apply(host, step.plan(host, config.containerd, NoSystemd()), NoSystemd(), 5)
    checks = _status(host, config)
    assert checks["toolkit"][0] == "skip"
    # Under --root nobody can say whether the containerd is a 1.6 (no CDI): a warning.
    state, detail = checks["containerd_runtime"]
    assert state == "warn" and "containerd 1.6: containerd 1.6 has no CDI support" in detail
    assert "containerd 1.7: injects CDI devices" in detail


# -- the toolkit ---------------------------------------------------------------------------------


def test_status_names_the_missing_toolkit_and_where_it_comes_from(make_host: HostFactory) -> None:
    host = make_host("nc4as-t4-v3", "driver")
    state, detail = _status(host, AgentConfig())["toolkit"]
    report = evaluate(observe(host, AgentConfig(), contact_api=False))
    hint = next(c.hint for c in report.checks if c.name == "toolkit") or ""
    assert state == "fail" and "/usr/bin/nvidia-container-runtime" in detail
    assert "sysext-bakery's nvidia-runtime sysext" in hint and 'gpu_access = "cdi"' in hint


def test_status_says_the_toolkit_is_there_on_a_ready_node(make_host: HostFactory) -> None:
    assert _status(make_host("nc4as-t4-v3", "ready"), AgentConfig())["toolkit"][0] == "ok"


def test_mode_runtimes_are_added_beside_nvidia_and_reverted(make_host: HostFactory) -> None:
    host, target = in_place_host(make_host, fixtures.FLATCAR_CONTAINERD_CONFIG)
    original = target.read_text()
    for name in ("nvidia-container-runtime.cdi", "nvidia-container-runtime.legacy"):
        (host.root / "usr/bin" / name).write_text("#!/bin/sh\n")
        (host.root / "usr/bin" / name).chmod(0o755)
    config = ContainerdConfig(mode_runtimes=True)
    the_plan = step.plan(host, config, NoSystemd())
    assert any("add runtime 'nvidia-cdi'" in line and "nvidia-container-runtime.cdi" in line
               for line in the_plan.describe())
    step.apply(host, the_plan, NoSystemd(), 5)
    text = target.read_text()
    assert 'BinaryName = "/usr/bin/nvidia-container-runtime.legacy"' in text
    assert not step.plan(host, config, NoSystemd()).changed  # idempotent
    revert.revert(host, NoSystemd(), 5)
    assert target.read_text() == original


def test_drop_in_mode_puts_the_mode_runtimes_into_the_imported_file(
    make_host: HostFactory,
) -> None:
    host, _ = in_place_host(make_host, "version = 3\n")
    for name in ("nvidia-container-runtime.cdi", "nvidia-container-runtime.legacy"):
        (host.root / "usr/bin" / name).write_text("#!/bin/sh\n")
        (host.root / "usr/bin" / name).chmod(0o755)
    config = ContainerdConfig(mode="drop-in", mode_runtimes=True)
    the_plan = step.plan(host, config, NoSystemd(), probe=Probe((2, 1)))
    assert the_plan.import_text is not None
    for name in ("nvidia", "nvidia-cdi", "nvidia-legacy"):
        assert f"runtimes.{name}]" in the_plan.import_text


def test_mode_runtimes_need_their_binaries(make_host: HostFactory) -> None:
    host = with_runtime_binary(make_host("nc4as-t4-v3", "driver"))
    with pytest.raises(Exception, match=r"nvidia-container-runtime\.cdi is not an executable"):
        step.plan(host, ContainerdConfig(mode_runtimes=True), NoSystemd())


def test_toolkit_mode_changes_only_that_key_and_only_once(make_host: HostFactory) -> None:
    host = with_runtime_binary(make_host("nc4as-t4-v3", "ready"))
    path = host.root / TOOLKIT_CONFIG.lstrip("/")
    path.parent.mkdir(parents=True)
    path.write_text(TOOLKIT_TEXT)
    config = ContainerdConfig(toolkit_mode="cdi")
    step.apply(host, step.plan(host, config, NoSystemd()), NoSystemd(), 5)
    assert path.read_text() == TOOLKIT_TEXT.replace('mode = "auto"', 'mode = "cdi"')
    assert not step.plan(host, config, NoSystemd()).changed
    assert _status(host, AgentConfig(containerd=config))["toolkit"][0] == "ok"


def test_status_warns_when_the_toolkit_config_for_its_mode_is_absent(
    make_host: HostFactory,
) -> None:
    config = AgentConfig(containerd=ContainerdConfig(toolkit_mode="cdi"))
    state, detail = _status(make_host("nc4as-t4-v3", "ready"), config)["toolkit"]
    assert state == "warn" and "is absent" in detail and "'cdi'" in detail


def test_toolkit_mode_unset_leaves_the_file_alone(make_host: HostFactory) -> None:
    host = with_runtime_binary(make_host("nc4as-t4-v3", "ready"))
    path = host.root / TOOLKIT_CONFIG.lstrip("/")
    path.parent.mkdir(parents=True)
    path.write_text("not toml at all [")
    assert not step.plan(host, ContainerdConfig(), NoSystemd()).changed


# -- LimitMEMLOCK and restarts -------------------------------------------------------------------


def test_first_boot_writes_the_memlock_dropin_reloads_and_does_not_restart(
    make_host: HostFactory,
) -> None:
    """containerd is not running yet at first boot: one daemon-reload (for both drop-ins),
    and it starts once, with them."""
    host = with_runtime_binary(make_host("nc4as-t4-v3", "driver"))
    systemd = RecordingSystemd(state="inactive")
    outcome = step.apply(host, step.plan(host, ContainerdConfig(), systemd), systemd, 5)
    assert (host.root / MEMLOCK_DROPIN.lstrip("/")).read_text() == extras.MEMLOCK_TEXT
    assert (outcome.restarted, systemd.calls) == (False, ["daemon-reload"])


def test_a_new_memlock_dropin_restarts_a_running_containerd_once(make_host: HostFactory) -> None:
    host = make_host("nc4as-t4-v3", "ready")
    (host.root / MEMLOCK_DROPIN.lstrip("/")).unlink()
    server = fake_containerd.listen(host)
    try:
        systemd = RecordingSystemd(state="active")
        outcome = step.apply(host, step.plan(host, ContainerdConfig(), systemd), systemd, 5)
    finally:
        server.close()
    assert outcome.restarted
    assert systemd.calls == ["daemon-reload", "restart containerd.service"]


def test_the_toolkit_mode_alone_restarts_nothing(make_host: HostFactory) -> None:
    host = make_host("nc4as-t4-v3", "ready")
    path = host.root / TOOLKIT_CONFIG.lstrip("/")
    path.parent.mkdir(parents=True)
    path.write_text(TOOLKIT_TEXT)
    systemd = RecordingSystemd(state="active")
    config = ContainerdConfig(toolkit_mode="cdi")
    outcome = step.apply(host, step.plan(host, config, systemd), systemd, 5)
    assert (outcome.changed, outcome.restarted, systemd.calls) == (True, False, [])


def test_limit_memlock_false_removes_gpunodes_dropin_only(make_host: HostFactory) -> None:
    host = make_host("nc4as-t4-v3", "ready")
    dropin = host.root / MEMLOCK_DROPIN.lstrip("/")
    config = ContainerdConfig(limit_memlock=False)
    step.apply(host, step.plan(host, config, NoSystemd()), NoSystemd(), 5)
    assert not dropin.exists()
    dropin.write_text("[Service]\nLimitMEMLOCK=1G\n")  # somebody else's: left alone
    assert not step.plan(host, config, NoSystemd()).changed


class Killed(BaseException):
    """A SIGKILL at this point: nothing after it runs."""


def test_a_memlock_dropin_rolled_back_after_a_kill_is_reloaded(
    make_host: HostFactory, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A configure killed right after writing the drop-in: the next run puts the node back
    (the drop-in removed) and has systemd read the units again before it plans."""
    host, _ = in_place_host(make_host, fixtures.FLATCAR_CONTAINERD_CONFIG)
    (host.root / MEMLOCK_DROPIN.lstrip("/")).unlink()
    real = Host.write_atomic

    def write_then_die(self: Host, path: str, *args: object, **kwargs: object) -> None:
        real(self, path, *args, **kwargs)  # type: ignore[arg-type]
        if path == MEMLOCK_DROPIN:
            raise Killed(path)

    with monkeypatch.context() as patch:
        patch.setattr(Host, "write_atomic", write_then_die)
        with pytest.raises(Killed):
            step.apply(host, step.plan(host, ContainerdConfig(), NoSystemd()), NoSystemd(), 5)
    assert (host.root / MEMLOCK_DROPIN.lstrip("/")).exists()
    systemd = RecordingSystemd(state="inactive")
    step.recover(host, systemd)
    assert not (host.root / MEMLOCK_DROPIN.lstrip("/")).exists()
    assert systemd.calls == ["daemon-reload"]
