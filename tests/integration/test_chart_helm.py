"""gpunode's cluster-azure and cluster-aws values rendered by a real helm (v3.17.2, and v4.1.4
for comparison) over the real charts at their pinned commits (../shared/charts, with the
`cluster` 7.0.0 subchart), read back as the Cluster API objects a management cluster gets.

Proved here: each document is one object; every pool's bootstrap and infrastructure references
resolve; the GPU pool carries gpunode's units (as units/ plus the GPU condition), directories,
Secret-backed files, taint and label; every other object, CPU pools included, is the chart's
own render without gpunode except for what docs/delivery.md admits; which bootstrap configs are
renamed (so which nodes Cluster API replaces) on install and on a change; each pool's Container
Linux Config in the shape Flatcar's transpiler reads and within Cluster API's limit. And the
two-pool defect of cluster-azure's `_machine_deployments.tpl`: shown on the pinned chart, and
fixed by deploy/upstream/cluster-azure-machine-templates.patch in a patched copy.

The values come from `gpunode ignition` itself (the installed command line)."""

from __future__ import annotations

import functools
import hashlib
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from conftest import REPO
from gpunode_testing import charts
from helpers.ignition_example import SHA512, URL
from real.helm_bins import Helm, ensure_helm

MISSING = charts.missing()
Manifests = functools.lru_cache(maxsize=64)(charts.Manifests)  # a render is read once
pytestmark = [pytest.mark.skipif(MISSING is not None, reason=MISSING or ""),
              pytest.mark.allow_paths(str(charts.SHARED_CHARTS.resolve()))]

PATCH = REPO / "deploy" / "upstream" / "cluster-azure-machine-templates.patch"
AGENT = REPO / "ignition" / "example-config.toml"
GPUNODE = Path(sys.executable).with_name("gpunode")
PROVIDERS = ("cluster-azure", "cluster-aws")
GPU_POOL = "gpu00"
# gpunode's units in the values, in their order: the mask, the bootstrap, gpunode's own three.
GPU_UNITS = ("nvidia.service", "gpunode-sysext.service", "gpunode.service",
             "gpunode-label.service", "gpunode-watch.service")
GPU_DIRECTORIES = [{"path": "/opt/extensions/gpunode", "mode": 0o755},
                   {"path": "/etc/extensions", "mode": 0o755}]
GPU_FILES = {"/etc/gpunode/config.toml": "config.toml",
             "/etc/modprobe.d/blacklist-nouveau.conf": "blacklist-nouveau.conf"}
# A new gpunode release: another image, so another download URL and checksum in the units.
URL_NEXT = URL.replace("0.1.0", "0.2.0")
SHA512_NEXT = hashlib.sha512(b"example 0.2.0").hexdigest()

# What Flatcar's container-linux-config-transpiler v0.9.4 (flatcar/container-linux-config-
# transpiler@8ec301f9123a91807a8cd51963bf875ad29eccb3, config/types/) reads: a key it does not
# know is a warning, and an error where the KubeadmConfig asks for `strict`.
CLC_KEYS = {"version", "ignition", "storage", "systemd", "networkd", "passwd", "etcd",
            "flannel", "update", "docker", "locksmith"}
CLC_STORAGE_KEYS = {"disks", "raid", "filesystems", "files", "directories", "links"}
CLC_UNIT_KEYS = {"name", "enable", "enabled", "mask", "contents", "dropins"}
CLC_DIRECTORY_KEYS = {"filesystem", "path", "user", "group", "mode", "overwrite"}


@pytest.fixture(scope="session")
def helm() -> Helm:
    return ensure_helm("3")


@pytest.fixture(scope="session")
def helm4() -> Helm:
    return ensure_helm("4")


@pytest.fixture(scope="session")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("charts")


