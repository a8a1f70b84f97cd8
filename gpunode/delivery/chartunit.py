"""gpunode's units in the structured form of Giant Swarm's `cluster` chart, and the bootstrap
unit that brings gpunode's system extension to a node the chart made.

The chart takes no unit text: a unit is `{name, enabled, mask, dropins, contents}`, and
`contents` is `unit.{description, after[], before[], wants[], requires[], partOf[], upholds[],
bindsTo, defaultDependencies}`, `service.{type, remainAfterExit, restart, execStart[],
environment[], environmentFile[], additionalFields}` and `install.wantedBy[]`; `type` and
`remainAfterExit` (a string) are required, `additionalFields` is free text that goes through
Helm's `tpl`, and no other `[Unit]` key has a place (no `Condition*=`). Source:
giantswarm/cluster@ad135475ddd1ab0f2eb2bca6e63bbd72d879b6e3 (v7.0.0),
helm/cluster/values.schema.json `$defs.systemdUnit` and
helm/cluster/templates/clusterapi/_helpers_flatcar.tpl, which writes the unit back as text.

`structured()` turns a unit of units/ into that form, refusing what it cannot carry, so units/
stays the one source. Every GPU-only unit gets `GPU_CONDITION` as its `ExecCondition=`: a
machine without an NVIDIA display controller skips it, downloads nothing and runs nothing.
"""

from __future__ import annotations

from typing import Any

from gpunode.errors import InputRefused

SYSEXT_UNIT = "gpunode-sysext.service"
PCI_DEVICES = "/sys/bus/pci/devices"

# One `ExecCondition=`: exit 0 when a PCI function has vendor 0x10de and a display-controller
# class (0x03xxxx: VGA 0x0300, 3D 0x0302), 1 (skip the unit) when none has, 255 (the unit
# fails, loudly) when sysfs has no PCI bus to look at. Reads two small files per function: no
# process but the shell. `$$` is systemd's escape for a literal `$`.
GPU_CONDITION = (
    f"ExecCondition=/bin/sh -c 'test -d {PCI_DEVICES} || "
    f"{{ echo \"gpunode: {PCI_DEVICES} is missing, cannot tell whether this node has a GPU\" "
    ">&2; exit 255; }; "
    f"for d in {PCI_DEVICES}/*; do "
    'read -r v < "$$d/vendor" && read -r c < "$$d/class" || continue; '
    '[ "$$v" = 0x10de ] && case "$$c" in 0x03*) exit 0;; esac; '
    "done; exit 1'")

_UNIT_LISTS = {"After": "after", "Before": "before", "Wants": "wants", "Requires": "requires",
               "PartOf": "partOf", "Upholds": "upholds"}
_SERVICE_LISTS = {"ExecStart": "execStart", "Environment": "environment",
                  "EnvironmentFile": "environmentFile"}
_SERVICE_SCALARS = {"Type": "type", "RemainAfterExit": "remainAfterExit", "Restart": "restart"}


def _sections(text: str, path: str) -> list[tuple[int, str, str, str]]:
    """(line, section, key, value) for every assignment of a unit file, in order."""
    out, section = [], ""
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.endswith("\\"):
            raise InputRefused(path, f"line {number}: a continued line; the chart's unit form "
                               "takes one line per setting", "join the line")
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
            continue
        key, eq, value = line.partition("=")
        if not eq or not section:
            raise InputRefused(path, f"line {number}: not a 'Key=value' line of a section")
        out.append((number, section, key.strip(), value.strip()))
    return out


def structured(text: str, path: str) -> dict[str, Any]:
    """A unit file's text as the chart's `contents`; InputRefused (exit 2) for what the chart
    cannot express: a `[Unit]` key outside its list, an `[Install]` key but WantedBy=, another
    section, an empty assignment (a reset), or `{{` (Helm's tpl would evaluate it)."""
    unit: dict[str, Any] = {}
    service: dict[str, Any] = {}
    install: dict[str, Any] = {}
    extra: list[str] = []
    for number, section, key, value in _sections(text, path):
        where = f"line {number}: [{section}] {key}="
        if not value or "{{" in value:
            raise InputRefused(path, f"{where}: {'an empty assignment' if not value else '{{'} "
                               "has no place in the cluster chart's unit form")
        if section == "Unit" and key in _UNIT_LISTS:
            unit.setdefault(_UNIT_LISTS[key], []).extend(value.split())
        elif section == "Unit" and key in ("Description", "BindsTo"):
            unit[key[0].lower() + key[1:]] = value
        elif section == "Unit" and key == "DefaultDependencies":
            unit["defaultDependencies"] = value.lower() in ("yes", "true", "1", "on")
        elif section == "Service" and key in _SERVICE_LISTS:
            service.setdefault(_SERVICE_LISTS[key], []).append(value)
        elif section == "Service" and key in _SERVICE_SCALARS:
            service[_SERVICE_SCALARS[key]] = value
        elif section == "Service":
            extra.append(f"{key}={value}")
        elif section == "Install" and key == "WantedBy":
            install.setdefault("wantedBy", []).extend(value.split())
        else:
            raise InputRefused(path, f"{where}: the cluster chart's unit form has no place for "
                               "it (giantswarm/cluster values.schema.json $defs.systemdUnit)")
    if "description" not in unit:
        raise InputRefused(path, "[Unit] has no Description=, which the chart's unit form "
                           "requires")
    service.setdefault("type", "simple")
    service.setdefault("remainAfterExit", "no")  # required by the schema; systemd's default
    if extra:
        service["additionalFields"] = "\n".join(extra)
    contents: dict[str, Any] = {"unit": unit, "service": service}
    if install:
        contents["install"] = install
    return contents


