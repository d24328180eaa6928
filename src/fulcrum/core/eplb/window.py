"""Sampling noise of a statistics window, and the noise threshold of a rebalance.

A window of N steps is kept as B buckets; bucket ``b`` holds ``n_b`` steps and the loads
``X_b`` (n_layers, n_logical) tokens. Model: each step's load of an expert is an
independent draw with a per-step variance ``s2`` (the routing of a step's tokens is a
multinomial sample), so ``Var(X_b) = s2 * n_b`` and the window sum ``S = sum_b X_b`` has
``Var(S) = s2 * N``. With the per-step rate ``r = S / N``, the residual
``R = sum_b (X_b - n_b r)^2 / n_b`` has expectation ``s2 * (B - 1)``, so

    Var(S) ~= N * R / (B - 1)                                   (B >= 2)

estimated per (layer, expert) from the buckets alone, whatever the unit of the loads.
Drift inside the window inflates it, which only makes the threshold more cautious.

Noise threshold of a rebalance: GPU ``g`` carries ``sum over its slots of S_e / c_e``, so
``Var(load_g) = sum over its slots of Var(S_e) / c_e^2`` (experts independent). A layer's
predicted gain is the drop of its hottest GPU's load, from the old map's hottest GPU to
the new map's; its standard error is ``sigma_l = sqrt(Var(hot_old) + Var(hot_new))``.
On top of it, the old map's maximum over ``G`` GPUs is read on the same noisy window the
new map is fitted to, which inflates it by up to ``bias_l = sqrt(2 ln G) * sd(hot_old)``
(the expected maximum of ``G`` standard normal errors) even when nothing changed. A
layer's change is kept only when its gain exceeds ``z * sigma_l + bias_l``, and a whole
map is applied only when its overall predicted moe_lb gain exceeds

    threshold = (z * sqrt(sum of sigma_l^2) + sum of bias_l) / sum over layers of mean GPU load

over the changed layers (``z`` = ``RebalanceParams.noise_z``, 3 by default: a gain that
sampling noise alone would produce with probability about 0.1% is not acted on).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

__all__ = ["LayerNoise", "gpu_variance", "layer_noise", "noise_threshold", "window_variance"]

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]


def window_variance(buckets: F64, steps: npt.ArrayLike) -> F64 | None:
    """Estimated variance of the window sum, shape (n_layers, n_logical), tokens^2.

    Args:
        buckets: shape (B, n_layers, n_logical), load of each bucket, tokens.
        steps: shape (B,), steps in each bucket (> 0).

    Returns:
        None with fewer than two non-empty buckets (no estimate).
    """
    n = np.asarray(steps, dtype=np.float64)
    x = np.asarray(buckets, dtype=np.float64)
    keep = n > 0
    if int(keep.sum()) < 2:
        return None
    x, n = x[keep], n[keep]
    total_steps = float(n.sum())
    # scale to the largest value so squares cannot overflow whatever the unit
    scale = float(np.max(x)) if x.size else 0.0
    if not scale > 0.0 or not np.isfinite(scale):
        return np.zeros(x.shape[1:], dtype=np.float64)
    xs = x / scale
    rate = xs.sum(axis=0) / total_steps
    resid = ((xs - n[:, None, None] * rate) ** 2 / n[:, None, None]).sum(axis=0)
    with np.errstate(over="ignore"):
        out: F64 = total_steps * resid / (x.shape[0] - 1) * scale * scale
    return np.where(np.isfinite(out), out, np.finfo(np.float64).max)


def gpu_variance(load_var: F64, phy2log: I64, ep_size: int) -> F64:
    """Variance of each GPU's load, shape (n_layers, ep_size), tokens^2.

    Args:
        load_var: shape (n_layers, n_logical), variance of each expert's window load.
        phy2log: shape (n_layers, n_physical), expert of each slot.
    """
    n_layers, n_phys = phy2log.shape
    n_log = load_var.shape[1]
    rows = np.arange(n_layers)[:, None]
    cnt = np.bincount((rows * n_log + phy2log).ravel(), minlength=n_layers * n_log).reshape(
        n_layers, n_log
    )
    per_slot = load_var[rows, phy2log] / (cnt[rows, phy2log].astype(np.float64) ** 2)
    out: F64 = per_slot.reshape(n_layers, ep_size, n_phys // ep_size).sum(axis=-1)
    return out


class LayerNoise(NamedTuple):
    """Per-layer noise of a predicted gain, tokens: standard error and max bias (L,)."""

    sigma: F64
    bias: F64

    def threshold(self, z: float) -> F64:
        """Per-layer gain (tokens) the noise explains, shape (L,)."""
        out: F64 = z * self.sigma + self.bias
        return out


def layer_noise(
    load_var: F64 | None, old: I64, new: I64, gl_old: F64, gl_new: F64, ep_size: int
) -> LayerNoise:
    """Noise of each layer's predicted gain (module docstring).

    Args:
        load_var: shape (n_layers, n_logical) or None (no estimate: zeros).
        old, new: shape (n_layers, n_physical), the two maps.
        gl_old, gl_new: shape (n_layers, ep_size), GPU loads of the two maps, tokens.
    """
    n_layers = old.shape[0]
    if load_var is None:
        zero = np.zeros(n_layers, dtype=np.float64)
        return LayerNoise(zero, zero.copy())
    rows = np.arange(n_layers)
    v_old = gpu_variance(load_var, old, ep_size)[rows, gl_old.argmax(axis=1)]
    v_new = gpu_variance(load_var, new, ep_size)[rows, gl_new.argmax(axis=1)]
    bias = math.sqrt(2.0 * math.log(max(ep_size, 2))) * np.sqrt(v_old)
    return LayerNoise(np.sqrt(v_old + v_new), bias)


def noise_threshold(
    noise: LayerNoise, changed: npt.NDArray[np.bool_], total_mean: float, z: float
) -> float:
    """Overall moe_lb gain that sampling noise can explain (module docstring formula).

    Args:
        noise: per-layer noise, tokens.
        changed: shape (n_layers,), layers the new map changes.
        total_mean: sum over layers of the mean GPU load, tokens.
    """
    if total_mean <= 0:
        return 0.0
    sig = np.where(changed, noise.sigma, 0.0)
    bias = float(np.where(changed, noise.bias, 0.0).sum())
    return float((z * np.sqrt(np.sum(sig**2)) + bias) / total_mean)
