"""Typed config sections: frozen dataclasses whose fields carry their default, their check and the
rules that tie them to other fields.

Every field declares the values it takes: `choice` (one of a tuple), `bounded` (a range), `parsed`
(a syntax, read by a parse function), `registered` (a name in a registry of implementations, checked
when the run starts: `registry.check_registered`), `flag` (a bool) — or, with `free`, why any value
of its type will do. A field may also declare `inert_unless=(predicate, why)`: a value other than its
default is refused, naming the key and why, when the rest of the section leaves it without effect.
Rules across several fields are the section's `check_rules`.

Building a section (directly, with `from_dict`, or `replace`) checks every value's type, then each
field's declaration, then the inert rules, then `check_rules`; a bad value is a `UserError` naming
its key. Imports no jax.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, NoReturn

from posttrain.errors import UserError

CHECK, INERT = "check", "inert_unless"
# The order checks run in over a whole tree (`check_tree`): every type before any choice, every
# choice before any range, every range before any syntax; rules after all of them.
KINDS = ("type", "choice", "bounds", "parse")
COMPARE = {">=": operator.ge, ">": operator.gt, "<=": operator.le, "<": operator.lt}  # bounded's order
Inert = tuple[Callable[[Any], bool], str]  # (the section → whether the field takes effect, why not)


def _field(default, check: tuple, inert_unless: Inert | list[Inert] | None) -> Any:
    rules = [inert_unless] if inert_unless and callable(inert_unless[0]) else list(inert_unless or ())
    metadata = {CHECK: check, **({INERT: tuple(rules)} if rules else {})}
    if isinstance(default, dict):  # a mapping default: each instance its own read-only copy
        return dataclasses.field(default_factory=lambda: types.MappingProxyType(dict(default)), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def choice(default, values: tuple, *, inert_unless: Inert | None = None) -> Any:
    """A field whose value is one of `values`."""
    return _field(default, ("choice", tuple(values)), inert_unless)


def bounded(default, *, ge=None, gt=None, le=None, lt=None, inert_unless: Inert | None = None) -> Any:
    """A number field bounded below (>= ge or > gt) and/or above (<= le or < lt)."""
    return _field(default, ("bounds", (ge, gt, le, lt)), inert_unless)


def parsed(default, parse: Callable[[Any], Any], *, inert_unless: Inert | None = None) -> Any:
    """A field with a syntax: `parse(value)` reads it and raises ValueError saying what is wrong."""
    return _field(default, ("parse", parse), inert_unless)


def registered(default: str, registry: str, *, inert_unless: Inert | None = None) -> Any:
    """A name in the registry `registry` (`config.registry`), checked when the run starts: the
    registries fill as their modules are imported, which the config does not do."""
    return _field(default, ("registered", registry), inert_unless)


def flag(default: bool, *, inert_unless: Inert | None = None) -> Any:
    """A switch: True or False."""
    return _field(default, ("flag",), inert_unless)


def free(default, why: str, *, inert_unless: Inert | None = None) -> Any:
    """A field any value of its type may take; `why` says why (what reads it, what checks it later)."""
    if not why:
        raise TypeError("free(): say why the field needs no check")
    return _field(default, ("free", why), inert_unless)


def options() -> Any:
    """The options sections of registered entries (`config.registry`): entry name → its section,
    every registered entry's defaults unless given."""
    from posttrain.config.registry import OPTIONS

    return dataclasses.field(
        default_factory=lambda: types.MappingProxyType({name: cls() for name, cls in OPTIONS.items()}),
        metadata={CHECK: ("options",)},
    )


def nested(cls: type[Section]) -> Any:
    """A field holding a section of its own (defaults: that section's)."""
    return dataclasses.field(default_factory=cls, metadata={CHECK: ("section",)})


def section(cls: type) -> type:
    """`@section`: a frozen, keyword-only dataclass."""
    return dataclasses.dataclass(frozen=True, kw_only=True)(cls)


def join(key: str, name: str) -> str:
    """The dotted key of `name` in the section at `key` ("" for the top)."""
    return f"{key}.{name}" if key else name


