"""A fleet's own certificate authority: a CA, a server certificate, a client certificate per identity.

Why a private CA: every NATS connection of a secure fleet is mutual TLS, and the only parties are the
fleet's own processes, so the fleet signs for itself (no public CA can vouch for a worker's client
certificate). `cryptography` (the Python Cryptographic Authority's library) does the X.509 work; nothing
here is hand-rolled crypto. Keys are EC P-256; certificates last `days` (rotation: docs/how-to/secure-fleet.md).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from collections.abc import Iterable
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

DEFAULT_DAYS = 365


def _name(common_name: str, role: str | None = None) -> x509.Name:
    """`O=fauxmad, CN=<identity>`, with `OU=<role>` for an identity's certificate (what the backhaul checks)."""
    attributes = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, "fauxmad")]
    if role:
        attributes.append(x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, role))
    attributes.append(x509.NameAttribute(NameOID.COMMON_NAME, common_name))
    return x509.Name(attributes)


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    """A private key, readable by its owner alone."""
    data = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def write_cert(path: Path, cert: x509.Certificate) -> None:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def load_ca(cert_path: Path, key_path: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
    key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise ValueError(f"{key_path}: not an EC private key")
    return cert, key


def make_ca(
    common_name: str = "fauxmad fleet CA", days: int = 10 * DEFAULT_DAYS
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = _name(common_name)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(_now() - datetime.timedelta(minutes=5))
        .not_valid_after(_now() + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(True, False, False, False, False, True, True, False, False), critical=True)
        .sign(key, hashes.SHA256())
    )
    return cert, key


def server_names(cert_path: Path) -> list[str]:
    """The DNS names and IP addresses a server certificate was issued for (to issue its successor)."""
    cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
    try:
        alternative = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return []
    names: list[str] = list(alternative.get_values_for_type(x509.DNSName))
    names += [str(address) for address in alternative.get_values_for_type(x509.IPAddress)]
    return names


def issue(
    ca: tuple[x509.Certificate, ec.EllipticCurvePrivateKey],
    common_name: str,
    *,
    server_names: Iterable[str] = (),
    client: bool = True,
    server: bool = False,
    role: str | None = None,
    days: int = DEFAULT_DAYS,
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """A certificate signed by `ca`: a server's (with `server_names` as SANs) or a client's; `server` with
    `client`: both (a worker: a client of NATS, and the server of its backhaul, naming its host's addresses).
    `role`: the identity's role, written in the subject (`OU`)."""
    ca_cert, ca_key = ca
    key = ec.generate_private_key(ec.SECP256R1())
    usages = [ExtendedKeyUsageOID.CLIENT_AUTH] if client else [ExtendedKeyUsageOID.SERVER_AUTH]
    if client and server:
        usages.append(ExtendedKeyUsageOID.SERVER_AUTH)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name, role))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(_now() - datetime.timedelta(minutes=5))
        .not_valid_after(_now() + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
    )
    names: list[x509.GeneralName] = []
    for server_name in server_names:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(server_name)))
        except ValueError:
            names.append(x509.DNSName(server_name))
    if names:
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    return builder.sign(ca_key, hashes.SHA256()), key
