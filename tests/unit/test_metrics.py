"""`gpunode metrics` and the watch's textfile on fixture nodes: each family's series as a user
reads them in Prometheus, parsed with prometheus_client's own parser (gpunode/metrics/)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.parser import text_string_to_metric_families

from conftest import HostFactory
from gpunode.config import AgentConfig, KubernetesConfig, MetricsConfig
from gpunode.metrics import exposition, facts, families
from gpunode.metrics.exposition import Family
from gpunode.pipeline import state
from gpunode.platform.host import Host
from gpunode.watch import once
from gpunode_testing import fixtures
from gpunode_testing.driver_files import gpu_uuid
from helpers.watch_api import FakeApi
from hostile.support import Cli

ND96, T4, CPU = "nd96amsr-a100-v4", "nc4as-t4-v3", "azure-d4s-v5"
GPU0, GPU1 = "0001:00:00.0", "0002:00:00.0"
TEXTFILE = "var/lib/node_exporter/textfile_collector/gpunode.prom"
CONFIG = AgentConfig(kubernetes=KubernetesConfig(node_name="node-0"))
DOC = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"

Series = dict[str, dict[tuple[tuple[str, str], ...], float]]


def parse(text: str) -> Series:
    """name → {sorted labels → value}, as prometheus_client's parser reads the text."""
    found: Series = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return found


def one(series: Series, name: str, **labels: str) -> float:
    wanted = tuple(sorted(labels.items()))
    return series[name][wanted]


def metrics_of(cli: Cli, host: Host) -> Series:
    result = cli("--root", str(host.root), "metrics")
    assert result.code == 0, result.err
    return parse(result.out)


def kernel_log(host: Host, *messages: str) -> None:
    (host.root / "dev").mkdir(exist_ok=True)
    (host.root / "dev/kmsg").write_text("".join(
        f"3,{n},{n * 1_000_000},-;{m}\n" for n, m in enumerate(messages, start=1)))


def watch_pass(host: Host, config: AgentConfig = CONFIG) -> FakeApi:
    api = FakeApi()
    once.run(host, config, False, lambda: api)
    return api


def state_of(series: Series, address: str) -> str:
    [state] = [dict(k)["state"] for k, v in series["gpunode_gpu_state"].items()
               if dict(k)["address"] == address and v == 1]
    return state


MACHINE_STATES = [(m.name, s) for m in fixtures.MACHINES.values() for s in m.states]


@pytest.mark.parametrize(("machine", "state"), MACHINE_STATES,
                         ids=[f"{m}-{s}" for m, s in MACHINE_STATES])
def test_every_fixture_node_prints_metrics_that_parse_and_are_all_documented(
        cli: Cli, make_host: HostFactory, machine: str, state: str) -> None:
    series = metrics_of(cli, make_host(machine, state))
    documented = DOC.read_text()
    assert series["gpunode_build_info"] == {(("version", metrics_version()),): 1}
    assert [n for n in series if f"`{n}`" not in documented] == []
    assert sum(v for v in series["gpunode_boot_outcome"].values()) == 1


def metrics_version() -> str:
    from gpunode import __version__

    return __version__


def test_a_cpu_node_has_its_boot_outcome_and_no_gpu_series(cli: Cli,
                                                           make_host: HostFactory) -> None:
    host = make_host(CPU, "bare")
    (host.root / "run/gpunode").mkdir(parents=True)
    (host.root / "run/gpunode/state.json").write_bytes(state.no_gpu(
        "2026-11-29T08:00:01Z", "2026-11-29T08:00:01Z", 1.5))
    series = metrics_of(cli, host)
    assert sorted(series) == ["gpunode_boot_finished_timestamp_seconds", "gpunode_boot_outcome",
                              "gpunode_boot_step_duration_seconds", "gpunode_boot_step_success",
                              "gpunode_build_info", "gpunode_gpus_detected"]
    assert one(series, "gpunode_boot_outcome", outcome="no-gpu") == 1
    assert one(series, "gpunode_gpus_detected") == 0
    assert one(series, "gpunode_boot_step_duration_seconds", step="detect") == 0.0015


def test_a_ready_node_shows_its_boot_steps_driver_gpu_and_gpu_ready(
        cli: Cli, make_host: HostFactory) -> None:
    series = metrics_of(cli, make_host(T4, "ready"))
    assert one(series, "gpunode_boot_outcome", outcome="ok") == 1
    assert one(series, "gpunode_boot_step_duration_seconds", step="driver") == 0.412
    assert one(series, "gpunode_boot_step_success", step="containerd") == 1
    assert one(series, "gpunode_boot_finished_timestamp_seconds") == 1795939202  # 08:00:02Z
    assert one(series, "gpunode_gpu_state", address=GPU0, index="0", state="ready",
               uuid=gpu_uuid(T4, GPU0)) == 1
    assert one(series, "gpunode_gpu_ready_condition", reason="GPUReady") == 1
    assert one(series, "gpunode_driver_info", version="550.127.08", flavour="proprietary",
               strategy="") == 1
    assert one(series, "gpunode_driver_userspace_matches") == 1
    assert series["gpunode_driver_userspace_info"] == {(("version", "550.127.08"),): 1}


