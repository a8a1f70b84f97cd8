"""GPU initialization: every GPU the driver sees brought up as production nodes bring it up, and
waited for; a GPU that does not come up is named by its address.

Right after the modules load the driver has not initialized any GPU: it does so on a GPU's
first client open, and tears it down again at the last close unless persistence mode is on.
Until then /proc/driver/nvidia/gpus/<address>/information reads `GPU UUID:
GPU-????????-…` (driverinfo.UNINITIALIZED_UUID); the driver keeps the UUID once it has read
it (nv_state's UUID cache, kernel-open/nvidia/nv.c), so a GPU that was up once shows it. A GPU
whose initialization fails logs `NVRM: GPU <address>: RmInitAdapter failed! (…)` (older
drivers: `NVRM: RmInitAdapter failed!` and `rm_init_adapter failed for device bearing minor
number N`) and keeps the placeholder.

How (`plan`, pure; `apply` through an Initializer, gpu/initializers.py):
- `nvidia-persistenced --persistence-mode` when the driver ships it (its binaries,
  driver/userspace.py) and none runs yet: what the GPU Operator's driver container runs after
  `modprobe nvidia` (NVIDIA/gpu-driver-container `_load_driver`) and AKS runs as a unit
  (`--verbose`; persistence mode is the daemon's default). It keeps every GPU initialized, so a
  CUDA process does not pay the initialization (seconds per GPU) and the GPU's state survives
  between jobs. `gpu.persistenced = false` leaves it out.
- otherwise one open (and close) of each /dev/nvidiaN not initialized yet: the driver
  initializes the GPU on that open and keeps its UUID.
Then the wait: the information files are read again until every GPU shows its UUID, a GPU
whose initialization the kernel log says failed is given up at once, and `gpu.init_timeout`
seconds bound the rest (`nvidia-smi -pm 1` takes over 25 s on an 8x A100 VM).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from gpunode.errors import DriverError, GpuInitError, GpunodeError, HostError
from gpunode.gpu import driverinfo
from gpunode.platform.host import Host

PERSISTENCED = "nvidia-persistenced"
PERSISTENCED_UNIT = "nvidia-persistenced.service"
PERSISTENCED_ARGS = ("--persistence-mode",)
# nvidia-persistenced's own files (NVIDIA/nvidia-persistenced nvpd_defs.h: /var/run, which is
# /run on every systemd host); the kernel's comm is the first 15 characters of its name
PERSISTENCED_PID_FILE = "/run/nvidia-persistenced/nvidia-persistenced.pid"
PERSISTENCED_COMM = PERSISTENCED[:15]
KMSG = "/dev/kmsg"
POLL_SECONDS = 0.2
OPEN_SECONDS = 10.0  # at least, for the opens of the GPUs persistenced did not bring up

_DEV_ADDRESS = r"([0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7])"
_FAILED_AT = re.compile(r"NVRM: GPU " + _DEV_ADDRESS + r": (RmInitAdapter failed!.*|"
                        r"rm_init_adapter failed.*)")
_FAILED_MINOR = re.compile(r"NVRM: rm_init_adapter failed for device bearing minor number "
                           r"(\d{1,3})")
_SUCCEEDED_AT = re.compile(r"NVRM: GPU " + _DEV_ADDRESS + r": RmInitAdapter succeeded")


def init_failures(records: Iterable[str], minors: dict[int, str]) -> dict[str, str]:
    """address → the kernel's last line saying the GPU's initialization failed, from /dev/kmsg
    records (or plain lines); a later `RmInitAdapter succeeded!` for it clears it. `minors`
    (device minor → address) places the older drivers' lines that name only the minor."""
    failed: dict[str, str] = {}
    for record in records:
        message = record.split("\n", 1)[0].split(";", 1)[-1].strip()
        if "NVRM" not in message:
            continue
        if (match := _FAILED_AT.search(message)) is not None:
            failed[match.group(1).lower()] = driverinfo.printable(message, 240)
        elif (match := _FAILED_MINOR.search(message)) is not None:
            address = minors.get(int(match.group(1)))
            if address is not None:
                failed[address] = driverinfo.printable(message, 240)
        elif (match := _SUCCEEDED_AT.search(message)) is not None:
            failed.pop(match.group(1).lower(), None)
    return failed