@pytest.fixture(scope="session")
def patched_azure(workdir: Path) -> Path:
    """A copy of the pinned cluster-azure with the repository's patch applied by git."""
    copy = workdir / "cluster-azure-patched"
    shutil.copytree(charts.CHARTS["cluster-azure"].path, copy, symlinks=True)
    copy.chmod(0o755)
    for path in copy.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)  # shared/ may come without write bits
    # A repository of its own, so that git applies the patch here wherever tmp lies.
    for command in (["git", "init", "--quiet"], ["git", "apply", "-p3", str(PATCH)]):
        subprocess.run(command, cwd=copy, check=True, capture_output=True, text=True)
    return copy


Values = Callable[..., Path]


@pytest.fixture(scope="session")
def values(workdir: Path) -> Values:
    """values(fmt, *flags, url=, sha512=, agent=): `gpunode ignition --format fmt` written
    to a file, once per distinct call."""
    made: dict[tuple[Any, ...], Path] = {}

    def make(fmt: str, *flags: str, url: str = URL, sha512: str = SHA512,
             agent: Path = AGENT) -> Path:
        key = (fmt, flags, url, sha512, agent)
        if key not in made:
            command = [str(GPUNODE), "ignition", "--format", fmt, "--sysext-url", url,
                       "--sysext-sha512", sha512, "--agent-config", str(agent), *flags]
            result = subprocess.run(command, capture_output=True, text=True)
            assert result.returncode == 0, f"{command} exited {result.returncode}: {result.stderr}"
            made[key] = workdir / f"values-{len(made)}.yaml"
            made[key].write_text(result.stdout)
        return made[key]

    return make


@pytest.fixture(scope="session")
def without_pools(workdir: Path) -> Callable[[str], Path]:
    """The chart's CI cluster without its own `global.nodePools`: the chart's default pools."""
    made: dict[str, Path] = {}

    def make(fmt: str) -> Path:
        if fmt not in made:
            made[fmt] = charts.ci_values_without_pools(fmt, workdir)
        return made[fmt]
    return make


Render = Callable[..., str]


@pytest.fixture(scope="session")
def render(helm: Helm) -> Iterator[Render]:
    """render(chart_dir, *values_files, helm=...): `helm template`'s text, once per call."""
    done: dict[tuple[Any, ...], str] = {}

    def run(chart: Path, *files: Path, binary: Path | None = None) -> str:
        key = (chart, files, binary)
        if key not in done:
            done[key] = charts.template(binary or helm.helm, chart, files)
        return done[key]

    yield run


def chart_dir(fmt: str, patched_azure: Path) -> Path:
    """The chart the correctness checks render: cluster-azure with the two-pool fix applied
    (the pinned one loses a pool: the tests of the defect below), cluster-aws as pinned."""
    return patched_azure if fmt == "cluster-azure" else charts.CHARTS[fmt].path


Scenario = tuple[list[Path], list[Path]]  # (the cluster's values, the same plus gpunode's)


@pytest.fixture(scope="session")
def scenarios(values: Values, without_pools: Callable[[str], Path]
              ) -> Callable[[str, str], Scenario]:
    """The two ways a platform engineer installs gpunode's values (docs/delivery.md, "The
    pools"): on a cluster that uses the chart's default pools, with gpunode's values as
    rendered by default; on a cluster with pools of its own, with --no-default-pool."""
    def make(fmt: str, kind: str) -> Scenario:
        if kind == "chart-pools":
            cluster = [without_pools(fmt)]
            return cluster, [*cluster, values(fmt)]
        cluster = [charts.CHARTS[fmt].ci_values]
        return cluster, [*cluster, values(fmt, "--no-default-pool")]
    return make


SCENARIOS = ("chart-pools", "own-pools")


# --- the two-pool defect of the pinned cluster-azure ------------------------------------------

TWO_POOLS = ["chart-pools", "own-pools", "registration-only"]


def two_pool_values(kind: str, scenarios: Callable[[str, str], Scenario]) -> list[Path]:
    if kind == "registration-only":  # deploy/cluster-azure-gpu-pool.yaml beside the CI pools
        return [charts.CHARTS["cluster-azure"].ci_values,
                REPO / "deploy" / "cluster-azure-gpu-pool.yaml"]
    return scenarios("cluster-azure", kind)[1]


