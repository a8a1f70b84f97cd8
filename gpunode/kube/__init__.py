"""Kubernetes: the node describes itself (labels, GPUReady) with the kubelet's identity."""