def read_failures(host: Host, infos: dict[str, driverinfo.GpuInfo]) -> dict[str, str]:
    """The kernel log's initialization failures of the GPUs not initialized (an initialized
    GPU has none to look for, and the kernel log is then not read at all). Best effort: an
    unreadable log names no failure."""
    if all(info.initialized for info in infos.values()):
        return {}
    try:
        records = host.read_records(KMSG)
    except GpunodeError:
        return {}
    minors = {i.minor: a for a, i in infos.items() if i.minor is not None}
    return {a: line for a, line in init_failures(records, minors).items()
            if a in infos and not infos[a].initialized}


# -- facts, and the plan made of them (pure) ----------------------------------------------------


@dataclass(frozen=True)
class Facts:
    """What the step reads of the node: the GPUs as the driver shows them, and persistenced."""

    infos: dict[str, driverinfo.GpuInfo]
    failures: dict[str, str]  # address → the kernel's line saying its initialization failed
    persistenced: str | None  # the loaded driver's nvidia-persistenced (host path), or None
    running: str | None  # how a persistenced already runs ("pid 812"), or None

    @property
    def waiting(self) -> tuple[str, ...]:
        return tuple(sorted(a for a, i in self.infos.items() if not i.initialized))


@dataclass(frozen=True)
class Plan:
    """What the step does: start persistenced, open devices, wait for the GPUs named."""

    start: str | None = None  # the persistenced binary to start
    opens: tuple[str, ...] = ()  # /dev/nvidiaN to open once (no persistenced, or it failed)
    waits: tuple[str, ...] = ()  # GPUs not initialized yet
    refused: str | None = None  # why nothing may be started or opened here (under --root)
    running: str | None = None  # the persistenced that runs already

    def describe(self) -> list[str]:
        lines = []
        if self.start is not None:
            lines.append(f"start {self.start} {' '.join(PERSISTENCED_ARGS)} (the unit "
                         f"{PERSISTENCED_UNIT}): persistence mode on every GPU")
        if self.opens:
            lines.append(f"open {', '.join(self.opens)} once: the driver initializes each GPU "
                         "on its first open")
        if self.waits and (self.start or self.opens):
            lines.append(f"wait for {_gpus(len(self.waits))} to show a UUID: "
                         f"{', '.join(self.waits)}")
        return lines


UNDER_ROOT = "under --root gpunode starts nothing and opens no device: the tree's GPUs are not " \
    "this machine's"
EXTERNAL = "driver.strategy is external: whoever owns the driver brings its GPUs up, not gpunode"


def plan(facts: Facts, may_act: bool, use_persistenced: bool = True,
         refused: str = UNDER_ROOT) -> Plan:
    """`may_act` False: nothing may be started or opened (`refused` says why: under --root the
    tree's GPUs are not this machine's; an external driver is its owner's), so the plan only
    names what is not up."""
    waits = facts.waiting
    if not may_act:
        return Plan(waits=waits, refused=refused, running=facts.running)
    start = facts.persistenced if (use_persistenced and facts.running is None) else None
    opens = () if start is not None else open_paths(facts.infos, waits)
    return Plan(start=start, opens=opens, waits=waits, running=facts.running)


def open_paths(infos: dict[str, driverinfo.GpuInfo], addresses: Iterable[str]) -> tuple[str, ...]:
    """The device node of each of `addresses` the driver still lists with a minor (a GPU may
    have gone since it was planned for)."""
    return tuple(f"/dev/nvidia{infos[a].minor}" for a in addresses
                 if a in infos and infos[a].minor is not None)


def _gpus(n: int) -> str:
    return f"{n} GPU{'' if n == 1 else 's'}"


# -- observing ---------------------------------------------------------------------------------


def observe(host: Host, binaries: Iterable[str] = ()) -> Facts:
    """The GPUs as the driver shows them now, their failures, and persistenced: `binaries` are
    the loaded driver's (driver/userspace.py's driver root)."""
    infos = driverinfo.read_gpu_infos(host)
    persistenced = next((b for b in sorted(binaries)
                         if b.rpartition("/")[2] == PERSISTENCED), None)
    return Facts(infos, read_failures(host, infos), persistenced, persistenced_running(host))


