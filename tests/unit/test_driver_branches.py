"""An image baked with several Flatcar driver sysexts: which one each fixture machine's GPUs
get (branch and flavour, a driver.sysext pin, driver.flavour), and the driver step that merges
the chosen one from /run/extensions at boot. systemd-sysext cannot merge under a fixture root:
`FakeKernel` does what it would (the extension's release file appears for each linked
sysext), the rest is the driver step as it runs on a node. The bake side (nothing enabled,
nothing linked): test_image_bake.py; a real systemd-sysext merge: tests/integration."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import HostFactory
from gpunode.config import DriverConfig
from gpunode.driver import branches, flavour, step
from gpunode.errors import DriverError
from gpunode.gpu.detect import detect
from gpunode.platform.host import Host
from gpunode_testing import fixtures
from helpers.bake import FLATCAR_VERSION, make_inputs, sha512
from helpers.fake_kernel import FakeKernel
from hostile.support import Cli

BAKED = ("nvidia-drivers-535", "nvidia-drivers-570-open", "nvidia-drivers-580")


def baked(*names: str) -> list[branches.Baked]:
    return [branches.Baked(n, f"/etc/flatcar/sysext/flatcar-{n}-{FLATCAR_VERSION}.raw")
            for n in names]


def needs(host: Host) -> list[flavour.Need]:
    return [flavour.need(g, step.on_azure(host)) for g in detect(host).gpus]


def choose(host: Host, names: tuple[str, ...] = BAKED, configured: str = "auto",
           pin: str | None = None) -> branches.BranchChoice:
    gpus = detect(host).gpus
    node = flavour.choose(gpus, configured, step.on_azure(host)).flavour
    return branches.choose(needs(host), baked(*names), node, configured, pin)


@pytest.mark.parametrize(("machine", "expected"), [
    ("nc4as-t4-v3", "nvidia-drivers-580"),  # T4: proprietary, as Azure keeps it
    ("nc24ads-a100-v4", "nvidia-drivers-570-open"),
    ("nc40ads-h100-v5", "nvidia-drivers-570-open"),
    ("hgx-b200", "nvidia-drivers-570-open"),  # Blackwell: open, R570 or later
    ("nc6s-v3", "nvidia-drivers-580"),  # V100: proprietary, R580 at the latest
    ("mixed-t4-a100", "nvidia-drivers-580"),  # both run the proprietary modules
])
def test_each_fixture_machine_gets_the_baked_branch_its_gpus_need(
        make_host: HostFactory, machine: str, expected: str) -> None:
    assert choose(make_host(machine, "bare")).baked.name == expected


def test_the_reason_says_the_flavour_and_that_it_is_the_newest_branch(
        make_host: HostFactory) -> None:
    assert choose(make_host("hgx-b200", "bare")).reason == (
        "nvidia-drivers-570-open (open modules, the newest baked branch that drives every GPU)")


def test_a_t4_takes_the_open_branch_when_no_proprietary_one_is_baked(
        make_host: HostFactory) -> None:
    choice = choose(make_host("nc4as-t4-v3", "bare"), ("nvidia-drivers-570-open",))
    assert choice.baked.name == "nvidia-drivers-570-open"
    assert "no baked proprietary branch drives every GPU; open does" in choice.reason


def test_blackwell_refuses_open_modules_older_than_r570(make_host: HostFactory) -> None:
    with pytest.raises(DriverError, match="blackwell GPUs need R570 or later"):
        choose(make_host("hgx-b200", "bare"), ("nvidia-drivers-550-open", "nvidia-drivers-580"))


def test_blackwell_with_only_old_or_proprietary_branches_says_why_each_does_not_fit(
        make_host: HostFactory) -> None:
    with pytest.raises(DriverError) as caught:
        choose(make_host("hgx-b200", "bare"), ("nvidia-drivers-550-open", "nvidia-drivers-580"))
    message = str(caught.value)
    assert "no driver sysext baked into this image drives this node's GPUs" in message
    assert "nvidia-drivers-550-open: GB100 [B200] at 0001:00:00.0: blackwell GPUs need R570" \
        in message
    assert "nvidia-drivers-580: GB100 [B200] at 0001:00:00.0: Blackwell GPUs are supported by " \
        "the open modules only" in message


def test_a_v100_refuses_branches_after_r580(make_host: HostFactory) -> None:
    with pytest.raises(DriverError, match="R580 is the last branch that drives volta GPUs"):
        choose(make_host("nc6s-v3", "bare"), ("nvidia-drivers-590",))


def test_a_pin_picks_the_pinned_branch_over_a_newer_one(make_host: HostFactory) -> None:
    choice = choose(make_host("nc24ads-a100-v4", "bare"), pin="nvidia-drivers-535")
    assert choice.baked.name == "nvidia-drivers-535"
    assert choice.reason == "nvidia-drivers-535 (pinned by driver.sysext)"


def test_a_pin_the_gpus_cannot_run_is_refused_not_swapped(make_host: HostFactory) -> None:
    with pytest.raises(DriverError, match=r"nvidia-drivers-550-open: .*blackwell GPUs need R570"):
        choose(make_host("hgx-b200", "bare"), (*BAKED, "nvidia-drivers-550-open"),
               pin="nvidia-drivers-550-open")


def test_a_pin_that_is_not_baked_names_the_baked_ones(make_host: HostFactory) -> None:
    with pytest.raises(DriverError, match=r"pins nvidia-drivers-550, which is not baked into "
                                          r"this image \(baked: nvidia-drivers-535, "
                                          r"nvidia-drivers-570-open, nvidia-drivers-580\)"):
        choose(make_host("nc24ads-a100-v4", "bare"), pin="nvidia-drivers-550")


def test_driver_flavour_open_on_a_t4_takes_the_open_branch(make_host: HostFactory) -> None:
    choice = choose(make_host("nc4as-t4-v3", "bare"), configured="open")
    assert choice.baked.name == "nvidia-drivers-570-open"


# -- the driver step on a baked root ---------------------------------------------------------


def bake_several(root: Path, tmp_path: Path, cli: Cli, names: tuple[str, ...] = BAKED) -> None:
    inputs = make_inputs(tmp_path / "mirror")
    extra = ""
    for name in names:
        data = f"hsqs {name} stand-in\n".encode() * 1000
        inputs.add(f"flatcar-{name}.raw", data)
        extra += (f'\n[[driver]]\nname = "{name}"\nsource = "flatcar-{name}.raw"\n'
                  f'sha512 = "{sha512(data)}"\n')
    result = cli("image", "bake", "--root", str(root), "--config",
                 str(inputs.config(driver=None, extra=extra)))
    assert result.code == 0, result.err


def test_several_baked_drivers_are_placed_but_none_enabled_or_linked(
        make_host: HostFactory, tmp_path: Path, cli: Cli) -> None:
    root = make_host("hgx-b200", "bare").root
    bake_several(root, tmp_path, cli)
    for name in BAKED:
        assert (root / f"etc/flatcar/sysext/flatcar-{name}-{FLATCAR_VERSION}.raw").is_file()
        assert not (root / f"etc/extensions/flatcar-{name}.raw").exists()
    enabled = root / "etc/flatcar/enabled-sysext.conf"
    assert not enabled.exists() or not any(n in enabled.read_text() for n in BAKED)
    entries = json.loads((root / "etc/gpunode/baked.json").read_text())["artifacts"]
    assert {e["name"]: e["activation"] for e in entries if e["what"] == "driver-sysext"} == \
        dict.fromkeys(BAKED, "boot")


def test_plan_on_a_b200_merges_the_baked_570_open_and_downloads_nothing(
        make_host: HostFactory, tmp_path: Path, cli: Cli) -> None:
    root = make_host("hgx-b200", "bare").root
    bake_several(root, tmp_path, cli)
    plan = cli("--root", str(root), "plan")
    assert plan.code == 0, plan.err
    name = "nvidia-drivers-570-open"
    assert (f"driver: flatcar-sysext: the driver sysext {name} (open modules, the newest baked "
            "branch that drives every GPU) is baked into the image: merging it, no download") \
        in plan.out
    assert (f"link /run/extensions/flatcar-{name}.raw to /etc/flatcar/sysext/flatcar-{name}-"
            f"{FLATCAR_VERSION}.raw, then run systemd-sysext refresh") in plan.out
    assert not (root / "run/extensions").exists()  # plan changes nothing


def test_the_driver_step_links_merges_and_loads_the_chosen_branch(
        make_host: HostFactory, tmp_path: Path, cli: Cli) -> None:
    host = make_host("nc6s-v3", "bare")
    bake_several(host.root, tmp_path, cli)
    kernel = FakeKernel(host.root, fixtures.MACHINES["nc6s-v3"])
    the_plan = step.plan(host, DriverConfig(), detect(host), kernel)
    outcome = step.apply(host, the_plan, DriverConfig(), kernel)
    assert (outcome.strategy, outcome.source) == ("flatcar-sysext", "flatcar-nvidia-drivers-580")
    assert kernel.refreshes == [["flatcar-nvidia-drivers-580.raw"]]
    assert kernel.calls[0] == step.SYSEXT_REFRESH
    assert [c[:2] for c in kernel.calls[1:]][:1] == [("modprobe", "nvidia")]
    assert (host.root / "run/extensions/flatcar-nvidia-drivers-580.raw").readlink() == Path(
        f"/etc/flatcar/sysext/flatcar-nvidia-drivers-580-{FLATCAR_VERSION}.raw")
    assert not (host.root / "etc/flatcar/enabled-sysext.conf").exists()


def test_a_baked_sysext_already_merged_is_loaded_without_another_refresh(
        make_host: HostFactory, tmp_path: Path, cli: Cli) -> None:
    host = make_host("nc6s-v3", "bare")
    bake_several(host.root, tmp_path, cli)
    release = host.root / "usr/lib/extension-release.d/extension-release.flatcar-nvidia-drivers-580"
    release.parent.mkdir(parents=True, exist_ok=True)
    release.write_text("ID=flatcar\n")
    the_plan = step.plan(host, DriverConfig(), detect(host),
                         FakeKernel(host.root, fixtures.MACHINES["nc6s-v3"]))
    assert the_plan.baked is None
    assert (the_plan.choice.action, the_plan.choice.source) == ("load",
                                                                "flatcar-nvidia-drivers-580")


def test_a_failed_refresh_removes_the_link_and_says_where_to_look(
        make_host: HostFactory, tmp_path: Path, cli: Cli) -> None:
    host = make_host("hgx-b200", "bare")
    bake_several(host.root, tmp_path, cli)
    kernel = FakeKernel(host.root, fixtures.MACHINES["hgx-b200"],
                           refresh_error="Failed to merge: Device or resource busy")
    the_plan = step.plan(host, DriverConfig(), detect(host), kernel)
    with pytest.raises(DriverError, match="systemd-sysext refresh failed to merge the baked "
                                          "nvidia-drivers-570-open: Failed to merge") as caught:
        step.apply(host, the_plan, DriverConfig(), kernel)
    assert "journalctl -b -t systemd-sysext" in caught.value.hint
    assert list((host.root / "run/extensions").iterdir()) == []


def test_a_refresh_that_does_not_merge_the_sysext_is_refused(
        make_host: HostFactory, tmp_path: Path, cli: Cli) -> None:
    host = make_host("hgx-b200", "bare")
    bake_several(host.root, tmp_path, cli)
    kernel = FakeKernel(host.root, fixtures.MACHINES["hgx-b200"], merge=False)
    the_plan = step.plan(host, DriverConfig(), detect(host), kernel)
    with pytest.raises(DriverError, match="did not merge the baked nvidia-drivers-570-open"):
        step.apply(host, the_plan, DriverConfig(), kernel)
    assert not any(c[0] == "modprobe" for c in kernel.calls)


def test_a_pin_in_the_agent_config_picks_the_baked_branch(
        make_host: HostFactory, tmp_path: Path, cli: Cli) -> None:
    host = make_host("nc24ads-a100-v4", "bare")
    bake_several(host.root, tmp_path, cli)
    config = DriverConfig(sysext="nvidia-drivers-535")
    the_plan = step.plan(host, config, detect(host), FakeKernel(host.root, fixtures.MACHINES[
        "nc24ads-a100-v4"]))
    assert the_plan.choice.source == "flatcar-nvidia-drivers-535"
    assert the_plan.sysext_line is None  # merged from /run: enabled-sysext.conf stays as it was


def test_strategy_flatcar_sysext_with_no_fitting_baked_branch_says_why_and_enables_one(
        make_host: HostFactory, tmp_path: Path, cli: Cli) -> None:
    host = make_host("hgx-b200", "bare")
    bake_several(host.root, tmp_path, cli, ("nvidia-drivers-535", "nvidia-drivers-580"))
    the_plan = step.plan(host, DriverConfig(strategy="flatcar-sysext"), detect(host),
                         FakeKernel(host.root, fixtures.MACHINES["hgx-b200"]))
    assert the_plan.choice.action == "fail"
    assert the_plan.choice.reason.startswith("no driver sysext baked into this image drives "
                                             "this node's GPUs (nvidia-drivers-535: ")
    # as without a bake: listed for the initramfs, which downloads it at the next boot
    assert the_plan.sysext_line == "nvidia-drivers-570-open"


def test_auto_with_no_fitting_baked_branch_falls_through_and_says_so_at_the_end(
        make_host: HostFactory, tmp_path: Path, cli: Cli) -> None:
    host = make_host("hgx-b200", "bare")
    bake_several(host.root, tmp_path, cli, ("nvidia-drivers-535", "nvidia-drivers-580"))
    with pytest.raises(DriverError, match=r"no Flatcar driver sysext is merged \(no driver "
                                          r"sysext baked into this image drives"):
        step.plan(host, DriverConfig(), detect(host),
                  FakeKernel(host.root, fixtures.MACHINES["hgx-b200"]))


def test_after_an_os_update_without_a_rebake_no_baked_branch_is_merged(
        make_host: HostFactory, tmp_path: Path, cli: Cli) -> None:
    host = make_host("hgx-b200", "bare")
    bake_several(host.root, tmp_path, cli)
    release = host.root / "etc/os-release"
    release.write_text(release.read_text().replace(FLATCAR_VERSION, "4459.2.2"))
    with pytest.raises(DriverError, match="no Flatcar driver sysext is merged, no prebuilt"):
        step.plan(host, DriverConfig(), detect(host),
                  FakeKernel(host.root, fixtures.MACHINES["hgx-b200"]))


def test_under_root_boot_says_extensions_are_not_merged_there(
        make_host: HostFactory, tmp_path: Path, cli: Cli) -> None:
    root = make_host("hgx-b200", "bare").root
    bake_several(root, tmp_path, cli)
    result = cli("--root", str(root), "driver", "load")
    assert result.code == 1
    assert "extensions are not merged under --root" in result.err


def test_rebaking_one_driver_after_several_enables_and_links_it_again(
        make_host: HostFactory, tmp_path: Path, cli: Cli) -> None:
    root = make_host("hgx-b200", "bare").root
    bake_several(root, tmp_path, cli)
    bake_several(root, tmp_path / "second", cli, ("nvidia-drivers-570-open",))
    assert (root / "etc/flatcar/enabled-sysext.conf").read_text() == \
        "nvidia-drivers-570-open\n"
    assert (root / "etc/extensions/flatcar-nvidia-drivers-570-open.raw").is_symlink()
    assert not (root / f"etc/flatcar/sysext/flatcar-nvidia-drivers-535-{FLATCAR_VERSION}.raw"
                ).exists()


def test_baking_several_after_one_takes_the_enabled_line_and_link_away(
        make_host: HostFactory, tmp_path: Path, cli: Cli) -> None:
    root = make_host("hgx-b200", "bare").root
    bake_several(root, tmp_path, cli, ("nvidia-drivers-570-open",))
    enabled = root / "etc/flatcar/enabled-sysext.conf"
    enabled.write_text("# operator's own\nnvidia-drivers-570-open\nzfs\n")
    bake_several(root, tmp_path / "second", cli)
    assert enabled.read_text() == "# operator's own\nzfs\n"
    assert not (root / "etc/extensions/flatcar-nvidia-drivers-570-open.raw").exists()


@pytest.mark.parametrize(("name", "path"), [
    ("nvidia-570", f"/etc/flatcar/sysext/flatcar-nvidia-570-{FLATCAR_VERSION}.raw"),
    ("nvidia-drivers-580", "/etc/shadow"),
    ("nvidia-drivers-580", f"/etc/flatcar/sysext/../../shadow-{FLATCAR_VERSION}.raw"),
], ids=["not-a-driver-name", "elsewhere", "climbing"])
def test_a_tampered_manifest_s_driver_is_ignored_not_merged(
        make_host: HostFactory, tmp_path: Path, cli: Cli, name: str, path: str) -> None:
    host = make_host("nc6s-v3", "bare")
    bake_several(host.root, tmp_path, cli, ("nvidia-drivers-580", "nvidia-drivers-570-open"))
    manifest = host.root / "etc/gpunode/baked.json"
    document = json.loads(manifest.read_text())
    for entry in document["artifacts"]:
        if entry["what"] == "driver-sysext":
            entry.update(name=name, path=path)
    manifest.write_text(json.dumps(document))
    target = host.root / path.lstrip("/")
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text("not an image")
    with pytest.raises(DriverError, match="no Flatcar driver sysext is merged, no prebuilt"):
        step.plan(host, DriverConfig(), detect(host),
                  FakeKernel(host.root, fixtures.MACHINES["nc6s-v3"]))
    assert not (host.root / "run/extensions").exists()


def test_a_boot_that_merges_a_baked_sysext_locates_containerd_again_after_it(
        make_host: HostFactory, tmp_path: Path, cli: Cli,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """What boot located and probed early (gpunode/containerd/locate.py) is dropped where the
    driver step merges a sysext, which could bring containerd drop-ins: the containerd step
    locates again after the merge, and the early probes are stopped first."""
    from gpunode.config import AgentConfig
    from gpunode.containerd import locate
    from gpunode.pipeline import boot
    from gpunode.platform.systemd import NoSystemd

    host = make_host("nc6s-v3", "bare")
    bake_several(host.root, tmp_path, cli)
    runtime = host.root / "usr/bin/nvidia-container-runtime"
    runtime.write_text("#!/bin/sh\n")
    runtime.chmod(0o755)
    kernel = FakeKernel(host.root, fixtures.MACHINES["nc6s-v3"])
    events: list[str] = []

    class Probe:
        def prefetch(self, binary: str, path: str | None, version: bool = True) -> None:
            events.append("prefetch")

        def version(self, binary: str) -> tuple[int, int] | None:
            return (1, 7)

        def dump(self, binary: str, path: str) -> None:
            return None

        def discard(self) -> None:
            events.append("discard")

    real = locate.locate

    def located(*args: object, **kwargs: object) -> locate.Located:
        events.append(f"locate, merged: {bool(kernel.refreshes)}")
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(locate, "locate", located)
    run = boot.boot(host, AgentConfig(), boot.Adapters(NoSystemd(), kernel, probe=Probe()))
    driver = next(s for s in run.steps if s["name"] == "driver")
    assert (driver["outcome"], driver["source"]) == ("ok", "flatcar-nvidia-drivers-580")
    assert events[:5] == ["locate, merged: False", "prefetch", "discard",
                          "locate, merged: True", "prefetch"]
    assert next(s for s in run.steps if s["name"] == "containerd")["outcome"] == "ok"
