"""One settings schema for daemon and simulator (issue 19, item 3): the cluster YAML
embeds the daemon's prefill and decode sections, so every daemon setting of those
balancers is accepted under the same name with the same default, and reaches the
simulated balancer."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel

from fulcrum.config.decode import DecodeSettings
from fulcrum.config.prefill import PrefillSettings
from fulcrum.core.prefill.rules import RULE_SETS
from fulcrum.sim.cluster import Cluster, load_cluster
from fulcrum.sim.engine import Simulator
from fulcrum.sim.policies import get_policy_set

#: Daemon keys the simulator deliberately defaults differently (and why).
DIFFERENT_DEFAULT = {("decode", "step_time"): "None: the step_time policy gets the "
                     "simulated GPUs' own step model"}


@pytest.mark.parametrize(("section", "daemon"), [("prefill", PrefillSettings),
                                                  ("decode", DecodeSettings)])
def test_every_daemon_setting_is_a_cluster_setting_of_the_same_name(
        section: str, daemon: type[BaseModel]) -> None:
    sim_cls = type(getattr(Cluster(), section))
    sim_fields = sim_cls.model_fields
    d_default = daemon()
    s_default = getattr(Cluster(), section)
    for name in daemon.model_fields:
        assert name in sim_fields, f"{section}.{name}: not accepted by the simulator"
        if (section, name) in DIFFERENT_DEFAULT:
            continue
        assert getattr(s_default, name) == getattr(d_default, name), f"{section}.{name}"


def _yaml_cluster(tmp_path: Path, text: str) -> Cluster:
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return load_cluster(p)


def test_daemon_names_reach_the_simulated_balancer(tmp_path: Path) -> None:
    c = _yaml_cluster(tmp_path, """
prefill:
  step_quota_ns: 500000000
  tier_batch_cap_ns: [4000000000, 16000000000, 64000000000, 256000000000]
  tier_horizon_ns: [1000000000, 4000000000, 15000000000, 60000000000]
  min_tier_dwell_ms: 3000
  cost_model: {a: 3.0}
  rules: [shorter_tiers, {late_binding: {horizon_steps: 0.2}}]
  cache_model: per_engine
  affinity_max_wait_ms: 1500
decode:
  dual: {long_factor: 3.0, short_slack: 2}
""")
    sim = Simulator(c, get_policy_set("default"), [], seed=0)
    cfg = sim.balancer.config
    assert cfg.step_quota_ns == 500_000_000
    assert cfg.batch_cap_ns == (4 * 10**9, 16 * 10**9, 64 * 10**9, 256 * 10**9)
    assert cfg.min_dwell_ns == 3 * 10**9
    assert cfg.rank_horizon_ns == 100_000_000
    assert cfg.rules.names()[:2] == ("shorter_tiers", "late_binding")
    assert sim.horizon == [10**9, 4 * 10**9, 15 * 10**9, 60 * 10**9]
    assert sim.model.a == 3.0 and sim.per_engine
    assert sim.affinity is not None and sim.affinity.max_wait_ns == 1_500_000_000
    params = c.decode.policy_params()
    assert (params.long_factor, params.short_slack) == (3.0, 2)
    # the published policy set keeps its own rules
    assert Simulator(c, get_policy_set("published"), [], seed=0).balancer.config.rules \
        == RULE_SETS["published"]


def test_former_simulator_names_translate_to_the_daemon_keys(tmp_path: Path) -> None:
    old = _yaml_cluster(tmp_path, """
prefill: {step_budget_ns: 500000000.0, horizon_s: [1, 4, 15, 60], batch_cap_s: [4, 16, 64, 256],
          round_s: 2, min_tier_dwell_s: 3, cost_a: 3.0}
cache: {mode: per_engine, affinity_max_wait_s: 1.5}
""")
    p = old.prefill
    assert p.step_quota_ns == 500_000_000 and p.round_period_ms == 2000
    assert p.tier_horizon_ns == [10**9, 4 * 10**9, 15 * 10**9, 60 * 10**9]
    assert p.tier_batch_cap_ns[0] == 4 * 10**9 and p.min_tier_dwell_ms == 3000
    assert p.cost_model.a == 3.0 and p.cache_model == "per_engine"
    assert p.affinity_max_wait_ms == 1500


def test_a_bad_daemon_value_is_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="tier_batch_cap_ns"):
        _yaml_cluster(tmp_path, "prefill: {tier_batch_cap_ns: [1, 2]}\n")
    with pytest.raises(ValueError, match=r"rules\[0\] urgncy"):
        _yaml_cluster(tmp_path, yaml.safe_dump({"prefill": {"rules": ["urgncy"]}}))
