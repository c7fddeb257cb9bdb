"""A development certificate authority and the certificates Sluice's services need.

    make_ca("sluice dev CA")              -> Issued(cert_pem, key_pem)   self-signed, 10 years
    issue(ca, "scheduler", hosts=[...])   -> Issued                      signed by the CA; both
                                             serverAuth and clientAuth, so one certificate per
                                             service serves its port and dials its peers (mTLS)
    write_dev_pki(folder, names, hosts)   -> {name: (cert path, key path)} plus ca.crt / ca.key

`sluice certs --out DIR [--name scheduler --name worker --name client] [--host HOST ...]` writes
them (keys with mode 0600). Subject alternative names: every --host (DNS names and IP
addresses), plus localhost, 127.0.0.1 and ::1. Keys are ECDSA P-256. For production, use your
own CA (cert-manager, Vault, a corporate PKI); the services only read PEM files.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

DEFAULT_HOSTS = ("localhost", "127.0.0.1", "::1")
CA_DAYS = 3650
LEAF_DAYS = 825


@dataclass(frozen=True)
class Issued:
    cert_pem: bytes
    key_pem: bytes

    @property
    def certificate(self) -> x509.Certificate:
        return x509.load_pem_x509_certificate(self.cert_pem)

    @property
    def private_key(self) -> ec.EllipticCurvePrivateKey:
        key = serialization.load_pem_private_key(self.key_pem, password=None)
        assert isinstance(key, ec.EllipticCurvePrivateKey)
        return key


SERVICE_ROLES = ("scheduler", "worker", "predictor")  # any other name is issued the role "client"


def role_for(name: str) -> str:
    return name if name in SERVICE_ROLES else "client"


def _name(common_name: str, role: str | None = None) -> x509.Name:
    """O=Sluice, OU=role (what a service checks, tls_client_roles), CN=the name."""
    attributes = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, "Sluice")]
    if role:
        attributes.append(x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, role))
    return x509.Name([*attributes, x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def certificate_role(cert_pem: bytes) -> str | None:
    """The role (subject OU) of a PEM certificate, None when it has none."""
    cert = x509.load_pem_x509_certificate(cert_pem)
    units = cert.subject.get_attributes_for_oid(NameOID.ORGANIZATIONAL_UNIT_NAME)
    return str(units[0].value) if units else None


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC) - dt.timedelta(minutes=5)  # tolerate small clock skew


def make_ca(common_name: str = "sluice dev CA", days: int = CA_DAYS) -> Issued:
    key = ec.generate_private_key(ec.SECP256R1())
    start = _now()
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(_name(common_name))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(start + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True
        )  # key_cert_sign, crl_sign
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return Issued(cert.public_bytes(serialization.Encoding.PEM), _key_pem(key))


def _alt_names(hosts: Iterable[str]) -> list[x509.GeneralName]:
    names: list[x509.GeneralName] = []
    for host in dict.fromkeys(hosts):
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return names


def issue(
    ca: Issued, common_name: str, hosts: Sequence[str] = (), days: int = LEAF_DAYS, role: str | None = None
) -> Issued:
    """A certificate for one service (server and client use), valid for `hosts` and loopback;
    its subject OU is `role` (default: the name for a service, else "client"): a worker under
    `sluice serve` accepts only its scheduler's role, so a client certificate cannot drive it."""
    key = ec.generate_private_key(ec.SECP256R1())
    ca_cert, ca_key = ca.certificate, ca.private_key
    start = _now()
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name, role or role_for(common_name)))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(start + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName(_alt_names([*hosts, *DEFAULT_HOSTS])), critical=False)
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False
        )
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return Issued(cert.public_bytes(serialization.Encoding.PEM), _key_pem(key))


def _write(path: Path, data: bytes, secret: bool) -> None:
    path.write_bytes(data)
    if secret:
        os.chmod(path, 0o600)


def write_dev_pki(
    folder: str | Path, names: Sequence[str] = ("scheduler", "worker", "client"), hosts: Sequence[str] = ()
) -> dict[str, tuple[Path, Path]]:
    """ca.crt, ca.key and NAME.crt / NAME.key for every name, in `folder` (created)."""
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    ca = make_ca()
    _write(out / "ca.crt", ca.cert_pem, False)
    _write(out / "ca.key", ca.key_pem, True)
    written = {}
    for name in names:
        leaf = issue(ca, name, hosts)
        cert, key = out / f"{name}.crt", out / f"{name}.key"
        _write(cert, leaf.cert_pem, False)
        _write(key, leaf.key_pem, True)
        written[name] = (cert, key)
    return written
