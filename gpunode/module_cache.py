"""gpunode's own modules' compiled code in one file, found without a walk of the import path.

A boot imports ~60 gpunode modules. For each, importlib's path finder and source loader
look the name up in the package directory, stat the source, open, read and check its .pyc,
and only then unmarshal the code: ~70 µs a module in importlib's own Python code, ~4 ms of
a boot here (of ~45 ms over Python's start; measured against one file of every module's
code with hyperfine). `write` compiles every module of the package into
gpunode/__pycache__/modules.<tag>.marshal (a temporary file renamed over it), with the size
and mtime of the source it was compiled from; `install`, called by the entry point where it
installs gpunode.dataclass_cache, reads the file and puts a finder first on sys.meta_path
that answers gpunode's submodules from it. Each module is still a plain source module: its
loader is importlib's SourceFileLoader for the same file (get_source, resources, __file__ and
__cached__ as without the file), whose get_code returns the kept code.

The kept code is used only while its source is unchanged: one stat per module, as a .pyc's
timestamp check does, and a module whose source changed, vanished or was never kept is found
as without the file. The sysext's bundle writes the file "unchecked", as its .pyc are
(packaging/build_sysext.py: no source stat at import, the image is read-only). The file is
read only where it is a regular file within a bound (a FIFO would hang the boot); one that
cannot be read or is not in this format changes nothing. `make setup` and the sysext build
write it; without it gpunode imports as any package does.
"""

from __future__ import annotations

import _imp
import marshal
import os
import sys

# importlib's own classes, from the frozen modules it is built on (importlib.machinery and
# importlib.util are these same objects, behind imports a boot need not pay for)
from _frozen_importlib import ModuleSpec
from _frozen_importlib_external import SourceFileLoader

TYPE_CHECKING = False  # typing for type checkers only (docs/design.md, the boot path)
if TYPE_CHECKING:
    from typing import Any

FORMAT = 1
PACKAGE = os.path.dirname(os.path.realpath(__file__))  # no pathlib: the boot path
CACHE = os.path.join(PACKAGE, "__pycache__", f"modules.{sys.implementation.cache_tag}.marshal")
_TAG = sys.implementation.cache_tag
LIMIT = 16 << 20  # the file is ~1.5 MB


class _Loader(SourceFileLoader):
    """The source loader of the module's file, its code taken from the kept file."""

    def __init__(self, fullname: str, path: str, code: bytes) -> None:
        super().__init__(fullname, path)
        self._kept: bytes | None = code

    def get_code(self, fullname: str) -> Any:
        kept, self._kept = self._kept, None  # once: a reload compiles the source again
        if kept is None or fullname != self.name:
            return super().get_code(fullname)
        code = marshal.loads(kept)
        _imp._fix_co_filename(code, self.path)  # as for a .pyc: the file where it now lies
        return code


class _Finder:
    """Answers the kept modules (a name it does not keep, or whose source changed: None, and
    the next finder on sys.meta_path looks for it as usual)."""

    def __init__(self, modules: dict[str, Any], checked: bool) -> None:
        self._modules = modules
        self._checked = checked

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        entry = self._modules.pop(name, None)  # each module is imported once
        if entry is None:
            return None
        relative, package, size, mtime_ns, code = entry
        source = os.path.join(PACKAGE, relative)
        if self._checked:
            try:
                st = os.stat(source)
            except OSError:
                return None
            if st.st_size != size or st.st_mtime_ns != mtime_ns:
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
    cannot be read, it is not this format, or this Python optimizes (-O)."""
    if any(isinstance(finder, _Finder) for finder in sys.meta_path):
        return True
    from gpunode import safeio

    try:
        kept = marshal.loads(safeio.read(path, LIMIT))
    except (OSError, safeio.Refused, ValueError, EOFError, TypeError):
        return False
    if type(kept) is not tuple or len(kept) != 4 or kept[0] != FORMAT \
            or kept[1] != sys.flags.optimize or type(kept[3]) is not dict:
        return False
    modules = {name: entry for name, entry in kept[3].items() if _valid(name, entry)}
    sys.meta_path.insert(0, _Finder(modules, kept[2] is not False))
    return True


def _valid(name: Any, entry: Any) -> bool:
    return type(name) is str and name.startswith("gpunode.") and type(entry) is tuple \
        and len(entry) == 5 and type(entry[0]) is str and not entry[0].startswith("/") \
        and ".." not in entry[0].split("/") and type(entry[1]) is bool \
        and type(entry[2]) is int and type(entry[3]) is int and type(entry[4]) is bytes


def write(path: str = CACHE, checked: bool = True) -> int:
    """Compile every gpunode module into `path` (checked: against its source's size and
    mtime at each import; unchecked: as the bundle's unchecked .pyc); the number kept."""
    modules: dict[str, tuple[str, bool, int, int, bytes]] = {}
    for directory, subdirectories, files in os.walk(PACKAGE):
        subdirectories[:] = sorted(d for d in subdirectories if d != "__pycache__"
                                   and os.path.exists(os.path.join(directory, d, "__init__.py")))
        for file in sorted(f for f in files if f.endswith(".py")):
            source = os.path.join(directory, file)
            relative = os.path.relpath(source, PACKAGE)
            parts = relative[:-3].split(os.sep)
            package = parts[-1] == "__init__"
            name = ".".join(["gpunode", *(parts[:-1] if package else parts)])
            if name == "gpunode" or name == "gpunode.__main__":
                continue  # the package itself is imported before install; __main__ by -m
            with open(source, "rb") as handle:
                data = handle.read()
                st = os.fstat(handle.fileno())
            # as importlib compiles a source: dont_inherit, this interpreter's optimize level
            code = compile(data, relative, "exec", dont_inherit=True)
            # unchecked: no size or mtime, which would differ from build to build
            modules[name] = (relative, package, st.st_size if checked else 0,
                             st.st_mtime_ns if checked else 0, marshal.dumps(code))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    partial = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.{os.getpid()}")
    with open(partial, "wb") as handle:
        handle.write(marshal.dumps((FORMAT, sys.flags.optimize, checked, modules)))
    os.replace(partial, path)
    return len(modules)


if __name__ == "__main__":
    if sys.argv[1:] not in ([], ["--unchecked"]):
        sys.exit("usage: python -m gpunode.module_cache [--unchecked]")
    print(f"{CACHE}: {write(checked=sys.argv[1:] != ['--unchecked'])} modules' code kept")
