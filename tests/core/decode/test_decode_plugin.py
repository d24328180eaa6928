"""Adding a decode policy with one parameter: one module and one registry line.

The policy below is what such a module holds (its parameter dataclass, validated in
``__post_init__``, and the policy); the test registers it (the one registry line),
then a YAML naming it (``decode.policy`` and ``decode.<name>.*``) configures the daemon's
decode table, which places through it and counts under its branch labels. Nothing else
in the code base knows the policy.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import pytest
import yaml

from fulcrum.config import ConfigError, parse_settings
from fulcrum.core.decode import REGISTRY, Decision, FleetView, NoCapacity, make_policy
from fulcrum.core.decode.policy import decided
from fulcrum.core.registry import check_bounds, knob
from fulcrum.core.types import DecodeInstanceShape, Member, MemberKind
from fulcrum.errors import ResourceExhausted
from fulcrum.state.decode import DecodeState

NAME = "test_last_fit"


@dataclass(frozen=True, slots=True)
class LastFitParams:
    """Parameters of ``test_last_fit``."""

    skip: int = knob(0, "eligible GPUs skipped from the highest index down, GPUs", ge=0)

    def __post_init__(self) -> None:
        check_bounds(self)


@dataclass(frozen=True, slots=True)
class LastFit:
    """The highest-index eligible GPU after skipping ``skip`` of them."""

    skip: int = 0
    name: ClassVar[str] = NAME

    def select(
        self, view: FleetView, kv_tokens: int, rng: np.random.Generator, cursor: int = 0
    ) -> Decision | NoCapacity:
        fits = np.flatnonzero(view.headroom >= kv_tokens)
        gpu = int(fits[-1 - self.skip]) if fits.shape[0] > self.skip else -1
        return decided(view, kv_tokens, gpu, cursor, "last")


@pytest.fixture
def registered() -> Iterator[None]:
    REGISTRY.register(NAME, lambda p: LastFit(p.skip), LastFitParams, branches=("last",))
    try:
        yield
    finally:
        REGISTRY.unregister(NAME)


YAML = f"""
decode:
  policy: {NAME}
  {NAME}:
    skip: 1
  dual:
    long_factor: 3.0
"""


def _join(state: DecodeState, member_id: str, gpus: int) -> None:
    shape = DecodeInstanceShape((8,) * gpus, (100_000,) * gpus)
    state.on_join(Member(member_id, MemberKind.DECODE_INSTANCE, 1, shape, 0), 0)


@pytest.mark.usefixtures("registered")
def test_a_registered_policy_is_configured_by_yaml_and_places_in_the_daemon_table() -> None:
    settings = parse_settings(yaml.safe_load(YAML))
    assert settings.decode.policy == NAME
    assert settings.decode.params() == LastFitParams(skip=1)
    state = DecodeState(settings.decode, np.random.default_rng(0))
    _join(state, "d-0", 4)
    placed = state.place("r1", 1_000, now_ns=1)
    assert (placed.instance_id, placed.gpu_index, placed.branch) == ("d-0", 2, "last")
    assert state.counts.placements[(NAME, "last", "placed")] == 1
    assert state.policy_name == NAME
    state.release("r1", now_ns=2)
    with pytest.raises(ResourceExhausted):
        state.place("r2", 200_000, now_ns=3)


@pytest.mark.usefixtures("registered")
def test_its_parameters_are_validated_by_its_own_dataclass() -> None:
    assert make_policy(NAME, {"skip": 2}) == LastFit(2)
    with pytest.raises(ConfigError, match=rf"decode.{NAME}.skip: must be >= 0"):
        parse_settings({"decode": {"policy": NAME, NAME: {"skip": -1}}})
    with pytest.raises(ConfigError, match=rf"decode.{NAME}.skp: unknown parameter"):
        parse_settings({"decode": {"policy": NAME, NAME: {"skp": 1}}})


def test_unregistered_it_is_unknown_again() -> None:
    assert NAME not in REGISTRY
    with pytest.raises(ConfigError, match="unknown decode policy"):
        parse_settings({"decode": {"policy": NAME}})
