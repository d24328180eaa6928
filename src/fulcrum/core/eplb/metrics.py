"""Balance and migration figures of a placement.

Load model (the one the published algorithm optimises): the tokens routed to a logical
expert split evenly over its replicas, so GPU ``g`` of layer ``l`` carries
``sum over its slots s of loads[l, e(s)] / replicas[l, e(s)]`` tokens.

- ``moe_lb`` of a layer = load of its slowest (most loaded) GPU / mean GPU load; 1.0 is
  perfect. A layer with no load counts as 1.0.
- overall ``moe_lb`` = sum over layers of the slowest GPU's load / sum over layers of the
  mean GPU load: every layer waits for its slowest GPU, so this is the ratio of the step's
  MoE time to the perfectly balanced time (a load-weighted mean of the per-layer figures).
- slots changed: physical slots whose logical expert differs between two maps.
- copies received: (layer, GPU, expert) triples held by the new map and not by the old one;
  each is one expert's weights that the GPU must receive from another GPU.
- bytes moved = copies received x ``expert_bytes``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from fulcrum.core.eplb.layout import PlacementMap

__all__ = [
    "Balance",
    "Migration",
    "balance",
    "gpu_loads",
    "migration",
    "moe_lb_of_gpu_loads",
]

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]


def gpu_loads(loads: npt.ArrayLike, phy2log: I64, ep_size: int) -> F64:
    """Tokens per GPU, shape (n_layers, ep_size).

    Args:
        loads: shape (n_layers, n_logical), tokens routed to each logical expert.
        phy2log: shape (n_layers, n_physical), expert held by each slot.
        ep_size: GPUs in the group.
    """
    w = np.asarray(loads, dtype=np.float64)
    n_layers, n_phys = phy2log.shape
    rows = np.arange(n_layers)[:, None]
    n_logical = w.shape[1]
    counts = np.bincount(
        (rows * n_logical + phy2log).ravel(), minlength=n_layers * n_logical
    ).reshape(w.shape)
    per_slot = w[rows, phy2log] / counts[rows, phy2log]
    out: F64 = per_slot.reshape(n_layers, ep_size, n_phys // ep_size).sum(axis=-1)
    return out


def moe_lb_of_gpu_loads(gl: F64) -> tuple[F64, float]:
    """Per-layer moe_lb, shape (n_layers,), and the overall figure, from GPU loads (L, G)."""
    mx = gl.max(axis=-1)
    mean = gl.mean(axis=-1)
    per_layer = np.where(mean > 0, mx / np.where(mean > 0, mean, 1.0), 1.0)
    total_mean = float(mean.sum())
    overall = float(mx.sum()) / total_mean if total_mean > 0 else 1.0
    return per_layer.astype(np.float64), overall


@dataclass(frozen=True, slots=True)
class Balance:
    """moe_lb of one map under one set of loads.

    Attributes:
        per_layer: shape (n_layers,), slowest GPU / mean GPU per layer.
        overall: sum of slowest GPU loads / sum of mean GPU loads.
    """

    per_layer: F64
    overall: float


def balance(loads: npt.ArrayLike, placement: PlacementMap) -> Balance:
    """moe_lb of ``placement`` under ``loads`` (n_layers, n_logical) tokens.

    The loads are divided by their largest value first (moe_lb is a ratio), so sums of
    huge values cannot overflow."""
    w = np.asarray(loads, dtype=np.float64)
    top = float(w.max()) if w.size else 0.0
    if top > 0.0 and np.isfinite(top):
        w = w / top
    per_layer, overall = moe_lb_of_gpu_loads(gpu_loads(w, placement.phy2log, placement.ep_size))
    return Balance(per_layer=per_layer, overall=overall)


@dataclass(frozen=True, slots=True)
class Migration:
    """What it costs to go from one map to another.

    Attributes:
        slots_changed: physical slots (all layers) whose logical expert changed.
        copies_received: (layer, GPU, expert) triples new to the GPU, i.e. expert weight
            copies the GPUs must receive.
        bytes_moved: ``copies_received * expert_bytes``.
        slots_total: physical slots over all layers (for fractions).
    """

    slots_changed: int
    copies_received: int
    bytes_moved: int
    slots_total: int

    @property
    def changed_fraction(self) -> float:
        """slots_changed / slots_total (0.0 for an empty map)."""
        return self.slots_changed / self.slots_total if self.slots_total else 0.0


def _triples(phy2log: I64, ep_size: int, n_logical: int) -> I64:
    n_layers, n_phys = phy2log.shape
    gpu = np.arange(n_phys) // (n_phys // ep_size)
    layer = np.arange(n_layers)[:, None]
    keys: I64 = ((layer * ep_size + gpu[None, :]) * n_logical + phy2log).ravel()
    return keys


def migration(old: PlacementMap | None, new: PlacementMap, expert_bytes: int) -> Migration:
    """Slots changed, copies received and bytes moved going from ``old`` to ``new``.

    With no old map (first placement) nothing is counted as moved.

    Raises:
        ValueError: the two maps have different shapes.
    """
    total = new.phy2log.size
    if old is None:
        return Migration(0, 0, 0, total)
    if old.phy2log.shape != new.phy2log.shape or old.ep_size != new.ep_size:
        raise ValueError("previous_map: shape differs from the new map")
    diff = old.phy2log != new.phy2log
    changed = int(np.count_nonzero(diff))
    if changed == 0:
        return Migration(0, 0, 0, total)
    n_log = max(new.n_logical, old.n_logical)
    if 8 * changed > total:  # most slots changed: mark every triple of both maps
        space = new.n_layers * new.ep_size * n_log
        held_all = np.zeros(space, dtype=np.bool_)
        held_all[_triples(old.phy2log, old.ep_size, n_log)] = True
        wanted = np.zeros(space, dtype=np.bool_)
        wanted[_triples(new.phy2log, new.ep_size, n_log)] = True
        copies = int(np.count_nonzero(wanted & ~held_all))
        return Migration(changed, copies, copies * expert_bytes, total)
    # a copy is received where a slot changed and its GPU held no replica of the new expert
    # before; (layer, GPU, expert) triples are counted once
    spg = new.slots_per_gpu
    layer, slot = np.nonzero(diff)
    gpu = slot // spg
    expert = new.phy2log[layer, slot]
    held = (old.gpu_slots[layer, gpu] == expert[:, None]).any(axis=1)
    keys = ((layer * new.ep_size + gpu) * n_log + expert)[~held]
    copies = int(np.unique(keys).size)
    return Migration(changed, copies, copies * expert_bytes, total)
