"""The compiled code of the modules gpunode imports, in one file, found without a walk of the
import path.

A boot imports ~60 gpunode modules and ~25 of the standard library's. For each, importlib's
path finder and source loader look the name up in its directory, stat the source, open,
read and check its .pyc, and only then unmarshal the code: ~70 µs a module in importlib's
own Python code. `write` imports every gpunode module, and compiles it and every standard
module that loaded from its source meanwhile into gpunode/__pycache__/modules.<tag>.marshal
(a temporary file renamed over it): an index (each module's source, relative to gpunode's
directory or the standard library's, its size and mtime, and where its code lies, counted
from the index's end), then the code. `install`, called by the entry point where it installs
gpunode.dataclass_cache, reads the index and puts a finder first on sys.meta_path that reads
a kept module's code (one pread) when it is imported. Each module is still a plain source
module: its loader is importlib's SourceFileLoader for the same file (get_source, resources,
__file__ and __cached__ as without the file), whose get_code returns the kept code.

The kept code is used only while its source is unchanged: one stat per module, as a .pyc's
timestamp check does, and a module whose source changed, vanished or was never kept, or whose
kept code is damaged, is found as without the file; so are the standard modules while
PYTHONPATH is set (its directories come first). The sysext's bundle writes the file
"unchecked", as its .pyc are (packaging/build_sysext.py: no source stat at import, the image
is read-only). The file is opened only where it is a regular file (a FIFO would hang the
boot), its index and each module's code within a bound; one that cannot be read or is not in
this format changes nothing. `make setup` and the sysext build write it; without it gpunode
imports as any package does.
"""

from __future__ import annotations

import _imp
import marshal
import os
import sys

# importlib's own classes, from the frozen modules it is built on (importlib.machinery and
# importlib.util are these same objects, behind imports a boot need not pay for)
from _frozen_importlib import ModuleSpec
from _frozen_importlib_external import MAGIC_NUMBER, SourceFileLoader
from types import CodeType

TYPE_CHECKING = False  # typing for type checkers only (docs/design.md, the boot path)
if TYPE_CHECKING:
    from typing import Any

MAGIC = b"gpunode-modules\n"
FORMAT = 2
_TAG = sys.implementation.cache_tag  # the file's, and each .pyc's (a module's __cached__)
PACKAGE = os.path.dirname(os.path.realpath(__file__))  # no pathlib: the boot path
CACHE = os.path.join(PACKAGE, "__pycache__", f"modules.{_TAG}.marshal")
INDEX_LIMIT = 1 << 20  # an index is ~20 KB
CODE_LIMIT = 16 << 20  # a module's code is at most ~100 KB


def _bases() -> tuple[str, str | None]:
    """The directories a kept module's path is relative to: gpunode's, the standard library's
    (the bundle has gpunode inside the latter; None where Python does not say where it is)."""
    stdlib = getattr(os, "__file__", None)
    return PACKAGE, os.path.dirname(stdlib) if isinstance(stdlib, str) and stdlib else None


class _Loader(SourceFileLoader):
    """The source loader of the module's file, its code taken from the kept file."""

    def __init__(self, fullname: str, path: str, code: bytes) -> None:
        super().__init__(fullname, path)
        self._kept: bytes | None = code

    def get_code(self, fullname: str) -> Any:
        kept, self._kept = self._kept, None  # once: a reload compiles the source again
        try:
            code = marshal.loads(kept) if kept is not None and fullname == self.name else None
        except (ValueError, EOFError, TypeError):
            code = None  # a damaged file: the module as without it
        if type(code) is not CodeType:
            return super().get_code(fullname)
        _imp._fix_co_filename(code, self.path)  # as for a .pyc: the file where it now lies
        return code


class _Finder:
    """Answers the kept modules (a name it does not keep, or whose source changed: None, and
    the next finder on sys.meta_path looks for it as usual)."""

    def __init__(self, fd: int, start: int, size: int, modules: dict[str, Any],
                 checked: bool) -> None:
        self._fd = fd  # close-on-exec: the programs gpunode runs do not inherit it
        self._start = start  # where the code begins (the offsets count from there)
        self._size = size
        self._modules = modules
        self._checked = checked
        self._bases = _bases()  # (install keeps no module whose base is None)

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        entry = self._modules.pop(name, None)  # each module is imported once
        if entry is None:
            return None
        base, relative, package, size, mtime_ns, offset, length = entry
        source = os.path.join(self._bases[base] or "/", relative)
        if self._checked:
            try:
                st = os.stat(source)
            except OSError:
                return None
            if st.st_size != size or st.st_mtime_ns != mtime_ns:
                return None
        if self._start + offset + length > self._size:
            return None
        try:
            code = os.pread(self._fd, length, self._start + offset)
        except OSError:
            return None
        if len(code) != length:
            return None
        # what importlib's path finder makes for the file (spec_from_file_location), made
        # directly: __file__, __cached__ and a package's __path__ are the same
        spec = ModuleSpec(name, _Loader(name, source, code), origin=source,
                          is_package=package)
        spec.has_location = True
        directory, _, file = source.rpartition("/")
        spec.cached = f"{directory}/__pycache__/{file[:-3]}.{_TAG}.pyc"
        if package:
            spec.submodule_search_locations = [directory]
        return spec

    def invalidate_caches(self) -> None:
        """(importlib.invalidate_caches calls it on every finder: nothing is cached here.)"""


