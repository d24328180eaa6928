"""Progress of ``fulcrum simulate --goodput`` on a terminal: one tqdm bar over every probe
of every policy's search (probe k of n, the rate probed, ETA), fed by the searches, in
worker processes or not, through a queue."""

from __future__ import annotations

import multiprocessing
import queue
import threading
from typing import Any, TextIO

from tqdm import tqdm


class SearchProgress:
    """The bar; ``queue`` goes to each job, whose searches :meth:`report` probes."""

    def __init__(self, n_jobs: int, max_runs: int, stream: TextIO, *, processes: bool):
        self.max_runs = max_runs
        self._stream = stream
        # spawn, as the simulator's process pool (fulcrum.sim.cli): no fork of a threaded process
        self._manager = multiprocessing.get_context("spawn").Manager() if processes else None
        self.queue: Any = self._manager.Queue() if self._manager else queue.Queue()
        self.bar = tqdm(total=n_jobs * max_runs, unit="probe", desc="goodput", file=stream,
                        dynamic_ncols=True, leave=False)
        self._thread = threading.Thread(target=self._consume, daemon=True)
        self._thread.start()

    @staticmethod
    def report(q: Any, policy: str, k: int, rps: float, passed: bool) -> None:
        """From a search (any process): probe ``k`` of ``policy`` ran at ``rps`` req/s."""
        q.put(("probe", policy, k, rps, passed))

    def done(self, policy: str, runs: int) -> None:
        """A search ended after ``runs`` probes: the bar's total drops its unused budget."""
        self.queue.put(("done", policy, runs, 0.0, True))

    def write(self, line: str) -> None:
        self.bar.write(line.rstrip("\n"), file=self._stream)

    def _consume(self) -> None:
        while (msg := self.queue.get()) is not None:
            kind, policy, k, rps, passed = msg
            if kind == "done":
                self.bar.total = max(self.bar.n, (self.bar.total or 0) - (self.max_runs - k))
                self.bar.refresh()
                continue
            self.bar.update(1)
            verdict = "met" if passed else "missed"
            self.bar.set_postfix_str(
                f"{policy}: probe {k} of {self.max_runs} at {rps:.3g} req/s, SLO {verdict}")

    def close(self) -> None:
        self.queue.put(None)
        self._thread.join(timeout=10)
        self.bar.close()
        if self._manager is not None:
            self._manager.shutdown()
