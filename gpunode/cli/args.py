"""The `gpunode` command line's grammar: every command, action and option, and its help.

Only the shape of the command line lives here; cli/main.py runs what it names. The allowed values
are the constants of the modules that own them (log.FORMATS, delivery.FORMATS,
registration.FORMATS), so help, parsing and the code that acts on them cannot disagree.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any, NoReturn

from gpunode import __version__, delivery, log
from gpunode.cdi import spec as cdi
from gpunode.config import DEFAULT_CONFIG_PATH
from gpunode.errors import ArgumentsError
from gpunode.kube import registration


class Parser(argparse.ArgumentParser):
    """argparse, but a refused command line is raised (cli/main.py logs it in the chosen
    format) instead of printed and exited on the spot. Subcommand parsers are of the same
    class."""

    def error(self, message: str) -> NoReturn:
        raise ArgumentsError(message, self.format_usage(), self.prog)

    def parse_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                   namespace: argparse.Namespace | None = None) -> argparse.Namespace:
        """As argparse's, but words nobody understood are blamed on the (sub)command they
        follow, whose --help lists what it takes."""
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            words = [getattr(parsed, "command", None), getattr(parsed, "action", None)]
            prog = " ".join([self.prog, *(w for w in words if w)])
            raise ArgumentsError(f"unrecognized arguments: {' '.join(extras)}",
                                 self.format_usage(), prog)
        return parsed


def parse(argv: Sequence[str]) -> argparse.Namespace:
    """The command line, or ArgumentsError."""
    return build_parser(Parser).parse_args(argv)


def build_parser(parser_class: type[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    """The whole grammar, built with `parser_class` (its subcommand parsers are of that class
    too). `command` names the command, `action` the action of driver and containerd."""
    parser = parser_class(prog="gpunode", description="Make an NVIDIA GPU node ready "
                          "for Kubernetes at boot, and explain its state.")
    parser.add_argument("--version", action="version", version=f"gpunode {__version__}")
    parser.add_argument("--root", default="/", metavar="DIR",
                        help="host root to observe and change (default: /)")
    parser.add_argument("--config", metavar="FILE",
                        help=f"agent config (default: <root>{DEFAULT_CONFIG_PATH}; missing "
                        "means defaults)")
    parser.add_argument("--log-format", choices=log.FORMATS,
                        help="log format (default: console on a TTY, json otherwise)")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    detect = commands.add_parser("detect", help="list NVIDIA PCI functions")
    _json_flag(detect)
    _json_flag(commands.add_parser("status", help="live checks and the last boot record"))
    _json_flag(commands.add_parser("plan", help="what 'boot' would change; touches nothing"))
    commands.add_parser("boot", help="the whole pipeline (what gpunode.service runs)")
    _label(commands.add_parser("label", help="label the own Node and set its GPUReady "
                               "condition, with the kubelet's credentials"))
    _ignition(commands.add_parser("ignition", help="render the node snippet that installs "
                                  "gpunode (sysext, units, config)"))

    driver = commands.add_parser("driver", help="the driver step alone")
    driver_actions = driver.add_subparsers(dest="action", required=True, metavar="ACTION")
    driver_actions.add_parser("load", help="make the NVIDIA modules loaded (and device nodes)")
    driver_actions.add_parser("build", help="build the modules for the running kernel into "
                              "the cache (once per kernel, driver and flavour)")
    _json_flag(driver_actions.add_parser("status", help="what the driver step would do, "
                                         "and the driver checks"))
    _json_flag(driver_actions.add_parser("verify", help="hash every file of every build cache "
                                         "entry against its manifest (boot checks them "
                                         "cheaply)"))

    cdi_parser = commands.add_parser("cdi", help="the node's CDI spec (nvidia.com/gpu)")
    generate = cdi_parser.add_subparsers(dest="action", required=True, metavar="ACTION") \
        .add_parser("generate", help="print the CDI spec for the GPUs the driver sees")
    generate.add_argument("--output", metavar="PATH", help="write it to this host path "
                          f"(under --root; e.g. {cdi.SPEC_PATH}) instead of stdout, only when "
                          "its bytes change")
    generate.add_argument("--format", choices=cdi.FORMATS, default="yaml")

    _nodes(commands.add_parser("nodes", help="the cluster's GPU nodes from the API server: "
                               "which are not ready, and why (run from a workstation)"))

    watch = commands.add_parser("watch", help="report fatal Xids and lost GPUs as the Node's "
                                "GPUReady condition and Events (what gpunode-watch.service runs)")
    watch.add_argument("--once", action="store_true", help="process what the kernel logged "
                       "so far, then exit")
    watch.add_argument("--dry-run", action="store_true", help="print each change as a JSON "
                       "line; contact nothing, remember nothing")

    commands.add_parser("metrics", help="the node's GPU health as Prometheus metrics (the "
                        "text format; gpunode watch keeps them for node-exporter)")

    _image(commands.add_parser("image", help="bake gpunode and a driver into an OS image"))
    containerd = commands.add_parser("containerd", help="the container runtime step alone")
    _containerd(containerd.add_subparsers(dest="action", required=True, metavar="ACTION"))
    return parser


def _json_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print a JSON document")


def _label(label: argparse.ArgumentParser) -> None:
    label.add_argument("--dry-run", action="store_true",
                       help="print the labels and condition; do not contact the API")
    _json_flag(label)
    label.add_argument("--registration", choices=registration.FORMATS,
                       help="print the taints and labels to set at registration in that form "
                       "(a kubelet may not change its taints later)")
    label.add_argument("--pool", help="node pool name (--registration cluster-azure; "
                       f"default {registration.DEFAULT_POOL})")
    label.add_argument("--instance-type", help="instance type (--registration cluster-azure; "
                       f"default {registration.DEFAULT_INSTANCE_TYPE})")


def _nodes(nodes: argparse.ArgumentParser) -> None:
    nodes.add_argument("--kubeconfig", metavar="FILE", help="the cluster's kubeconfig "
                       "(default: $KUBECONFIG, else ~/.kube/config)")
    nodes.add_argument("--context", metavar="NAME", help="the kubeconfig's context to use "
                       "(default: its current-context)")
    _json_flag(nodes)


def _ignition(ignition_parser: argparse.ArgumentParser) -> None:
    ignition_parser.add_argument("--format", choices=delivery.FORMATS, default="butane")
    ignition_parser.add_argument("--pool", help="the GPU node pool's name (cluster-azure, "
                                 "cluster-aws; default gpu00)")
    ignition_parser.add_argument("--instance-type", help="the GPU pool's instance type "
                                 "(default: Standard_NC4as_T4_v3, g4dn.xlarge)")
    ignition_parser.add_argument("--nodes", type=int, metavar="N", help="the GPU pool's node "
                                 "count (cluster-azure replicas, cluster-aws minSize and "
                                 "maxSize; default 1)")
    ignition_parser.add_argument("--no-default-pool", action="store_true",
                                 help="leave out the chart's default pool (for a cluster "
                                 "whose values list node pools of their own)")
    ignition_parser.add_argument("--sysext-url", required=True, metavar="URL",
                                 help="where nodes download gpunode-<version>-x86-64.raw")
    ignition_parser.add_argument("--sysext-sha512", required=True, metavar="HEX",
                                 help="the image's sha512 (make sysext writes it beside the "
                                 "image)")
    ignition_parser.add_argument("--agent-config", metavar="FILE",
                                 help=f"agent config to install as {DEFAULT_CONFIG_PATH} "
                                 "(checked first)")
    ignition_parser.add_argument("--units", metavar="DIR", help="directory holding the units "
                                 "(default: the units installed with gpunode)")


def _image(image: argparse.ArgumentParser) -> None:
    bake = image.add_subparsers(dest="action", required=True, metavar="ACTION").add_parser(
        "bake", help="put gpunode's sysext, a Flatcar driver sysext and the node's config "
        "into an image root, as a bake config names them")
    bake.add_argument("--root", default=argparse.SUPPRESS, metavar="DIR",
                      help="the image's root (/ inside the image-build machine)")
    bake.add_argument("--config", dest="bake_config", required=True, metavar="BAKE.toml",
                      help="the bake config (docs/cli.md, 'gpunode image bake')")


def _containerd(actions: Any) -> None:
    """The containerd command's actions (`actions`: what add_subparsers returned)."""
    configure = actions.add_parser("configure", help="add or reconcile the nvidia runtime")
    configure.add_argument("--config", dest="containerd_config", metavar="PATH",
                           help="containerd config file to edit in place (default: the one "
                           "containerd.service uses)")
    configure.add_argument("--runtime-name", metavar="NAME")
    configure.add_argument("--runtime-path", metavar="PATH")
    configure.add_argument("--set-as-default", action="store_true", default=None)
    configure.add_argument("--enable-cdi", action="store_true", default=None)
    configure.add_argument("--force", action="store_true",
                           help="configure even if the runtime binary does not exist")
    configure.add_argument("--dry-run", action="store_true",
                           help="print a unified diff and write nothing")
    revert = actions.add_parser("revert", help="remove what gpunode added")
    revert.add_argument("--config", dest="containerd_config", metavar="PATH",
                        help="the file gpunode changed (default: the one its ledger names)")


def command_name(args: argparse.Namespace) -> str:
    """"status", "driver load", "containerd configure": the command and its action."""
    return " ".join(w for w in (args.command, getattr(args, "action", None)) if w)


def log_format(argv: Sequence[str]) -> str | None:
    """--log-format as given, for the refusal of a command line the whole grammar refused
    (argparse, with that one option only); None (console on a TTY, JSON otherwise) when absent
    or not a valid choice."""
    parser = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    parser.add_argument("--log-format")
    try:
        given = parser.parse_known_args(argv)[0].log_format
    except argparse.ArgumentError:
        return None
    return given if given in log.FORMATS else None
