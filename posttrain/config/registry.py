"""Registries: the named implementations of each extension point, filled by the modules that define
them (and by the user's), and the config keys that name them.

    from posttrain.config.registry import POLICY_LOSSES

    @POLICY_LOSSES.register("mine", options=MyLossOptions)   # options: a Section of the entry's own keys
    def my_loss(inputs, rl): ...

An entry's options section sits at `rl.options.<name>` (`--config.rl.options.mine.scale=2`); its
fields declare their checks like any other. A config key that names an entry declares
`fields.registered(default, "<key>")`, and `check_registered` refuses an unknown name at start-up,
naming the registered ones (the registries fill as their modules are imported, which the config
does not do). Imports no jax.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

from posttrain.errors import UserError


class Registry:
    """Named entries of one extension point; `key` is the config key that names one (or "")."""

    def __init__(self, key: str, what: str):
        self.key, self.what = key, what
        self._entries: dict[str, Any] = {}
        self._families: dict[str, Any] = {}
        REGISTRIES[key] = self

    def register(self, name: str, entry: Any = None, *, options: type | None = None) -> Any:
        """Add `entry` under `name` (used as a decorator when `entry` is omitted); `options`: a
        Section of the entry's own config keys, at `rl.options.<name>`."""

        def add(entry):
            if name in self._entries:
                raise ValueError(f"{self.what} {name!r} is already registered")
            if options is not None:
                if name in OPTIONS:
                    raise ValueError(f"options {name!r} are already registered (rl.options.{name})")
                OPTIONS[name] = options
            self._entries[name] = entry
            return entry

        return add if entry is None else add(entry)

    def register_family(self, prefix: str, resolve: Any) -> None:
        """Entries named "<prefix>:<member>" (`rl.domains=rg:chain_sum`), made on demand: `resolve(member)`
        returns the entry or raises a UserError naming the valid members."""
        if prefix in self._families or prefix in self._entries:
            raise ValueError(f"{self.what} family {prefix!r} is already registered")
        self._families[prefix] = resolve

    def unregister(self, name: str) -> None:
        """Remove `name` (and its options): tests that register entries of their own clean up."""
        self._entries.pop(name, None)
        OPTIONS.pop(name, None)

    def __getitem__(self, name: str) -> Any:
        prefix, colon, member = name.partition(":")
        if colon and prefix in self._families:
            return self._families[prefix](member)
        if name not in self._entries:
            raise UserError(
                f"config.{self.key}={name!r}: no such {self.what}; registered: {', '.join(sorted(self))}", key=self.key
            )
        return self._entries[name]

    def __contains__(self, name: str) -> bool:
        """Whether `name` is an entry or names a registered family ("rg:..."; its member is checked when resolved)."""
        prefix, colon, _ = name.partition(":")
        return name in self._entries or bool(colon and prefix in self._families)

    def __iter__(self) -> Iterator[str]:
        return iter([*self._entries, *(f"{p}:<name>" for p in self._families)])

    def names(self) -> tuple[str, ...]:
        """The registered names, in registration order."""
        return tuple(self._entries)


REGISTRIES: dict[str, Registry] = {}
OPTIONS: dict[str, type] = {}  # entry name → its options section (rl.options.<name>)

POLICY_LOSSES = Registry("rl.loss_type", "policy loss")  # rl.algo.losses
ADVANTAGES = Registry("rl.advantage", "advantage estimator")  # rl.algo.advantages
KL_ESTIMATORS = Registry("rl.kl_estimator", "KL estimator")  # rl.algo.kl
ENVIRONMENTS = Registry("rl.env", "environment")  # rl.envs
DOMAINS = Registry("rl.domains", "task domain")  # rl.tasks.domains
VERIFIERS = Registry("verifier", "verifier")  # rl.verifiers: a task record's "verifier", by its task type
USER_VERIFIERS = Registry("rl.verifiers", "user verifier")  # functions registered from Python (rl.tasks)


def check_registered(section) -> None:
    """Refuse a value of a `registered` field of `section` (nested sections included) that names no
    entry of its registry, naming the registered ones."""
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        declared = f.metadata.get("check", ())  # (fields.CHECK)
        if declared and declared[0] == "registered":
            REGISTRIES[declared[1]][value]
        elif dataclasses.is_dataclass(value):
            check_registered(value)