@section
class Section:
    """A config section. `KEY`: where it sits in the run config ("" for the run itself). `STAGE`: the
    stage that reads it, when only one does; its rules (inert values, `check_rules`) are then checked
    by the run config for runs that reach that stage, and its own building checks values alone."""

    KEY: ClassVar[str] = ""
    STAGE: ClassVar[str] = ""

    def __post_init__(self):
        for f in value_fields(type(self)):
            if f.name not in nested_sections(type(self)):
                object.__setattr__(self, f.name, coerce(join(self.KEY, f.name), getattr(self, f.name), hint(self, f)))
        for kind in KINDS[1:]:  # nested sections checked themselves when they were built
            for f in own_fields(type(self)):
                check_value(join(self.KEY, f.name), getattr(self, f.name), f, kind)
        if not self.STAGE:
            self.check_inert()
            self.check_rules()

    def check_inert(self) -> None:
        """Refuse a value away from its default that the rest of the section leaves without effect."""
        for f in own_fields(type(self)):
            value = getattr(self, f.name)
            for takes_effect, why in f.metadata.get(INERT, ()) if value != default(f) else ():
                if not takes_effect(self):
                    key = join(self.KEY, f.name)
                    raise UserError(f"config.{key}={value!r} cannot take effect: {why}", key=key)

    def check_rules(self) -> None:
        """The section's rules across fields: raise a UserError naming the key (none by default)."""

    def refuse(self, name: str, why: str) -> NoReturn:
        """Raise the UserError of field `name` (dotted below this section, "vision.image_token_id"),
        naming its key: "config.<key>=<its value>" then `why` as written (": expected …", " must …")."""
        key = join(self.KEY, name)
        raise UserError(f"config.{key}={functools.reduce(getattr, name.split('.'), self)!r}{why}", key=key)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], key: str | None = None):
        """The section of the nested mapping `values` (a ConfigDict's `to_dict()`, a saved
        config.json), checked. Keys it lacks take their defaults (a config saved before they
        existed); a key that is not a field is a UserError naming the valid ones."""
        key = cls.KEY if key is None else key
        for kind in KINDS:
            check_tree(cls, values, key, kind)
        return _build(cls, values, key)

    def replace(self, changes: Mapping[str, Any] = types.MappingProxyType({}), /, **fields):
        """A copy with `changes` (dotted keys relative to this section, e.g. {"rl.steps": 10,
        "model.moe.num_experts": 4}) and `fields` (this section's own) applied, checked anew."""
        tree = self.to_dict()
        for dotted, value in {**changes, **fields}.items():
            *path, leaf = dotted.split(".")
            node = tree
            for i, part in enumerate(path):
                if not isinstance(node.get(part), dict):
                    raise UserError(f"config.{join(self.KEY, '.'.join(path[: i + 1]))}: not a section", key=dotted)
                node = node[part]
            if leaf not in node:
                raise UserError(unknown_key(join(self.KEY, dotted), sorted(node)), key=join(self.KEY, dotted))
            node[leaf] = value.to_dict() if isinstance(value, Section) else value
        return type(self).from_dict(tree)

    def to_dict(self) -> dict[str, Any]:
        """The nested plain values, in field order (mappings as dicts, tuples kept)."""
        out = {}
        for f in value_fields(type(self)):
            value = getattr(self, f.name)
            out[f.name] = _plain(value)
        return out


def _plain(value):
    if isinstance(value, Section):
        return value.to_dict()
    if _is_mapping(value):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _build(cls, values: Mapping[str, Any], key: str):
    kwargs = {}
    for f in value_fields(cls):
        if f.name not in values:
            continue
        value = values[f.name]
        if f.name in nested_sections(cls):
            sub = nested_sections(cls)[f.name]
            value = value if isinstance(value, sub) else _build(sub, value, join(key, f.name))
        kwargs[f.name] = value
    return cls(**kwargs)


@functools.cache
def value_fields(cls) -> tuple[dataclasses.Field, ...]:
    """The fields of section class `cls` that hold config keys, in order."""
    return tuple(dataclasses.fields(cls))


@functools.cache
def nested_sections(cls) -> dict[str, type[Section]]:
    """Field name → section class, for the fields of `cls` that are sections themselves."""
    hints = typing.get_type_hints(cls)
    return {
        f.name: hints[f.name]
        for f in value_fields(cls)
        if isinstance(hints[f.name], type) and issubclass(hints[f.name], Section)
    }


@functools.cache
def own_fields(cls) -> tuple[dataclasses.Field, ...]:
    """The fields of `cls` that hold values (not sections)."""
    return tuple(f for f in value_fields(cls) if f.name not in nested_sections(cls))


