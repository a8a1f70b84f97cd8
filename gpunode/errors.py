"""Every error gpunode reports, in one module that imports nothing of gpunode's. (A few
modules keep a private ValueError of their own that never leaves them: safeio.Refused,
schema.SchemaError; their callers turn it into one of these.)

Each carries what failed, where, and what to do (`hint`), and a stable kebab-case `code` that
operators, the boot record, `status --json` and `--log-format json` events carry: match the
code, never the wording (docs/errors.md lists them). `main()` turns any of them into one log
event and an exit code, so nothing below the CLI prints or exits on its own.

One hint mechanism: a class's `hint` is its default; a raise site that knows better passes
`hint=`.
"""

from __future__ import annotations

from collections.abc import Sequence


class GpunodeError(Exception):
    """Something gpunode was asked to do cannot be done; the message says why."""

    code: str = "error"
    hint: str = ""

    def __init__(self, message: str = "", hint: str = "") -> None:
        if hint:
            self.hint = hint
        super().__init__(message)


# -- the command line and the agent config (exit 2) ---------------------------------------------


class UsageError(GpunodeError):
    """The command line asks for something that cannot be done as asked."""

    code = "usage"


class ArgumentsError(UsageError):
    """argparse refused the command line; main() reports it like any usage error."""

    code = "usage-arguments"

    def __init__(self, message: str, usage: str, prog: str) -> None:
        self.usage = usage
        self.prog = prog
        super().__init__(message, hint=f"see '{prog} --help'")


class InputRefused(UsageError):
    """A file named on the command line cannot go into an Ignition snippet."""

    code = "ignition-input-refused"

    def __init__(self, path: str, reason: str, hint: str = "") -> None:
        self.path = path
        self.reason = reason
        super().__init__(f"{path}: {reason}", hint)


class ConfigError(GpunodeError):
    """The agent config file is unreadable or invalid."""

    code = "config-invalid"
    hint = ("correct the agent config (docs/config.md lists every key and its valid values), "
            "or name another file with --config")

    def __init__(self, file: str, key: str | None, reason: str, line: int | None = None) -> None:
        self.file = file
        self.key = key
        self.reason = reason
        self.line = line
        where = file if line is None else f"{file}:{line}"
        what = f"key '{key}': " if key else ""
        super().__init__(f"{where}: {what}{reason}")


class BakeConfigError(ConfigError):
    """The bake config of `gpunode image bake` is unreadable or invalid: file, key, line."""

    code = "bake-config-invalid"
    hint = ("correct the bake config (docs/cli.md, 'gpunode image bake', lists every key and "
            "its valid values)")


# -- the host ------------------------------------------------------------------------------------


class HostError(GpunodeError):
    """A read or write on the host tree failed: 'Failed to <op> '<path>': <reason>'."""

    code = "host-io-failed"

    def __init__(self, op: str, path: str, reason: str) -> None:
        self.op = op
        self.path = path
        self.reason = reason
        super().__init__(f"Failed to {op} '{path}': {reason}")


class LockTimeout(HostError):
    """Another process held a lock file (Host.lock) past the wait; `note` is what it wrote."""

    code = "lock-timeout"

    def __init__(self, path: str, note: str, waited: float) -> None:
        self.note = note
        self.waited = waited
        holder = f" ({note.strip()})" if note.strip() else ""
        super().__init__("lock", path, f"another process{holder} holds it; gave up after "
                         f"waiting {waited:g} s")


class FileError(GpunodeError):
    """A file's content is refused: '<file>[:<line>]: <reason>', and what to do about it."""

    code = "file-refused"

    def __init__(self, file: str, reason: str, line: int | None = None, hint: str = "") -> None:
        self.file = file
        self.reason = reason
        self.line = line
        super().__init__(f"{file}{'' if line is None else f':{line}'}: {reason}", hint)


class RecordError(GpunodeError, ValueError):
    """gpunode's own record of a boot exists but cannot be understood."""

    code = "boot-record-invalid"
    hint = "run 'gpunode boot' again to rewrite it"


class BakeManifestError(RecordError):
    """The bake manifest /etc/gpunode/baked.json exists but cannot be understood."""

    code = "bake-manifest-invalid"
    hint = "bake the image again ('gpunode image bake') to rewrite it"


class LockBusy(GpunodeError):
    """Another gpunode command holds the node lock past the wait."""

    code = "node-lock-busy"


class CommandFailed(GpunodeError):
    """'<argv>' <what happened>: <last stderr lines>. `returncode` is None when the program
    never exited on its own: it could not be started, ran too long, or was not run at all."""

    code = "command-failed"

    def __init__(self, argv: Sequence[str], returncode: int | None, stderr: str,
                 how: str | None = None) -> None:
        self.argv = list(argv)
        self.returncode = returncode
        self.stderr = stderr
        status = how or ("was not run" if returncode is None else f"exited {returncode}")
        tail = stderr.strip().splitlines()[-3:]
        super().__init__(f"'{' '.join(self.argv)}' {status}" + (f": {' / '.join(tail)}"
                                                                  if tail else ""))


