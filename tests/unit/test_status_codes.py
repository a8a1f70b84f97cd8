"""`status --json` checks carry the stable code of the error that decided them (docs/errors.md),
the same code the boot record and the JSON log carry: operators match codes, not wording."""

from __future__ import annotations

import json

from conftest import HostFactory
from hostile.support import Cli


def checks(cli: Cli, root: str) -> dict[str, dict[str, object]]:
    result = cli("--root", root, "status", "--json")
    return {c["name"]: c for c in json.loads(result.out)["checks"]}


def test_a_check_that_passes_carries_no_code(cli: Cli, make_host: HostFactory) -> None:
    host = make_host("nc4as-t4-v3", "ready")
    passed = {name: c["code"] for name, c in checks(cli, str(host.root)).items()
              if c["state"] == "ok"}
    assert "containerd_runtime" in passed
    assert set(passed.values()) == {None}


def test_an_unparsable_containerd_config_is_named_by_its_code(cli: Cli,
                                                               make_host: HostFactory) -> None:
    host = make_host("nc4as-t4-v3", "ready")
    path = json.loads(cli("--root", str(host.root), "status", "--json").out)["containerd_config"]
    (host.root / path.lstrip("/")).write_text("version = 2\n[plugins\n")
    runtime = checks(cli, str(host.root))["containerd_runtime"]
    assert (runtime["state"], runtime["code"]) == ("fail", "containerd-config-invalid")


def test_the_last_boots_failed_step_code_reaches_status(cli: Cli, make_host: HostFactory) -> None:
    host = make_host("nc4as-t4-v3", "bare")  # no driver source: the driver step fails
    assert cli("--root", str(host.root), "boot").code == 1
    record = json.loads((host.root / "run/gpunode/state.json").read_text())
    driver = next(s for s in record["steps"] if s["name"] == "driver")
    last_boot = checks(cli, str(host.root))["last_boot"]
    assert driver["code"] == "driver-unavailable"
    assert (last_boot["state"], last_boot["code"]) == ("warn", "driver-unavailable")


def test_an_unreadable_boot_record_is_named_by_its_code(cli: Cli, make_host: HostFactory) -> None:
    host = make_host("nc4as-t4-v3", "ready")
    (host.root / "run/gpunode").mkdir(parents=True, exist_ok=True)
    (host.root / "run/gpunode/state.json").write_text("{not json")
    last_boot = checks(cli, str(host.root))["last_boot"]
    assert (last_boot["state"], last_boot["code"]) == ("warn", "boot-record-invalid")
