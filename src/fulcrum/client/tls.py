"""Client-side TLS helpers: channel credentials and bearer tokens from files.

Typical use::

    creds = channel_credentials(ca_file="ca.crt", cert_file="engine.crt", key_file="engine.key")
    async with FulcrumClient("fulcrum:50051", credentials=creds) as c: ...

    # or TLS to the server plus a bearer token (grpc sends call credentials only over TLS)
    creds = channel_credentials(ca_file="ca.crt")
    async with FulcrumClient(target, credentials=creds,
                             metadata_token=read_token("/run/secrets/fulcrum")) as c: ...
"""

from __future__ import annotations

from pathlib import Path

import grpc

__all__ = ["channel_credentials", "channel_credentials_from_pem", "read_token"]


def channel_credentials_from_pem(
    ca: bytes | None = None, cert: bytes | None = None, key: bytes | None = None
) -> grpc.ChannelCredentials:
    """TLS channel credentials from PEM bytes: ``ca`` verifies the server (None = the
    system roots); ``cert`` and ``key`` (both or neither) are the client certificate for
    mutual TLS."""
    if (cert is None) != (key is None):
        raise ValueError("cert and key must be given together")
    return grpc.ssl_channel_credentials(
        root_certificates=ca, private_key=key, certificate_chain=cert
    )


def channel_credentials(
    ca_file: str | Path | None = None,
    cert_file: str | Path | None = None,
    key_file: str | Path | None = None,
) -> grpc.ChannelCredentials:
    """TLS channel credentials from PEM files (see :func:`channel_credentials_from_pem`)."""

    def read(path: str | Path | None) -> bytes | None:
        return Path(path).read_bytes() if path else None

    return channel_credentials_from_pem(read(ca_file), read(cert_file), read(key_file))


def read_token(path: str | Path) -> str:
    """A bearer token from a file (surrounding whitespace removed). Raises ValueError when
    the file is empty; the token itself never appears in a message."""
    token = Path(path).read_text().strip()
    if not token or any(ch.isspace() for ch in token):
        raise ValueError(f"{path}: expected one token without whitespace")
    return token
