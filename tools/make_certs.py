"""``python -m tools.make_certs DIR``: a throwaway CA plus server and client certificates for local TLS.

Writes ``ca.pem``, ``server.pem`` / ``server.key`` (valid for localhost and 127.0.0.1) and
``client.pem`` / ``client.key`` (for mutual TLS). For tests and trying TLS out, never for production.
Needs the ``cryptography`` package (a dev dependency).
"""

from __future__ import annotations

import datetime
import ipaddress
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class CertPaths:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def _key():
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.generate_private_key(ec.SECP256R1())


def _write_key(key, path: Path) -> None:
    from cryptography.hazmat.primitives import serialization

    path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    path.chmod(0o600)


def _name(common_name: str):
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def make_certs(directory: Path | str, ca_name: str = "ardit test CA") -> CertPaths:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.x509.oid import ExtendedKeyUsageOID

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    valid = (now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=2))

    ca_key = _key()
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(_name(ca_name))
        .issuer_name(_name(ca_name))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(valid[0])
        .not_valid_after(valid[1])
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True
        )
        .sign(ca_key, hashes.SHA256())
    )

    def leaf(common_name: str, usage, sans) -> tuple[object, object]:
        key = _key()
        builder = (
            x509.CertificateBuilder()
            .subject_name(_name(common_name))
            .issuer_name(ca_cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(valid[0])
            .not_valid_after(valid[1])
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        )
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        return builder.sign(ca_key, hashes.SHA256()), key

    server_cert, server_key = leaf(
        "localhost",
        ExtendedKeyUsageOID.SERVER_AUTH,
        [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))],
    )
    client_cert, client_key = leaf("ardit client", ExtendedKeyUsageOID.CLIENT_AUTH, None)

    paths = CertPaths(
        directory / "ca.pem", directory / "server.pem", directory / "server.key", directory / "client.pem", directory / "client.key"
    )
    pem = serialization.Encoding.PEM
    paths.ca.write_bytes(ca_cert.public_bytes(pem))
    paths.server_cert.write_bytes(server_cert.public_bytes(pem))
    paths.client_cert.write_bytes(client_cert.public_bytes(pem))
    _write_key(server_key, paths.server_key)
    _write_key(client_key, paths.client_key)
    return paths


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m tools.make_certs DIR", file=sys.stderr)
        return 2
    paths = make_certs(args[0])
    print("\n".join(str(p) for p in vars(paths).values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
