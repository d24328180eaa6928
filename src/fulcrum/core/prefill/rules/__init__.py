"""Prefill rule sets: named lists of small rules, one per extension point.

A rule set (:class:`Rules`) is a list of rules from :data:`RULES`, at most one of each
kind (``source``, ``binding``, ``puller``, ``orphan``, ``order``; see
:mod:`fulcrum.core.prefill.rules.base`); a kind left out takes its published rule. The
queue ``order`` (issue 23, :mod:`fulcrum.core.prefill.rules.order`) defaults to
``wfq_ns`` in every set: with one tenant at one priority it is FIFO, the order before
tenants existed; ``fifo``, ``strict_rr`` and ``vtc_tokens`` are the baselines. The
shipped sets (:data:`RULE_SETS`):

* ``published`` (the letter of the design): ``own_tier``, ``early_binding``,
  ``most_quota``, ``orphan_gate``;
* ``default`` (what the simulator measured best, see BENCHMARKS.md):
  ``late_binding`` (``horizon_steps: 0.1``), ``emptiest_rank``, ``urgency``,
  ``orphan_gate``.

In YAML, ``prefill.rules`` is a set's name or a list whose entries are a rule name or a
one-key mapping of a rule name to its parameters::

    rules:
      - late_binding: {horizon_steps: 0.2}
      - emptiest_rank
      - shorter_tiers

:func:`rules_by_name` turns either form into :class:`Rules`; a bad entry raises
``ValueError`` naming its index and rule (``rules[0] late_binding.horizon_steps: ...``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, cast

from fulcrum.core.prefill.rules import binding, order, orphan, puller, source
from fulcrum.core.prefill.rules.base import (
    ALL_KINDS,
    KINDS,
    RULES,
    BindingRule,
    OrderRule,
    OrphanRule,
    PullerRule,
    Rule,
    SourceRule,
    TierView,
)

PUBLISHED: Final = "published"
DEFAULT: Final = "default"
CUSTOM: Final = "custom"

KIND_DEFAULTS: Final[Mapping[str, Rule]] = {
    "source": source.OwnTier(),
    "binding": binding.EarlyBinding(),
    "puller": puller.MostQuota(),
    "orphan": orphan.OrphanGate(),
    "order": order.WfqNs(),
}
"""The rule a set uses for a kind it does not list (the published design's)."""


def _resolve(steps: Sequence[Rule]) -> dict[str, Rule]:
    chosen: dict[str, Rule] = {}
    for i, rule in enumerate(steps):
        if rule.kind in chosen:
            raise ValueError(
                f"rules[{i}] {rule.name}: a second {rule.kind} rule "
                f"(already {chosen[rule.kind].name!r}; one per kind: {', '.join(ALL_KINDS)})"
            )
        chosen[rule.kind] = rule
    return {k: chosen.get(k, KIND_DEFAULTS[k]) for k in ALL_KINDS}


@dataclass(frozen=True, slots=True)
class Rules:
    """A named rule set: ``steps`` (at most one rule per kind) and, resolved from them,
    the rule of each kind (``source``, ``binding``, ``puller``, ``orphan``, ``order``)."""

    name: str = DEFAULT
    steps: tuple[Rule, ...] = ()
    source: SourceRule = field(init=False, repr=False, compare=False)
    binding: BindingRule = field(init=False, repr=False, compare=False)
    puller: PullerRule = field(init=False, repr=False, compare=False)
    orphan: OrphanRule = field(init=False, repr=False, compare=False)
    order: OrderRule = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        kinds = _resolve(self.steps)
        object.__setattr__(self, "source", cast(SourceRule, kinds["source"]))
        object.__setattr__(self, "binding", cast(BindingRule, kinds["binding"]))
        object.__setattr__(self, "puller", cast(PullerRule, kinds["puller"]))
        object.__setattr__(self, "orphan", cast(OrphanRule, kinds["orphan"]))
        object.__setattr__(self, "order", cast(OrderRule, kinds["order"]))

    @property
    def rank_horizon_steps(self) -> float | None:
        """Late binding's horizon in step budgets (None: early binding)."""
        b = self.binding
        return b.horizon_steps if isinstance(b, binding.LateBinding) else None

    @property
    def work_conserving(self) -> bool:
        """True when engines with room help other tiers."""
        return self.source.helps

    @property
    def urgency(self) -> bool:
        """True under the ``urgency`` source rule."""
        return isinstance(self.source, source.Urgency)

    @property
    def orphan_gate(self) -> bool:
        """True under the ``orphan_gate`` orphan rule."""
        return isinstance(self.orphan, orphan.OrphanGate)

    def names(self) -> tuple[str, ...]:
        """The rule of each kind, by name (source, binding, puller, orphan; the queue
        order is :attr:`order`'s name)."""
        return (self.source.name, self.binding.name, self.puller.name, self.orphan.name)

    def with_order(self, name: str) -> Rules:
        """This set with the queue order rule ``name`` (ValueError when unknown)."""
        rule = RULES.make(name)
        if rule.kind != "order":
            raise ValueError(f"order: {name!r} is a {rule.kind} rule, not a queue order")
        steps = (*(r for r in self.steps if r.kind != "order"), rule)
        return Rules(self.name if name == self.order.name else f"{self.name}+{name}", steps)


RULE_SETS: Final[dict[str, Rules]] = {
    PUBLISHED: Rules(PUBLISHED, (
        source.OwnTier(), binding.EarlyBinding(), puller.MostQuota(), orphan.OrphanGate())),
    DEFAULT: Rules(DEFAULT, (
        binding.LateBinding(0.1), puller.EmptiestRank(), source.Urgency(),
        orphan.OrphanGate())),
}
"""Named rule sets: ``published`` (the letter of the design) and ``default``."""

RuleSpec = str | Sequence[str | Mapping[str, Any]]
"""A rule set as YAML gives it: a set's name or a list of rule entries."""


def _entry(i: int, raw: object) -> Rule:
    if isinstance(raw, str):
        name, params = raw, None
    elif isinstance(raw, Mapping) and len(raw) == 1:
        name, params = next(iter(raw.items()))
        if params is not None and not isinstance(params, Mapping):
            raise ValueError(f"rules[{i}] {name}: parameters must be a mapping")
    else:
        raise ValueError(f"rules[{i}]: must be a rule name or a one-key mapping "
                         "{name: {parameters}}")
    try:
        return RULES.make(str(name), params)
    except ValueError as err:
        raise ValueError(f"rules[{i}] {name}: {err}") from None


def parse_rules(spec: Sequence[object], name: str = CUSTOM) -> Rules:
    """A rule set from a YAML list (entries: a rule name or ``{name: {params}}``);
    ValueError naming the entry's index and rule."""
    if not spec:
        raise ValueError("rules: a rule list needs at least one entry")
    return Rules(name, tuple(_entry(i, raw) for i, raw in enumerate(spec)))


def rules_by_name(spec: RuleSpec) -> Rules:
    """The rule set ``spec`` names, or the one its list describes; ValueError naming the
    known sets or the bad entry otherwise."""
    if isinstance(spec, str):
        try:
            return RULE_SETS[spec]
        except KeyError:
            known = ", ".join(RULE_SETS)
            raise ValueError(f"rules: unknown name {spec!r} (known: {known})") from None
    return parse_rules(list(spec))


__all__ = [
    "ALL_KINDS",
    "CUSTOM",
    "DEFAULT",
    "KINDS",
    "KIND_DEFAULTS",
    "PUBLISHED",
    "RULES",
    "RULE_SETS",
    "BindingRule",
    "OrderRule",
    "OrphanRule",
    "PullerRule",
    "Rule",
    "RuleSpec",
    "Rules",
    "SourceRule",
    "TierView",
    "parse_rules",
    "rules_by_name",
]
