#!/bin/bash
# build.sh KERNEL FLAVOUR: gpunode's package data (gpunode/driver/build.sh), written into the
# build's work dir by NspawnBuilder (gpunode/driver/builders.py) and run inside the Flatcar
# developer container, which has the kernel build tree of its Flatcar release.
#   /work  this script, the NVIDIA installer (nvidia-installer.run), userspace.list (written by
#          gpunode/driver/build.py: "version V", then "lib NAME" and "bin NAME" lines) and
#          build.log
#   /out   the cache entry being staged: the built *.ko files, flat, and the driver's
#          user-space from the same installer in lib/, bin/ and firmware/nvidia/V/
# The installer is only unpacked (--extract-only: nothing is installed); the modules of
# kernel/ (proprietary, grid) or kernel-open/ (open) are built with the kernel's kbuild and
# copied to /out. The extracted tree has the 64-bit libraries (lib*.so.V), the binaries and
# firmware/gsp_*.bin at its top and the 32-bit libraries in 32/ (not taken): the layout
# flatcar/scripts reads, see gpunode/driver/extracted.py. Only regular files are copied (a
# link in the extracted tree is skipped, never followed); `ldconfig -n` makes the SONAME links
# in lib/ as ldconfig does on an installed system. gpunode checks and checksums all of it
# before the entry is published.
# Everything goes to /work/build.log; on failure its tail goes to stderr too.
# GPUNODE_BUILD_ROOT (unset in the container) prefixes the kernel tree's paths, and
# GPUNODE_BUILD_WORK and GPUNODE_BUILD_OUT replace /work and /out: tests run the script as it
# is, outside a container, on trees of their own.
set -euo pipefail
kernel="$1"
flavour="$2"
root="${GPUNODE_BUILD_ROOT:-}"
work="${GPUNODE_BUILD_WORK:-$root/work}"
out="${GPUNODE_BUILD_OUT:-$root/out}"
exec 3>&2 >"$work/build.log" 2>&1
on_exit() {
  local rc=$?
  if [ "$rc" -ne 0 ]; then tail -n 20 "$work/build.log" >&3; fi
}
trap on_exit EXIT

case "$flavour" in
  open) tree="kernel-open" ;;
  proprietary|grid) tree="kernel" ;;
  *) echo "unknown flavour '$flavour' (open, proprietary or grid)"; exit 2 ;;
esac

sysrc=""
for candidate in "$root/lib/modules/$kernel/build" "$root/usr/lib/modules/$kernel/build" \
                 "$root/usr/src/linux"; do
  if [ -f "$candidate/include/config/kernel.release" ] &&
     [ "$(cat "$candidate/include/config/kernel.release")" = "$kernel" ]; then
    sysrc="$candidate"
    break
  fi
done
if [ -z "$sysrc" ]; then
  echo "no prepared build tree for kernel $kernel in this developer container" \
       "(it has: $(find "$root/lib/modules" -mindepth 1 -maxdepth 1 -printf '%f ' 2>/dev/null))"
  exit 3
fi

version="$(sed -n 's/^version //p' "$work/userspace.list")"
if [ -z "$version" ]; then
  echo "$work/userspace.list names no driver version"
  exit 4
fi

rm -rf "$work/extract"
mkdir "$work/extract"
cd "$work/extract"
sh "$work/nvidia-installer.run" --extract-only
src="$(find "$work/extract" -mindepth 1 -maxdepth 1 -type d | head -n 1)"
make -C "$src/$tree" SYSSRC="$sysrc" -j"$(nproc)" modules
cp "$src/$tree"/*.ko "$out/"
echo "built for $kernel ($flavour): $(cd "$out" && echo *.ko)"

# copy_regular FILE DIR: FILE into DIR when it is a regular file (not a link, FIFO, device).
copy_regular() {
  if [ -L "$1" ] || [ ! -f "$1" ]; then
    if [ -e "$1" ] || [ -L "$1" ]; then echo "skipped $1: not a regular file"; fi
    return 0
  fi
  cp --no-dereference --preserve=mode "$1" "$2/"
}

mkdir -p "$out/lib" "$out/bin" "$out/firmware/nvidia/$version"
while read -r kind name; do
  case "$kind" in
    lib) copy_regular "$src/$name.so.$version" "$out/lib" ;;
    bin) copy_regular "$src/$name" "$out/bin" ;;
  esac
done <"$work/userspace.list"
for firmware in "$src"/firmware/gsp*.bin; do
  if [ -e "$firmware" ] || [ -L "$firmware" ]; then
    copy_regular "$firmware" "$out/firmware/nvidia/$version"
  fi
done
ldconfig -n "$out/lib"
echo "user-space of $version: $(cd "$out" && find lib bin firmware -mindepth 1 -printf '%P ')"
