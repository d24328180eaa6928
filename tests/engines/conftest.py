"""Session fixture: real vLLM engines (started once, in parallel). Tests that need them
skip only when the vLLM venv is absent, and fail instead under CI=true."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.engines.vllm_fleet import (
    VllmFleet,
    free_port_below_ephemeral,
    kv_events_args,
    make_model,
    vllm_python,
)

#: Where the session's engines send their KV events (the gateway binds it in
#: test_vllm_kv_events; until then the engines' PUB sockets retry and drop). Below the
#: ephemeral range: a retry there could self-connect and hold the port (a CI failure,
#: "address already in use"). The start varies by process so parallel runs differ.
KV_PORT = free_port_below_ephemeral(os.getpid() * 7919)


@pytest.fixture(scope="session")
def vllm_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmFleet]:
    if vllm_python() is None:
        msg = "vLLM venv absent: run tests/engines/install_vllm.sh"
        if os.environ.get("CI") == "true":
            pytest.fail(msg + " (a skip in CI is a failure)")
        pytest.skip(msg)
    model = make_model(Path(tmp_path_factory.mktemp("tiny-moe")))
    fleet = VllmFleet(model, n=2, extra_args=kv_events_args(KV_PORT))
    fleet.start()
    try:
        fleet.wait_ready()
        yield fleet
    finally:
        fleet.stop()
