"""gpunode.module_cache: the code of gpunode's modules and of the standard ones it imports,
kept in one file, is what a boot imports, each module as its source makes it (the same file,
__cached__, package path and loader API),
a module whose source changed or vanished is imported as without the file, and a broken
file changes nothing. Each case runs in a fresh interpreter on a copy of the package: install()
changes the process's sys.meta_path, and the copy's sources are edited."""

from __future__ import annotations

import json
import marshal
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import gpunode
from gpunode import module_cache

PACKAGE = Path(gpunode.__file__).parent
# No PYTHONPATH (it would leave the standard modules to Python), no .pyc written in the copy.
CLEAN_ENV = {**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
             "PYTHONDONTWRITEBYTECODE": "1"}
# What a module looks like once imported: where its code says it lies, its file attributes,
# its loader's kind and answers, and a package's search path.
SEEN = """\
import json, sys
from gpunode import module_cache
ok = module_cache.install(*sys.argv[1:])
import gpunode.pipeline.boot, gpunode.containerd, gpunode.containerd.step, shlex
assert shlex.split("a 'b c'") == ["a", "b c"]
def seen(module):
    return {"file": module.__file__, "cached": module.__cached__,
            "code": module.__spec__.loader.get_code(module.__name__).co_filename,
            "function": next((v.__code__.co_filename for v in vars(module).values()
                             if getattr(v, "__module__", None) == module.__name__
                             and hasattr(v, "__code__")), None),
            "source": module.__spec__.loader.get_source(module.__name__)[:60],
            "path": getattr(module, "__path__", None), "parent": module.__spec__.parent,
            "kept": type(module.__spec__.loader).__module__ == "gpunode.module_cache"}
print(json.dumps({"installed": ok, "edited": getattr(gpunode.pipeline.boot, "EDITED", None),
                  "modules": {m.__name__: seen(m) for m in (gpunode.pipeline.boot, gpunode.containerd,
                                                            gpunode.containerd.step, shlex)}}))
"""


