"""A GPU node as cluster-azure provisions it, for the unit tests of gpunode's edit of the
cluster chart's containerd file and the integration tests that show it to real containerd
(tests/data/containerd/cluster-chart/README.md)."""

from __future__ import annotations

from collections.abc import Callable

from conftest import with_runtime_binary
from gpunode.containerd import extras
from gpunode.containerd.ledger import MEMLOCK_DROPIN
from gpunode.platform.host import Host
from helpers.containerd_vectors import VECTORS

CONFIG = "etc/containerd/config.toml"
# CAPI's Flatcar images run their own containerd on /etc/containerd/config.toml
# (kubernetes-sigs/image-builder, images/capi/ansible/roles/containerd: containerd-flatcar.conf
# installed as this drop-in).
IMAGE_BUILDER_DROPIN = ("etc/systemd/system/containerd.service.d/10-opt-bin-custom.conf",
                        "[Service]\nExecStart=\n"
                        "ExecStart=/opt/bin/containerd --config /etc/containerd/config.toml\n")


def vector(name: str, which: str = "input") -> str:
    return (VECTORS / name / f"{which}.toml").read_text()


def chart_node(make_host: Callable[..., Host], name: str = "cluster-azure",
               memlock: bool = True) -> Host:
    """The chart's file (vector `name`), the image-builder drop-in that makes containerd read
    it, the toolkit; with gpunode's LimitMEMLOCK drop-in from an earlier boot unless `memlock`
    is False (a first boot)."""
    host = with_runtime_binary(make_host("nc4as-t4-v3", "driver"))
    for path, text in ((CONFIG, vector(name)), IMAGE_BUILDER_DROPIN,
                       (MEMLOCK_DROPIN.lstrip("/"), extras.MEMLOCK_TEXT if memlock else None)):
        if text is not None:
            (host.root / path).parent.mkdir(parents=True, exist_ok=True)
            (host.root / path).write_text(text)
    return host
