"""Transport security (TLS, mutual TLS) and caller authorisation (roles, bound ids).

The default is ``plaintext: true`` with authorisation off, so that ``fulcrum serve``
works with no file at all; the daemon logs a warning at start when it serves plaintext.

A production configuration::

    security:
      plaintext: false
      tls:
        cert_file: /etc/fulcrum/tls/server.crt     # PEM chain
        key_file: /etc/fulcrum/tls/server.key
        client_ca_file: /etc/fulcrum/tls/ca.crt    # set => mutual TLS (client cert required)
      auth:
        enabled: true
        tokens_file: /etc/fulcrum/tokens            # "<identity> <token>" per line
        identities:
          entrypoint-1: {role: entrypoint}
          node-17: {role: engine, ids: ["node-17-*"], kinds: [prefill_engine]}
          ops: {role: admin}

An engine identity acts only for ids matching its ``ids`` globs and registers only members
of the ``kinds`` it lists (``prefill_engine``, ``decode_instance``, ``vision_machine``;
none by default: an engine identity must say what it is).

Reload: every key applies on SIGHUP (identities and tokens are swapped, the server
certificate and key are re-read and served to new connections) except ``plaintext`` and
``tls.client_ca_file`` (the path; the CA bundle's content at that path is re-read), which
need a restart.

An identity's name is matched against the client certificate's SAN entries, then its
subject CN, or is the name its bearer token maps to in ``tokens_file``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from fulcrum.config.base import RESTART_ONLY, Section

Role = Literal["entrypoint", "engine", "admin"]
#: Member kinds an engine identity may register (values of ``core.types.MemberKind``).
Kind = Literal["prefill_engine", "decode_instance", "vision_machine"]

#: Shortest accepted bearer token, characters.
MIN_TOKEN_CHARS = 16


class TlsSettings(Section):
    """Server certificate and, for mutual TLS, the CA that signs client certificates."""

    cert_file: str = Field("", description="PEM certificate chain of the server ('' = none)")
    key_file: str = Field("", description="PEM private key of the server ('' = none)")
    client_ca_file: str = Field(
        "",
        description="PEM CA bundle; when set, every client must present a certificate it "
        "signs (mutual TLS), else the TLS handshake fails (the file's content is re-read "
        "on reload; the path itself needs a restart)",
        json_schema_extra=RESTART_ONLY,
    )


class IdentitySettings(Section):
    """One caller identity: its role and, for engines, the member/engine/group ids it may
    act for."""

    role: Role = Field(description="entrypoint, engine or admin")
    ids: list[str] = Field(
        default_factory=list,
        max_length=4096,
        description="ids (fnmatch globs, e.g. 'node-17-*') an engine may pull, report and "
        "heartbeat for; ignored for other roles",
    )
    kinds: list[Kind] = Field(
        default_factory=list,
        max_length=3,
        description="member kinds an engine may register (prefill_engine, decode_instance, "
        "vision_machine); ignored for other roles",
    )


class AuthSettings(Section):
    """Authorisation by role. Off by default (every caller may call everything)."""

    enabled: bool = Field(False, description="authenticate callers and check their role")
    tokens_file: str = Field(
        "",
        description="file of bearer tokens, one '<identity> <token>' per line ('#' starts a "
        f"comment line; tokens of at least {MIN_TOKEN_CHARS} characters); '' = no tokens",
    )
    identities: dict[str, IdentitySettings] = Field(
        default_factory=dict,
        max_length=100_000,
        description="identity name (certificate SAN/CN or token name) -> role and bound ids",
    )


class SecuritySettings(Section):
    """TLS and caller identities."""

    plaintext: bool = Field(
        True, description="serve without TLS (a warning is logged)", json_schema_extra=RESTART_ONLY
    )
    tls: TlsSettings = Field(default_factory=TlsSettings)
    auth: AuthSettings = Field(default_factory=AuthSettings)

    @model_validator(mode="after")
    def _consistent(self) -> SecuritySettings:
        tls = self.tls
        problems: list[str] = []
        if self.plaintext:
            if tls.cert_file or tls.key_file or tls.client_ca_file:
                problems.append(
                    "plaintext: must be false when tls files are given (refusing to serve "
                    "plaintext by mistake)"
                )
        else:
            if not tls.cert_file or not tls.key_file:
                problems.append("tls: cert_file and key_file are required when plaintext is false")
            for name in ("cert_file", "key_file", "client_ca_file"):
                path = getattr(tls, name)
                if path and not Path(path).is_file():
                    problems.append(f"tls.{name}: no such file: {path}")
        if self.auth.enabled and not (self.auth.tokens_file or tls.client_ca_file):
            problems.append(
                "auth.enabled: needs auth.tokens_file or tls.client_ca_file (no caller could "
                "prove an identity)"
            )
        if self.auth.enabled and self.auth.tokens_file:
            try:
                tokens = read_tokens(self.auth.tokens_file)
            except ValueError as err:
                problems.append(f"auth.tokens_file: {err}")
            else:
                unknown = sorted(set(tokens.values()) - set(self.auth.identities))
                if unknown:
                    problems.append(
                        f"auth.tokens_file: identities not in auth.identities: {unknown[:5]}"
                    )
        if problems:
            raise ValueError("; ".join(problems))
        return self


def read_tokens(path: str) -> dict[str, str]:
    """Parse a tokens file into {token: identity}. Raises ValueError naming the line (never
    the token) when a line is malformed, a token is too short or used twice."""
    try:
        text = Path(path).read_text()
    except OSError as err:
        raise ValueError(f"cannot read {path} ({err.strerror})") from None
    out: dict[str, str] = {}
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        if len(parts) != 2:
            raise ValueError(f"line {lineno}: expected '<identity> <token>'")
        name, token = parts
        if len(token) < MIN_TOKEN_CHARS:
            raise ValueError(f"line {lineno}: token shorter than {MIN_TOKEN_CHARS} characters")
        if token in out:
            raise ValueError(f"line {lineno}: token already given to another identity")
        out[token] = name
    return out
