"""Array types and the bounds of the decode fleet's packed keys (see :mod:`.view`)."""

from __future__ import annotations

from typing import Final

import numpy as np
import numpy.typing as npt

I64 = npt.NDArray[np.int64]
Mask = npt.NDArray[np.bool_]

KV_BITS: Final = 40
"""Bits of the KV part in ``order_conc`` (``order_conc >> KV_BITS`` is the concurrency)."""
MAX_CONCURRENCY_LIMIT: Final = 1 << 20
"""Upper bound (exclusive) on any ``max_concurrency`` (requests); keeps packed keys in int64."""
MAX_KV_LIMIT: Final = 1 << KV_BITS
"""Upper bound (exclusive) on any ``max_kv_tokens`` (tokens); keeps packed keys in int64."""
INT64_MAX: Final = int(np.iinfo(np.int64).max)
INT64_MIN: Final = int(np.iinfo(np.int64).min)
