"""Registry of decode placement policies (:class:`fulcrum.core.registry.Registry`).

Each policy module owns its parameter dataclass (``NoParams`` when it takes none) and a
``from_params`` factory; it registers here with one line, naming the branch labels its
decisions carry (``branches``, default ``("",)``). The configuration derives
``decode.policy`` and the ``decode.<policy>.*`` sections from this registry, and the
daemon's table its metric labels.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from fulcrum.core.decode import (
    dual,
    least_kv,
    least_requests,
    power_of_two,
    round_robin,
    step_time,
)
from fulcrum.core.decode.policy import DecodePolicy
from fulcrum.core.registry import Registry

REGISTRY: Final[Registry[DecodePolicy]] = Registry("decode")
REGISTRY.register(dual.NAME, dual.from_params, dual.DualParams, branches=dual.BRANCHES)
REGISTRY.register(step_time.NAME, step_time.from_params, step_time.StepTimeParams)
REGISTRY.register(least_requests.NAME, least_requests.from_params)
REGISTRY.register(least_kv.NAME, least_kv.from_params)
REGISTRY.register(round_robin.NAME, round_robin.from_params)
REGISTRY.register(power_of_two.NAME, power_of_two.from_params)

DEFAULT_POLICY: Final = dual.NAME
#: The shipped policies (a test-only policy registered later is in ``REGISTRY.names()``).
POLICY_NAMES: Final[tuple[str, ...]] = REGISTRY.names()
#: Branch label of a decision from a policy that declares none.
NO_BRANCHES: Final = ("",)


def _known(name: str) -> None:
    if name not in REGISTRY:
        known = ", ".join(sorted(REGISTRY))
        raise ValueError(f"policy: unknown decode policy {name!r} (known: {known})")


def make_policy(name: str, params: Any = None) -> DecodePolicy:
    """Build the policy called ``name`` from its parameter dataclass, a raw mapping of its
    parameters, or None (its defaults); raises ValueError for an unknown name or a bad
    parameter (``decode.<name>.<key>: ...``)."""
    _known(name)
    return REGISTRY.make(name, params)


def branches(name: str) -> tuple[str, ...]:
    """The branch labels the decisions of policy ``name`` carry."""
    _known(name)
    labels: tuple[str, ...] = REGISTRY.entry(name).attrs.get("branches", NO_BRANCHES)
    return labels


def params_for(name: str, values: Mapping[str, Any]) -> Any:
    """The parameter dataclass of policy ``name`` from the keys of ``values`` it declares
    (the others are ignored: one mapping may carry several policies' parameters)."""
    _known(name)
    own = {f for f in REGISTRY.entry(name).params.__dataclass_fields__}
    return REGISTRY.parse(name, {k: v for k, v in values.items() if k in own})