def test_a_failed_boot_step_is_outcome_failed_and_that_steps_success_0(
        cli: Cli, make_host: HostFactory) -> None:
    host = make_host(T4, "ready")
    record = json.loads((host.root / "run/gpunode/state.json").read_text())
    record["outcome"] = "failed"
    record["steps"][1].update(outcome="failed", error="modprobe nvidia failed", code="driver")
    (host.root / "run/gpunode/state.json").write_text(json.dumps(record))
    series = metrics_of(cli, host)
    assert one(series, "gpunode_boot_outcome", outcome="failed") == 1
    assert one(series, "gpunode_boot_outcome", outcome="ok") == 0
    assert one(series, "gpunode_boot_step_success", step="driver") == 0


def test_a_boot_record_that_cannot_be_used_is_outcome_unreadable_and_still_exit_0(
        cli: Cli, make_host: HostFactory) -> None:
    host = make_host(T4, "ready")
    (host.root / "run/gpunode/state.json").write_text("{not json")
    series = metrics_of(cli, host)
    assert one(series, "gpunode_boot_outcome", outcome="unreadable") == 1
    assert "gpunode_boot_step_duration_seconds" not in series


def test_an_xid_79_makes_that_gpu_fell_off_bus_and_gpu_ready_false_and_every_xid_counts(
        make_host: HostFactory) -> None:
    host = make_host(ND96, "ready")
    kernel_log(host, "NVRM: Xid (PCI:0001:00:00): 79, pid=1122, GPU has fallen off the bus.",
               "NVRM: Xid (PCI:0002:00:00): 13, pid=7, name=python, Graphics Exception",
               "NVRM: Xid (PCI:0002:00:00): 13, pid=7, name=python, Graphics Exception")
    watch_pass(host)
    series = parse((host.root / TEXTFILE).read_text())
    assert state_of(series, GPU0) == "fell-off-bus"
    assert state_of(series, GPU1) == "ready"
    assert one(series, "gpunode_gpu_ready_condition", reason="GPUFellOffBus") == 0
    assert one(series, "gpunode_xids_total", address=GPU0, code="79") == 1
    assert one(series, "gpunode_xids_total", address=GPU1, code="13") == 2  # ignored, counted


def test_another_fatal_xid_is_xid_fatal_and_a_rerun_counts_nothing_twice(
        make_host: HostFactory) -> None:
    host = make_host(ND96, "ready")
    kernel_log(host, "NVRM: Xid (PCI:0002:00:00): 48, pid='<unknown>', name=<unknown>, DBE")
    watch_pass(host)
    watch_pass(host)
    series = parse((host.root / TEXTFILE).read_text())
    assert state_of(series, GPU1) == "xid-fatal"
    assert one(series, "gpunode_xids_total", address=GPU1, code="48") == 1
    assert one(series, "gpunode_gpu_ready_condition", reason="GPUXidFatal") == 0


def test_a_gpu_gone_since_the_watch_first_saw_it_is_missing(make_host: HostFactory) -> None:
    host = make_host(ND96, "ready")
    kernel_log(host)
    watch_pass(host)
    for gone in (host.root / "sys/bus/pci/devices/0008:00:00.0",
                 host.root / "sys/devices/pci0008:00/0008:00:00.0"):
        if gone.is_symlink():
            gone.unlink()
    watch_pass(host)
    series = parse((host.root / TEXTFILE).read_text())
    assert one(series, "gpunode_gpus_detected") == 7
    assert state_of(series, "0008:00:00.0") == "missing"
    assert one(series, "gpunode_gpu_ready_condition", reason="GPUMissing") == 0


def test_the_vm_sizes_gpu_count_is_expected_beside_the_detected_one(
        cli: Cli, make_host: HostFactory) -> None:
    host = make_host(T4, "ready", extra={"/run/metadata/flatcar":
                                         "COREOS_AZURE_VMSIZE=Standard_NC64as_T4_v3\n"})
    series = metrics_of(cli, host)
    assert one(series, "gpunode_gpus_expected") == 4
    assert one(series, "gpunode_gpus_detected") == 1
    assert one(series, "gpunode_vm_size_info", vm_size="Standard_NC64as_T4_v3") == 1


def test_a_gpu_bound_to_vfio_pci_is_passthrough_without_an_index(
        cli: Cli, make_host: HostFactory) -> None:
    series = metrics_of(cli, make_host("a100-vfio", "ready"))
    assert state_of(series, GPU0) == "ready"
    assert state_of(series, GPU1) == "passthrough"
    assert one(series, "gpunode_gpu_state", address=GPU1, index="", uuid="",
               state="passthrough") == 1


