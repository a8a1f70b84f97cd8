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
# kernel/ (proprietary, grid) or kernel-open/ (open) are built with the kernel's kbuild
# (split source and output trees as NVIDIA's Makefile takes them: SYSSRC, SYSOUT), stripped
# of debug info and copied to /out. The extracted tree has the 64-bit libraries (lib*.so.V), the binaries and
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

# tree_release DIR: the kernel release that modules built against the kernel tree DIR carry
# in their vermagic: UTS_RELEASE of include/generated/utsrelease.h (Debian's headers say the
# upstream version, 6.1.176, in include/config/kernel.release and 6.1.0-50-amd64 there), else
# include/config/kernel.release.
tree_release() {
  if [ -f "$1/include/generated/utsrelease.h" ]; then
    sed -n 's/^#define UTS_RELEASE "\(.*\)"$/\1/p' "$1/include/generated/utsrelease.h"
  elif [ -f "$1/include/config/kernel.release" ]; then
    cat "$1/include/config/kernel.release"
  fi
}

# in_root PATH: PATH with an absolute link target taken under $root (in the container $root
# is empty), then resolved to the directory it names.
in_root() {
  local path="$1" target
  if [ -L "$path" ]; then
    target="$(readlink "$path")"
    case "$target" in
      /*) path="$root$target" ;;
      *) path="$(dirname "$path")/$target" ;;
    esac
  fi
  if [ -d "$path" ]; then (cd "$path" && pwd -P); fi
}

# The kernel's trees as NVIDIA's Makefile finds them for `uname -r` (kernel-open/Makefile):
# the source tree SYSSRC is <modlib>/source, else <modlib>/build/source, else <modlib>/build;
# the output tree SYSOUT is <modlib>/build. One tree (Flatcar's developer container:
# /usr/src/linux too) is both; Debian and Ubuntu split them (linux-headers-<abi>-common holds
# the sources, linux-headers-<release> the configured output tree).
sysrc="" sysout="" seen=""
for modlib in "$root/lib/modules/$kernel" "$root/usr/lib/modules/$kernel" ""; do
  if [ -n "$modlib" ]; then
    out_tree="$(in_root "$modlib/build")"
    src_tree="$(in_root "$modlib/source")"
    [ -z "$out_tree" ] || [ -n "$src_tree" ] || src_tree="$(in_root "$out_tree/source")"
    where="$modlib/build"
  else
    out_tree="$(in_root "$root/usr/src/linux")"
    src_tree=""
    where="$root/usr/src/linux"
  fi
  [ -n "$out_tree" ] || continue
  release="$(tree_release "$out_tree")"
  if [ "$release" = "$kernel" ]; then
    sysout="$out_tree"
    sysrc="${src_tree:-$out_tree}"
    break
  fi
  seen="$seen; $where is for kernel ${release:-(neither include/generated/utsrelease.h nor include/config/kernel.release names one)}"
done
if [ -z "$sysout" ]; then
  if [ -n "$seen" ]; then
    echo "no build tree for kernel $kernel in this developer container${seen}"
  else
    echo "no build tree for kernel $kernel in this developer container: none of" \
         "$root/lib/modules/$kernel/build, $root/usr/lib/modules/$kernel/build," \
         "$root/usr/src/linux is there (it has modules for:" \
         "$(find "$root/lib/modules" "$root/usr/lib/modules" -mindepth 1 -maxdepth 1 \
             -printf '%f ' 2>/dev/null))"
  fi
  exit 3
fi
echo "kernel $kernel: SYSSRC=$sysrc SYSOUT=$sysout"

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
make -C "$src/$tree" SYSSRC="$sysrc" SYSOUT="$sysout" -j"$(nproc)" modules
# Without their debug info, as distributions ship modules (the open nvidia.ko: 235 MB
# compiled, 13 MB stripped); .modinfo, symbols and relocations stay.
for module in "$src/$tree"/*.ko; do
  strip --strip-debug -o "$out/$(basename "$module")" "$module"
  echo "$(basename "$module"): $(stat -c %s "$module") bytes, $(stat -c %s "$out/$(basename "$module")") stripped"
done
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
