"""Calls and checks shared by the HA tests (real processes, real etcd)."""

from __future__ import annotations

import itertools
import urllib.request
from collections.abc import Callable
from typing import Any

import grpc
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from fulcrum.ha.harness import DaemonProcess
from fulcrum.v1 import diagnostics_pb2, diagnostics_pb2_grpc
from fulcrum.v1 import expert_pb2 as epb
from fulcrum.v1 import expert_pb2_grpc as epb_grpc
from tests.polling import until_sync

LAYERS, EXPERTS, EP = 4, 16, 4


def metric(d: DaemonProcess, name: str) -> float:
    """Sum of a metric family's samples (0 when absent)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{d.metrics_port}/metrics", timeout=5) as r:
        text = r.read().decode()
    total = 0.0
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name:
                total += float(s.value)
    return total


def ping(d: DaemonProcess, timeout_s: float = 5.0) -> grpc.RpcError | None:
    """None when Ping is answered OK, else the error."""
    stub = diagnostics_pb2_grpc.DiagnosticsServiceStub(d.channel)
    try:
        stub.Ping(diagnostics_pb2.PingRequest(), timeout=timeout_s)
    except grpc.RpcError as err:
        return err
    return None


def pair(daemons: Callable[..., DaemonProcess], **kw: Any) -> tuple[DaemonProcess, DaemonProcess]:
    """Two daemons on one key; returns (leader, standby) once one of them serves."""
    a = daemons("a", **kw)
    b = daemons("b", **kw)
    until_sync(lambda: "SERVING" in (a.health(), b.health()), "a leader elected", 30)
    return (a, b) if a.health() == "SERVING" else (b, a)


def roles(d: DaemonProcess) -> list[str]:
    """The roles of the daemon's ``ha_role`` lines, checked to alternate (each
    transition logged once: never two lines for one change)."""
    seen = [str(e["role"]) for e in d.events("ha_role")]
    assert all(a != b for a, b in itertools.pairwise(seen)), seen
    return seen


def expert(d: DaemonProcess) -> Any:
    return epb_grpc.ExpertBalancerServiceStub(d.channel)


def tensor(a: np.ndarray[Any, Any]) -> epb.Tensor:
    arr = np.ascontiguousarray(a)
    return epb.Tensor(dtype=arr.dtype.name, shape=list(arr.shape), data=arr.tobytes())


def register(d: DaemonProcess, gid: str, **kw: Any) -> Any:
    args: dict[str, Any] = {"group_id": gid, "role": epb.GROUP_ROLE_PREFILL, "ep_size": EP,
                            "gpus_per_node": 8, "num_layers": LAYERS, "num_experts": EXPERTS,
                            "window_steps": 20, "period_steps": 1000,
                            "expert_bytes": 1 << 20}
    args.update(kw)
    return expert(d).RegisterGroup(epb.RegisterGroupRequest(**args), timeout=10)


def rebalanced(d: DaemonProcess, gid: str, seed: int) -> int:
    """Report skewed loads at the version in force and force a rebalance; the new
    version."""
    stub = expert(d)
    version = stub.GetMap(epb.GetMapRequest(group_id=gid), timeout=10).map.version
    pop = np.random.default_rng(seed).lognormal(0.0, 1.5, size=(LAYERS, EXPERTS))
    load = np.random.default_rng(seed + 1).poisson(pop * 500).astype(np.int64)
    stub.ReportLoad(epb.ReportLoadRequest(group_id=gid, map_version=version, step_begin=0,
                                          step_end=10, load=tensor(load)), timeout=10)
    reply = stub.Rebalance(epb.RebalanceRequest(group_id=gid), timeout=30)
    return int(reply.map.version) if reply.HasField("map") else int(version)


def get_map(d: DaemonProcess, gid: str) -> tuple[int, bytes]:
    m = expert(d).GetMap(epb.GetMapRequest(group_id=gid), timeout=10).map
    return int(m.version), bytes(m.physical_to_logical.data)
