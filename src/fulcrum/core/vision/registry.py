"""Registry of VE placement policies: name -> factory.

``random_machine`` (the published rule) is the default; ``power_of_two`` and
``least_patches`` are baselines for comparison. Unknown names raise ``ValueError``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Final

from fulcrum.core.vision import least_patches, power_of_two, random_machine
from fulcrum.core.vision.base import VisionPolicy

__all__ = ["DEFAULT_POLICY", "REGISTRY", "make_policy", "policy_names"]

DEFAULT_POLICY: Final = random_machine.NAME

REGISTRY: Final[Mapping[str, Callable[[], VisionPolicy]]] = MappingProxyType(
    {
        random_machine.NAME: random_machine.RandomMachine,
        power_of_two.NAME: power_of_two.PowerOfTwo,
        least_patches.NAME: least_patches.LeastPatches,
    }
)


def policy_names() -> tuple[str, ...]:
    """Registered policy names, sorted."""
    return tuple(sorted(REGISTRY))


def make_policy(name: str) -> VisionPolicy:
    """A new policy by registry name.

    Raises:
        ValueError: ``name`` is not registered (the message lists the known names).
    """
    try:
        factory = REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"policy: unknown VE policy {name!r}; known: {', '.join(policy_names())}"
        ) from None
    return factory()
