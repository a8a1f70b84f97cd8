"""containerd: where its config is, and how the nvidia runtime lives in it."""

from gpunode.errors import GpunodeError


class ContainerdStepError(GpunodeError):
    """The container runtime step cannot go on; the message says why."""