def test_user_space_of_another_version_than_the_loaded_driver_is_a_mismatch_naming_it(
        cli: Cli, make_host: HostFactory) -> None:
    host = make_host(T4, "ready")
    for library in (host.root / "usr/lib64").glob("*.so.550.127.08"):
        library.rename(library.with_name(library.name.replace("550.127.08", "535.216.03")))
    series = metrics_of(cli, host)
    assert one(series, "gpunode_driver_userspace_matches") == 0
    assert series["gpunode_driver_userspace_info"] == {(("version", "535.216.03"),): 1}
    assert one(series, "gpunode_driver_info", version="550.127.08", flavour="proprietary",
               strategy="") == 1


def test_a_node_whose_driver_is_not_loaded_says_so(cli: Cli, make_host: HostFactory) -> None:
    series = metrics_of(cli, make_host(T4, "bare"))
    assert one(series, "gpunode_driver_loaded") == 0
    assert state_of(series, GPU0) == "no-driver"
    assert "gpunode_driver_info" not in series


def test_a_containerd_repair_of_the_watch_is_counted_once_even_when_reported_late(
        make_host: HostFactory) -> None:
    from helpers.watch_api import FakeApi as Api

    host = make_host(T4, "ready")
    kernel_log(host)
    (host.root / "etc/containerd/config.toml").write_text(fixtures.FLATCAR_CONTAINERD_CONFIG)

    class Away(Api):
        def create_event(self, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
            from gpunode.errors import ApiError

            raise ApiError("create event", None, "connection refused")

    with pytest.raises(Exception, match="connection refused"):
        once.run(host, CONFIG, False, Away)
    watch_pass(host)  # reports the repair the failed pass made
    watch_pass(host)
    series = parse((host.root / TEXTFILE).read_text())
    assert one(series, "gpunode_containerd_config_repairs_total") == 1
    assert one(series, "gpunode_cdi_spec_regenerations_total") == 0
    assert one(series, "gpunode_containerd_restart_pending") == 0


def test_the_watch_writes_no_file_when_metrics_textfile_is_empty(
        make_host: HostFactory) -> None:
    host = make_host(T4, "ready")
    kernel_log(host)
    watch_pass(host, AgentConfig(kubernetes=CONFIG.kubernetes,
                                 metrics=MetricsConfig(textfile="")))
    assert not (host.root / "var/lib/node_exporter").exists()


def test_a_textfile_that_cannot_be_written_is_warned_once_and_the_pass_goes_on(
        make_host: HostFactory, capsys: pytest.CaptureFixture[str]) -> None:
    host = make_host(T4, "ready")
    kernel_log(host)
    (host.root / TEXTFILE).mkdir(parents=True)  # a directory where the file should be
    watch_pass(host)
    watch_pass(host)
    assert capsys.readouterr().err.count("watch.metrics_unwritten") == 1
    assert (host.root / "run/gpunode/watch.json").exists()


# -- the text format ------------------------------------------------------------------------


def test_help_and_label_values_are_escaped_as_the_format_says() -> None:
    family = Family("gpunode_x", "gauge", 'a \\ back\nslash').add(1.5, reason='say "hi"\\\n')
    assert exposition.render([family]) == (
        '# HELP gpunode_x a \\\\ back\\nslash\n# TYPE gpunode_x gauge\n'
        'gpunode_x{reason="say \\"hi\\"\\\\\\n"} 1.5\n')
    [parsed] = text_string_to_metric_families(exposition.render([family]))
    assert parsed.samples[0].labels == {"reason": 'say "hi"\\\n'}


def test_the_text_reads_as_what_prometheus_clients_writer_makes_of_the_same_families(
        make_host: HostFactory) -> None:
    host = make_host(ND96, "ready", extra={"/run/metadata/flatcar":
                                           "COREOS_AZURE_VMSIZE=Standard_ND96amsr_A100_v4\n"})
    kernel_log(host, "NVRM: Xid (PCI:0001:00:00): 79, pid=1122, GPU has fallen off the bus.")
    watch_pass(host)
    ours = families.families(facts.observe(host, CONFIG))
    registry = CollectorRegistry()
    registry.register(_Reference(ours))
    assert parse(exposition.render(ours)) == parse(generate_latest(registry).decode())
    assert {f.name for f in ours if f.samples} >= {"gpunode_xids_total", "gpunode_gpu_state",
                                                   "gpunode_gpus_expected"}


class _Reference:
    """gpunode's families as prometheus_client's own metric families."""

    def __init__(self, families: list[Family]) -> None:
        self.families = families

    def collect(self) -> Any:
        for family in self.families:
            if not family.samples:
                continue
            names = [k for k, _ in family.samples[0].labels]
            kind = CounterMetricFamily if family.kind == "counter" else GaugeMetricFamily
            made = kind(family.name, family.help, labels=names)
            for sample in family.samples:
                made.add_metric([v for _, v in sample.labels], sample.value)
            yield made

