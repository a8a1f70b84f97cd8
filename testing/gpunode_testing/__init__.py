"""gpunode's test and development support: never imported by gpunode, never shipped.

Installed into the development virtualenv by `make setup` (`pip install -e testing`), beside
gpunode itself; the sysext bundles only `gpunode` and what it imports. What lives here:

- `fixtures`: fixture hosts, a node's sysfs, /proc, /dev and /etc as files
  (`python -m gpunode_testing.fixtures build|list`).
- `boundary`: the test boundary guard, a pytest plugin (loaded by pyproject's addopts).
- `systemd_ns`: a real systemd as PID 1 of a PID+mount namespace; `boot_harness`: a fixture
  GPU node booted in it, Flatcar-shaped (the end-to-end test and `benchmarks/boot_path.py`).
- `kube_api`: a local TLS Kubernetes API server with NodeRestriction's rules, and its PKI.
- `configdoc`: the agent config's key table in docs/config.md, generated from gpunode.config.

The fetchers of real containerd binaries and of the kmod tree stay in tests/real/ (their cache
is keyed by the text of tests/real/kmod_tree.py).
"""
