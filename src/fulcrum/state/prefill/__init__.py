"""In-memory state of the prefill balancer: the daemon's shell around the core balancer.

The balancing itself -- tier queues, round demand and engine redistribution, who may
pull, batch taking -- is :class:`fulcrum.core.prefill.balancer.PrefillBalancer`, the
very object the simulator drives. This package adds only what a daemon needs around it,
one part per concern, composed by :class:`~fulcrum.state.prefill.state.PrefillState`:
futures of waiting submits and retained outcomes (``submits``), leases and
acknowledgements (``leasebook``), long-polling pulls (``dispatcher``), the cost-model
refit (``refit``) and the metrics export (``export``).

Life of a request (every transition is synchronous on the event loop, so each request is
in exactly one place at a time):

1. ``submit`` validates, predicts its cost with the model in force (ns, including the
   fixed step cost ``k``), queues it in the balancer and waits on a future.
2. It leaves the queue exactly once, by one of: being taken in a batch by an engine's
   pull (the future gets the :class:`Delivery`: outcome ``delivered``); its wait expiring
   (DEADLINE_EXCEEDED); its caller cancelling (``cancelled``); the daemon draining
   (UNAVAILABLE). A request whose caller has gone is never put in a batch.
3. Pulls are long polls: a pull that finds nothing it may take waits. When work arrives
   in a tier, the balancer chooses which waiting pull takes it (one woken at a time per
   tier); it takes its batch itself, then passes the wake on if work is left.

Engines follow the fleet (join/leave). Every round the balancer redistributes engines
across tiers; joins, leaves and a tier receiving work with no engine ("orphan") do so
at once. Engines report step times; a bounded window feeds a periodic refit of the
cost model, adopted only when better by the configured margin.
"""

from fulcrum.state.prefill.records import (
    LEASE_OUTCOMES,
    OUTCOMES,
    AckReply,
    Assignment,
    Batch,
    Delivery,
    PulledItem,
    balancer_config,
    wait_ns,
)
from fulcrum.state.prefill.state import PrefillState

__all__ = [
    "LEASE_OUTCOMES",
    "OUTCOMES",
    "AckReply",
    "Assignment",
    "Batch",
    "Delivery",
    "PrefillState",
    "PulledItem",
    "balancer_config",
    "wait_ns",
]
