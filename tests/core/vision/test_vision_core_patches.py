"""Patch counting and image validation (SPEC.md section 5 and the worked example)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fulcrum.core.vision.patches import (
    InvalidImageError,
    checked_patches,
    patches,
    validate_image,
)


@pytest.mark.parametrize(
    ("width", "height", "patch_size", "expected"),
    [
        (1280, 800, 16, 4_000),  # the worked example's screenshot
        (1281, 800, 16, 81 * 50),  # width rounds up
        (1280, 801, 16, 80 * 51),  # height rounds up
        (1, 1, 16, 1),
        (16, 16, 16, 1),
        (17, 17, 16, 4),
        (224, 224, 14, 256),
        (448, 448, 14, 1_024),
        (5, 7, 1, 35),
        (10, 3, 100, 1),
    ],
)
def test_patches_table(width: int, height: int, patch_size: int, expected: int) -> None:
    assert patches(width, height, patch_size) == expected
    assert checked_patches(width, height, patch_size, max_side=16_384) == expected


@pytest.mark.parametrize(
    ("width", "height", "patch_size", "max_side", "field", "rule"),
    [
        (0, 800, 16, 0, "width", "must be > 0"),
        (-1, 800, 16, 0, "width", "must be > 0"),
        (1280, 0, 16, 0, "height", "must be > 0"),
        (1280, -5, 16, 0, "height", "must be > 0"),
        (1280, 800, 0, 0, "patch_size", "must be > 0"),
        (1280, 800, -16, 0, "patch_size", "must be > 0"),
        (20_000, 800, 16, 16_384, "width", "must be <= 16384 (max side)"),
        (1280, 16_385, 16, 16_384, "height", "must be <= 16384 (max side)"),
        (1280, 800, 20_000, 16_384, "patch_size", "must be <= 16384 (max side)"),
        (1280.0, 800, 16, 0, "width", "must be an integer"),
        (True, 800, 16, 0, "width", "must be an integer"),
    ],
)
def test_validation_names_the_field(
    width: int, height: int, patch_size: int, max_side: int, field: str, rule: str
) -> None:
    with pytest.raises(InvalidImageError) as exc:
        validate_image(width, height, patch_size, max_side=max_side)
    assert exc.value.field == field
    assert exc.value.rule == rule
    assert str(exc.value) == f"{field}: {rule}"
    assert isinstance(exc.value, ValueError)


def test_patches_rejects_zero_patch_size() -> None:
    with pytest.raises(InvalidImageError, match="patch_size: must be > 0"):
        patches(1280, 800, 0)


def test_prefix_for_multi_image_requests() -> None:
    err = InvalidImageError("width", "must be > 0").with_prefix("images[2].")
    assert err.field == "images[2].width"
    assert str(err) == "images[2].width: must be > 0"


def test_max_side_is_inclusive() -> None:
    assert checked_patches(16_384, 16_384, 16, max_side=16_384) == 1024 * 1024


@settings(max_examples=200, deadline=None)
@given(w=st.integers(1, 10_000), h=st.integers(1, 10_000), p=st.integers(1, 64))
def test_patches_is_ceil_product(w: int, h: int, p: int) -> None:
    n = patches(w, h, p)
    assert n == math.ceil(w / p) * math.ceil(h / p)
    # Every pixel is covered, and no patch row/column is wholly outside the image.
    cols, rows = -(-w // p), -(-h // p)
    assert cols * p >= w > (cols - 1) * p
    assert rows * p >= h > (rows - 1) * p
    assert n >= 1
