"""Credentials towards etcd from ``ha.etcd.tls``, checked when the daemon starts: a file
that cannot be read, is not PEM of the right kind, or a key that does not match its
certificate is one :class:`TlsError` naming the key, the file and the reason."""

from __future__ import annotations

import ssl
from pathlib import Path

import grpc

from fulcrum.config.ha import EtcdTlsSettings


class TlsError(ValueError):
    """``ha.etcd.tls`` cannot be used; the message is one line naming the file."""


def _read(key: str, path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as err:
        raise TlsError(f"ha.etcd.tls.{key}: {path}: cannot read ({err.strerror})") from None


def _pem_kind(key: str, path: str, data: bytes, marker: bytes, what: str) -> None:
    if b"-----BEGIN " not in data or marker not in data:
        raise TlsError(f"ha.etcd.tls.{key}: {path}: not a PEM {what}")


def credentials(tls: EtcdTlsSettings) -> grpc.ChannelCredentials | None:
    """gRPC channel credentials, or None for plaintext (no ``ca_file``)."""
    if tls.ca_file is None:
        return None
    ca = _read("ca_file", tls.ca_file)
    _pem_kind("ca_file", tls.ca_file, ca, b"CERTIFICATE-----", "certificate bundle")
    try:
        ssl.create_default_context(cadata=ca.decode("ascii", "replace"))
    except (ssl.SSLError, ValueError) as err:
        raise TlsError(f"ha.etcd.tls.ca_file: {tls.ca_file}: not a usable CA bundle ({err})"
                       ) from None
    if tls.cert_file is None or tls.key_file is None:
        return grpc.ssl_channel_credentials(root_certificates=ca)
    cert = _read("cert_file", tls.cert_file)
    key = _read("key_file", tls.key_file)
    _pem_kind("cert_file", tls.cert_file, cert, b"CERTIFICATE-----", "certificate")
    _pem_kind("key_file", tls.key_file, key, b"PRIVATE KEY-----", "private key")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    try:
        ctx.load_cert_chain(tls.cert_file, tls.key_file)
    except ssl.SSLError as err:
        raise TlsError(
            f"ha.etcd.tls.key_file: {tls.key_file}: does not match ha.etcd.tls.cert_file "
            f"{tls.cert_file} or cannot be parsed ({err.reason or err})"
        ) from None
    return grpc.ssl_channel_credentials(
        root_certificates=ca, private_key=key, certificate_chain=cert
    )