@pytest.fixture
def package(tmp_path: Path) -> Path:
    """A copy of the gpunode package (sources only): its directory, the one above on the path."""
    shutil.copytree(PACKAGE, tmp_path / "gpunode", ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path / "gpunode"


def python(package: Path, *args: str, flags: tuple[str, ...] = (),
           extra: dict[str, str] | None = None) -> dict:
    # the copy is first on the path: the working directory
    done = subprocess.run([sys.executable, *flags, *args], env={**CLEAN_ENV, **(extra or {})},
                          cwd=package.parent,
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def write(package: Path, *args: str) -> Path:
    done = subprocess.run([sys.executable, "-m", "gpunode.module_cache", *args], env=CLEAN_ENV,
                          cwd=package.parent, capture_output=True, text=True, timeout=60,
                          check=False)
    assert done.returncode == 0, done.stderr
    cache = package / "__pycache__" / f"modules.{sys.implementation.cache_tag}.marshal"
    assert done.stdout.startswith(f"{cache}: ")
    return cache


def test_the_kept_modules_are_the_ones_their_sources_make(package: Path) -> None:
    write(package)
    kept = python(package, "-c", SEEN)
    plain = python(package, "-c", SEEN.replace("ok = module_cache.install(*sys.argv[1:])",
                                               "ok = None"))
    assert kept["installed"] is True
    assert all(module["kept"] for module in kept["modules"].values())
    assert not any(module["kept"] for module in plain["modules"].values())
    for name, module in kept["modules"].items():
        assert {**module, "kept": None} == {**plain["modules"][name], "kept": None}, name
        assert module["code"] == module["file"]
        assert module["function"] in (None, module["file"])
    assert kept["modules"]["gpunode.containerd"]["path"] == [str(package / "containerd")]
    assert kept["modules"]["shlex"]["file"] == shlex.__file__  # the standard library's own


def test_a_module_whose_source_changed_or_vanished_is_imported_as_without_the_file(
        package: Path) -> None:
    write(package)
    boot = package / "boot.py"
    boot.write_text(boot.read_text() + "\nEDITED = True\n")
    seen = python(package, "-c", SEEN)
    assert seen["edited"] is True
    assert seen["modules"]["gpunode.pipeline.boot"]["kept"] is False
    assert seen["modules"]["gpunode.containerd.step"]["kept"] is True
    (package / "containerd" / "step.py").unlink()
    done = subprocess.run([sys.executable, "-c", SEEN], env=CLEAN_ENV,
        cwd=package.parent, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 1
    assert done.stderr.splitlines()[-1] == \
        "ModuleNotFoundError: No module named 'gpunode.containerd.step'"


def test_an_unchecked_file_is_used_without_looking_at_the_sources(package: Path) -> None:
    """As the sysext's unchecked .pyc: the image is read-only, its sources never change."""
    write(package, "--unchecked")
    boot = package / "boot.py"
    boot.write_text(boot.read_text() + "\nEDITED = True\n")
    seen = python(package, "-c", SEEN)
    assert seen["installed"] is True
    assert seen["edited"] is None
    assert seen["modules"]["gpunode.pipeline.boot"]["kept"] is True


def test_optimized_python_does_not_use_code_compiled_without_it(package: Path) -> None:
    write(package)
    seen = python(package, "-c", SEEN, flags=("-O",))
    assert seen["installed"] is False
    assert not any(module["kept"] for module in seen["modules"].values())


def cache_file(entries: dict[str, tuple], code: bytes = b"") -> bytes:
    """A file in module_cache's format (gpunode/module_cache.py) with these index entries."""
    header = marshal.dumps((module_cache.FORMAT, module_cache.MAGIC_NUMBER, 0, True, entries))
    return module_cache.MAGIC + len(header).to_bytes(8, "little") + header + code


BROKEN = {  # each a file install() reads, whose one entry it cannot use
    "escaping": {"gpunode.pipeline.boot": (0, "../../etc/passwd", False, 0, 0, 0, 0)},
    "absolute": {"gpunode.pipeline.boot": (0, "/etc/passwd.py", False, 0, 0, 0, 0)},
    "base": {"gpunode.pipeline.boot": (2, "boot.py", False, 0, 0, 0, 0)},
    "past-end": {"gpunode.pipeline.boot": (0, "boot.py", False, 0, 0, 0, 1 << 20)},
    "too-long": {"gpunode.pipeline.boot": (0, "boot.py", False, 0, 0, 0, 17 << 20)},
}


@pytest.mark.parametrize("content", [b"", b"garbage", marshal.dumps({"a": 1}),
                                     b"gpunode-modules\n" + (1 << 40).to_bytes(8, "little"),
                                     *BROKEN, "magic", "fifo", "directory", "huge"])
def test_a_broken_file_changes_nothing(package: Path, content: bytes | str) -> None:
    cache = package.parent / "broken.marshal"
    if content == "fifo":
        os.mkfifo(cache)  # nobody writes: reading it would hang
    elif content == "directory":
        cache.mkdir()
    elif content == "huge":  # an index claimed past any bound
        with cache.open("wb") as out:
            out.truncate(17 << 20)
    elif content in BROKEN:
        cache.write_bytes(cache_file(BROKEN[content]))
    elif content == "magic":  # another bytecode's (another 3.x wrote it)
        whole = write(package).read_bytes()
        cache.write_bytes(whole.replace(module_cache.MAGIC_NUMBER, b"\0\0\r\n", 1))
    else:
        assert isinstance(content, bytes)
        cache.write_bytes(content)
    seen = python(package, "-c", SEEN, str(cache))
    assert not any(module["kept"] for module in seen["modules"].values())
    assert seen["installed"] is (content in BROKEN)  # read; its one entry refused


def test_pythonpath_keeps_its_own_modules_named_as_standard_ones(package: Path,
                                                                  tmp_path: Path) -> None:
    """PYTHONPATH comes before the standard library: its shlex.py is the one imported, the
    file's standard modules are left to Python, gpunode's are still taken from it."""
    write(package)
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    (shadow / "shlex.py").write_text("def split(text):\n    return ['a', 'b c']\n")
    seen = python(package, "-c", SEEN, extra={"PYTHONPATH": str(shadow)})
    assert seen["installed"] is True
    assert seen["modules"]["shlex"]["file"] == str(shadow / "shlex.py")
    assert seen["modules"]["gpunode.pipeline.boot"]["kept"] is True


@pytest.mark.parametrize("damage", ["garbage", "not-code"])
def test_a_module_whose_kept_code_is_damaged_is_imported_from_its_source(
        package: Path, damage: str) -> None:
    """The index whole, one module's code not: that module as without the file, no error."""
    whole = write(package, "--unchecked").read_bytes()
    length = int.from_bytes(whole[len(module_cache.MAGIC):len(module_cache.MAGIC) + 8], "little")
    start = len(module_cache.MAGIC) + 8 + length
    index = marshal.loads(whole[len(module_cache.MAGIC) + 8:start])[4]
    _, _, _, _, _, offset, size = index["gpunode.pipeline.boot"]
    code = marshal.dumps("a string") if damage == "not-code" else b"\xff" * size
    code = code.ljust(size, b"\0")[:size]
    damaged = bytearray(whole)
    damaged[start + offset:start + offset + size] = code
    cache = package.parent / "damaged.marshal"
    cache.write_bytes(bytes(damaged))
    seen = python(package, "-c", SEEN, str(cache))
    assert seen["installed"] is True
    assert seen["modules"]["gpunode.pipeline.boot"]["code"] == str(package / "boot.py")
    assert seen["modules"]["gpunode.containerd.step"]["kept"] is True


def test_a_boot_imports_gpunode_from_the_file(tmp_path: Path) -> None:
    """The installed command's own file (make setup writes it), on a fixture node's boot:
    every module the boot imports after the entry point installs it, gpunode's and the
    standard library's, comes from it (C extensions and the interpreter's own built-in and
    frozen modules aside)."""
    from gpunode_testing import fixtures

    root = tmp_path / "node"
    fixtures.build(fixtures.MACHINES["nc4as-t4-v3"], root, fixtures.Options(state="ready"))
    code = ("import sys; sys.argv[1:] = ['--root', sys.argv[1], 'boot']\n"
            "from gpunode import module_cache\nfrom gpunode.cli import entry\n"
            "install, before = module_cache.install, []\n"
            "def installing(*args):\n"
            "    before.extend(sys.modules)\n"
            "    return install(*args)\n"
            "module_cache.install = installing\n"
            "entry.gc.disable(); code = entry.main()\n"
            "mods = {n: type(m.__spec__.loader).__name__ for n, m in sys.modules.items()"
            " if n not in before and type(m.__spec__.loader).__name__ != "
            "'ExtensionFileLoader' and m.__spec__.origin not in ('built-in', 'frozen')}\n"
            "import json; print(json.dumps({'code': code, 'loaders': mods}))")
    done = subprocess.run([sys.executable, "-c", code, str(root)], env=CLEAN_ENV,
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.splitlines()[-1])
    assert seen["code"] == 0
    loaders = seen["loaders"]  # the modules imported after install(), but C extensions
    assert len([name for name in loaders if name.startswith("gpunode.")]) > 40
    assert {"dataclasses", "enum", "re"} <= set(loaders)  # the standard library's
    assert set(loaders.values()) == {"_Loader"}, loaders