@functools.cache
def _hints(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def hint(obj_or_cls, f: dataclasses.Field) -> Any:
    """The type annotation of field `f`."""
    return _hints(obj_or_cls if isinstance(obj_or_cls, type) else type(obj_or_cls))[f.name]


def default(f: dataclasses.Field) -> Any:
    """Field `f`'s default value."""
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def _is_mapping(value) -> bool:
    return isinstance(value, Mapping) and not isinstance(value, Section)


def _type_name(tp) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def coerce(key: str, value, tp):
    """`value` as field type `tp` (an int where a float is declared becomes a float, a list a tuple,
    a mapping a read-only dict); a UserError naming `key` when it is not of that type."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    bad = UserError(f"config.{key}={value!r}: expected a value of type {_type_name(tp)}", key=key)
    if tp is bool:
        if not isinstance(value, bool):
            raise bad
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise bad
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise bad
        return value
    if origin is tuple:
        if isinstance(value, str) or not isinstance(value, tuple | list):
            raise bad
        return tuple(coerce(f"{key}[{i}]", v, args[0]) for i, v in enumerate(value))
    if origin in (Mapping, dict) or tp is Mapping:
        if not _is_mapping(value):
            raise bad
        if args[1] is Section:
            return _options(key, value)
        return types.MappingProxyType({k: coerce(f"{key}.{k}", v, args[1]) for k, v in value.items()})
    raise TypeError(f"config.{key}: no coercion for the declared type {tp!r}")


def _options(key: str, values: Mapping[str, Any]) -> Mapping[str, Section]:
    """Registered entries' options: every registered one (its defaults unless given), each checked."""
    from posttrain.config.registry import OPTIONS

    unknown = [name for name in values if name not in OPTIONS]
    if unknown:
        raise UserError(unknown_key(f"{key}.{unknown[0]}", sorted(OPTIONS)), key=f"{key}.{unknown[0]}")
    out = {}
    for name, cls in OPTIONS.items():
        value = values.get(name, {})
        out[name] = value if isinstance(value, cls) else cls.from_dict(value, f"{key}.{name}")
    return types.MappingProxyType(out)


def check_value(key: str, value, f: dataclasses.Field, kind: str) -> None:
    """Raise a UserError naming `key` when `value` breaks `f`'s declaration of `kind`."""
    declared, *arg = f.metadata[CHECK]
    if kind == "choice" and declared == "choice" and value not in arg[0]:
        raise UserError(f"config.{key}={value!r}: expected one of {', '.join(map(repr, arg[0]))}", key=key)
    if kind == "bounds" and declared == "bounds":
        bounds = [(op, b) for op, b in zip(COMPARE, arg[0]) if b is not None]
        if not all(COMPARE[op](value, b) for op, b in bounds):
            raise UserError(
                f"config.{key}={value!r}: expected {' and '.join(f'{op} {b}' for op, b in bounds)}", key=key
            )
    if kind == "parse" and declared == "parse":
        try:
            arg[0](value)
        except ValueError as e:
            raise UserError(f"config.{key}={value!r}: {e}", key=key) from None


def unknown_key(key: str, valid: list[str]) -> str:
    """The message for a key that is not a field: the valid keys at its level."""
    parent = key.rpartition(".")[0]
    return (
        f"unknown config key 'config.{key}'; valid keys of config{'.' + parent if parent else ''}: {', '.join(valid)}"
    )


def check_tree(cls, values: Mapping[str, Any], key: str, kind: str) -> None:
    """Check the `kind` declarations of every field in the nested mapping `values`, nested sections
    included, before any section is built: so every type is checked before any choice, and so on."""
    if not isinstance(values, Mapping):
        raise UserError(f"config.{key}={values!r}: expected a section (a mapping of its keys)", key=key)
    fields = {f.name: f for f in value_fields(cls)}
    for name in values:
        if name not in fields:
            raise UserError(unknown_key(join(key, name), list(fields)), key=join(key, name))
    for name, value in values.items():
        f = fields[name]
        if name in nested_sections(cls):
            if not isinstance(value, Section):
                check_tree(nested_sections(cls)[name], value, join(key, name), kind)
        elif kind == "type":
            coerce(join(key, name), value, hint(cls, f))
        else:
            check_value(join(key, name), coerce(join(key, name), value, hint(cls, f)), f, kind)


def undeclared(cls) -> list[str]:
    """The dotted keys under section class `cls` whose field declares no check nor a reason."""
    out = []
    for f in value_fields(cls):
        if CHECK not in f.metadata:
            out.append(join(cls.KEY, f.name))
        elif f.name in nested_sections(cls):
            out += undeclared(nested_sections(cls)[f.name])
    return out
