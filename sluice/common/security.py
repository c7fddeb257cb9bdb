"""Who may call a Sluice service, and over what: TLS files, API keys and caller identities.

    SecurityConfig (api_key, tls_cert, tls_key, tls_ca, health_port: flags and SLUICE_* variables)
        -> ServerSecurity.from_config(cfg)   what GrpcServer.build enforces on every service
        -> ClientSecurity.from_config(cfg)   how the scheduler dials its workers (mTLS + key)

    server side:  TLS (tls_cert + tls_key); mutual TLS when tls_ca is given too (clients must
                  present a certificate that CA signed); API keys checked by
                  sluice.common.interceptors on every method but standard health
    client side:  tls_ca verifies the server, tls_cert + tls_key are the client certificate,
                  the key travels as `authorization: Bearer <key>` metadata

An API key, as vLLM's `--api-key`, is a bearer token; `api_key` may list several keys
separated by commas, and each key is its own caller identity (`caller_identity`), which is
what the Generation API's Abort checks ownership against. Without keys, the identity is the
common name of a verified client certificate (`ServerSecurity.identity`); without either,
every caller is anonymous and ownership cannot be told apart (docs/ARCHITECTURE.md).
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import logging
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sluice.common.config import add_config_arguments, config_from, opt

if TYPE_CHECKING:
    import grpc

# NOTE: grpc is imported where it is used: the `sluice` command builds its client flags from
# this module and should not pay for importing gRPC to print --help.

AUTHORIZATION_KEY = "authorization"  # gRPC metadata keys are lower case
BEARER = "bearer "
ANONYMOUS = ""


@dataclass
class SecurityConfig:
    """The settings every Sluice server shares (mixed into each service's config dataclass)."""

    api_key: str | None = opt(
        None, "bearer token(s) clients must send as `authorization: Bearer KEY` (comma-separated for several)"
    )
    tls_cert: str | None = opt(None, "PEM certificate chain of this service: turns TLS on (with tls_key)")
    tls_key: str | None = opt(None, "PEM private key of tls_cert")
    tls_ca: str | None = opt(
        None, "PEM CA bundle: servers require client certificates it signed (mutual TLS); clients verify servers"
    )
    health_port: int | None = opt(
        None, "also serve standard gRPC health, plaintext and unauthenticated, on this port (probes under mTLS)"
    )
    tls_client_roles: str | None = opt(
        None,
        "under mutual TLS, only client certificates whose role (subject OU) is one of these may call "
        "(comma-separated; `sluice certs` writes the role); none: any certificate tls_ca signed",
    )


SECRET_FIELDS = frozenset({"api_key", "worker_api_key"})

# scheme://user:password@host -> the password replaced (redis://:PASSWORD@host included)
_URL_CREDENTIALS = re.compile(r"(?P<head>\b[A-Za-z][A-Za-z0-9+.\-]*://[^/\s:@]*:)(?P<secret>[^@\s/]+)(?=@)")
REDACTED = "***"


def redact_url(text: str) -> str:
    """`text` with the password of every URL in it replaced by ***: the one helper every log
    line, settings dump and error message that may hold a URL goes through."""
    return _URL_CREDENTIALS.sub(lambda m: m.group("head") + REDACTED, text)


def redacted(settings: dict[str, Any]) -> dict[str, Any]:
    """A settings dict fit for a log line: secrets shown only as set or not, URL passwords hidden."""
    return {
        k: ("<set>" if v else v) if k in SECRET_FIELDS else redact_url(v) if isinstance(v, str) else v
        for k, v in settings.items()
    }


class RedactingFilter(logging.Filter):
    """Hides URL passwords in every record a handler emits (its message and its traceback), so a
    library that logs a URL it was given cannot leak one."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        clean = redact_url(message)
        if clean != message:
            record.msg, record.args = clean, None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redact_url(record.exc_text)
        return True


def setup_logging(level: int) -> None:
    """basicConfig with URL passwords redacted on every root handler (the services' entry points)."""
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, RedactingFilter) for f in handler.filters):
            handler.addFilter(RedactingFilter())


# ---------------------------------------------------------------- TLS


