"""The generic rule registry: registration, parameter parsing, building (table-driven)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from fulcrum.core.registry import NoParams, Registry


@dataclass(frozen=True, slots=True)
class Knobs:
    width: int = 2

    def __post_init__(self) -> None:
        if self.width < 1:
            raise ValueError("width: must be >= 1")


def _registry() -> Registry[tuple[str, int]]:
    reg: Registry[tuple[str, int]] = Registry("demo")
    reg.register("wide", lambda p: ("wide", p.width), Knobs, branch_labels=("a", "b"))
    reg.register("plain", lambda p: ("plain", 0))
    return reg


def test_names_keep_registration_order_and_attrs_ride_along() -> None:
    reg = _registry()
    assert reg.names() == ("wide", "plain")
    assert "wide" in reg and "nope" not in reg
    assert reg.entry("wide").attrs["branch_labels"] == ("a", "b")
    assert reg.entry("plain").params is NoParams


def test_duplicate_name_is_refused() -> None:
    reg = _registry()
    with pytest.raises(ValueError, match="registered twice"):
        reg.register("wide", lambda p: ("x", 0))


def test_params_must_be_a_dataclass() -> None:
    reg = _registry()
    with pytest.raises(ValueError, match="dataclass"):
        reg.register("bad", lambda p: ("x", 0), dict)


@pytest.mark.parametrize(
    ("name", "raw", "expected"),
    [
        ("wide", None, ("wide", 2)),
        ("wide", {}, ("wide", 2)),
        ("wide", {"width": 7}, ("wide", 7)),
        ("plain", None, ("plain", 0)),
    ],
)
def test_make_from_raw(name: str, raw: dict[str, int] | None, expected: tuple[str, int]) -> None:
    assert _registry().make(name, raw) == expected


def test_make_from_parsed_params() -> None:
    assert _registry().make("wide", Knobs(width=3)) == ("wide", 3)
    with pytest.raises(ValueError, match="params must be Knobs"):
        _registry().make("wide", NoParams())


@pytest.mark.parametrize(
    ("name", "raw", "message"),
    [
        ("wdie", None, r"unknown name 'wdie'.*did you mean 'wide'"),
        ("wide", {"widht": 3}, r"demo\.wide\.widht: unknown parameter.*did you mean 'width'"),
        ("wide", {"width": 0}, r"demo\.wide\.width: must be >= 1"),
        ("plain", {"x": 1}, r"demo\.plain\.x: unknown parameter \(known: none\)"),
    ],
)
def test_bad_input_names_the_key(name: str, raw: dict[str, int] | None, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _registry().make(name, raw)


def test_unregister_removes_a_test_only_rule() -> None:
    reg = _registry()
    reg.register("tmp", lambda p: ("tmp", 1))
    reg.unregister("tmp")
    assert reg.names() == ("wide", "plain")
