"""High availability: an active-passive pair (or more) of daemons under leader election.

Every key here is restart-only: the election backend, its endpoints, its TLS files and its
timings are fixed when the daemon starts. With ``backend: none`` (the default) the daemon
is alone and always serving, exactly as without this section: no interceptor, no
background task, no cost on the request path.

With ``backend: etcd`` one key per pool (``election_key``) names the leader's advertised
address under an etcd lease of ``lease_ttl_s``. A leader that has not renewed its lease for
``renew_deadline_s`` (less than the TTL) stops serving before the lease can expire, so two
daemons never serve at once. See docs/ha.md.
"""

from __future__ import annotations

from typing import Literal, Self

from pydantic import Field, model_validator

from fulcrum.config.base import RESTART_ONLY, Section


class EtcdTlsSettings(Section):
    """TLS towards etcd (PEM files). No ``ca_file``: plaintext. ``cert_file`` and
    ``key_file`` (client certificate) go together."""

    ca_file: str | None = Field(
        None, description="CA bundle that signs etcd's server certificate (PEM path); "
        "null = plaintext", json_schema_extra=RESTART_ONLY,
    )
    cert_file: str | None = Field(
        None, description="client certificate (PEM path), with key_file",
        json_schema_extra=RESTART_ONLY,
    )
    key_file: str | None = Field(
        None, description="client private key (PEM path), with cert_file",
        json_schema_extra=RESTART_ONLY,
    )
    server_name: str | None = Field(
        None, description="name expected in etcd's certificate (null = the endpoint's host)",
        json_schema_extra=RESTART_ONLY,
    )

    @model_validator(mode="after")
    def _pair(self) -> Self:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("cert_file and key_file must be given together")
        if self.cert_file is not None and self.ca_file is None:
            raise ValueError("a client certificate needs ca_file (TLS) as well")
        return self


class EtcdSettings(Section):
    """The etcd cluster holding the election key and the durable EPLB maps."""

    endpoints: list[str] = Field(
        default_factory=lambda: ["127.0.0.1:2379"], min_length=1, max_length=16,
        description="etcd client endpoints, host:port; tried in turn when one fails",
        json_schema_extra=RESTART_ONLY,
    )
    dial_timeout_s: float = Field(
        1.0, gt=0, le=60, description="deadline of one etcd request, seconds",
        json_schema_extra=RESTART_ONLY,
    )
    tls: EtcdTlsSettings = Field(default_factory=EtcdTlsSettings)

    @model_validator(mode="after")
    def _endpoints(self) -> Self:
        for ep in self.endpoints:
            host, sep, port = ep.rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"endpoint {ep!r} is not host:port")
        return self


class HaSettings(Section):
    """Leader election (restart-only, every key)."""

    backend: Literal["none", "etcd"] = Field(
        "none", description="none = a single daemon, always serving; etcd = leader "
        "election on etcd (standbys answer UNAVAILABLE with the x-fulcrum-leader trailer)",
        json_schema_extra=RESTART_ONLY,
    )
    advertise: str | None = Field(
        None, description="host:port clients should use for this daemon, sent to them in "
        "the x-fulcrum-leader trailer (null = server.host and the bound port)",
        json_schema_extra=RESTART_ONLY,
    )
    election_key: str = Field(
        "/fulcrum/pools/default/leader", min_length=1, max_length=512,
        description="etcd key of the pool's leader (one pool, one key); the durable EPLB "
        "maps live under <election_key>/eplb/", json_schema_extra=RESTART_ONLY,
    )
    lease_ttl_s: int = Field(
        3, ge=2, le=600, description="TTL of the leader's etcd lease, whole seconds: a "
        "dead leader is replaced within about this time", json_schema_extra=RESTART_ONLY,
    )
    renew_deadline_s: float = Field(
        2.0, gt=0, le=600, description="a leader whose lease was last renewed this long "
        "ago stops serving (less than lease_ttl_s: it stops before the lease can expire), "
        "seconds", json_schema_extra=RESTART_ONLY,
    )
    retry_period_s: float = Field(
        0.25, gt=0, le=60, description="a standby tries to take the key this often; a "
        "daemon that cannot reach etcd retries this often, seconds",
        json_schema_extra=RESTART_ONLY,
    )

    adopt_grace_ms: int = Field(
        1000, ge=0, le=60_000, description="a new leader hands out no prefill work for "
        "this long after it is elected, so that engines re-register first and declare the "
        "requests they still hold from the old leader (never run twice), milliseconds",
        json_schema_extra=RESTART_ONLY,
    )

    etcd: EtcdSettings = Field(default_factory=EtcdSettings)

    @model_validator(mode="after")
    def _deadline(self) -> Self:
        if self.renew_deadline_s >= self.lease_ttl_s:
            raise ValueError(
                f"renew_deadline_s ({self.renew_deadline_s}) must be below lease_ttl_s "
                f"({self.lease_ttl_s}): a leader must stop serving before its lease expires"
            )
        return self

    @property
    def enabled(self) -> bool:
        return self.backend != "none"
