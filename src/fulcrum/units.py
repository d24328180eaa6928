"""Unit constants, defined once for the whole package (core, shell and simulator).

Times inside Fulcrum are integer nanoseconds unless a name says otherwise; token counts are
integers; protobuf ``uint64`` fields range over ``[0, MAX_U64]``.
"""

from __future__ import annotations

from typing import Final

NS_PER_US: Final = 1_000
NS_PER_MS: Final = 1_000_000
NS_PER_S: Final = 1_000_000_000

#: Largest value of a protobuf ``uint64`` field.
MAX_U64: Final = (1 << 64) - 1
#: Largest value of a protobuf ``int64`` field (and of a signed 64-bit counter).
MAX_I64: Final = (1 << 63) - 1
#: Largest value of a protobuf ``uint32`` field.
MAX_U32: Final = (1 << 32) - 1
#: Largest integer a float64 represents exactly (load values above it are refused).
MAX_EXACT_FLOAT: Final = 1 << 53
