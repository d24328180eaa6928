"""Registry of decode placement policies: name -> factory(DecodeParams) -> policy."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Final

from fulcrum.core.decode import (
    dual,
    least_kv,
    least_requests,
    power_of_two,
    round_robin,
    step_time,
)
from fulcrum.core.decode.policy import DecodeParams, DecodePolicy

DEFAULT_POLICY: Final = dual.NAME

REGISTRY: Final[Mapping[str, Callable[[DecodeParams], DecodePolicy]]] = MappingProxyType(
    {
        dual.NAME: dual.from_params,
        step_time.NAME: step_time.from_params,
        least_requests.NAME: least_requests.from_params,
        least_kv.NAME: least_kv.from_params,
        round_robin.NAME: round_robin.from_params,
        power_of_two.NAME: power_of_two.from_params,
    }
)

POLICY_NAMES: Final[tuple[str, ...]] = tuple(REGISTRY)


def make_policy(name: str, params: DecodeParams | None = None) -> DecodePolicy:
    """Build the policy called ``name``; raises ValueError for an unknown name."""
    try:
        factory = REGISTRY[name]
    except KeyError:
        known = ", ".join(sorted(REGISTRY))
        raise ValueError(f"policy: unknown decode policy {name!r} (known: {known})") from None
    return factory(params if params is not None else DecodeParams())
