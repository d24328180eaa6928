"""The real etcd and daemon-process fixtures of the HA tests (tests/ha/conftest.py),
shared with the client's end-to-end failover tests rather than written twice."""

from tests.ha.conftest import daemons, etcd  # noqa: F401  (pytest finds them here)
