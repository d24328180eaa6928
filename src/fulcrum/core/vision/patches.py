"""Image size -> patch count, and validation of image sizes.

Rule (SPEC.md section 5, rounding is our decision):
``patches = ceil(width / patch_size) * ceil(height / patch_size)``, all in pixels,
result in patches. A 1280 x 800 screenshot at patch size 16 is 80 * 50 = 4,000 patches;
1281 x 800 is 81 * 50 = 4,050.

Validation errors are :class:`InvalidImageError` (a ``ValueError``) carrying the name of
the offending field and the rule it broke, so the service can answer INVALID_ARGUMENT
with ``"<field>: <rule>"``.
"""

from __future__ import annotations

from typing import Final

__all__ = [
    "DEFAULT_MAX_SIDE",
    "DEFAULT_PATCH_SIZE",
    "InvalidImageError",
    "checked_patches",
    "patches",
    "validate_image",
]

DEFAULT_PATCH_SIZE: Final = 16
"""Default patch side, pixels (the worked example's encoder)."""

DEFAULT_MAX_SIDE: Final = 16_384
"""Default largest accepted image side, pixels; bigger sizes are rejected as absurd."""


class InvalidImageError(ValueError):
    """An image description broke a rule.

    Attributes:
        field: name of the offending field (``"width"``, ``"height"``, ``"patch_size"``,
            or an indexed form such as ``"images[2].width"`` when the caller adds a prefix).
        rule: human-readable rule that was broken (``"must be > 0"``).
    """

    def __init__(self, field: str, rule: str) -> None:
        super().__init__(f"{field}: {rule}")
        self.field = field
        self.rule = rule

    def with_prefix(self, prefix: str) -> InvalidImageError:
        """The same error with ``prefix`` prepended to the field (``"images[1]."``)."""
        return InvalidImageError(prefix + self.field, self.rule)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def patches(width: int, height: int, patch_size: int) -> int:
    """Number of patches of an image: ``ceil(width/p) * ceil(height/p)``.

    Args:
        width: image width, pixels (> 0).
        height: image height, pixels (> 0).
        patch_size: patch side ``p``, pixels (> 0).

    Returns:
        Patch count (>= 1).

    Raises:
        InvalidImageError: a size or the patch size is not a positive integer.
    """
    validate_image(width, height, patch_size, max_side=0)
    return _ceil_div(width, patch_size) * _ceil_div(height, patch_size)


def validate_image(width: int, height: int, patch_size: int, *, max_side: int) -> None:
    """Check an image description; raise :class:`InvalidImageError` naming the field.

    Args:
        width: image width, pixels; must be an int > 0 and <= ``max_side``.
        height: image height, pixels; must be an int > 0 and <= ``max_side``.
        patch_size: patch side, pixels; must be an int > 0 and <= ``max_side`` when
            bounded.
        max_side: largest accepted side, pixels; ``0`` means unbounded.
    """
    for name, value in (("width", width), ("height", height), ("patch_size", patch_size)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise InvalidImageError(name, "must be an integer")
        if value <= 0:
            raise InvalidImageError(name, "must be > 0")
        if max_side > 0 and value > max_side:
            raise InvalidImageError(name, f"must be <= {max_side} (max side)")


def checked_patches(width: int, height: int, patch_size: int, *, max_side: int) -> int:
    """:func:`validate_image` then :func:`patches`; the patch count of a valid image."""
    validate_image(width, height, patch_size, max_side=max_side)
    return _ceil_div(width, patch_size) * _ceil_div(height, patch_size)
