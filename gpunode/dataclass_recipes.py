"""What `dataclasses` did to each gpunode class, kept with its code and done again without it.

On Python 3.11 the kept code (gpunode.dataclass_cache) leaves `dataclasses` building every
class's methods anyway: finding its fields (a regular expression per annotation, three times
each, for ClassVar, InitVar and KW_ONLY), writing each method's text, and only then running
the kept code. That was ~15 ms of a first boot here, a sixth of its process, for 62 classes.

So `record`, run by `dataclass_cache.write` while `dataclasses` processes each class, keeps a
recipe: the class's `shape` (everything `_process_class` reads of it: the decorator's
arguments, each annotation and what its default is, the dataclass bases' fields, which of the
methods it would write the class defines itself, whether the module binds ClassVar, InitVar or
KW_ONLY at all) and the steps it took (each method's text and the names its creator takes, in
order; a `__match_args__` value; `__hash__` set to None); the file keeps each text compiled
(dataclass_cache.write). `replay` does those steps again for
a class whose shape is the recorded one: the same Field objects, the same functions from the
same code with the same defaults and closures, set in the same order; any other class, or one
that changed, goes through `dataclasses` itself. tests/integration/test_dataclass_cache.py
holds every gpunode class made this way to the one `dataclasses` makes.
"""

from __future__ import annotations

import abc
import builtins
import dataclasses
import sys
import types

TYPE_CHECKING = False  # typing for type checkers only (docs/design.md, the boot path)
if TYPE_CHECKING:
    from typing import Any

_MISSING = dataclasses.MISSING
# The methods _process_class may write (it writes none the class defines itself).
_METHODS = ("__init__", "__repr__", "__eq__", "__lt__", "__le__", "__gt__", "__ge__",
            "__setattr__", "__delattr__", "__hash__", "__match_args__")


