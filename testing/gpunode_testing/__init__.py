"""gpunode's test and development support: never imported by gpunode, never shipped.

Installed into the development virtualenv by `make setup` (`pip install -e testing`), beside
gpunode itself; the sysext bundles only `gpunode` and what it imports. What lives here:

- `fixtures`: fixture hosts, a node's sysfs, /proc, /dev and /etc as files
  (`python -m gpunode_testing.fixtures build|list`).
- `systemd_ns`: a real systemd as PID 1 of a PID+mount namespace; `boot_harness`: a fixture
  GPU node booted in it, Flatcar-shaped (the end-to-end test and `benchmarks/boot_path.py`).
- `kube_api`: a local TLS Kubernetes API server with NodeRestriction's rules, and its PKI.
- `containerd_bins`, `fetch_containerd`: real containerd 1.6/1.7/2.1 binaries in the test cache.
- `kmod_tree`, `fetch_kmod_tree`: Debian's kernel modules plus NVIDIA stand-ins for real kmod tools.
- `configdoc`: the agent config's key table in docs/config.md, generated from gpunode.config.
"""