def install(path: str = CACHE) -> bool:
    """True when the finder is in use; False (nothing changed) where there is no file, it
    cannot be read, it is not this format, it is another bytecode's (the .pyc magic number)
    or this Python optimizes (-O)."""
    if any(isinstance(finder, _Finder) for finder in sys.meta_path):
        return True
    from gpunode.platform import safeio

    try:
        fd, st = safeio.open_regular(path)
    except (OSError, safeio.Refused, ValueError):
        return False
    try:
        head = os.pread(fd, len(MAGIC) + 8, 0)
        length = int.from_bytes(head[len(MAGIC):], "little")
        if head[:len(MAGIC)] != MAGIC or len(head) != len(MAGIC) + 8 \
                or length > min(INDEX_LIMIT, st.st_size):
            raise ValueError("not this format")
        kept = marshal.loads(os.pread(fd, length, len(MAGIC) + 8))
        if type(kept) is not tuple or len(kept) != 5 or kept[0] != FORMAT \
                or kept[1] != MAGIC_NUMBER or kept[2] != sys.flags.optimize \
                or type(kept[4]) is not dict:
            raise ValueError("not this format")
    except (OSError, ValueError, EOFError, TypeError):
        os.close(fd)
        return False
    bases = _bases()
    # PYTHONPATH's directories come before the standard library's: a module there named as a
    # standard one is the one Python imports, so none of those is taken from the file then
    shadowed = bool(os.environ.get("PYTHONPATH")) and not sys.flags.ignore_environment
    modules = {name: entry for name, entry in kept[4].items()
               if _valid(name, entry) and bases[entry[0]] is not None
               and not (entry[0] == 1 and shadowed)}
    start = len(MAGIC) + 8 + length
    sys.meta_path.insert(0, _Finder(fd, start, st.st_size, modules, kept[3] is not False))
    return True


def _valid(name: Any, entry: Any) -> bool:
    return type(name) is str and type(entry) is tuple and len(entry) == 7 \
        and entry[0] in (0, 1) and type(entry[1]) is str and entry[1].endswith(".py") \
        and not entry[1].startswith("/") and ".." not in entry[1].split("/") \
        and type(entry[2]) is bool and all(type(n) is int and n >= 0 for n in entry[3:]) \
        and entry[6] <= CODE_LIMIT


def write(path: str = CACHE, checked: bool = True) -> int:
    """Import every gpunode module, and compile it and each standard module loaded from its
    source into `path` (checked: against its source's size and mtime at each import;
    unchecked: as the bundle's unchecked .pyc); the number kept."""
    import importlib
    import pkgutil

    import gpunode

    for info in pkgutil.walk_packages(gpunode.__path__, "gpunode."):
        if not info.name.endswith("__main__"):  # running that would run gpunode
            importlib.import_module(info.name)
    bases = _bases()
    index: dict[str, tuple[int, str, bool, int, int, int, int]] = {}
    blobs: list[bytes] = []
    offset = 0
    for name, module in sorted(sys.modules.items()):
        spec = getattr(module, "__spec__", None)
        if spec is None or type(spec.loader) is not SourceFileLoader or name == "gpunode" \
                or name == "__main__" or not str(spec.origin).endswith(".py"):
            continue  # frozen, built in, an extension, or imported before install
        source = os.path.realpath(spec.origin)
        base = next((i for i, b in enumerate(bases)
                     if b is not None and source.startswith(b + os.sep)), None)
        if base is None:
            continue  # neither gpunode's nor the standard library's (site-packages)
        with open(source, "rb") as handle:
            data = handle.read()
            st = os.fstat(handle.fileno())
        relative = os.path.relpath(source, bases[base])
        # as importlib compiles a source: dont_inherit, this interpreter's optimize level
        blob = marshal.dumps(compile(data, relative, "exec", dont_inherit=True))
        # unchecked: no size or mtime, which would differ from build to build
        index[name] = (base, relative, spec.submodule_search_locations is not None,
                       st.st_size if checked else 0, st.st_mtime_ns if checked else 0,
                       offset, len(blob))
        blobs.append(blob)
        offset += len(blob)
    header = marshal.dumps((FORMAT, MAGIC_NUMBER, sys.flags.optimize, checked, index))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    partial = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.{os.getpid()}")
    with open(partial, "wb") as handle:
        handle.write(MAGIC + len(header).to_bytes(8, "little") + header)
        handle.writelines(blobs)
    os.replace(partial, path)
    return len(index)


if __name__ == "__main__":
    if sys.argv[1:] not in ([], ["--unchecked"]):
        sys.exit("usage: python -m gpunode.module_cache [--unchecked]")
    print(f"{CACHE}: {write(checked=sys.argv[1:] != ['--unchecked'])} modules' code kept")
