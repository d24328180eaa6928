"""Transport security: plaintext, TLS or mutual TLS on the gRPC port, and certificate
rotation without a restart.

``security.plaintext: true`` (the default) binds an insecure port and logs a warning;
otherwise the port serves TLS with ``security.tls.cert_file`` / ``key_file``, and when
``tls.client_ca_file`` is set every client must present a certificate signed by that CA
(mutual TLS). A client without a certificate, or with one from another CA, fails the TLS
handshake: its call ends UNAVAILABLE on the client side and never reaches a handler.

Rotation: the port is bound with gRPC's *dynamic* server credentials. On a reload
(SIGHUP) :class:`CertificateStore` re-reads the certificate, key and CA files on the event
loop and, when their bytes changed, publishes a new certificate configuration; gRPC's
fetcher (called from the transport at each new TLS handshake) takes it by reference.
Connections open at the time keep the certificate they negotiated; new connections get the
new one. Files that do not parse as a key pair leave the old certificate in place (logged
``tls_reload_refused``). Switching between plaintext and TLS, or the CA file's path, needs a
restart (restart-only keys).

``fulcrum_tls_certificate_expiry_timestamp_seconds`` carries the served certificate's
notAfter; it is absent on a plaintext daemon.
"""

from __future__ import annotations

import grpc
import structlog

from fulcrum.config import Settings
from fulcrum.config.security import SecuritySettings
from fulcrum.metrics.security import CERT_EXPIRY, MTLS_ENABLED, TLS_ENABLED
from fulcrum.service.app import App

log = structlog.get_logger(__name__)


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _not_after(cert_pem: bytes) -> float | None:
    """notAfter of the first certificate of a PEM chain, Unix seconds (None if unreadable)."""
    try:
        from cryptography import x509
    except ImportError:  # optional: only the expiry gauge needs it
        return None
    try:
        cert = x509.load_pem_x509_certificate(cert_pem)
    except ValueError:
        return None
    return float(cert.not_valid_after_utc.timestamp())


def _check_pair(key: bytes, cert: bytes) -> None:
    """Raise ValueError unless ``key`` is the private key of ``cert``'s first certificate
    (only when ``cryptography`` is installed; gRPC would otherwise fail the handshakes)."""
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import serialization
    except ImportError:
        return
    try:
        public = x509.load_pem_x509_certificate(cert).public_key()
        private = serialization.load_pem_private_key(key, password=None)
    except (ValueError, TypeError) as err:
        raise ValueError(f"not a PEM certificate and unencrypted key ({err})") from None
    fmt = serialization.PublicFormat.SubjectPublicKeyInfo
    enc = serialization.Encoding.DER
    if public.public_bytes(enc, fmt) != private.public_key().public_bytes(enc, fmt):
        raise ValueError("tls.key_file is not the key of tls.cert_file")


class CertificateStore:
    """The server certificate configuration, swapped by reference on reload.

    :meth:`fetch` runs on gRPC's transport (a handshake), not on the event loop: it only
    reads and clears one attribute, so it never observes a half-built configuration."""

    def __init__(self, settings: SecuritySettings) -> None:
        self._files: tuple[bytes, bytes, bytes | None] = self._load(settings)
        self.initial = self._config(self._files)
        self._pending: grpc.ServerCertificateConfiguration | None = None
        self.rotations = 0
        self._export()

    @staticmethod
    def _load(settings: SecuritySettings) -> tuple[bytes, bytes, bytes | None]:
        tls = settings.tls
        cert = _read(tls.cert_file)
        key = _read(tls.key_file)
        ca = _read(tls.client_ca_file) if tls.client_ca_file else None
        _check_pair(key, cert)
        return key, cert, ca

    @staticmethod
    def _config(files: tuple[bytes, bytes, bytes | None]) -> grpc.ServerCertificateConfiguration:
        key, cert, ca = files
        return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca)

    def _export(self) -> None:
        expiry = _not_after(self._files[1])
        if expiry is None:
            CERT_EXPIRY.clear()
        else:
            CERT_EXPIRY.set(expiry)

    def credentials(self, require_client_auth: bool) -> grpc.ServerCredentials:
        return grpc.dynamic_ssl_server_credentials(
            self.initial, self.fetch, require_client_authentication=require_client_auth
        )

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """gRPC's certificate-configuration fetcher: the new configuration once after a
        rotation, else None (keep the current one)."""
        pending, self._pending = self._pending, None
        return pending

    def reload(self, settings: SecuritySettings) -> bool:
        """Re-read the files; publish them if their bytes changed. True if rotated.
        Raises ValueError (nothing changes) when they cannot be read or do not match."""
        try:
            files = self._load(settings)
        except OSError as err:
            raise ValueError(f"cannot read ({err.strerror}: {err.filename})") from None
        if files == self._files:
            return False
        config = self._config(files)
        self._files = files
        self._pending = config
        self.rotations += 1
        self._export()
        return True


def add_port(server: grpc.aio.Server, settings: Settings, app: App) -> int:
    """Bind the gRPC port as configured (and, with TLS, register the rotation hook);
    returns the bound port."""
    s = settings.server
    sec = settings.security
    address = f"{s.host}:{s.port}"
    if sec.plaintext:
        TLS_ENABLED.set(0)
        MTLS_ENABLED.set(0)
        CERT_EXPIRY.clear()
        log.warning("plaintext_transport", hint="configure security.tls for production")
        return int(server.add_insecure_port(address))
    store = CertificateStore(sec)
    app.components["tls"] = store
    mtls = bool(sec.tls.client_ca_file)

    def reload(new: Settings) -> None:
        try:
            rotated = store.reload(new.security)
        except ValueError as err:
            log.error("tls_reload_refused", problem=str(err))
            return
        if rotated:
            log.info("tls_certificate_rotated", cert_file=new.security.tls.cert_file,
                     rotations=store.rotations)

    app.reload_hooks.append(reload)
    TLS_ENABLED.set(1)
    MTLS_ENABLED.set(1 if mtls else 0)
    if not sec.auth.enabled:
        log.warning("authorisation_disabled", hint="set security.auth.enabled")
    log.info("tls_transport", mutual=mtls)
    return int(server.add_secure_port(address, store.credentials(mtls)))
