"""Registry of VE placement policies (:class:`fulcrum.core.registry.Registry`).

``random_machine`` (the published rule) is the default; ``power_of_two`` and
``least_patches`` are baselines for comparison. None takes parameters (``NoParams``).
Unknown names raise ``ValueError``.
"""

from __future__ import annotations

from typing import Any, Final

from fulcrum.core.registry import Registry
from fulcrum.core.vision import least_patches, power_of_two, random_machine
from fulcrum.core.vision.base import VisionPolicy

__all__ = ["DEFAULT_POLICY", "REGISTRY", "make_policy", "policy_names"]

DEFAULT_POLICY: Final = random_machine.NAME

REGISTRY: Final[Registry[VisionPolicy]] = Registry("vision")
REGISTRY.register(random_machine.NAME, lambda _: random_machine.RandomMachine())
REGISTRY.register(power_of_two.NAME, lambda _: power_of_two.PowerOfTwo())
REGISTRY.register(least_patches.NAME, lambda _: least_patches.LeastPatches())


def policy_names() -> tuple[str, ...]:
    """Registered policy names, sorted."""
    return tuple(sorted(REGISTRY))


def make_policy(name: str, params: Any = None) -> VisionPolicy:
    """A new policy by registry name (``params``: its parameters, None for defaults).

    Raises:
        ValueError: ``name`` is not registered (the message lists the known names).
    """
    if name not in REGISTRY:
        raise ValueError(f"policy: unknown VE policy {name!r}; known: {', '.join(policy_names())}")
    return REGISTRY.make(name, params)