def persistenced_running(host: Host, unit_state: str | None = None) -> str | None:
    """How an nvidia-persistenced runs already: its unit active (`unit_state`, as systemd
    says), or its pid file naming a live process of that name; None when none runs."""
    if unit_state in ("active", "activating", "reloading"):
        return f"{PERSISTENCED_UNIT} is {unit_state}"
    try:
        text = host.read_optional(PERSISTENCED_PID_FILE, limit=64)
        pid = text.strip() if text is not None else ""
        if not pid.isascii() or not pid.isdigit() or not 0 < int(pid) < 1 << 22:
            return None
        comm = host.read_optional(f"/proc/{int(pid)}/comm", limit=64)
    except HostError:
        return None
    if comm is None or comm.strip() != PERSISTENCED_COMM:
        return None  # a stale pid file: that process is gone, or the pid is someone else's
    return f"pid {int(pid)} ({PERSISTENCED_PID_FILE})"


# -- applying: start or open, then wait -------------------------------------------------------


class Initializer(Protocol):
    """What the step asks of the node (gpu/initializers.py): start persistenced, open a GPU."""

    may_act: bool

    def unit_state(self) -> str | None: ...

    def start_persistenced(self, binary: str, timeout: float) -> str: ...

    def open_devices(self, paths: Sequence[str], timeout: float) -> dict[str, str]: ...


@dataclass
class Outcome:
    """What the step did and found: the record's fields."""

    ready: list[str] = field(default_factory=list)
    not_ready: dict[str, str] = field(default_factory=dict)  # address → why
    persistenced: str | None = None  # how it runs now, or why it does not
    opened: list[str] = field(default_factory=list)
    waited_ms: float = 0.0
    changed: bool = False

    def fields(self) -> dict[str, object]:
        return {"ready": self.ready, "not_ready": self.not_ready,
                "persistenced": self.persistenced, "opened": self.opened,
                "waited_ms": round(self.waited_ms, 1)}


def apply(host: Host, the_plan: Plan, initializer: Initializer, timeout: float,
          report: dict[str, object], binaries: Iterable[str] = (),
          clock: Callable[[], float] = time.monotonic,
          sleep: Callable[[float], None] = time.sleep) -> Outcome:
    """Start or open as planned, then wait up to `timeout` seconds for every GPU. `report` gets
    the outcome's fields (also when it raises GpuInitError, naming each GPU not up)."""
    outcome = Outcome(persistenced=the_plan.running)
    deadline = clock() + timeout
    opens = the_plan.opens
    if the_plan.start is not None:
        try:
            said = initializer.start_persistenced(the_plan.start, timeout)
            outcome.persistenced = persistenced_running(host, initializer.unit_state()) or said
            outcome.changed = True
        except GpunodeError as exc:
            outcome.persistenced = f"not started: {exc}"
            opens = open_paths(driverinfo.read_gpu_infos(host), the_plan.waits)
    # A GPU initializes in its first open, which takes seconds: the opens get that long even
    # where a failed persistenced start used up the step's own bound (or it is 0).
    tried = initializer.open_devices(opens, max(OPEN_SECONDS, deadline - clock())) if opens else {}
    outcome.opened = [p for p in opens if p not in tried]
    outcome.changed = outcome.changed or bool(outcome.opened)
    acted = outcome.changed
    start = clock()
    while True:
        facts = observe(host, binaries)
        failed = facts.failures
        left = [a for a in facts.waiting if a not in failed]
        if not left or not acted or clock() >= deadline:
            break
        sleep(min(POLL_SECONDS, max(0.0, deadline - clock())))
    outcome.waited_ms = (clock() - start) * 1000
    outcome.ready = sorted(a for a, i in facts.infos.items() if i.initialized)
    for address in facts.waiting:
        info = facts.infos[address]
        node = f"/dev/nvidia{info.minor}" if info.minor is not None else None
        why = [failed[address]] if address in failed else []
        if node in tried:
            why.append(f"opening {node} failed: {tried[node]}")
        if not why:
            why.append(info.uuid_problem or "its UUID is not known")
            if acted:
                why.append(f"not up within {timeout:g} s")
            elif the_plan.refused:
                why.append(the_plan.refused)
        outcome.not_ready[address] = "; ".join(why)
    report.update(outcome.fields())
    if outcome.not_ready:
        raise GpuInitError(outcome.not_ready)
    return outcome


