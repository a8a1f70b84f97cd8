"""`containerd_running`: a restart is pending only when the config changed after the running
containerd started, as systemd recorded that start (microseconds, the wall clock of mtimes);
where nobody can say when it started, status says so instead of guessing."""

from __future__ import annotations

import dataclasses

from conftest import HostFactory
from gpunode.config import AgentConfig
from gpunode.platform.processes import ProcessFacts
from gpunode.status import DaemonStart, StatusFacts, evaluate, observe

BTIME = 1764400000  # /proc/stat's btime: whole seconds


def containerd_check(facts: StatusFacts):  # type: ignore[no-untyped-def]
    return next(c for c in evaluate(facts).checks if c.name == "containerd_running")


def booted(make_host: HostFactory, config_mtime: float, start: DaemonStart) -> StatusFacts:
    """A ready node where containerd (pid 812) started 0.9 s into a boot whose btime, as
    /proc/stat rounds it, is BTIME: /proc's start time (btime + clock ticks, what status used
    to compare) says BTIME + 0.0 for it."""
    facts = observe(make_host("nc4as-t4-v3", "ready"), AgentConfig(), contact_api=False)
    processes = ProcessFacts(boot_time=BTIME, running={"containerd": [812], "kubelet": [901]})
    return dataclasses.replace(
        facts, processes=processes, containerd_start=start,
        containerd=dataclasses.replace(facts.containerd, config_mtime=config_mtime))


def test_config_written_just_before_containerd_started_is_no_pending_restart(
    make_host: HostFactory,
) -> None:
    """The first boot: gpunode writes the config 0.6 s before systemd starts containerd. The
    /proc start time (btime rounded down + ticks) would put containerd's start before that."""
    facts = booted(make_host, BTIME + 0.3, DaemonStart(pid=812, started=BTIME + 0.9))
    check = containerd_check(facts)
    assert (check.state, check.detail) == ("ok", "containerd running (pid 812)")


def test_config_changed_after_systemd_started_containerd_is_a_pending_restart(
    make_host: HostFactory,
) -> None:
    facts = booted(make_host, BTIME + 0.9001, DaemonStart(pid=812, started=BTIME + 0.9))
    check = containerd_check(facts)
    assert check.state == "warn"
    assert check.detail == ("containerd running (pid 812), but /etc/containerd/config.toml "
                            "changed after it started: a restart is pending")
    assert check.hint == "run 'systemctl restart containerd' when pods on this node can take it"


def test_without_systemd_s_record_status_says_it_cannot_tell(make_host: HostFactory) -> None:
    facts = booted(make_host, BTIME + 3600, DaemonStart(
        unknown="no systemd on the system bus (No such file or directory)"))
    check = containerd_check(facts)
    assert check.state == "ok"
    assert check.detail == ("containerd running (pid 812); cannot tell whether a restart is "
                            "pending: no systemd on the system bus (No such file or directory)")


def test_a_containerd_that_is_not_the_unit_s_main_process_cannot_be_judged(
    make_host: HostFactory,
) -> None:
    facts = booted(make_host, BTIME + 3600, DaemonStart(pid=4242, started=BTIME + 0.9))
    check = containerd_check(facts)
    assert (check.state, check.detail) == (
        "ok", "containerd running (pid 812); cannot tell whether a restart is pending: "
        "containerd.service's main process is pid 4242, not a running containerd")


def test_under_a_root_no_service_manager_says_when_containerd_started(
    make_host: HostFactory,
) -> None:
    host = make_host("nc4as-t4-v3", "ready")
    (host.root / "etc/containerd/config.toml").touch()  # long after the fixture's boot
    check = containerd_check(observe(host, AgentConfig(), contact_api=False))
    assert check.state == "ok"
    assert check.detail == (f"containerd running (pid 812); cannot tell whether a restart is "
                            f"pending: under --root {host.root} no service manager says when "
                            "containerd started")
