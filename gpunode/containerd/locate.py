"""Where the containerd step's change goes, found before it is planned: the config containerd
uses (its unit says, or the agent config's `containerd.config_path`), gpunode's ledger of its
earlier changes, the file gpunode writes (a writable copy of a read-only one, with what points
containerd at it) and the text the change starts from.

Boot locates early (`early`), as soon as detect has found GPUs, and starts containerd's
`--version` then: it runs beside the preflight, driver and cdi steps instead of after them.
The plan asks for containerd's `config dump` only for a version whose defaults gpunode does not
know (schema.KNOWN_DEFAULTS). None of those steps touches what the probes read (containerd's
unit, its config, the binary), except a driver step that merges a sysext: boot then drops what
it located and stops the probe, and the containerd step starts over.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpunode.config import ContainerdConfig
from gpunode.containerd import discover, journal, ledger
from gpunode.containerd.discover import ActiveConfig, ContainerdConfigError, active_config
from gpunode.containerd.ledger import DROPIN, ENV_FILE, READ_ONLY_PREFIXES, WRITABLE_CONFIG, Ledger
from gpunode.containerd.probe import Probe
from gpunode.containerd.writes import refuse_hard_links
from gpunode.errors import ContainerdStepError, GpunodeError
from gpunode.platform.host import Host
from gpunode.platform.systemd import Systemd


@dataclass(frozen=True)
class Located:
    """Where the change goes and the text it starts from, read before anything is planned."""

    active: ActiveConfig
    recorded: Ledger | None  # what gpunode changed before, validated
    target: str  # the file gpunode writes
    copied_from: str | None  # the read-only file a writable copy is made from
    dropin: str | None  # what points containerd at the copy; None: not needed
    dropin_path: str  # where: the drop-in, or ENV_FILE (then no daemon-reload)
    source_text: str  # the target's text, or the copied original's

    @property
    def source(self) -> str:
        return self.copied_from or self.target


def locate(host: Host, config: ContainerdConfig, systemd: Systemd | None,
           explicit: str | None = None) -> Located:
    if explicit or config.config_path:
        path = explicit or config.config_path or ""
        active = ActiveConfig(path, "--config" if explicit else "containerd.config_path")
    else:
        active = active_config(host, systemd)
    recorded = ledger.read(host)
    target, copied_from, dropin, dropin_path = _target(host, active, recorded)
    if recorded is not None and recorded.target != target:
        raise ContainerdStepError(
            f"gpunode's ledger {host.display(ledger.LEDGER)} records changes to "
            f"{recorded.target}, not {target}; gpunode keeps one config's changes at a time",
            f"run 'gpunode containerd revert' first to undo them in {recorded.target}")
    source_text = _read_config(host, copied_from or target)
    refuse_hard_links(host, [target])
    return Located(active, recorded, target, copied_from, dropin, dropin_path, source_text)


def wants_dump(config: ContainerdConfig, located: Located) -> bool:
    """Whether the plan may ask containerd for its own reading of the file (for a version
    whose defaults gpunode does not know): only where a runtime is to be added (the file does
    not name it yet), or drop-in and mode runtimes are wanted."""
    return config.runtime_wanted and (config.mode == "drop-in" or config.mode_runtimes
                                      or config.runtime_name not in located.source_text)


def start_probes(located: Located, probe: Probe) -> None:
    """containerd's `--version`, started now; the plan takes its answer
    (probe.CommandProbe.prefetch)."""
    probe.prefetch(located.active.binary, None)


def early(host: Host, config: ContainerdConfig, systemd: Systemd | None,
          probe: Probe | None) -> Located | GpunodeError | None:
    """Boot's locating right after detect, containerd's `--version` started: what the
    containerd step's plan then takes as its own (a failure too, raised there in its turn).
    None, and nothing started, while an interrupted change waits to be rolled back: the step
    rolls it back first and locates from the files as that leaves them."""
    try:
        if journal.pending(host):
            return None
    except GpunodeError:
        return None  # something at the journal's path: the step's recover() says what
    try:
        located = locate(host, config, systemd)
    except GpunodeError as exc:
        return exc
    if probe is not None:  # None: the step's plan makes its own (the tests' adapters)
        start_probes(located, probe)
    return located


def _target(host: Host, active: ActiveConfig,
            recorded: Ledger | None) -> tuple[str, str | None, str | None, str]:
    """(file to write, read-only original it is copied from, the text and path of what points
    containerd at it) for the active file."""
    if not active.path.startswith(READ_ONLY_PREFIXES):
        return active.path, None, None, DROPIN
    if host.exists(WRITABLE_CONFIG) and not (recorded and recorded.copied_from):
        raise ContainerdStepError(
            f"containerd reads {active.path} (read-only), and {host.display(WRITABLE_CONFIG)} "
            "exists but is not the config containerd uses; gpunode will not overwrite it",
            f"point containerd at {WRITABLE_CONFIG} (a containerd.service.d drop-in), or "
            "remove it, then run gpunode again")
    return (WRITABLE_CONFIG, active.path, *_pointer(active))


def _pointer(active: ActiveConfig) -> tuple[str, str]:
    """(text, path) of what makes containerd read the writable copy: where the unit reads
    ENV_FILE (gpunode's shipped drop-in) and takes the path from a variable, that file — read
    at containerd's next start, no daemon-reload; else a drop-in of its own."""
    note = ("# Written by gpunode: containerd reads a writable copy of its config, which has "
            "the NVIDIA runtime.\n")
    flag = active.raw_flag or ""
    if flag.startswith("${") and flag.endswith("}"):
        if ENV_FILE in active.env_files:
            return note + f"{flag[2:-1]}={WRITABLE_CONFIG}\n", ENV_FILE
        return note + f"[Service]\nEnvironment={flag[2:-1]}={WRITABLE_CONFIG}\n", DROPIN
    return note + "[Service]\n" + _exec_override(active), DROPIN


def _exec_override(active: ActiveConfig) -> str:
    argv = list(active.raw_exec) or ["/usr/bin/containerd"]
    argv = _with_config(argv, WRITABLE_CONFIG)
    return "ExecStart=\nExecStart=" + " ".join(argv) + "\n"


def _with_config(argv: list[str], path: str) -> list[str]:
    for i, word in enumerate(argv):
        if word in ("--config", "-c") and i + 1 < len(argv):
            return [*argv[: i + 1], path, *argv[i + 2 :]]
        if word.startswith(("--config=", "-c=")):
            return [*argv[:i], word.split("=", 1)[0] + "=" + path, *argv[i + 1 :]]
    return [*argv, "--config", path]


def _read_config(host: Host, path: str) -> str:
    try:
        text = discover.read_config(host, path)
    except ContainerdConfigError as exc:
        raise ContainerdStepError(str(exc), exc.hint) from None
    if text is None:
        raise ContainerdStepError(f"{host.display(path)}: does not exist",
                                  "check the path containerd.service names")
    return text
