"""The base of the placement tables' sections (``decode``, ``vision``).

Every key of such a section is reloadable: on SIGHUP the table's ``apply_settings``
(:class:`fulcrum.state.placement.PlacementTable`) applies all of them to the next call;
none is restart-only.
"""

from __future__ import annotations

from typing import Any

from fulcrum.config.policies import PolicySection, policy_fields
from fulcrum.core.registry import Registry


def add_policy_sections(namespace: dict[str, Any], registry: Registry[Any]) -> None:
    """Declare, in a section class body (``namespace`` is its ``vars()``), one field
    ``<policy>`` per policy of ``registry`` with parameters (its sub-section)."""
    annotations = namespace.setdefault("__annotations__", {})
    for name, (section, fld) in policy_fields(registry).items():
        annotations[name] = section
        namespace[name] = fld


class TableSection(PolicySection):
    """A placement table's section: ``policy`` (a name of the balancer's registry), one
    sub-section per policy with parameters, then lease, sweep, bound and metrics keys."""

    def params(self) -> Any:
        """The parameter dataclass of the policy in force (``NoParams`` when it has none)."""
        return self.policy_params()
