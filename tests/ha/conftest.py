"""Fixtures of the HA tests: a real etcd (Debian's etcd-server) and daemon processes.
Without etcd the tests skip, except under CI=true, where a skip is a failure."""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from fulcrum.ha.harness import ETCD, DaemonProcess, EtcdProcess, ha_config

_keys = itertools.count()


@pytest.fixture
def etcd() -> Iterator[EtcdProcess]:
    if ETCD is None:
        if os.environ.get("CI") == "true":
            pytest.fail("etcd is not installed (.ci/run installs etcd-server)")
        pytest.skip("etcd is not installed (apt-get install etcd-server)")
    e = EtcdProcess()
    yield e
    e.stop()


@pytest.fixture
def daemons(etcd: EtcdProcess, tmp_path: Path) -> Iterator[Callable[..., DaemonProcess]]:
    """Start daemons on one election key: ``start(name, ttl_s=..., **sections)``."""
    started: list[DaemonProcess] = []
    key = f"/fulcrum-test/{os.getpid()}/{next(_keys)}/leader"

    def start(name: str, ttl_s: int = 3, renew_s: float = 2.0, **extra: Any) -> DaemonProcess:
        d = DaemonProcess(ha_config(etcd.endpoint, key, ttl_s, renew_s, **extra),
                          tmp_path, name)
        started.append(d)
        return d

    yield start
    for d in started:
        d.stop()
