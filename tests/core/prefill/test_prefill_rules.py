"""Prefill rules as strategies: the registry, rule lists, the shipped sets as lists, and
the YAML form validated by the settings (and so by ``fulcrum check-config``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from fulcrum.cli import main as fulcrum_main
from fulcrum.config.prefill import PrefillSettings
from fulcrum.core.prefill.balancer import BalancerConfig, Offer, PrefillBalancer, Queued
from fulcrum.core.prefill.rules import (
    DEFAULT,
    KINDS,
    PUBLISHED,
    RULE_SETS,
    RULES,
    parse_rules,
    rules_by_name,
)
from fulcrum.core.prefill.rules.base import PullerRule
from fulcrum.core.registry import NoParams

S = 1_000_000_000
BOUNDS = (16_384, 65_536, 262_144)
CAPS = (8 * S, 32 * S, 128 * S, 512 * S)


def test_shipped_sets_are_rule_lists() -> None:
    assert RULE_SETS[PUBLISHED].names() == (
        "own_tier", "early_binding", "most_quota", "orphan_gate")
    assert RULE_SETS[DEFAULT].names() == (
        "urgency", "late_binding", "emptiest_rank", "orphan_gate")
    for rs in RULE_SETS.values():
        assert {r.kind for r in rs.steps} == set(KINDS)
        assert all(r.name in RULES for r in rs.steps)


def test_a_yaml_list_equals_the_shipped_default() -> None:
    listed = parse_rules([{"late_binding": {"horizon_steps": 0.1}}, "emptiest_rank",
                          "urgency", "orphan_gate"])
    assert listed.steps == RULE_SETS[DEFAULT].steps
    assert listed.names() == RULE_SETS[DEFAULT].names()
    # a kind left out takes the published rule
    assert parse_rules(["urgency"]).names() == (
        "urgency", "early_binding", "most_quota", "orphan_gate")


@pytest.mark.parametrize(("spec", "match"), [
    (["urgncy"], r"rules\[0\] urgncy: .*did you mean 'urgency'"),
    ([{"late_binding": {"horizon_steps": 0}}], r"rules\[0\] late_binding: .*horizon_steps"),
    ([{"late_binding": {"horizn": 1}}], r"did you mean 'horizon_steps'"),
    (["urgency", "own_tier"], r"rules\[1\] own_tier: a second source rule"),
    ([{"urgency": {"help_divisor": 0}}], r"help_divisor: must be >= 1"),
    ([{"a": {}, "b": {}}], r"rules\[0\]: must be a rule name"),
    ([{"urgency": 3}], r"parameters must be a mapping"),
    ([], "at least one entry"),
    ("nope", "known"),
])
def test_bad_rule_entries_name_index_and_rule(spec: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        rules_by_name(spec)  # type: ignore[arg-type]


def test_settings_accept_a_rule_list_and_refuse_a_bad_entry() -> None:
    ok = PrefillSettings(rules=["shorter_tiers", {"late_binding": {"horizon_steps": 0.2}}])
    assert rules_by_name(ok.rules).rank_horizon_steps == 0.2
    with pytest.raises(ValueError, match=r"rules\[1\] urgncy"):
        PrefillSettings(rules=["emptiest_rank", "urgncy"])


def test_check_config_names_the_bad_entry(tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("prefill:\n  rules:\n    - late_binding: {horizon_steps: -1}\n")
    with pytest.raises(SystemExit) as exc:
        fulcrum_main(["check-config", str(bad)])
    err = capsys.readouterr()
    assert exc.value.code != 0
    assert "prefill.rules" in err.err + err.out
    assert "rules[0] late_binding" in err.err + err.out
    good = tmp_path / "good.yaml"
    good.write_text("prefill:\n  rules: [shorter_tiers, emptiest_rank]\n")
    assert fulcrum_main(["check-config", str(good)]) == 0


def test_custom_rules_change_decisions_by_strategy_only() -> None:
    """late binding with the published puller: the engine with most quota takes the head."""
    rules = parse_rules(["late_binding", "most_quota"])
    bal = PrefillBalancer(BalancerConfig(BOUNDS, CAPS, 8.0, 1.0, 256, rules))
    bal.add_engine("a", 2)
    bal.add_engine("b", 2)
    bal.enqueue(Queued("r", 100, 0, 0, S // 100, 0))
    offers = [Offer("a", S // 2, [0, 0]), Offer("b", S, [S // 20, S // 20])]
    assert bal.choose_puller(0, offers) == 1
    default = PrefillBalancer(BalancerConfig(BOUNDS, CAPS, 8.0, 1.0, 256))
    default.add_engine("a", 2)
    default.add_engine("b", 2)
    default.enqueue(Queued("r", 100, 0, 0, S // 100, 0))
    assert default.choose_puller(0, offers) == 0  # emptiest least-loaded rank


class _LeastQuota(PullerRule):
    name = "least_quota"

    def rank(self, offer):  # type: ignore[no-untyped-def]
        return (offer.remaining_ns,)


def test_a_new_rule_is_one_class_and_one_registry_line() -> None:
    RULES.register("least_quota", lambda p: _LeastQuota(), NoParams, kind="puller")
    try:
        rules = rules_by_name(["least_quota"])
        bal = PrefillBalancer(BalancerConfig(BOUNDS, CAPS, 8.0, 1.0, 256, rules))
        for e in ("a", "b", "c"):
            bal.add_engine(e, 1)
        bal.enqueue(Queued("r", 100, 0, 0, S // 100, 0))
        offers = [Offer(e, q * S, [0]) for e, q in (("a", 3), ("b", 2), ("c", 2))]
        assert bal.choose_puller(0, offers) == 1  # the least quota, ties the first
        assert PrefillSettings(rules=["least_quota"]).rules == ["least_quota"]
    finally:
        RULES.unregister("least_quota")