@pytest.mark.parametrize("kind", TWO_POOLS)
def test_the_pinned_cluster_azure_puts_two_pools_templates_in_one_document(
        kind: str, render: Render, scenarios: Callable[[str, str], Scenario]) -> None:
    """With a second pool, the pinned chart renders two AzureMachineTemplates as one YAML
    document: a strict reader refuses it, a last-key-wins reader keeps only the last pool's,
    and the CPU pool's MachineDeployment names a template that is not there."""
    text = render(charts.CHARTS["cluster-azure"].path, *two_pool_values(kind, scenarios))
    with pytest.raises(yaml.constructor.ConstructorError, match="duplicate key 'apiVersion'"):
        Manifests(text)
    lenient = [d for d in yaml.safe_load_all(text) if d]
    templates = {d["metadata"]["name"] for d in lenient if d["kind"] == "AzureMachineTemplate"}
    deployments = {d["metadata"]["name"].removeprefix("test-wc-"):
                   d["spec"]["template"]["spec"]["infrastructureRef"]["name"]
                   for d in lenient if d["kind"] == "MachineDeployment"}
    assert len(deployments) >= 2
    unresolved = {pool for pool, name in deployments.items() if name not in templates}
    assert unresolved == set(deployments) - {max(deployments)}  # only the last pool survives


def test_the_pinned_cluster_azure_renders_one_pool_correctly(render: Render) -> None:
    """The chart's own CI values (one pool) never show the defect."""
    manifests = Manifests(render(charts.CHARTS["cluster-azure"].path,
                                 charts.CHARTS["cluster-azure"].ci_values))
    assert list(manifests.pools()) == ["def00"]


@pytest.mark.parametrize("kind", TWO_POOLS)
def test_the_patch_renders_every_pools_template_in_a_document_of_its_own(
        kind: str, render: Render, patched_azure: Path,
        scenarios: Callable[[str, str], Scenario]) -> None:
    manifests = Manifests(render(patched_azure, *two_pool_values(kind, scenarios)))
    pools = manifests.pools()
    assert len(pools) >= 2
    for pool in pools.values():
        assert manifests.get(*pool.infrastructure) is not None, pool
    assert len(manifests.named("AzureMachineTemplate")) == len(pools) + 1  # + control plane


def test_the_patch_changes_nothing_where_there_is_one_pool(
        render: Render, patched_azure: Path) -> None:
    ci = charts.CHARTS["cluster-azure"].ci_values
    assert render(patched_azure, ci) == render(charts.CHARTS["cluster-azure"].path, ci)


def test_kubectl_kustomize_refuses_the_pinned_render_and_takes_the_patched_one(
        helm: Helm, render: Render, patched_azure: Path, workdir: Path,
        scenarios: Callable[[str, str], Scenario]) -> None:
    """A Kubernetes tool that reads YAML strictly (kustomize, in kubectl v1.32) says what is
    wrong with the pinned render, and accepts the patched one."""
    given = scenarios("cluster-azure", "chart-pools")[1]
    outcomes = {}
    for name, chart in (("pinned", charts.CHARTS["cluster-azure"].path),
                        ("patched", patched_azure)):
        folder = workdir / f"kustomize-{name}"
        folder.mkdir(exist_ok=True)
        (folder / "all.yaml").write_text(render(chart, *given))
        (folder / "kustomization.yaml").write_text("resources:\n- all.yaml\n")
        outcomes[name] = subprocess.run([str(helm.kubectl), "kustomize", str(folder)],
                                        capture_output=True, text=True, timeout=120)
    assert outcomes["pinned"].returncode != 0
    assert 'mapping key "apiVersion" already defined' in outcomes["pinned"].stderr
    assert outcomes["patched"].returncode == 0, outcomes["patched"].stderr
    assert len(Manifests(outcomes["patched"].stdout).named("AzureMachineTemplate")) == 3


# --- what the charts render of gpunode's values --------------------------------------------------