# -- boot's gpu_init step (pipeline/boot.py STEPS): plan and apply decide with the same code ----


def _loaded(ctx: Any) -> bool:
    return driverinfo.parse_version(
        ctx.host.read_optional(f"{driverinfo.PROC_NVIDIA}/version") or "") is not None


def _binaries(ctx: Any) -> tuple[str, ...]:
    """The loaded driver's binaries: the driver step's driver root, else found now."""
    from gpunode.driver import userspace

    found = ctx.found.get("driver_root")
    if found is None:
        found, _ = userspace.loaded_root(ctx.host, ctx.config.driver.prebuilt_dirs)
    return found.binaries if found is not None else ()


@dataclass(frozen=True)
class NoInitializer:
    """Under --root: the tree's GPUs are not this machine's, so nothing is started or opened."""

    may_act: bool = False

    def unit_state(self) -> str | None:
        return None

    def start_persistenced(self, binary: str, timeout: float) -> str:
        raise GpunodeError("under --root gpunode starts no daemon")

    def open_devices(self, paths: Sequence[str], timeout: float) -> dict[str, str]:
        return {path: "under --root gpunode opens no device" for path in paths}


def _initializer(ctx: Any) -> Initializer:
    return ctx.adapters.gpus if ctx.adapters.gpus is not None else NoInitializer()


def _plan_now(ctx: Any) -> tuple[Plan, Facts, tuple[str, ...]]:
    if not _loaded(ctx):
        raise DriverError(*NO_DRIVER)
    initializer = _initializer(ctx)
    binaries = _binaries(ctx)
    facts = observe(ctx.host, binaries)
    if facts.running is None and initializer.may_act:
        facts = Facts(facts.infos, facts.failures, facts.persistenced,
                      persistenced_running(ctx.host, initializer.unit_state()))
    if ctx.config.driver.strategy == "external":
        return plan(facts, False, refused=EXTERNAL), facts, binaries
    return plan(facts, initializer.may_act, ctx.config.gpu.persistenced), facts, binaries


NO_DRIVER = ("no GPU to bring up: the NVIDIA driver is not loaded",
             "fix what the driver step reports; the next boot brings the GPUs up")


def step_plan(ctx: Any) -> list[str]:
    if not _loaded(ctx) and ctx.found.get("driver_changes"):
        if not _initializer(ctx).may_act:
            return []  # under --root: nothing to say before the driver is there
        how = ("nvidia-persistenced when the driver ships it, else one open of each "
               "/dev/nvidiaN" if ctx.config.gpu.persistenced else "one open of each /dev/nvidiaN")
        return [f"once the driver is loaded, bring its GPUs up ({how}) and wait up to "
                f"{ctx.config.gpu.init_timeout} s for each"]
    the_plan, facts, _ = _plan_now(ctx)
    if the_plan.refused is not None and the_plan.waits:
        raise GpuInitError({a: f"{facts.infos[a].uuid_problem}; {the_plan.refused}"
                            for a in the_plan.waits})
    return the_plan.describe()


def step_apply(ctx: Any, fields: dict[str, Any]) -> bool:
    the_plan, _, binaries = _plan_now(ctx)
    outcome = apply(ctx.host, the_plan, _initializer(ctx), ctx.config.gpu.init_timeout, fields,
                    binaries)
    if the_plan.start is not None and (outcome.persistenced or "").startswith("not started"):
        from gpunode import log

        log.get().warning("gpu_init.persistenced_not_started", reason=outcome.persistenced,
                          note="the GPUs run without persistence mode: each CUDA start pays "
                          "their initialization")
    if outcome.changed:
        ctx.found.pop("driver_root", None)  # persistenced's socket: the cdi step looks again
    return outcome.changed
