"""The simulator's decode stage: GPUs grouped in instances (EP groups), the decode policy
placing each request on a GPU with room, and the lock-step decode steps of an instance.

One :class:`DecodeStage` per simulation, driven by :class:`fulcrum.sim.engine.Simulator`
(the *host*: virtual clock ``now`` (ns), per-request ``inp``/``outp`` tokens, the event
heap ``_push`` and ``_finish``). A step of an instance lasts ``d0 + max over its GPUs of
(d1 x concurrency + d2 x KV)`` stretched by the MoE load balance of the step (ns).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from typing import Protocol

import numpy as np
import numpy.typing as npt

from fulcrum.sim.cluster import DecodeCluster
from fulcrum.sim.events import DECODE_DONE, DECODE_KICK
from fulcrum.sim.experts import EplbGroup
from fulcrum.sim.policies import DecodeChooser, PolicySet
from fulcrum.sim.stats import Series, StageTotals

I64 = npt.NDArray[np.int64]


class Host(Protocol):
    """What the decode stage reads of the simulator."""

    now: int
    inp: I64
    outp: I64

    def _push(self, t: int, kind: int, arg: int) -> None: ...

    def _finish(self, rid: int) -> None: ...


class DecodeStage:
    """Decode GPUs' concurrency and KV (tokens), instances' steps, waiting requests."""

    def __init__(self, host: Host, cfg: DecodeCluster, policy: PolicySet, n_requests: int,
                 rng: np.random.Generator) -> None:
        self.host = host
        self.cfg = cfg
        self.policy = policy
        self.rng = rng
        g = cfg.n_gpus
        self.gpi = cfg.gpus_per_instance
        self.conc = np.zeros(g, dtype=np.int64)
        self.kv = np.zeros(g, dtype=np.int64)
        self.max_conc = np.full(g, cfg.max_concurrency, dtype=np.int64)
        self.max_kv = np.full(g, cfg.max_kv_tokens, dtype=np.int64)
        self.inst_step = [0] * cfg.instances
        self.inst_busy = [False] * cfg.instances
        self.inst_kicked = [False] * cfg.instances
        self.inst_heap: list[list[tuple[int, int, int]]] = [[] for _ in range(cfg.instances)]
        self.inst_conc_snapshot: list[I64 | None] = [None] * cfg.instances
        self.wait: deque[int] = deque()
        self.rejected = 0
        self.chooser = DecodeChooser(policy.decode, cfg.sim_params())
        #: The decode GPU of each request (-1: none yet).
        self.gpu_of: list[int] = [-1] * n_requests
        #: One EPLB group per instance (set by the host with the expert model).
        self.eplb: list[EplbGroup] = []
        self.tot = StageTotals()
        self.imbalance = Series()
        self.moe_lb = Series()

    def kick(self, inst: int) -> None:
        """A kick event for ``inst``: start a step unless one runs."""
        self.inst_kicked[inst] = False
        if not self.inst_busy[inst]:
            self.start_step(inst)

    def admit(self, rid: int) -> None:
        if self.host.outp[rid] <= 1:
            self.host._finish(rid)
            return
        if int(self.host.inp[rid]) + int(self.host.outp[rid]) > self.cfg.max_kv_tokens:
            self.rejected += 1  # can never fit one decode GPU: dropped, counted
            self.host._finish(rid)
            return
        if self.wait:
            self.wait.append(rid)
            return
        if not self._try_place(rid):
            self.wait.append(rid)

    def _try_place(self, rid: int) -> bool:
        kv_tokens = int(self.host.inp[rid])
        g = self.chooser.choose(
            self.conc, self.kv, self.max_conc, self.max_kv, kv_tokens, self.rng
        )
        if g < 0:
            return False
        self.conc[g] += 1
        self.kv[g] += kv_tokens
        self.gpu_of[rid] = g
        inst = g // self.gpi
        busy = 1 if self.inst_busy[inst] else 0
        finish_step = self.inst_step[inst] + int(self.host.outp[rid]) - 1 + busy
        heapq.heappush(self.inst_heap[inst], (finish_step, rid, g))
        if not self.inst_busy[inst] and not self.inst_kicked[inst]:
            self.inst_kicked[inst] = True
            self.host._push(self.host.now, DECODE_KICK, inst)
        return True

    def start_step(self, inst: int) -> None:
        if not self.inst_heap[inst]:
            self.inst_busy[inst] = False
            return
        d = self.cfg
        s = slice(inst * self.gpi, (inst + 1) * self.gpi)
        conc = self.conc[s].copy()
        kv = self.kv[s]
        load = d.d1_ns * conc + d.d2_ns * kv
        mx_load = float(load.max())
        mean_load = float(load.mean())
        tokens = int(conc.sum())
        mean = d.d0_ns + mean_load
        if self.policy.ideal:
            lb = 1.0
            dur = mean
        else:
            lb = self.eplb[inst].step(self.host.now, tokens)
            dur = d.d0_ns + mx_load + d.moe_fraction * d.d1_ns * tokens / self.gpi * (lb - 1.0)
        tot = self.tot
        tot.steps += 1
        tot.actual_ns += dur * self.gpi
        tot.ideal_ns += mean * self.gpi
        if not self.policy.ideal:
            tot.moe_ns += (dur - d.d0_ns - mx_load) * self.gpi
            tot.drained_ns += (mx_load - mean_load) * self.gpi
        tot.tokens += tokens
        tot.useful_ns += mean_load * self.gpi
        if mean_load > 0:
            self.imbalance.add(self.host.now, mx_load / mean_load)
        self.moe_lb.add(self.host.now, lb, float(tokens))
        self.inst_conc_snapshot[inst] = conc
        self.inst_busy[inst] = True
        self.host._push(self.host.now + max(1, math.ceil(dur)), DECODE_DONE, inst)

    def done(self, inst: int) -> None:
        s = slice(inst * self.gpi, (inst + 1) * self.gpi)
        snap = self.inst_conc_snapshot[inst]
        assert snap is not None
        self.kv[s] += snap
        self.inst_step[inst] += 1
        step = self.inst_step[inst]
        heap = self.inst_heap[inst]
        released = False
        while heap and heap[0][0] <= step:
            _, rid, g = heapq.heappop(heap)
            self.conc[g] -= 1
            self.kv[g] -= int(self.host.inp[rid]) + int(self.host.outp[rid]) - 1
            self.host._finish(rid)
            released = True
        self.inst_busy[inst] = False
        if released:
            while self.wait and self._try_place(self.wait[0]):
                self.wait.popleft()
        self.start_step(inst)
