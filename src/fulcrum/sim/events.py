"""Event kinds of the simulator's event heap (``(t_ns, seq, kind, arg)``)."""

from __future__ import annotations

from typing import Final

PREFILL_DONE: Final = 1
DECODE_DONE: Final = 2
VE_DONE: Final = 3
ROUND: Final = 4
PREFILL_KICK: Final = 5
DECODE_KICK: Final = 6