def gpu_only(contents: dict[str, Any], after: tuple[str, ...] = ()) -> dict[str, Any]:
    """contents with GPU_CONDITION first in its additionalFields, and `after` added."""
    service = dict(contents["service"])
    fields = service.get("additionalFields")
    service["additionalFields"] = GPU_CONDITION + (f"\n{fields}" if fields else "")
    unit = dict(contents["unit"])
    if after:
        unit["after"] = [*unit.get("after", []), *(a for a in after
                                                   if a not in unit.get("after", []))]
    return {**contents, "unit": unit, "service": service}


def _sh(*lines: str) -> str:
    """One ExecStart= running a POSIX shell script (lines joined by '; ')."""
    script = "; ".join(lines)
    assert "'" not in script and "%" not in script and "\\" not in script  # systemd quoting
    return f"/bin/sh -c '{script}'"


def sysext_unit(url: str, sha512: str, image: str, link: str) -> dict[str, Any]:
    """The bootstrap unit: on a GPU node, download the image from `url` (retrying until the
    network answers), check its sha512 (a mismatch: the download is deleted, the unit fails,
    nothing is merged), keep it as `image`, link it as `link` and merge it with systemd-sysext,
    all before gpunode.service, containerd and the kubelet. A later boot finds the image
    verified and merged and downloads nothing.

    Not After=network-online.target: ordering is unconditional, so on a CPU node (where
    GPU_CONDITION skips the unit) it would hold gpunode.service and containerd until the
    network is online; the download retries instead (curl --retry-all-errors: also a name
    that does not resolve yet). No namespacing option (PrivateTmp=, ProtectHome=): in a
    service's own mount namespace systemd-sysext's merge would not reach the node (systemd
    252, tests/integration/test_chart_bootstrap.py)."""
    fetch = _sh(
        "set -eu",
        'image="$${GPUNODE_SYSEXT_IMAGE}"',
        'sum="$${GPUNODE_SYSEXT_SHA512}"',
        'if echo "$$sum  $$image" | sha512sum --check --status 2>/dev/null; then exit 0; fi',
        "curl --fail --silent --show-error --location --retry 60 --retry-delay 2 "
        '--retry-all-errors --connect-timeout 10 --output "$$image.part" '
        '"$${GPUNODE_SYSEXT_URL}" || { rm -f "$$image.part"; exit 1; }',
        'if ! echo "$$sum  $$image.part" | sha512sum --check --status; then '
        'rm -f "$$image.part"; echo "gpunode-sysext: $${GPUNODE_SYSEXT_URL} does not have '
        'sha512 $$sum: refused, nothing merged" >&2; exit 1; fi',
        'mv -f "$$image.part" "$$image"')
    merge = _sh(
        "set -eu",
        f'if [ "$$(readlink {link} 2>/dev/null)" = "$${{GPUNODE_SYSEXT_IMAGE}}" ] && '
        "[ -x /usr/bin/gpunode ]; then exit 0; fi",
        f'ln -sfn "$${{GPUNODE_SYSEXT_IMAGE}}" {link}',
        "systemd-sysext refresh")
    return {
        "unit": {"description": "gpunode: download, verify and merge gpunode's system "
                                "extension (GPU nodes only)",
                 # After Flatcar's own merge of /etc/extensions (and its reload), as Giant
                 # Swarm's gpu-node-pool orders its units: giantswarm/gpu-node-pool@62af02dd81aa
                 # 3ff255da27dfcaed43eff1c4c606, helm/gpu-node-pool/files/etc/systemd/system/
                 # nvidia-cdi-spec.service.flatcar-sysext.
                 "after": ["network.target", "systemd-sysext.service", "ensure-sysext.service"],
                 "wants": ["network-online.target"],
                 "before": ["gpunode.service", "containerd.service", "kubelet.service",
                            "kubeadm.service"]},
        "service": {"type": "oneshot", "remainAfterExit": "yes",
                    "environment": [f"GPUNODE_SYSEXT_URL={_systemd_value(url)}",
                                    f"GPUNODE_SYSEXT_SHA512={sha512}",
                                    f"GPUNODE_SYSEXT_IMAGE={image}"],
                    "execStart": [fetch, merge],
                    "additionalFields": f"{GPU_CONDITION}\nTimeoutStartSec=10min"},
        "install": {"wantedBy": ["multi-user.target"]},
    }


def _systemd_value(text: str) -> str:
    """A value for Environment=: `%` starts a specifier there, `%%` is a literal one."""
    return text.replace("%", "%%")
