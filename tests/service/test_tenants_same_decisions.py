"""With tenants and priority bands, the simulator and the daemon make the same prefill
decisions (issue 23): the daemon's Submit carries each request's class into the core
item, so the queue order rule (weighted fair queueing over predicted ns by default, and
the baselines) takes the same requests in the same order in both shells."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from fulcrum.config.tenants import TenantsSettings
from fulcrum.core.prefill.rules import rules_by_name
from fulcrum.core.tenants import TenantTable
from fulcrum.sim.engine import simulate
from fulcrum.sim.policies import get_policy_set
from fulcrum.sim.workload import Request
from tests.service.test_prefill_same_decisions import CLUSTER, replay, workload

TENANTS = TenantsSettings.model_validate(
    {"classes": {"heavy": {"weight": 1.0}, "light": {"weight": 3.0}}})


def classed(seed: int) -> list[Request]:
    rng = np.random.default_rng(seed + 100)
    names = ["heavy", "light", "", "anon-7"]
    return [replace(r, tenant=names[int(rng.integers(0, 4))],
                    priority=int(rng.choice([0, 0, 0, 1, -1])))
            for r in workload(seed)]


@pytest.mark.parametrize("policy", ["default", "strict_rr", "vtc_tokens"])
async def test_simulator_and_daemon_decide_alike_with_tenants(policy: str) -> None:
    reqs = classed(3)
    cluster = CLUSTER.with_overrides(tenants=TENANTS.model_dump())
    ps = get_policy_set(policy)
    events: list[tuple[object, ...]] = []
    simulate(cluster, ps, reqs, seed=0, trace=events.append)
    table = TenantTable(TENANTS.to_policy())
    classes = {str(r.rid): table.resolve(r.tenant, r.priority, r.ttft_slo_ms) for r in reqs}
    rules: str | list[str] = ps.rules
    if ps.order:  # the daemon's prefill.rules naming the same steps
        rules = [r.name for r in rules_by_name(ps.rules).with_order(ps.order).steps]
    seen = await replay(events, rules, table, classes)
    assert seen["batch"] >= 20 and seen["pull"] > seen["batch"]
    # Fair-share precedence is the default order's alone, and it acted here.
    assert (seen["boosted"] > 0) == (policy == "default"), seen
