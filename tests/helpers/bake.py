"""Inputs of `gpunode image bake`, shared by tests/unit/test_image_bake.py,
tests/integration/test_bake_http.py and tests/hostile/test_bake.py: stand-in sysext images
with their sha512, a bake config naming them, and a counting HTTP server on 127.0.0.1."""

from __future__ import annotations

import hashlib
import http.server
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

GPUNODE_FILE = "gpunode-0.2.0-x86-64.raw"
DRIVER = "nvidia-drivers-570-open"
FLATCAR_VERSION = "4459.2.1"  # the fixture hosts' os-release
DRIVER_PATH = f"etc/flatcar/sysext/flatcar-{DRIVER}-{FLATCAR_VERSION}.raw"
GPUNODE_PATH = f"opt/extensions/gpunode/{GPUNODE_FILE}"


def sha512(data: bytes) -> str:
    return hashlib.sha512(data).hexdigest()


@dataclass
class Inputs:
    """Artifacts in a directory of the test (the 'mirror'), and bake configs that name them."""

    directory: Path
    images: dict[str, bytes] = field(default_factory=dict)

    def add(self, name: str, data: bytes) -> str:
        (self.directory / name).write_bytes(data)
        self.images[name] = data
        return name

    def config(self, base: str = "", gpunode: str = GPUNODE_FILE,
               driver: str | None = f"flatcar-{DRIVER}.raw", extra: str = "",
               gpunode_sha: str | None = None, driver_sha: str | None = None,
               name: str = "bake.toml") -> Path:
        """A bake config; `base` prefixes each source (a URL, file://, or '' for a path
        relative to the config)."""
        text = (f'[gpunode]\nsource = "{base}{gpunode}"\n'
                f'sha512 = "{gpunode_sha or sha512(self.images[gpunode])}"\n')
        if driver is not None:
            text += (f'\n[[driver]]\nname = "{DRIVER}"\nsource = "{base}{driver}"\n'
                     f'sha512 = "{driver_sha or sha512(self.images[driver])}"\n')
        path = self.directory / name
        path.write_text(text + extra)
        return path


def make_inputs(directory: Path) -> Inputs:
    directory.mkdir(parents=True, exist_ok=True)
    inputs = Inputs(directory)
    inputs.add(GPUNODE_FILE, b"hsqs gpunode sysext stand-in\n" * 2000)
    inputs.add(f"flatcar-{DRIVER}.raw", b"hsqs driver sysext stand-in\n" * 5000)
    return inputs


@dataclass
class Server:
    url: str
    requests: list[str]


@contextmanager
def serving(directory: Path, fail_first: int = 0) -> Iterator[Server]:
    """An HTTP server on 127.0.0.1 serving `directory`, recording every request path; the
    first `fail_first` requests are answered 503 (to prove the retries)."""
    requests: list[str] = []
    failures = [fail_first]

    class Handler(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__(*args, directory=str(directory), **kwargs)  # type: ignore[arg-type]

        def do_GET(self) -> None:
            requests.append(self.path)
            if failures[0] > 0:
                failures[0] -= 1
                self.send_error(503, "busy")
                return
            super().do_GET()

        def guess_type(self, path: object) -> str:
            return "application/octet-stream"  # never reads the machine's mime.types

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield Server(f"http://127.0.0.1:{server.server_address[1]}/", requests)
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
