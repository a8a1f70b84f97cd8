"""gpunode: make a Flatcar node with NVIDIA GPUs a ready Kubernetes GPU node at boot."""

__version__ = "0.1.0"