class SystemdError(GpunodeError):
    """A request to systemd failed: which unit, what was asked, and what systemd said."""

    code = "systemd-request-failed"

    def __init__(self, unit: str, action: str, reason: str, hint: str = "") -> None:
        self.unit = unit
        self.action = action
        self.reason = reason
        super().__init__(f"Failed to {action} '{unit}': {reason}",
                         hint or f"see 'systemctl status {unit}' and 'journalctl -u {unit}'")


class Unavailable(SystemdError):
    """No service manager answers on the system bus (the cause is in the message)."""

    code = "systemd-unavailable"


# -- the pipeline's steps ------------------------------------------------------------------------


class ConflictError(GpunodeError):
    """Something else on the node installs the driver (Flatcar's nvidia.service)."""

    code = "preflight-conflict"


class UndecidedError(GpunodeError):
    """A PCI function may be a GPU nobody can identify: gpunode decides nothing."""

    code = "gpu-undecided"
    hint = ("check the device with 'lspci -nn -vvv -s ADDRESS' and the kernel log; gpunode "
            "decides nothing while a function may be an unreadable GPU")


class DriverError(GpunodeError):
    """The driver step cannot go on; the message says why."""

    code = "driver-unavailable"


class MissingMajor(DriverError):
    """/proc/devices lacks a major the driver should have registered, or the driver names a
    device number the kernel cannot have; the message says which."""

    code = "driver-devices-unregistered"
    hint = ("the NVIDIA modules did not register their devices; see 'dmesg | grep NVRM'")


class FlavourError(GpunodeError):
    """No driver flavour (open or proprietary modules) fits the GPUs as configured."""

    code = "driver-flavour-unsuitable"


class LoadError(GpunodeError):
    """A kernel module did not load; carries what the kernel said."""

    code = "driver-load-failed"
    hint = ("check that the modules match the running kernel and that Secure Boot accepts "
            "them ('dmesg | grep -i nvrm')")

    def __init__(self, module: str, cause: str, kernel_says: list[str]) -> None:
        self.module = module
        self.kernel_says = kernel_says
        said = f"; kernel: {' | '.join(kernel_says)}" if kernel_says else ""
        super().__init__(f"Failed to load '{module}': {cause}{said}")


class DriverBuildError(GpunodeError):
    """Building or caching the driver failed: 'Failed to <verb> '<object>': <cause>'."""

    code = "driver-build-failed"

    def __init__(self, verb: str, obj: str, cause: str, hint: str = "") -> None:
        self.verb = verb
        self.obj = obj
        self.cause = cause
        super().__init__(f"Failed to {verb} '{obj}': {cause}", hint)


class ExtractedFileError(DriverBuildError):
    """A build left driver user-space gpunode refuses to cache (a link out of the entry, a FIFO,
    a file too large, no libcuda); names the file and what is wrong with it."""

    code = "driver-build-userspace-refused"


class ModuleRefused(DriverError):
    """A kernel module about to be loaded does not fit this node (its .modinfo names another
    kernel, flavour or version than the node's): names the file and both values; nothing was
    loaded."""

    code = "driver-module-refused"

    def __init__(self, path: str, what: str, found: str, wanted: str, hint: str = "") -> None:
        self.path = path
        self.what = what
        self.found = found
        self.wanted = wanted
        super().__init__(f"Refused to load '{path}': its {what} is {found}, {wanted}", hint)


class FirmwarePathError(DriverError):
    """The modules about to load need firmware the kernel would not find, and the kernel's
    firmware search path (firmware_class.path) is set by someone else (or missing), so gpunode
    cannot point it at the firmware that came with the modules."""

    code = "driver-firmware-path-taken"


class FirmwareMissing(DriverError):
    """A module about to load names firmware that neither the kernel's firmware search nor the
    modules' own firmware directory has: names the module file and the firmware."""

    code = "driver-firmware-missing"


class NvidiaSmiError(DriverError):
    """With the GPU Operator: its validator would find no nvidia-smi of the loaded driver, or
    another one first (driver/smilink.py)."""

    code = "nvidia-smi-unreachable"
    hint = ("the GPU Operator's validator runs the first nvidia-smi in /usr/bin, /usr/sbin, "
            "/bin, /sbin, /opt/bin: remove the one that is not the loaded driver's")


class DeviceMinorCollision(DriverError):
    """The driver names one device minor for several GPUs: which /dev/nvidiaN is which GPU
    cannot be told, so no CDI spec is written (a pod must never get another GPU than it asked
    for)."""

    code = "driver-device-minor-ambiguous"
    hint = ("the driver's information files of these GPUs contradict each other: look for "
            "NVRM errors in 'dmesg', reload the NVIDIA modules or reboot the node")