def shape(cls: type, params: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """What `dataclasses._process_class(cls, *params)` depends on, as a marshallable value;
    None for a class it does not apply to (then `dataclasses` makes it)."""
    if params[7:] != (False, False, False) or not cls.__doc__:  # kw_only, slots, weakref_slot
        return None
    module = sys.modules.get(cls.__module__)
    if module is None or _marks(vars(module)):
        return None  # a ClassVar, InitVar or KW_ONLY annotation is possible: not replayed
    own = cls.__dict__
    annotations = own.get("__annotations__", {})
    fields = []
    for name, annotation in annotations.items():
        if type(annotation) is not str:
            return None
        default = getattr(cls, name, _MISSING)
        if isinstance(default, dataclasses.Field):
            if default.kw_only not in (_MISSING, False):
                return None
            kind: tuple[Any, ...] = ("field", default.default is not _MISSING,
                                     default.default_factory is not _MISSING, default.init,
                                     default.repr, default.hash, default.compare,
                                     type(default.default).__hash__ is None)
        elif default is _MISSING or isinstance(default, types.MemberDescriptorType):
            kind = ("none",)
        else:
            kind = ("value", type(default).__hash__ is None)
        fields.append((name, annotation, kind))
    if any(isinstance(value, dataclasses.Field) and name not in annotations
           for name, value in own.items()):
        return None
    bases = []
    for base in cls.__mro__[-1:0:-1]:
        base_fields = getattr(base, "__dataclass_fields__", None)
        if base_fields is not None:
            bases.append((base.__module__, base.__qualname__, base.__dataclass_params__.frozen,
                          tuple((f.name, str(f._field_type), f.init, f.repr, f.hash, f.compare,
                                 f.kw_only, f.default is not _MISSING,
                                 f.default_factory is not _MISSING)
                                for f in base_fields.values())))
    defined = tuple(name in own for name in _METHODS)
    explicit_hash = own.get("__hash__", _MISSING)
    return (params, tuple(fields), tuple(bases), defined,
            explicit_hash is None, "__eq__" in own, hasattr(cls, "__post_init__"))


def _marks(namespace: dict[str, Any]) -> bool:
    """Whether the module binds ClassVar, InitVar or KW_ONLY under any name: only then can
    `dataclasses` take a string annotation for one of them."""
    typing = sys.modules.get("typing")
    classvar = getattr(typing, "ClassVar", None)
    alias = getattr(typing, "_GenericAlias", None)
    for value in namespace.values():
        if value is classvar or value is dataclasses.InitVar or value is dataclasses.KW_ONLY \
                or type(value) is dataclasses.InitVar \
                or (type(value) is alias and value.__origin__ is classvar):
            return True
    return False


class Recorder:
    """Watches `dataclasses` process classes (dataclass_cache.write) and keeps each one's
    recipe: {module: {qualname: (shape, steps)}}."""

    def __init__(self) -> None:
        self.recipes: dict[str, dict[str, tuple[Any, ...]]] = {}
        self._made: dict[int, tuple[str, tuple[str, ...]]] = {}  # id(function) -> its text
        self._wrapped: dict[int, Any] = {}  # id(__repr__'s wrapper) -> the function
        self._steps: list[tuple[Any, ...]] | None = None
        self._keep: list[Any] = []  # what the ids above name stays alive until the end

    def install(self, keep_text: Any) -> dict[str, Any]:
        """Wrap `dataclasses`' internals; `keep_text(text, globals)` is the cache's exec. The
        originals, to put back (`uninstall`)."""
        originals = {name: getattr(dataclasses, name) for name in (
            "_process_class", "_create_fn", "_recursive_repr", "_set_new_attribute")}
        originals["_hash_action"] = dict(dataclasses._hash_action)  # type: ignore[attr-defined]
        texts: list[str] = []

        def exec_(source: Any, globals: Any = None, locals: Any = None) -> None:
            if type(source) is str:
                texts.append(source)
            keep_text(source, globals, locals)

        def create_fn(name: str, *args: Any, **kwargs: Any) -> Any:
            fn = originals["_create_fn"](name, *args, **kwargs)
            text = texts[-1]
            code = compile(text, "<string>", "exec", dont_inherit=True)
            creator = next(c for c in code.co_consts if isinstance(c, types.CodeType))
            self._made[id(fn)] = (text, creator.co_varnames[:creator.co_argcount])
            self._keep.append(fn)
            return fn

        def recursive_repr(fn: Any) -> Any:
            wrapper = originals["_recursive_repr"](fn)
            self._wrapped[id(wrapper)] = fn
            self._keep.append(wrapper)
            return wrapper

        def set_new_attribute(cls: type, name: str, value: Any) -> bool:
            exists = originals["_set_new_attribute"](cls, name, value)
            if not exists and self._steps is not None:
                self._steps.append(("set", name, value))
            return bool(exists)

        def hashing(action: Any) -> Any:
            def hash_action(cls: type, fields: Any, globals: Any) -> Any:
                value = action(cls, fields, globals)
                if self._steps is not None:
                    self._steps.append(("hash", "__hash__", value))
                return value
            return hash_action

        def process_class(cls: type, *params: Any) -> type:
            before = shape(cls, params)
            self._steps = []
            try:
                made = originals["_process_class"](cls, *params)
                steps = [self._step(step) for step in self._steps]
            finally:
                self._steps = None
            if before is not None and made is cls and None not in steps:
                self.recipes.setdefault(cls.__module__, {})[cls.__qualname__] = (
                    before, tuple(steps))
            return made

        dataclasses.exec = exec_  # type: ignore[attr-defined]
        dataclasses._create_fn = create_fn  # type: ignore[attr-defined]
        dataclasses._recursive_repr = recursive_repr  # type: ignore[attr-defined]
        dataclasses._set_new_attribute = set_new_attribute  # type: ignore[attr-defined]
        dataclasses._process_class = process_class  # type: ignore[attr-defined]
        for key, action in originals["_hash_action"].items():
            if action is not None:
                dataclasses._hash_action[key] = hashing(action)  # type: ignore[attr-defined]
        return originals

    @staticmethod
    def uninstall(originals: dict[str, Any]) -> None:
        del dataclasses.exec  # type: ignore[attr-defined]
        dataclasses._hash_action.update(originals.pop("_hash_action"))  # type: ignore[attr-defined]
        for name, value in originals.items():
            setattr(dataclasses, name, value)

    def _step(self, step: tuple[Any, ...]) -> tuple[Any, ...] | None:
        """A step as the recipe keeps it; None for one it cannot (the class is then not
        replayed)."""
        kind, name, value = step
        if kind == "hash" and value is None:
            return ("none",)
        how = "hash" if kind == "hash" else "set"
        if id(value) in self._wrapped:
            value, how = self._wrapped[id(value)], "repr"
        if id(value) in self._made:
            text, names = self._made[id(value)]
            return ("fn", name, text, names, how) if _resolvable(names) else None
        if kind == "set" and type(value) is tuple and all(type(v) is str for v in value):
            return ("value", name, value)  # __match_args__
        return None


def usable(steps: Any) -> bool:
    """Whether `steps` are a recipe's, as `Recorder` keeps them (a file that unmarshals to
    something else is not replayed: the class is then made by dataclasses, untouched)."""
    if type(steps) is not tuple:
        return False
    for step in steps:
        if type(step) is not tuple or not step:
            return False
        if step == ("none",):
            continue
        if step[0] == "value" and len(step) == 3 and type(step[1]) is str \
                and type(step[2]) is tuple and all(type(v) is str for v in step[2]):
            continue
        if not (step[0] == "fn" and len(step) == 5 and type(step[1]) is str
                and type(step[2]) is types.CodeType and type(step[3]) is tuple
                and step[4] in ("set", "repr", "hash")):
            return False
        if not _resolvable(step[3]):
            return False
    return True


def _resolvable(names: tuple[Any, ...]) -> bool:
    """Whether `_function` can give each of a creator's names its value."""
    return all(type(n) is str and (n.startswith(("_type_", "_dflt_")) or n == "cls"
                                   or n in _CONSTANTS) for n in names)


def replay(cls: type, params: tuple[Any, ...], steps: tuple[Any, ...]) -> type:
    """Do to `cls` what `dataclasses._process_class(cls, *params)` did to the class recorded
    with the same shape (`steps` as `usable` accepts them: each text compiled)."""
    globals = vars(sys.modules[cls.__module__])
    init, repr_, eq, order, unsafe_hash, frozen = params[:6]
    cls.__dataclass_params__ = dataclasses._DataclassParams(  # type: ignore[attr-defined]
        init, repr_, eq, order, unsafe_hash, frozen)
    fields: dict[str, dataclasses.Field[Any]] = {}
    for base in cls.__mro__[-1:0:-1]:
        base_fields = getattr(base, "__dataclass_fields__", None)
        if base_fields is not None:
            fields.update((f.name, f) for f in base_fields.values())
    own = []
    # as dataclasses reads them (3.11): inspect.get_annotations would import inspect
    for name, annotation in cls.__dict__.get("__annotations__", {}).items():  # noqa: RUF063
        default = getattr(cls, name, _MISSING)
        if isinstance(default, dataclasses.Field):
            field = default
        else:
            if isinstance(default, types.MemberDescriptorType):
                default = _MISSING
            field = dataclasses.field(default=default)
        field.name, field.type = name, annotation
        field._field_type = dataclasses._FIELD  # type: ignore[attr-defined]
        if field.kw_only is _MISSING:
            field.kw_only = False
        own.append(field)
    for field in own:
        fields[field.name] = field
        if isinstance(getattr(cls, field.name, None), dataclasses.Field):
            if field.default is _MISSING:
                delattr(cls, field.name)
            else:
                setattr(cls, field.name, field.default)
    cls.__dataclass_fields__ = fields  # type: ignore[attr-defined]
    set_new = dataclasses._set_new_attribute  # type: ignore[attr-defined]
    for step in steps:
        if step[0] == "none":
            cls.__hash__ = None  # type: ignore[assignment]
        elif step[0] == "value":
            set_new(cls, step[1], step[2])
        else:
            _, name, compiled, names, how = step
            fn = _function(cls, compiled, names, fields, globals)
            if how == "repr":
                fn = dataclasses._recursive_repr(fn)  # type: ignore[attr-defined]
            if how == "hash":
                cls.__hash__ = dataclasses._set_qualname(cls, fn)  # type: ignore[attr-defined]
            else:
                set_new(cls, name, fn)
    abc.update_abstractmethods(cls)
    return cls


def _function(cls: type, compiled: types.CodeType, names: tuple[str, ...],
              fields: dict[str, Any], globals: dict[str, Any]) -> Any:
    """One method, as `dataclasses._create_fn` makes it from its text (`compiled`): its
    creator run in the module's globals and called with the values `dataclasses` gives each
    name."""
    namespace: dict[str, Any] = {}
    builtins.exec(compiled, globals, namespace)
    values: dict[str, Any] = {}
    for name in names:
        if name.startswith("_type_"):
            values[name] = fields[name[6:]].type
        elif name.startswith("_dflt_"):
            field = fields[name[6:]]
            values[name] = field.default_factory if field.default_factory is not _MISSING \
                else field.default
        else:
            values[name] = _CONSTANTS[name] if name != "cls" else cls
    return namespace["__create_fn__"](**values)


_CONSTANTS: dict[str, Any] = {
    "MISSING": _MISSING, "_HAS_DEFAULT_FACTORY": dataclasses._HAS_DEFAULT_FACTORY,  # type: ignore[attr-defined]
    "__dataclass_builtins_object__": object, "_return_type": None,
    "FrozenInstanceError": dataclasses.FrozenInstanceError}
