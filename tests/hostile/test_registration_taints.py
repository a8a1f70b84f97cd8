"""Agent configs whose taints cluster-azure's chart cannot take: one refusal each (exit 2, the
config file and key named), nothing printed on stdout, and no file changed."""

from __future__ import annotations

import pytest

from conftest import HostFactory
from hostile.support import Cli, check_refusal

VALUELESS = {
    "no-value": ['"example.com/gpu:NoSchedule"'],
    "empty-value": ['"example.com/gpu=:NoExecute"'],
    "second-of-two": ['"nvidia.com/gpu=present:NoSchedule"', '"dedicated:PreferNoSchedule"'],
}


@pytest.mark.parametrize("taints", list(VALUELESS.values()), ids=list(VALUELESS))
def test_a_taint_without_a_value_is_refused_for_cluster_azure(
        taints: list[str], make_host: HostFactory, cli: Cli) -> None:
    root = make_host("nc4as-t4-v3", "ready").root
    (root / "etc/gpunode").mkdir(parents=True, exist_ok=True)
    (root / "etc/gpunode/config.toml").write_text(f"[kubernetes]\ntaints = [{', '.join(taints)}]\n")
    bad = taints[-1].strip('"')
    result = check_refusal(
        cli, root, ["--root", str(root), "label", "--registration", "cluster-azure"], 2,
        rf"config\.toml: key 'kubernetes\.taints': taint '{bad}' has no value, and "
        r"cluster-azure's customNodeTaints require one .*e\.g\. 'nvidia\.com/gpu=present")
    assert result.out == ""
    assert result.errors[0]["error_code"] == "config-invalid"


@pytest.mark.parametrize("form", ["kubeadm", "kubelet-flags"])
def test_the_other_forms_still_render_a_taint_without_a_value(
        form: str, make_host: HostFactory, cli: Cli) -> None:
    """Kubernetes taints may have no value: only the chart insists on one."""
    root = make_host("nc4as-t4-v3", "ready").root
    (root / "etc/gpunode").mkdir(parents=True, exist_ok=True)
    (root / "etc/gpunode/config.toml").write_text('[kubernetes]\ntaints = ["a.b/c:NoSchedule"]\n')
    result = cli("--root", str(root), "label", "--registration", form)
    assert result.code == 0, result.err
    assert "a.b/c" in result.out and "value" not in result.out
