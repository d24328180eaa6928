"""One registry shape for every pluggable rule: name -> (parameter dataclass, factory).

Decode and vision policies, EPLB algorithms, prefill rules and the simulator's baselines
all register here the same way. A policy module owns its parameter dataclass (frozen,
with defaults; it validates itself in ``__post_init__`` and raises ``ValueError`` naming
the field) and a factory that turns parameters into the policy object. The registry adds
what every kind needs and nothing else:

- a duplicate name is refused when it is registered (``ValueError``);
- :meth:`Registry.parse` turns a YAML mapping into the parameter dataclass, refusing an
  unknown key with a "did you mean" hint and re-raising a bad value as ``ValueError``
  prefixed with ``<kind>.<name>.``;
- :meth:`Registry.make` builds the policy from a name and raw or parsed parameters;
- :meth:`Registry.names` lists the registered names (in registration order), which are
  also the metric labels.

A parameter is declared with :func:`knob` (default, description, bounds): the dataclass
checks the bounds with :func:`check_bounds` in its ``__post_init__``, and the
configuration derives its YAML section (same keys, defaults, bounds and descriptions)
from the same declaration.

Extra per-entry facts (an EPLB algorithm's promise, a policy's branch labels) ride in
``attrs``. Pure: no I/O, no logging, no clock.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Generic, TypeVar

T = TypeVar("T")

#: Bound keywords of :func:`knob`, with the comparison each one demands.
BOUNDS: dict[str, tuple[str, Callable[[Any, Any], bool]]] = {
    "gt": (">", lambda v, b: v > b),
    "ge": (">=", lambda v, b: v >= b),
    "lt": ("<", lambda v, b: v < b),
    "le": ("<=", lambda v, b: v <= b),
}


def knob(default: Any, description: str, **bounds: float) -> Any:
    """A parameter field: ``default``, a ``description`` naming its unit, and bounds
    (``gt``, ``ge``, ``lt``, ``le``) checked by :func:`check_bounds`."""
    unknown = set(bounds) - set(BOUNDS)
    if unknown:
        raise ValueError(f"knob: unknown bound {sorted(unknown)}")
    return field(default=default, metadata={"description": description, "bounds": bounds})


def check_bounds(params: Any) -> None:
    """Raise ``ValueError`` (``"<field>: must be <op> <bound>"``) for the first field of
    the dataclass ``params`` outside its :func:`knob` bounds (or a non-finite float)."""
    for f in dataclasses.fields(params):
        value = getattr(params, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{f.name}: must be finite")
        for key, bound in f.metadata.get("bounds", {}).items():
            op, ok = BOUNDS[key]
            if not ok(value, bound):
                raise ValueError(f"{f.name}: must be {op} {bound}")


@dataclass(frozen=True, slots=True)
class NoParams:
    """Parameters of a rule that takes none."""


@dataclass(frozen=True, slots=True)
class Entry(Generic[T]):
    """One registered rule.

    Attributes:
        name: registry name (YAML value and metric label).
        params: the parameter dataclass type (``NoParams`` when the rule takes none).
        factory: ``factory(params) -> T``.
        attrs: extra read-only facts about the rule (e.g. ``promise``, ``branches``).
    """

    name: str
    params: type[Any]
    factory: Callable[[Any], T]
    attrs: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))


def _hint(word: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(word, choices, n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


class Registry(Generic[T]):
    """Name -> :class:`Entry` for one kind of rule (``kind`` names it in messages)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, Entry[T]] = {}

    def register(
        self,
        name: str,
        factory: Callable[[Any], T],
        params: type[Any] = NoParams,
        **attrs: Any,
    ) -> Entry[T]:
        """Add a rule; raises ``ValueError`` if ``name`` is taken or ``params`` is not a
        dataclass type."""
        if name in self._entries:
            raise ValueError(f"{self.kind}: {name!r} is registered twice")
        if not (isinstance(params, type) and dataclasses.is_dataclass(params)):
            raise ValueError(f"{self.kind}.{name}: params must be a dataclass type")
        entry: Entry[T] = Entry(name, params, factory, MappingProxyType(dict(attrs)))
        self._entries[name] = entry
        return entry

    def unregister(self, name: str) -> None:
        """Remove a rule (tests that register a test-only rule clean up with this)."""
        self._entries.pop(name, None)

    def names(self) -> tuple[str, ...]:
        """Registered names, in registration order."""
        return tuple(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def entry(self, name: str) -> Entry[T]:
        """The entry for ``name``; ``ValueError`` listing the known names when unknown."""
        try:
            return self._entries[name]
        except KeyError:
            known = ", ".join(self._entries)
            raise ValueError(
                f"{self.kind}: unknown name {name!r} (known: {known})"
                f"{_hint(name, list(self._entries))}"
            ) from None

    def parse(self, name: str, raw: Mapping[str, Any] | None = None) -> Any:
        """The parameter dataclass of ``name`` built from ``raw`` (a YAML mapping).

        Raises ``ValueError`` for an unknown name, an unknown key (with a hint) or a value
        the dataclass refuses, prefixed ``<kind>.<name>.<key>``.
        """
        entry = self.entry(name)
        raw = dict(raw or {})
        fields = [f.name for f in dataclasses.fields(entry.params) if f.init]
        for key in raw:
            if key not in fields:
                raise ValueError(
                    f"{self.kind}.{name}.{key}: unknown parameter (known: "
                    f"{', '.join(fields) or 'none'}){_hint(str(key), fields)}"
                )
        try:
            return entry.params(**raw)
        except (TypeError, ValueError) as err:
            raise ValueError(f"{self.kind}.{name}.{err}") from None

    def make(self, name: str, params: Any = None) -> T:
        """Build the rule ``name``: ``params`` is its dataclass, a raw mapping or None
        (the defaults)."""
        entry = self.entry(name)
        if params is None or isinstance(params, Mapping):
            params = self.parse(name, params)
        elif not isinstance(params, entry.params):
            raise ValueError(
                f"{self.kind}.{name}: params must be {entry.params.__name__}, "
                f"not {type(params).__name__}"
            )
        return entry.factory(params)
