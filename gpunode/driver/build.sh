#!/bin/bash
# build.sh KERNEL FLAVOUR: gpunode's package data (gpunode/driver/build.sh), written into the
# build's work dir by NspawnBuilder (gpunode/driver/builders.py) and run inside the Flatcar
# developer container, which has the kernel build tree of its Flatcar release.
#   /work  this script, the NVIDIA installer (nvidia-installer.run) and build.log
#   /out   where the built *.ko files go, flat (the cache entry being staged)
# The installer is only unpacked (--extract-only: nothing is installed); the modules of
# kernel/ (proprietary, grid) or kernel-open/ (open) are built with the kernel's kbuild and
# copied to /out. Everything goes to /work/build.log; on failure its tail goes to stderr too.
set -euo pipefail
kernel="$1"
flavour="$2"
exec 3>&2 >/work/build.log 2>&1
on_exit() {
  local rc=$?
  if [ "$rc" -ne 0 ]; then tail -n 20 /work/build.log >&3; fi
}
trap on_exit EXIT

case "$flavour" in
  open) tree="kernel-open" ;;
  proprietary|grid) tree="kernel" ;;
  *) echo "unknown flavour '$flavour' (open, proprietary or grid)"; exit 2 ;;
esac

sysrc=""
for candidate in "/lib/modules/$kernel/build" "/usr/lib/modules/$kernel/build" /usr/src/linux; do
  if [ -f "$candidate/include/config/kernel.release" ] &&
     [ "$(cat "$candidate/include/config/kernel.release")" = "$kernel" ]; then
    sysrc="$candidate"
    break
  fi
done
if [ -z "$sysrc" ]; then
  echo "no prepared build tree for kernel $kernel in this developer container" \
       "(it has: $(find /lib/modules -mindepth 1 -maxdepth 1 -printf '%f ' 2>/dev/null))"
  exit 3
fi

rm -rf /work/extract
mkdir /work/extract
cd /work/extract
sh "/work/nvidia-installer.run" --extract-only
src="$(find /work/extract -mindepth 1 -maxdepth 1 -type d | head -n 1)"
make -C "$src/$tree" SYSSRC="$sysrc" -j"$(nproc)" modules
cp "$src/$tree"/*.ko /out/
echo "built for $kernel ($flavour): $(cd /out && echo *.ko)"
