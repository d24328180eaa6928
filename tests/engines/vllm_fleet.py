"""Real vLLM servers on loopback (CPU build, tiny dummy-weight MoE of :mod:`tiny_model`).

:class:`VllmFleet` starts N ``python -m vllm.entrypoints.openai.api_server`` processes in
parallel from the vLLM venv (``FULCRUM_VLLM_VENV``, default ``.venv-vllm`` at the repo
root; made by ``tests/engines/install_vllm.sh``), each pinned to one core, and waits for
each one's ``/health`` with a deadline. Used by the engine tests and by
``benchmarks/bench_engines.py``.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MODEL_NAME = "tiny"
BLOCK_SIZE = 32


def vllm_python() -> Path | None:
    """The vLLM venv's python, or None when the venv is absent."""
    venv = Path(os.environ.get("FULCRUM_VLLM_VENV", ROOT / ".venv-vllm"))
    py = venv / "bin" / "python"
    return py if py.exists() and any(venv.glob(".installed-vllm-*")) else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_ports(n: int) -> list[int]:
    """``n`` distinct free loopback ports (each held open until all are chosen: separate
    :func:`free_port` calls can return the same port twice)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def free_port_below_ephemeral(seed: int) -> int:
    """A free loopback port below the kernel's ephemeral range, for a port that clients
    connect to long before anything listens on it (the engines' KV-event PUB sockets
    retry every 100 ms from their start). In the ephemeral range such a retry can pick
    the destination port as its own source port and connect to itself (a TCP
    self-connect), which then holds the port: the later bind fails "address already in
    use". ``seed``: where the search starts (tests pass a seeded value)."""
    low = 32768
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as fh:
            low = int(fh.read().split()[0])
    except (OSError, ValueError, IndexError):
        pass
    span = max(low - 10_000, 1)
    for i in range(span):
        port = 10_000 + (seed + i) % span
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    return free_port()


def make_model(out: Path) -> Path:
    py = vllm_python()
    assert py is not None
    subprocess.run(
        [str(py), str(Path(__file__).with_name("tiny_model.py")), str(out)],
        check=True, capture_output=True,
    )
    return out


def metric_sum(port: int, name: str) -> float:
    """Sum of one metric's samples on an engine's /metrics page."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def kv_events_args(kv_port: int) -> Callable[[int, int], list[str]]:
    """``--kv-events-config`` sending an engine's KV events to ``tcp://127.0.0.1:kv_port``
    (the gateway binds it), topic = the engine's ``127.0.0.1:port``."""

    def args(_i: int, port: int) -> list[str]:
        cfg = {"enable_kv_cache_events": True, "publisher": "zmq",
               "endpoint": f"tcp://127.0.0.1:{kv_port}", "topic": f"127.0.0.1:{port}"}
        return ["--kv-events-config", json.dumps(cfg)]

    return args


def _setup(core: int | None, nice: int) -> Callable[[], None] | None:
    """A ``preexec_fn`` confining the child (and what it starts) to one core (None: any)
    and adding ``nice`` to its niceness; None when there is nothing to do."""
    if core is None and not nice:
        return None

    def setup() -> None:
        if core is not None:
            os.sched_setaffinity(0, {core})
        os.nice(nice)

    return setup


@dataclass
class VllmFleet:
    """N vLLM engines; :meth:`start` then :meth:`wait_ready`; :meth:`stop` ends them."""

    model_dir: Path
    n: int = 2
    log_dir: Path | None = None
    #: Extra command-line arguments per engine: called with its number and its port.
    extra_args: Callable[[int, int], list[str]] | None = None
    #: Extra environment of every engine (over the fleet's own settings).
    env: dict[str, str] = field(default_factory=dict)
    #: Confine each engine's whole process tree (API server, engine core, tokenizer
    #: threads) to its core, not only its OpenMP threads: then an engine's HTTP and
    #: detokenising work cannot take time from the other engine's core.
    pin_processes: bool = False
    #: Niceness added to every engine (``os.nice``): with engines at a lower CPU priority
    #: than the routers in front of them, a router thread woken by a request runs at once
    #: instead of waiting for an engine's time slice on a machine where they share cores
    #: (in production the router has CPUs of its own).
    nice: int = 0
    ports: list[int] = field(default_factory=list)
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def start(self) -> None:
        py = vllm_python()
        assert py is not None, "vLLM venv absent (tests/engines/install_vllm.sh)"
        cores = os.cpu_count() or 1
        for i in range(self.n):
            port = free_port()
            core = i % cores
            env = {
                **os.environ,
                "VLLM_CPU_KVCACHE_SPACE": "1",
                "VLLM_CPU_OMP_THREADS_BIND": str(core),
                "VLLM_LOGGING_LEVEL": "WARNING",
                **self.env,
            }
            log = open((self.log_dir or self.model_dir) / f"vllm-{i}.log", "wb")  # noqa: SIM115
            cmd = [
                str(py), "-m", "vllm.entrypoints.openai.api_server",
                "--model", str(self.model_dir), "--served-model-name", MODEL_NAME,
                "--load-format", "dummy", "--block-size", str(BLOCK_SIZE),
                "--max-model-len", "4096", "--enable-prefix-caching",
                "--host", "127.0.0.1", "--port", str(port),
                *(self.extra_args(i, port) if self.extra_args is not None else []),
            ]
            self.procs.append(
                subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                 cwd=self.model_dir, start_new_session=True,
                                 preexec_fn=_setup(core if self.pin_processes else None,
                                                   self.nice))
            )
            self.ports.append(port)

    def wait_ready(self, deadline_s: float = 300.0) -> None:
        """Poll every engine's /health until all answer; fails at the deadline."""
        end = time.monotonic() + deadline_s
        todo = set(range(self.n))
        while todo:
            for i in sorted(todo):
                if self.procs[i].poll() is not None:
                    raise RuntimeError(f"vLLM engine {i} exited: see its log in {self.model_dir}")
                try:
                    with urllib.request.urlopen(
                        f"http://127.0.0.1:{self.ports[i]}/health", timeout=2
                    ) as r:
                        if r.status == 200:
                            todo.discard(i)
                except OSError:
                    pass
            if todo:
                assert time.monotonic() < end, f"vLLM engines {sorted(todo)} not ready in time"
                time.sleep(0.5)  # polling interval of a deadline-bounded poll

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


if __name__ == "__main__":  # manual use: python -m tests.engines.vllm_fleet DIR N
    fleet = VllmFleet(make_model(Path(sys.argv[1])), int(sys.argv[2]))
    fleet.start()
    fleet.wait_ready()
    print(fleet.ports, flush=True)