@pytest.mark.parametrize("fmt", PROVIDERS)
def test_helm_v3_and_v4_render_the_same_bytes(
        fmt: str, helm4: Helm, render: Render, scenarios: Callable[[str, str], Scenario]
        ) -> None:
    given = scenarios(fmt, "chart-pools")[1]
    chart = charts.CHARTS[fmt].path
    assert render(chart, *given, binary=helm4.helm) == render(chart, *given)


@pytest.mark.parametrize("kind", SCENARIOS)
@pytest.mark.parametrize("fmt", PROVIDERS)
def test_every_document_is_one_object_and_every_pool_reference_resolves(
        fmt: str, kind: str, render: Render, patched_azure: Path,
        scenarios: Callable[[str, str], Scenario]) -> None:
    manifests = Manifests(render(chart_dir(fmt, patched_azure), *scenarios(fmt, kind)[1]))
    pools = manifests.pools()
    assert GPU_POOL in pools and len(pools) >= 2
    for pool in pools.values():
        assert manifests.get(*pool.bootstrap) is not None, pool
        assert manifests.get(*pool.infrastructure) is not None, pool


def test_helm_refuses_what_the_values_shipped_before_had(render: Render, workdir: Path) -> None:
    """Both charts' schemas, checked by helm itself: subchart values at the top level and a
    taint without `value` are refused, naming each."""
    old = workdir / "old-values.yaml"
    old.write_text(yaml.safe_dump({
        "global": {"nodePools": {"gpu-t4": {
            "instanceType": "Standard_NC4as_T4_v3",
            "customNodeTaints": [{"key": "nvidia.com/gpu", "effect": "NoSchedule"}]}}},
        "providerIntegration": {"workers": {}}}))
    with pytest.raises(charts.HelmFailed) as refused:
        render(charts.CHARTS["cluster-azure"].path, charts.CHARTS["cluster-azure"].ci_values,
               old)
    assert "Additional property providerIntegration is not allowed" in refused.value.stderr
    assert "customNodeTaints.0: value is required" in refused.value.stderr


@pytest.mark.parametrize(("fmt", "size"), [("cluster-azure", {"replicas": 1}),
                                           ("cluster-aws", {"minSize": 1, "maxSize": 1})])