def _read(path: str | None, what: str) -> bytes | None:
    if not path:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"{what}: cannot read {path!r}: {exc.strerror or exc}") from None


@dataclass(frozen=True)
class TlsFiles:
    """PEM bytes of one service's certificate, key and CA bundle (any may be absent)."""

    cert: bytes | None = None
    key: bytes | None = None
    ca: bytes | None = None

    @classmethod
    def load(cls, cert: str | None, key: str | None, ca: str | None) -> TlsFiles | None:
        """None when no file is named; ValueError naming the setting when a file is missing
        or only one of cert and key is given."""
        if bool(cert) != bool(key):
            raise ValueError("tls_cert and tls_key: give both (a certificate and its private key) or neither")
        if not (cert or ca):
            return None
        return cls(_read(cert, "tls_cert"), _read(key, "tls_key"), _read(ca, "tls_ca"))

    @property
    def mutual(self) -> bool:
        return self.ca is not None

    def server_credentials(self) -> grpc.ServerCredentials:
        import grpc

        if self.cert is None or self.key is None:
            raise ValueError("tls_ca alone cannot serve TLS: give tls_cert and tls_key too")
        return grpc.ssl_server_credentials(
            [(self.key, self.cert)], root_certificates=self.ca, require_client_auth=self.mutual
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        import grpc

        return grpc.ssl_channel_credentials(
            root_certificates=self.ca, private_key=self.key, certificate_chain=self.cert
        )


# ---------------------------------------------------------------- API keys


def split_keys(setting: str | None) -> tuple[str, ...]:
    return tuple(k.strip() for k in (setting or "").split(",") if k.strip())


def key_identity(key: str) -> str:
    """A stable name for a key that does not reveal it (logs, ownership)."""
    return "key:" + hashlib.sha256(key.encode()).hexdigest()[:12]


@dataclass(frozen=True)
class ApiKeys:
    keys: tuple[str, ...]

    def check(self, metadata: Iterable[tuple[str, Any]] | None) -> str | None:
        """None when the metadata carries a valid key, else why not (for UNAUTHENTICATED)."""
        token = bearer_token(metadata)
        if token is None:
            return "missing API key: send `authorization: Bearer <key>` metadata"
        if not any(hmac.compare_digest(token.encode(), k.encode()) for k in self.keys):
            return "invalid API key"
        return None


def client_role(context: grpc.aio.ServicerContext) -> str | None:
    """The role (subject OU) of the caller's verified client certificate, None without one."""
    auth = context.auth_context() or {}
    for subject in auth.get("x509_subject", ()):
        text = subject.decode() if isinstance(subject, bytes) else str(subject)
        for part in text.split(","):
            key, _, value = part.strip().partition("=")
            if key == "OU":
                return value
    return None


def bearer_token(metadata: Iterable[tuple[str, Any]] | None) -> str | None:
    for key, value in metadata or ():
        if key == AUTHORIZATION_KEY:
            text = value.decode() if isinstance(value, bytes) else str(value)
            return text[len(BEARER) :].strip() if text.lower().startswith(BEARER) else text.strip()
    return None


def bearer_metadata(key: str | None) -> tuple[tuple[str, str], ...]:
    return ((AUTHORIZATION_KEY, f"Bearer {key}"),) if key else ()


# ---------------------------------------------------------------- both ends


@dataclass(frozen=True)
class ServerSecurity:
    """What a server enforces: TLS (maybe mutual) and API keys; both optional."""

    tls: TlsFiles | None = None
    api_keys: ApiKeys | None = None
    client_roles: tuple[str, ...] = ()  # under mutual TLS: the client certificate roles allowed (none: any)

    @classmethod
    def from_config(cls, cfg: SecurityConfig) -> ServerSecurity:
        tls = TlsFiles.load(cfg.tls_cert, cfg.tls_key, cfg.tls_ca)
        if tls is not None and tls.cert is None:
            raise ValueError("tls_ca is set without tls_cert and tls_key: a server needs its own certificate")
        keys = split_keys(cfg.api_key)
        roles = split_keys(cfg.tls_client_roles)
        if roles and (tls is None or not tls.mutual):
            raise ValueError("tls_client_roles: needs mutual TLS (tls_cert, tls_key and tls_ca)")
        return cls(tls, ApiKeys(keys) if keys else None, roles)

    @property
    def enabled(self) -> bool:
        return self.tls is not None or self.api_keys is not None

    def identity(self, context: grpc.aio.ServicerContext) -> str:
        """Who is calling, as verified: their API key's identity when keys are required, else
        the common name of their client certificate under mutual TLS, else ANONYMOUS."""
        if self.api_keys is not None:
            token = bearer_token(context.invocation_metadata())
            return key_identity(token) if token else ANONYMOUS
        if self.tls is not None and self.tls.mutual:
            auth = context.auth_context() or {}
            names = auth.get("x509_common_name") or auth.get("x509_subject")
            if names:
                value = names[0]
                return "cert:" + (value.decode() if isinstance(value, bytes) else str(value))
        return ANONYMOUS

    def describe(self) -> str:
        parts = []
        if self.tls is not None:
            parts.append("mutual TLS" if self.tls.mutual else "TLS")
        if self.api_keys is not None:
            parts.append(f"{len(self.api_keys.keys)} API key(s)")
        return ", ".join(parts) or "plaintext, no authentication"


@dataclass(frozen=True)
class ClientSecurity:
    """How a client dials a Sluice server: TLS files (the CA verifies the server; a cert and
    key are the client certificate under mutual TLS) and an API key."""

    tls: TlsFiles | None = None
    api_key: str | None = None

    @classmethod
    def from_config(cls, cfg: SecurityConfig, api_key: str | None = None) -> ClientSecurity:
        return cls(TlsFiles.load(cfg.tls_cert, cfg.tls_key, cfg.tls_ca), api_key)

    def channel(self, address: str, options: Sequence[tuple[str, Any]] = ()) -> grpc.aio.Channel:
        import grpc

        if self.tls is None:
            return grpc.aio.insecure_channel(address, options=options)
        return grpc.aio.secure_channel(address, self.tls.channel_credentials(), options=options)

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return bearer_metadata(self.api_key)


PLAINTEXT = ClientSecurity()

# What gRPC says when a TLS handshake was cut short by the other side.
_HANDSHAKE_CLOSED = ("Socket closed", "handshake", "Connection reset", "SSL")


def explain_unavailable(details: str, security: ClientSecurity) -> str:
    """UNAVAILABLE's details with what they mean when TLS is involved: gRPC reports a server
    that refused our certificate (or its absence) only as "Socket closed"; the server's log
    says why (gRPC's "Handshake failed ... PEER_DID_NOT_RETURN_A_CERTIFICATE" and the like)."""
    if not any(marker in details for marker in _HANDSHAKE_CLOSED):
        return details
    if security.tls is None:
        return (
            f"{details} (a plaintext call to a TLS server fails this way: give --tls-ca, and --tls-cert and "
            "--tls-key when it requires client certificates)"
        )
    if security.tls.cert is None:
        return (
            f"{details} (the server closed the TLS handshake: under mutual TLS it requires a client certificate "
            "signed by its CA; give --tls-cert and --tls-key; the server's log says why it refused)"
        )
    return (
        f"{details} (the TLS handshake failed: the server refused our client certificate, or we refused its "
        "certificate (check --tls-ca and the host name); the server's log says which and why)"
    )


_SERVER_ONLY = ("health_port", "tls_client_roles")


def add_client_security_arguments(parser: argparse.ArgumentParser) -> None:
    """--api-key, --tls-cert, --tls-key, --tls-ca (and their SLUICE_* variables) for a client:
    the CA verifies the server, a certificate and key are the client's under mutual TLS."""
    add_config_arguments(parser.add_argument_group("security"), SecurityConfig, exclude=_SERVER_ONLY)


def client_security_from(args: argparse.Namespace) -> ClientSecurity:
    cfg = config_from(SecurityConfig, args, exclude=_SERVER_ONLY)
    return ClientSecurity.from_config(cfg, api_key=next(iter(split_keys(cfg.api_key)), None))