class GpuInitError(GpunodeError):
    """GPUs the driver sees did not initialize (no UUID yet, or RmInitAdapter failed): each
    named by its PCI address, with what the kernel or the attempt said."""

    code = "gpu-init-failed"
    hint = ("look at the kernel log ('dmesg | grep NVRM'): a GPU whose RmInitAdapter fails needs "
            "a reset or a reboot (and, on a VM, maybe another host); status and GPUReady say "
            "not ready until it is up")

    def __init__(self, not_ready: dict[str, str], hint: str = "") -> None:
        self.not_ready = dict(not_ready)
        gpus = "GPU" if len(not_ready) == 1 else f"{len(not_ready)} GPUs"
        said = "; ".join(f"{address}: {why}" for address, why in sorted(not_ready.items()))
        super().__init__(f"{gpus} not initialized: {said}", hint)


class ContainerdStepError(GpunodeError):
    """The container runtime step cannot go on; the message says why."""

    code = "containerd-step-failed"


class LedgerError(ContainerdStepError):
    """gpunode's ledger of its containerd changes cannot be used; names the file and key."""

    code = "containerd-ledger-invalid"


class JournalError(ContainerdStepError):
    """An interrupted containerd change cannot be rolled back safely; names the file."""

    code = "containerd-journal-unrecoverable"


class ContainerdConfigError(FileError):
    """containerd's config cannot be read or understood; carries file, line and reason."""

    code = "containerd-config-invalid"


class EditError(FileError):
    """containerd's config cannot be edited safely; file and line when known, and why."""

    code = "containerd-config-uneditable"


class BakeError(GpunodeError):
    """An artifact of `gpunode image bake` cannot be fetched or is not the one the bake config
    pins (its sha512 differs); nothing of the bake was placed."""

    code = "bake-failed"

    def __init__(self, what: str, source: str, reason: str, hint: str = "") -> None:
        self.what = what
        self.source = source
        self.reason = reason
        super().__init__(f"Failed to bake {what} from '{source}': {reason}", hint)


class BakeArchiveError(BakeError):
    """A prebuilt module set's archive holds a member `gpunode image bake` refuses to unpack
    (an absolute name, `..`, a link, a device or FIFO, a file too large) or is no tar archive;
    names the member, and nothing of the archive was placed."""

    code = "bake-archive-refused"


# -- Kubernetes ----------------------------------------------------------------------------------


class ApiError(GpunodeError):
    """The API server answered with an error, or could not be reached."""

    code = "kube-api-failed"

    def __init__(self, what: str, status: int | None, message: str, hint: str = "") -> None:
        self.status = status
        self.message = message
        answer = "no answer" if status is None else f"HTTP {status}"
        super().__init__(f"Failed to {what}: {answer}: {message}", hint)

    @property
    def retryable(self) -> bool:
        """Worth trying again: unreachable, overloaded, or the Node not registered yet."""
        return self.status is None or self.status in (404, 409, 429) or self.status >= 500


class ReplyError(ApiError):
    """The API server answered, but not with the object asked for (a proxy's HTML page, a list
    where a Node belongs, labels that are not a map): never retried, never guessed at."""

    code = "kube-api-reply-invalid"

    def __init__(self, what: str, url: str, problem: str) -> None:
        super().__init__(what, 200, f"the reply from {url} {problem}",
                         "is kubernetes.kubeconfig's server the API server itself (not a proxy "
                         "or another service)?")

    @property
    def retryable(self) -> bool:
        return False


class KubeconfigError(GpunodeError):
    """The kubeconfig (or a file it names) cannot be used: the file's fault, so waiting for the
    API server cannot help; the default hint says to fix or regenerate it."""

    code = "kubeconfig-invalid"

    def __init__(self, path: str, reason: str, hint: str = "") -> None:
        self.path = path
        self.reason = reason
        self.given_hint = hint  # the raise site's own, without the kubelet default below
        # kubeadm: 'kubeadm join' (its kubelet-start phase) has the kubelet TLS-bootstrap and
        # write /etc/kubernetes/kubelet.conf; 'kubeadm init phase kubeconfig kubelet' writes it
        # on a control-plane node (kubernetes.io/docs/reference/setup-tools/kubeadm/generated/).
        super().__init__(f"{path}: {reason}", hint or (
            f"fix {path} or regenerate it (kubeadm writes the kubelet's kubeconfig when the "
            "node joins: 'kubeadm join'), or point kubernetes.kubeconfig at the kubelet's "
            "kubeconfig; retrying does not help while the file is wrong"))


class NodesKubeconfigError(KubeconfigError, UsageError):
    """`gpunode nodes`: the operator's kubeconfig is missing or cannot be used (exit 2, as an
    agent config is: the command's own input, refused before the API server is asked)."""

    code = "nodes-kubeconfig-invalid"

    def __init__(self, path: str, reason: str, hint: str = "") -> None:
        super().__init__(path, reason, hint or (
            f"fix {path}, or name another with --kubeconfig FILE ('kubectl config view "
            "--minify --flatten' writes the current context's as one file)"))


class NodeNameError(GpunodeError):
    """Nobody can say what this node is called in Kubernetes."""

    code = "node-name-unknown"
    hint = "set kubernetes.node_name in the agent config"

    def __init__(self, message: str = "cannot tell this node's name: no --hostname-override "
                 "for the kubelet and no hostname") -> None:
        super().__init__(message)
