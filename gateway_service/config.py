"""The gateway's settings: flags, SLUICE_* variables and config files (sluice.common.config)."""

from __future__ import annotations

from dataclasses import dataclass

from sluice.common.config import opt
from sluice.common.security import ClientSecurity, SecurityConfig, TlsFiles, split_keys

MAX_BODY_BYTES = 16 * 2**20  # the scheduler's own limit of one Generate request


@dataclass
class GatewayConfig(SecurityConfig):
    """`sluice gateway`: the OpenAI HTTP API in front of a running scheduler. api_key, tls_cert,
    tls_key and tls_ca secure the HTTP port as they secure the scheduler's gRPC port (tls_ca:
    clients must present a certificate it signed). To the scheduler the gateway is a client:
    the first API key, and with scheduler_tls its certificate under the scheduler's mutual TLS."""

    host: str = opt("127.0.0.1", "address to listen on (loopback: only this machine reaches it)")
    port: int = opt(8000, "HTTP port to listen on (0 picks a free one)")
    scheduler: str = opt("127.0.0.1:50051", "HOST:PORT of the scheduler's gRPC API")
    scheduler_api_key: str | None = opt(None, "the API key the scheduler requires; none: the first of api_key")
    scheduler_tls: bool = opt(
        False,
        "dial the scheduler over TLS: scheduler_tls_ca verifies it; tls_cert and tls_key are our certificate",
    )
    scheduler_tls_ca: str | None = opt(
        None,
        "PEM CA bundle that verifies the scheduler; none: tls_ca (which also makes HTTP clients show certificates)",
    )
    served_model_name: list[str] = opt(
        default_factory=list, help="model names clients may ask for (besides the scheduler's model); first is listed"
    )
    chat_template: str | None = opt(
        None, "a Jinja chat template (a file, or the template text); none: the model's own, else the default"
    )
    request_timeout_s: float | None = opt(None, "deadline of each generation request in seconds (504 past it)")
    max_body_bytes: int = opt(MAX_BODY_BYTES, "largest request body accepted, in bytes (413 above)")

    def scheduler_security(self) -> ClientSecurity:
        keys = split_keys(self.api_key)
        key = self.scheduler_api_key or (keys[0] if keys else None)
        ca = self.scheduler_tls_ca or self.tls_ca
        tls = TlsFiles.load(self.tls_cert, self.tls_key, ca) if self.scheduler_tls else None
        return ClientSecurity(tls, key)


# The gateway serves no gRPC: the security mix-in's plaintext gRPC health port does not apply.
GATEWAY_EXCLUDES = ("health_port",)
