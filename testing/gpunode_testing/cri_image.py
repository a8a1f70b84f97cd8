"""A container image built here, for containerd's CRI: busybox-static in an OCI image layout.

    build_image(tmp / "busybox.tar", IMAGE)        # then: ctr -n k8s.io images import
    image_layout(path, layer, env, entrypoint, name)  # any one-layer image (cuda_probe's)

No registry can be reached from the tests, and CRI runs nothing but images from its image
store, so the image is made locally and imported with containerd's own `ctr images import`.
The tar is an OCI image layout (image-spec's image-layout.md: `oci-layout`, `index.json`,
`blobs/sha256/…`) with one uncompressed layer: /bin/busybox (Debian's busybox-static: no
dynamic loader needed) and a link per applet, and the few directories a runtime mounts over.
The index names the image both ways ctr reads a name (`org.opencontainers.image.ref.name` and
`io.containerd.image.name`). The same image serves as the pod sandbox ("pause": it sleeps) and
as every container. Its environment is a CUDA image's: NVIDIA's CUDA images put
/usr/local/nvidia/bin on PATH and /usr/local/nvidia/lib64 on LD_LIBRARY_PATH, where gpunode's
hook-free CDI spec mounts the driver's binaries and libraries (gpunode/cdi/spec.py).

The bytes are reproducible (fixed mtimes, owners, order), so the digest is the same every run.
"""

from __future__ import annotations

import hashlib
import io
import json
import subprocess
import tarfile
from collections.abc import Sequence
from pathlib import Path

BUSYBOX = Path("/bin/busybox")  # busybox-static's (gpunode_testing.podman checks it is static)
IMAGE = "localhost/gpunode-test/busybox:1"
DIRECTORIES = ("bin", "dev", "etc", "proc", "run", "sys", "tmp", "usr", "var")
ENV = ("PATH=/usr/local/nvidia/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
       "LD_LIBRARY_PATH=/usr/local/nvidia/lib64")
SANDBOX_COMMAND = ("/bin/sleep", "2147483647")  # the pause container's job: stay
MEDIA_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
MEDIA_CONFIG = "application/vnd.oci.image.config.v1+json"
MEDIA_LAYER = "application/vnd.oci.image.layer.v1.tar"


def build_image(path: Path, name: str = IMAGE) -> str:
    """Write the image layout tar to `path`; return the manifest's digest."""
    return image_layout(path, _layer(), ENV, SANDBOX_COMMAND, name)


def image_layout(path: Path, layer: bytes, env: Sequence[str], entrypoint: Sequence[str],
                 name: str) -> str:
    """Write an OCI image layout tar of one uncompressed `layer` (a tar's bytes) to `path`,
    named `name` both ways ctr reads a name; return the manifest's digest."""
    config = _json({"architecture": "amd64", "os": "linux",
                    "config": {"Env": list(env), "Entrypoint": list(entrypoint)},
                    "rootfs": {"type": "layers", "diff_ids": [_digest(layer)]}})
    manifest = _json({"schemaVersion": 2, "mediaType": MEDIA_MANIFEST,
                      "config": _descriptor(MEDIA_CONFIG, config),
                      "layers": [_descriptor(MEDIA_LAYER, layer)]})
    index = _json({"schemaVersion": 2, "manifests": [{
        **_descriptor(MEDIA_MANIFEST, manifest),
        "annotations": {"org.opencontainers.image.ref.name": name,
                        "io.containerd.image.name": name}}]})
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        _add_dir(tar, "blobs")
        _add_dir(tar, "blobs/sha256")
        for blob in (layer, config, manifest):
            _add_file(tar, "blobs/sha256/" + _digest(blob).removeprefix("sha256:"), blob)
        _add_file(tar, "index.json", index)
        _add_file(tar, "oci-layout", _json({"imageLayoutVersion": "1.0.0"}))
    return _digest(manifest)


def _layer() -> bytes:
    applets = subprocess.run([str(BUSYBOX), "--list"], capture_output=True, text=True,
                             check=True, timeout=30).stdout.split()
    data = io.BytesIO()
    with tarfile.open(fileobj=data, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for directory in DIRECTORIES:
            _add_dir(tar, directory)
        _add_file(tar, "bin/busybox", BUSYBOX.read_bytes(), mode=0o755)
        for applet in sorted(set(applets) - {"busybox"}):
            info = tarfile.TarInfo(f"bin/{applet}")
            info.type, info.linkname, info.mode = tarfile.SYMTYPE, "busybox", 0o777
            tar.addfile(info)
    return data.getvalue()


def _add_dir(tar: tarfile.TarFile, name: str) -> None:
    info = tarfile.TarInfo(name)
    info.type, info.mode = tarfile.DIRTYPE, 0o755
    tar.addfile(info)


def _add_file(tar: tarfile.TarFile, name: str, data: bytes, mode: int = 0o644) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mode = len(data), mode
    tar.addfile(info, io.BytesIO(data))


def _descriptor(media_type: str, blob: bytes) -> dict[str, object]:
    return {"mediaType": media_type, "digest": _digest(blob), "size": len(blob)}


def _digest(blob: bytes) -> str:
    return "sha256:" + hashlib.sha256(blob).hexdigest()


def _json(value: object) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()
