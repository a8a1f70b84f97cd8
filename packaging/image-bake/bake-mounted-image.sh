#!/bin/bash
# Bake gpunode (and a Flatcar driver sysext) into flatcar_production_image.bin on a Linux build
# host, without booting it: attach the image, mount its ROOT partition with USR-A read-only on
# ROOT/usr, run `gpunode image bake --root` on it, and detach everything again, also when a
# step fails or the script is interrupted. Guide: docs/image-bake.md.
#
#   sudo bake-mounted-image.sh --image flatcar_production_image.bin --config bake.toml \
#       [--gpunode-sysext gpunode-0.1.0-x86-64.raw | --gpunode PROGRAM]
#
# Which gpunode bakes: with --gpunode-sysext, the bundled one inside that system extension
# (unsquashfs'd into a temporary directory: a bundle with its own Python, glibc
# 2.36 or newer on the host), so the gpunode that bakes is the one baked; otherwise --gpunode
# PROGRAM, or `gpunode` on PATH (pip install of gpunode's wheel into a virtualenv).
#
# Partitions (flatcar/scripts build_library/disk_layout.json): 3 USR-A (/usr, read-only,
# btrfs in current releases), 9 ROOT (ext4, /). They are found by their GPT names and attached
# as loop devices at their offsets (losetup --offset --sizelimit, the offsets read by partx),
# not with `losetup --partscan`: that needs the kernel to parse GPT and /dev to get the
# partition nodes, which containers and some CI runners do not give.
#
# Needs root, util-linux (losetup, partx, mount, umount, mountpoint), and unsquashfs
# (squashfs-tools) for --gpunode-sysext. A .bin.bz2 must be decompressed first; a qcow2 image
# converted (qemu-img convert -f qcow2 -O raw). Exit status: the bake's, or 2 for bad
# arguments, 1 for a failed step; nothing stays mounted or attached either way.
set -euo pipefail

usage() {
    { printf 'usage: '; sed -n '7,8p' "$0" | sed 's/^#  *//'; } >&2
    exit 2
}

IMAGE="" CONFIG="" GPUNODE="" SYSEXT=""
while [ $# -gt 0 ]; do
    case "$1" in
        --image) IMAGE="${2-}"; shift 2 || usage ;;
        --config) CONFIG="${2-}"; shift 2 || usage ;;
        --gpunode) GPUNODE="${2-}"; shift 2 || usage ;;
        --gpunode-sysext) SYSEXT="${2-}"; shift 2 || usage ;;
        -h|--help) usage ;;
        *) echo "bake-mounted-image: unknown argument '$1'" >&2; usage ;;
    esac
done
fail() { echo "bake-mounted-image: $1" >&2; exit "${2:-1}"; }
if [ -z "$IMAGE" ] || [ -z "$CONFIG" ]; then usage; fi
[ -f "$IMAGE" ] || fail "--image $IMAGE: not a file (decompress a .bin.bz2 first)" 2
[ -f "$CONFIG" ] || fail "--config $CONFIG: not a file" 2
[ -z "$GPUNODE" ] || [ -z "$SYSEXT" ] || fail "give --gpunode or --gpunode-sysext, not both" 2
[ "$(id -u)" = 0 ] || fail "must run as root (it attaches and mounts the image)" 2
CONFIG=$(realpath "$CONFIG")

WORK="" MNT="" ROOT_LOOP="" USR_LOOP="" MADE_USR="" HAD_RUN=""
cleanup() {
    local status=$? problem=0
    trap - EXIT INT TERM
    if [ -n "$MNT" ]; then
        # The bake's node lock (<root>/run/gpunode/lock, docs/cli.md "The node lock") is of no
        # use in an image, whose /run is a tmpfs at boot: take it out again.
        if mountpoint -q "$MNT"; then
            rm -f "$MNT/run/gpunode/lock"
            rmdir "$MNT/run/gpunode" 2>/dev/null || :
            if [ -z "$HAD_RUN" ]; then rmdir "$MNT/run" 2>/dev/null || :; fi
        fi
        if mountpoint -q "$MNT/usr"; then umount "$MNT/usr" || problem=1; fi
        if [ -n "$MADE_USR" ]; then rmdir "$MNT/usr" || problem=1; fi
        if mountpoint -q "$MNT"; then umount "$MNT" || problem=1; fi
        rmdir "$MNT" || problem=1
    fi
    for loop in "$USR_LOOP" "$ROOT_LOOP"; do
        if [ -n "$loop" ]; then losetup -d "$loop" || problem=1; fi
    done
    if [ -n "$WORK" ]; then rm -rf "$WORK"; fi
    if [ "$problem" != 0 ]; then
        echo "bake-mounted-image: cleanup failed: check 'findmnt' and 'losetup -a'" >&2
        [ "$status" != 0 ] || status=1
    fi
    exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# The partition named $1 (GPT name): "START SECTORS" in 512-byte sectors.
partition() {
    local start sectors name
    while read -r start sectors name; do
        if [ "$name" = "$1" ]; then echo "$start $sectors"; return 0; fi
    done < <(partx --noheadings --output START,SECTORS,NAME "$IMAGE")
    fail "$IMAGE has no GPT partition named $1: not a Flatcar disk image (partx --show $IMAGE)"
}

attach() {  # attach FLAGS PARTITION-NAME → the loop device
    local flags="$1" where start sectors
    where=$(partition "$2") || exit 1
    read -r start sectors <<<"$where"
    # shellcheck disable=SC2086 # $flags is empty or --read-only
    losetup --find --show $flags --offset $((start * 512)) --sizelimit $((sectors * 512)) \
        "$IMAGE"
}

WORK=$(mktemp -d)
if [ -n "$SYSEXT" ]; then
    [ -f "$SYSEXT" ] || fail "--gpunode-sysext $SYSEXT: not a file" 2
    unsquashfs -no-progress -quiet -d "$WORK/sysext" "$SYSEXT" >/dev/null
    GPUNODE="$WORK/sysext/usr/lib/gpunode/gpunode"
    [ -x "$GPUNODE" ] || fail "$SYSEXT holds no usr/lib/gpunode/gpunode: not gpunode's sysext" 2
elif [ -z "$GPUNODE" ]; then
    GPUNODE=$(command -v gpunode) || fail "no gpunode on PATH: give --gpunode-sysext RAW or \
--gpunode PROGRAM" 2
fi

ROOT_LOOP=$(attach "" ROOT)
USR_LOOP=$(attach --read-only USR-A)
MNT=$(mktemp -d -p "${TMPDIR:-/tmp}" gpunode-bake.XXXXXX)
mount "$ROOT_LOOP" "$MNT"
if [ ! -d "$MNT/usr" ]; then
    mkdir "$MNT/usr"  # the mount point only; removed again before detaching
    MADE_USR=1
fi
mount -o ro "$USR_LOOP" "$MNT/usr"
if [ -d "$MNT/run" ]; then HAD_RUN=1; fi

"$GPUNODE" image bake --root "$MNT" --config "$CONFIG"
sync
