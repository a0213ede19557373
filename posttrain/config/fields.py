"""Typed config sections: frozen dataclasses whose fields declare the values they take.

A section is built from its ConfigDict node (`Section.from_config`), which stays the one source of
default values: fields have no defaults, and a key without a field (or a field without a key) is an
error. Building checks each field's declaration (`choice`, `bounded`), then the section's
cross-field rules (`check_rules`); a bad value is a `UserError` naming the key. Imports no jax.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
import types
import typing
from typing import Any, ClassVar

from posttrain.errors import UserError

CHOICE, BOUNDS = "choice", "bounds"
KINDS = (CHOICE, BOUNDS)  # the order a field's declarations are checked in
COMPARE = {">=": operator.ge, ">": operator.gt, "<=": operator.le, "<": operator.lt}  # bounded's order


def choice(values: tuple) -> Any:
    """A field whose value is one of `values`."""
    return dataclasses.field(metadata={CHOICE: values})


def bounded(*, ge=None, gt=None, le=None, lt=None) -> Any:
    """A number field bounded below (>= ge or > gt) and/or above (<= le or < lt)."""
    return dataclasses.field(metadata={BOUNDS: (ge, gt, le, lt)})


def check_value(key: str, value, field: dataclasses.Field, kind: str) -> None:
    """Raise a UserError naming `key` when `value` breaks `field`'s declaration of `kind`."""
    if kind == CHOICE and CHOICE in field.metadata and value not in field.metadata[CHOICE]:
        valid = ", ".join(map(repr, field.metadata[CHOICE]))
        raise UserError(f"config.{key}={value!r}: expected one of {valid}", key=key)
    if kind == BOUNDS and BOUNDS in field.metadata:
        bounds = [(op, b) for op, b in zip(COMPARE, field.metadata[BOUNDS]) if b is not None]
        if not all(COMPARE[op](value, b) for op, b in bounds):
            raise UserError(
                f"config.{key}={value!r}: expected {' and '.join(f'{op} {b}' for op, b in bounds)}", key=key
            )


def join(key: str, name: str) -> str:
    """The dotted key of `name` in the section at `key` ("" for the top)."""
    return f"{key}.{name}" if key else name


def section(cls: type) -> type:
    """`@section`: a frozen, keyword-only dataclass (a section's fields have no defaults)."""
    return dataclasses.dataclass(frozen=True, kw_only=True)(cls)


@section
class Section:
    """A config section. `KEY`: where it sits in the run config (its default `key`)."""

    KEY: ClassVar[str] = ""
    key: str = dataclasses.field(default="", repr=False, compare=False)

    def __post_init__(self):
        own = [f for f in value_fields(type(self)) if f.name not in nested_sections(type(self))]
        for kind in KINDS:  # nested sections checked themselves when they were built
            for f in own:
                check_value(join(self.key, f.name), getattr(self, f.name), f, kind)
        self.check_rules()

    def check_rules(self) -> None:
        """The section's cross-field rules: raise a UserError naming the key (none by default)."""

    @classmethod
    def from_config(cls, node, key: str | None = None):
        """The section of ConfigDict `node`, checked; `key` (default `KEY`): where `node` sits."""
        key = cls.KEY if key is None else key
        values = {}
        for f, value in node_values(cls, node, key):
            if f.name in nested_sections(cls):
                value = nested_sections(cls)[f.name].from_config(value, join(key, f.name))
            elif isinstance(value, list):
                value = tuple(value)
            elif hasattr(value, "to_dict"):  # a free-form group (sharding.rules): a read-only dict
                value = types.MappingProxyType(value.to_dict())
            values[f.name] = value
        return cls(key=key, **values)


@functools.cache
def value_fields(cls) -> tuple[dataclasses.Field, ...]:
    """The fields of `cls` that hold config keys (not `key`)."""
    return tuple(f for f in dataclasses.fields(cls) if f.name != "key")


@functools.cache
def nested_sections(cls) -> dict[str, type[Section]]:
    """Field name → section class, for the fields of `cls` that are sections themselves."""
    hints = typing.get_type_hints(cls)
    return {
        f.name: hints[f.name]
        for f in value_fields(cls)
        if isinstance(hints[f.name], type) and issubclass(hints[f.name], Section)
    }


def node_values(cls, node, key: str) -> list[tuple[dataclasses.Field, Any]]:
    """(field, value) for each field of `cls`, from ConfigDict `node`; every key of `node` must be a
    field and every field a key of `node` (a TypeError: the code, not the run, is wrong)."""
    fields = value_fields(cls)
    names, keys = {f.name for f in fields}, set(node.keys())
    if names != keys:
        raise TypeError(
            f"config.{key or '<top>'} and {cls.__name__} disagree: keys without a field: "
            f"{sorted(keys - names)}, fields without a key: {sorted(names - keys)}"
        )
    return [(f, node[f.name]) for f in fields]


def check_tree(cls, node, key: str, kind: str) -> None:
    """Check the `kind` declarations of every field under ConfigDict `node`, nested sections included,
    before anything is built (so every section's enums can be checked before any range)."""
    for f, value in node_values(cls, node, key):
        if f.name in nested_sections(cls):
            check_tree(nested_sections(cls)[f.name], value, join(key, f.name), kind)
        else:
            check_value(join(key, f.name), value, f, kind)
