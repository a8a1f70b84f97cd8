#!/bin/bash
# Bake gpunode into the Flatcar machine this runs on: the provisioner step of an image build
# (Packer's shell provisioner, Ansible's script module; docs/image-bake.md).
#
#   sudo bake-in-vm.sh --config bake.toml --gpunode-sysext gpunode-0.1.0-x86-64.raw [--reset]
#
# Which gpunode bakes: the bundled one of --gpunode-sysext (Flatcar has no Python). The image
# is merged for the bake alone from /run/extensions (a tmpfs: gone at the next boot) and taken
# out again afterwards, also when the bake fails; `systemd-sysext refresh` then merges what the
# disk says, the baked images included. The bake itself writes /etc and /opt only, starts and
# loads nothing. The bake config's [gpunode] source is usually that same file.
#
# --reset stages Flatcar's selective OS reset (flatcar-reset, from flatcar/init) for the next
# boot, which is the first boot of every node made from the image: the build machine's own
# state (its Ignition result, SSH host keys, machine ID, logs) is discarded and Ignition runs
# again, and only the paths the bake placed are kept. Without it, the image pipeline must do
# its own clean-up (and keep those paths).
set -euo pipefail

# What `gpunode image bake` places (docs/cli.md, "What goes where"), the optional build cache
# (/opt/gpunode) and prebuilt sets (/opt/nvidia/modules, the default driver.prebuilt_dirs) too.
BAKED_PATHS=(
    /etc/gpunode
    /etc/extensions
    /etc/flatcar/sysext
    /etc/flatcar/enabled-sysext.conf
    /opt/extensions
    /etc/systemd/system/nvidia.service
    /etc/systemd/system/multi-user.target.wants/gpunode.service
    /etc/systemd/system/multi-user.target.wants/gpunode-label.service
    /etc/systemd/system/multi-user.target.wants/gpunode-watch.service
    /opt/gpunode
    /opt/nvidia/modules
    /etc/modprobe.d/blacklist-nouveau.conf
)

usage() {
    { printf 'usage: '; sed -n '5p' "$0" | sed 's/^#  *//'; } >&2
    exit 2
}
fail() { echo "bake-in-vm: $1" >&2; exit "${2:-1}"; }

CONFIG="" SYSEXT="" RESET=""
while [ $# -gt 0 ]; do
    case "$1" in
        --config) CONFIG="${2-}"; shift 2 || usage ;;
        --gpunode-sysext) SYSEXT="${2-}"; shift 2 || usage ;;
        --reset) RESET=1; shift ;;
        -h|--help) usage ;;
        *) echo "bake-in-vm: unknown argument '$1'" >&2; usage ;;
    esac
done
if [ -z "$CONFIG" ] || [ -z "$SYSEXT" ]; then usage; fi
[ -f "$CONFIG" ] || fail "--config $CONFIG: not a file" 2
[ -f "$SYSEXT" ] || fail "--gpunode-sysext $SYSEXT: not a file" 2
[ "$(id -u)" = 0 ] || fail "must run as root (sudo)" 2
# shellcheck disable=SC1091 # the machine's own os-release
OS_ID=$(. /usr/lib/os-release && echo "${ID-}")
[ "$OS_ID" = flatcar ] || fail "this machine is not Flatcar (ID=$OS_ID in /usr/lib/os-release)" 2
if [ -n "$RESET" ] && ! command -v flatcar-reset >/dev/null; then
    fail "--reset needs flatcar-reset (Flatcar releases since 2023); without it, clean up yourself" 2
fi

STAGED=/run/extensions/gpunode.raw
[ ! -e "$STAGED" ] || fail "$STAGED exists: another bake runs, or an earlier one left it"
cleanup() {
    local status=$?
    trap - EXIT INT TERM
    if [ -e "$STAGED" ]; then
        rm -f "$STAGED"
        systemd-sysext refresh >/dev/null || status=1
    fi
    exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

mkdir -p /run/extensions
cp "$SYSEXT" "$STAGED"
systemd-sysext refresh >/dev/null
/usr/bin/gpunode image bake --root / --config "$CONFIG"

if [ -n "$RESET" ]; then
    flatcar-reset --keep-paths "${BAKED_PATHS[@]}"
fi
