"""Named workloads and load calibration shared by the CLI and the benchmarks.

Workload names: ``mooncake``, ``azure-code``, ``azure-conv`` (the shared traces),
``servegen`` (requests sampled from the ServeGen multimodal distributions),
``synthetic`` (:mod:`fulcrum.sim.synthetic`), or a path to a ``.jsonl`` (Mooncake format)
or ``.csv`` (Azure format) file.

Load: the *offered prefill load* ``rho`` of a workload on a cluster is the predicted
prefill compute it brings (the variable part of the cost model, with the prefix cache
applied in arrival order) divided by what the prefill ranks offer over the arrival span:
``rho = sum of quota (ns) / (span (ns) * prefill ranks)``. :func:`rate_for_load` returns
the arrival-rate scale that gives a target ``rho`` (the cache hit ratio does not depend
on the rate, so one pass suffices).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Final

import numpy as np

from fulcrum.core.cost import CostModel
from fulcrum.sim import workload as W
from fulcrum.sim.cache import BlockCache
from fulcrum.sim.cluster import Cluster
from fulcrum.sim.synthetic import SyntheticSpec, generate

TRACES: Final = ("mooncake", "azure-code", "azure-conv", "servegen", "synthetic")
SERVEGEN_START_S: Final = 36_000
"""Default ServeGen window start (s into the day): mid-morning traffic."""


def load_workload(
    name: str,
    *,
    seed: int = 0,
    duration_s: float | None = None,
    start_s: float = 0.0,
    limit: int | None = None,
) -> list[W.Request]:
    """The requests of workload ``name`` at its native rate (before any scaling)."""
    rng = np.random.default_rng(seed)
    d = W.traces_dir()
    if name == "mooncake":
        reqs = W.read_mooncake(d / "mooncake_synthetic_trace.jsonl")
    elif name == "azure-code":
        reqs = W.read_azure(d / "azure2023_code.csv")
    elif name == "azure-conv":
        reqs = W.read_azure(d / "azure2023_conv.csv")
    elif name == "servegen":
        reqs = W.servegen_requests(
            d / "servegen-mm-image",
            rng,
            start_s=int(SERVEGEN_START_S + start_s),
            duration_s=duration_s if duration_s is not None else 600.0,
        )
        start_s = 0.0
    elif name == "synthetic":
        spec = SyntheticSpec() if duration_s is None else SyntheticSpec(duration_s=duration_s)
        reqs = generate(spec, rng)
    else:
        path = Path(name)
        if path.suffix == ".jsonl":
            reqs = W.read_mooncake(path)
        elif path.suffix == ".csv":
            reqs = W.read_azure(path)
        else:
            known = ", ".join(TRACES)
            raise ValueError(f"trace: unknown workload {name!r} (known: {known}, or a path)")
    if start_s or duration_s is not None or limit is not None:
        reqs = W.window(reqs, start_s=start_s, duration_s=duration_s, limit=limit)
    return reqs


def offered_work_ns(reqs: Sequence[W.Request], cluster: Cluster) -> float:
    """Predicted prefill compute of ``reqs`` (ns), prefix cache applied in arrival order."""
    p = cluster.prefill
    model = CostModel(a=p.cost_model.a, b=p.cost_model.b, k=p.cost_model.k)
    cache = BlockCache(cluster.cache.capacity_blocks)
    total = 0.0
    for r in sorted(reqs, key=lambda x: (x.arrival_ns, x.rid)):
        c0 = cache.lookup_and_insert(r.hash_ids, r.input_tokens)
        total += model.cost(r.input_tokens - c0, c0) - model.k
    return total


def offered_load(reqs: Sequence[W.Request], cluster: Cluster) -> float:
    """``rho`` of ``reqs`` on ``cluster`` (see module docstring); 0 for < 2 requests."""
    span = W.duration_ns(reqs)
    if span <= 0:
        return 0.0
    return offered_work_ns(reqs, cluster) / (span * cluster.prefill.n_ranks)


def rate_for_load(reqs: Sequence[W.Request], cluster: Cluster, rho: float) -> float:
    """Arrival-rate scale that makes the offered prefill load ``rho``."""
    if not rho > 0:
        raise ValueError(f"load: must be > 0, got {rho}")
    now = offered_load(reqs, cluster)
    if now <= 0:
        raise ValueError("load: the workload offers no prefill work")
    return rho / now


def size_decode(
    reqs: Sequence[W.Request], cluster: Cluster, *, per_gpu: float = 48.0
) -> Cluster:
    """A copy of ``cluster`` whose decode fleet holds about ``per_gpu`` requests per GPU.

    Little's law with the step time at that concurrency: requests in decode =
    arrival rate x mean decode steps x step time; instances are rounded up (>= 1).
    """
    span = W.duration_ns(reqs) / 1e9
    if span <= 0 or not reqs:
        return cluster
    d = cluster.decode
    rate = len(reqs) / span
    steps = float(np.mean([max(0, r.output_tokens - 1) for r in reqs]))
    kv = float(np.mean([r.input_tokens + r.output_tokens / 2 for r in reqs]))
    step_s = (d.d0_ns + d.d1_ns * per_gpu + d.d2_ns * per_gpu * kv) / 1e9
    in_decode = rate * steps * step_s
    gpus = in_decode / per_gpu
    instances = max(1, int(np.ceil(gpus / d.gpus_per_instance)))
    return cluster.with_overrides(decode={"instances": instances})


def size_vision(
    reqs: Sequence[W.Request], cluster: Cluster, *, utilisation: float = 0.6
) -> Cluster:
    """A copy of ``cluster`` with enough VE machines for ``utilisation`` (>= 1 machine)."""
    span = W.duration_ns(reqs) / 1e9
    v = cluster.vision
    work = sum(v.v0_ns * len(r.image_patches) + v.v1_ns * sum(r.image_patches) for r in reqs)
    if span <= 0 or work <= 0:
        return cluster
    gpus = work / 1e9 / span / utilisation
    machines = max(1, int(np.ceil(gpus / v.gpus_per_machine)))
    return cluster.with_overrides(vision={"machines": machines})


def scale_to_load(
    reqs: Sequence[W.Request], cluster: Cluster, rho: float
) -> tuple[list[W.Request], float]:
    """``reqs`` with arrivals scaled to offered prefill load ``rho``, and the scale used."""
    scale = rate_for_load(reqs, cluster, rho)
    return W.scale_rate(reqs, scale), scale


def relabel(reqs: Sequence[W.Request], source: str) -> list[W.Request]:
    """Requests with their ``source`` replaced."""
    return [replace(r, source=source) for r in reqs]