def test_the_gpu_pool_registers_with_the_taint_and_label_and_is_sized(
        fmt: str, size: dict[str, int], render: Render, patched_azure: Path,
        scenarios: Callable[[str, str], Scenario]) -> None:
    manifests = Manifests(render(chart_dir(fmt, patched_azure),
                                 *scenarios(fmt, "chart-pools")[1]))
    registration = manifests.bootstrap(GPU_POOL)["joinConfiguration"]["nodeRegistration"]
    cpu = manifests.bootstrap("def00")["joinConfiguration"]["nodeRegistration"]
    assert registration["taints"] == [*cpu.get("taints", []), {
        "key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}]
    args = {a["name"]: a["value"] for a in registration["kubeletExtraArgs"]}
    assert "nvidia.com/gpu.present=true" in args["node-labels"].split(",")
    pool = manifests.pools()[GPU_POOL]
    sizing = (manifests.get(pool.kind, f"test-wc-{GPU_POOL}") or {})["spec"]
    if fmt == "cluster-aws":
        sizing = (manifests.get(*pool.infrastructure) or {})["spec"]
    assert {key: sizing[key] for key in size} == size


def rendered_units(fmt: str, render: Render, patched_azure: Path,
                   scenarios: Callable[[str, str], Scenario]) -> dict[str, dict[str, Any]]:
    manifests = Manifests(render(chart_dir(fmt, patched_azure),
                                 *scenarios(fmt, "chart-pools")[1]))
    return manifests.units(GPU_POOL)


@pytest.mark.parametrize("fmt", PROVIDERS)
def test_the_gpu_pools_units_are_the_mask_the_bootstrap_and_units_plus_the_gpu_condition(
        fmt: str, render: Render, patched_azure: Path, values: Values,
        scenarios: Callable[[str, str], Scenario]) -> None:
    """The unit files the chart writes are those of units/, with the ExecCondition= gpunode's
    values ask for (and gpunode.service after the bootstrap), setting for setting."""
    units = rendered_units(fmt, render, patched_azure, scenarios)
    assert list(units)[-len(GPU_UNITS):] == list(GPU_UNITS)
    assert units["nvidia.service"] == {"name": "nvidia.service", "mask": True, "enabled": False}
    given = {u["name"]: u for u in yaml.safe_load(values(fmt).read_text())["cluster"][
        "providerIntegration"]["workers"]["kubeadmConfig"]["ignition"]["containerLinuxConfig"][
        "additionalConfig"]["systemd"]["units"]}
    for name in GPU_UNITS[2:]:
        written = charts.settings(units[name]["contents"])
        source = charts.settings((REPO / "units" / name).read_text())
        source.setdefault(("Service", "RemainAfterExit"), ["no"])  # systemd's default, spelled
        condition = given[name]["contents"]["service"]["additionalFields"].splitlines()[0]
        added = {("Service", "ExecCondition"): [condition.partition("=")[2]]}
        if name == "gpunode.service":
            source[("Unit", "After")].append("gpunode-sysext.service")
        assert written == {**source, **added}, name
        assert units[name]["enabled"] is True


def test_the_bootstrap_unit_runs_before_gpunode_containerd_and_the_kubelet(
        render: Render, patched_azure: Path, scenarios: Callable[[str, str], Scenario]) -> None:
    unit = rendered_units("cluster-azure", render, patched_azure, scenarios)[
        "gpunode-sysext.service"]
    written = charts.settings(unit["contents"])
    assert written[("Service", "Type")] == ["oneshot"]
    assert written[("Service", "RemainAfterExit")] == ["yes"]
    assert set(written[("Unit", "Before")]) == {"gpunode.service", "containerd.service",
                                                "kubelet.service", "kubeadm.service"}
    assert {"systemd-sysext.service", "ensure-sysext.service"} <= set(
        written[("Unit", "After")])
    # Wanted, not waited for: on a CPU node the ordering alone would delay containerd.
    assert written[("Unit", "Wants")] == ["network-online.target"]
    assert "network-online.target" not in written[("Unit", "After")]
    assert written[("Service", "Environment")][:2] == [
        f"GPUNODE_SYSEXT_URL={URL}", f"GPUNODE_SYSEXT_SHA512={SHA512}"]
    fetch, merge = written[("Service", "ExecStart")]
    assert "sha512sum --check" in fetch and "--retry" in fetch and "rm -f" in fetch
    assert "/etc/extensions/gpunode.raw" in merge and merge.endswith("systemd-sysext refresh'")
    assert not any(k in written for k in (("Service", "PrivateTmp"),
                                          ("Service", "ProtectHome")))


@pytest.mark.parametrize("fmt", PROVIDERS)
def test_the_gpu_pool_gets_the_directories_and_the_secrets_files(
        fmt: str, render: Render, patched_azure: Path,
        scenarios: Callable[[str, str], Scenario]) -> None:
    manifests = Manifests(render(chart_dir(fmt, patched_azure),
                                 *scenarios(fmt, "chart-pools")[1]))
    directories = manifests.clc(GPU_POOL)["storage"]["directories"]
    assert directories[-2:] == GPU_DIRECTORIES
    files = {f["path"]: f for f in manifests.bootstrap(GPU_POOL)["files"]}
    for path, key in GPU_FILES.items():
        assert files[path]["contentFrom"] == {"secret": {"name": "gpunode-files", "key": key}}
        assert files[path]["permissions"] == "0644"


# --- CPU pools and every other object against the chart's render without gpunode --------------

def without_gpunode(clc: dict[str, Any]) -> dict[str, Any]:
    """A pool's CLC less what docs/delivery.md says gpunode's values add to every pool."""
    out = {**clc, "systemd": {**clc["systemd"], "units": [
        u for u in clc["systemd"]["units"] if u["name"] not in GPU_UNITS]}}
    out["storage"] = {**clc["storage"], "directories": [
        d for d in clc["storage"]["directories"] if d not in GPU_DIRECTORIES]}
    return out


def bootstrap_without_gpunode(manifests: Manifests, pool: str) -> dict[str, Any]:
    spec = dict(manifests.bootstrap(pool))
    spec["files"] = [f for f in spec["files"] if f["path"] not in GPU_FILES]
    spec["ignition"] = {"containerLinuxConfig": {"additionalConfig": "(compared parsed)"}}
    return spec


@pytest.mark.parametrize("kind", SCENARIOS)
@pytest.mark.parametrize("fmt", PROVIDERS)
def test_cpu_pools_differ_from_the_charts_own_render_only_by_gpunodes_units_dirs_and_files(
        fmt: str, kind: str, render: Render, patched_azure: Path,
        scenarios: Callable[[str, str], Scenario]) -> None:
    """Every object but the pools' bootstrap configs is the chart's own render without
    gpunode, unchanged (the control plane, the apps, each CPU pool's machine template and
    MachineDeployment/MachinePool but for the bootstrap name); each CPU pool's bootstrap config
    differs only by gpunode's five units, two directories and two Secret-backed files; and
    the GPU pool's objects are new."""
    cluster, given = scenarios(fmt, kind)
    chart = chart_dir(fmt, patched_azure)
    base, ours = Manifests(render(chart, *cluster)), Manifests(render(chart, *given))
    base_pools, our_pools = base.pools(), ours.pools()
    assert set(our_pools) == {*base_pools, GPU_POOL}
    bootstrap = {p.bootstrap for p in our_pools.values()} | {
        p.bootstrap for p in base_pools.values()}
    gpu = {(kind_, name) for (kind_, name) in ours.by_key if f"-{GPU_POOL}" in name}
    for key, obj in base.by_key.items():
        if key in bootstrap:
            continue
        if key[0] in charts.POOL_KINDS:
            pool = key[1].removeprefix("test-wc-")
            obj = _with_bootstrap(obj, our_pools[pool].bootstrap[1])
        assert ours.get(*key) == obj, f"{key} changed"
    assert set(ours.by_key) - set(base.by_key) - bootstrap == gpu - bootstrap
    for pool in base_pools:
        assert bootstrap_without_gpunode(ours, pool) == bootstrap_without_gpunode(base, pool)
        assert without_gpunode(ours.clc(pool)) == base.clc(pool), pool
        assert set(ours.units(pool)) - set(base.units(pool)) == set(GPU_UNITS)


def _with_bootstrap(obj: dict[str, Any], name: str) -> dict[str, Any]:
    spec = obj["spec"]["template"]["spec"]
    ref = {**spec["bootstrap"]["configRef"], "name": name}
    return {**obj, "spec": {**obj["spec"], "template": {
        **obj["spec"]["template"], "spec": {**spec, "bootstrap": {**spec["bootstrap"],
                                                                  "configRef": ref}}}}}


# --- what Cluster API replaces: the bootstrap names before and after ---------------------------

def names(manifests: Manifests) -> dict[str, tuple[str, str]]:
    """pool → (bootstrap config name, infrastructure template name)."""
    return {p.name: (p.bootstrap[1], p.infrastructure[1]) for p in manifests.pools().values()}


@pytest.mark.parametrize("kind", SCENARIOS)
@pytest.mark.parametrize("fmt", PROVIDERS)
def test_installing_renames_every_pools_bootstrap_config_and_no_machine_template(
        fmt: str, kind: str, render: Render, patched_azure: Path,
        scenarios: Callable[[str, str], Scenario]) -> None:
    """The worker Ignition is global to all pools: the install renames every existing pool's
    bootstrap config (Cluster API replaces those nodes) while its machine template stays."""
    cluster, given = scenarios(fmt, kind)
    chart = chart_dir(fmt, patched_azure)
    before, after = names(Manifests(render(chart, *cluster))), names(
        Manifests(render(chart, *given)))
    for pool, (boot, infra) in before.items():
        assert after[pool][0] != boot and after[pool][1] == infra, (pool, before, after)


@pytest.mark.parametrize("fmt", PROVIDERS)
def test_a_new_gpunode_release_renames_every_pools_bootstrap_config_again(
        fmt: str, render: Render, patched_azure: Path, values: Values,
        scenarios: Callable[[str, str], Scenario]) -> None:
    cluster, given = scenarios(fmt, "chart-pools")
    chart = chart_dir(fmt, patched_azure)
    before = names(Manifests(render(chart, *given)))
    after = names(Manifests(render(chart, *cluster, values(fmt, url=URL_NEXT,
                                                                sha512=SHA512_NEXT))))
    assert set(after) == set(before) and len(after) >= 2
    for pool, (boot, infra) in before.items():
        assert after[pool][0] != boot and after[pool][1] == infra, pool


@pytest.mark.parametrize("fmt", PROVIDERS)
def test_another_agent_config_changes_no_pool(
        fmt: str, render: Render, patched_azure: Path, values: Values, workdir: Path,
        without_pools: Callable[[str], Path]) -> None:
    """The agent config lives in the Secret only: the values, and so every pool, stay."""
    other = workdir / "other-config.toml"
    other.write_text(AGENT.read_text().replace('gpu_access = "runtime"', 'gpu_access = "cdi"'))
    assert other.read_text() != AGENT.read_text()
    chart, cluster = chart_dir(fmt, patched_azure), without_pools(fmt)
    assert render(chart, cluster, values(fmt, agent=other)) == render(
        chart, cluster, values(fmt))


def test_a_pool_entry_alone_renames_no_other_pools_bootstrap_config(
        render: Render, patched_azure: Path) -> None:
    """What a baked GPU image needs from the chart (docs/image-bake.md): the pool entry only.
    Adding it leaves every existing pool's objects as they were."""
    ci = charts.CHARTS["cluster-azure"].ci_values
    before = names(Manifests(render(patched_azure, ci)))
    after = names(Manifests(render(patched_azure, ci,
                                   REPO / "deploy" / "cluster-azure-gpu-pool.yaml")))
    assert set(after) == {*before, "gpu-t4"}
    assert {pool: after[pool] for pool in before} == before


# --- one step toward the node: the Container Linux Config CAPBK transpiles ---------------------

@pytest.mark.parametrize("fmt", PROVIDERS)
def test_each_pools_clc_has_only_keys_the_transpiler_reads_and_fits_the_limit(
        fmt: str, render: Render, patched_azure: Path,
        scenarios: Callable[[str, str], Scenario]) -> None:
    """Cluster API's kubeadm bootstrap hands additionalConfig to Flatcar's transpiler (ct
    v0.9.4), whose types are the keys below; the field holds at most 32768 characters."""
    cluster, given = scenarios(fmt, "chart-pools")
    chart = chart_dir(fmt, patched_azure)
    ours, base = Manifests(render(chart, *given)), Manifests(render(chart, *cluster))
    for pool in ours.pools():
        clc = ours.clc(pool)
        assert set(clc) <= CLC_KEYS and set(clc["storage"]) <= CLC_STORAGE_KEYS, pool
        for unit in clc["systemd"]["units"]:
            assert set(unit) <= CLC_UNIT_KEYS and unit["name"].count(".") >= 1, unit
            assert isinstance(unit.get("contents", ""), str), unit
            assert all(set(d) == {"name", "contents"} for d in unit.get("dropins", [])), unit
        for directory in clc["storage"]["directories"]:
            assert set(directory) <= CLC_DIRECTORY_KEYS and isinstance(directory["mode"], int)
        assert len(ours.clc_text(pool)) <= charts.CLC_LIMIT
    # gpunode's share of the limit, which the chart's own units also use
    added = len(ours.clc_text("def00")) - len(base.clc_text("def00"))
    assert 0 < added < charts.CLC_LIMIT // 4
