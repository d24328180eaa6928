"""Engine-side prefill chunk planner (pure), re-exported from :mod:`fulcrum.core`.

See :mod:`fulcrum.core.prefill.chunks` for the rule: per-rank FIFO queues, one group
budget per step (the MIN over the ranks' budgets), the largest ``q`` the remaining budget
allows from the closed-form inverse of the cost model, at most 32,768 tokens per rank
per step, and splitting across steps without starvation.
"""

from fulcrum.core.cost import DEFAULT_COST_MODEL, MAX_CHUNK_TOKENS, CostModel
from fulcrum.core.prefill.chunks import (
    DEFAULT_FLOOR_FRACTION,
    Chunk,
    ChunkPlanner,
    PrefillTask,
    StepPlan,
    commit,
    plan_step,
    rank_budget,
    rank_budgets,
)

__all__ = [
    "DEFAULT_COST_MODEL",
    "DEFAULT_FLOOR_FRACTION",
    "MAX_CHUNK_TOKENS",
    "Chunk",
    "ChunkPlanner",
    "CostModel",
    "PrefillTask",
    "StepPlan",
    "commit",
    "plan_step",
    "rank_budget",
    "rank_budgets",
]
