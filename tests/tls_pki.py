"""A throwaway PKI for the TLS tests (tests/test_tls.py, tests/test_tls_config.py), made with
`cryptography` (a dev requirement; the servers never import it).

- `make_pki(directory) -> Pki`: a test CA, another CA that signed nothing, a server certificate
  (127.0.0.1 and localhost, server auth) and a client certificate (client auth), all EC P-256,
  valid from 5 minutes ago for a day, written as PEM files into `directory` (keys PKCS8,
  unencrypted). Each test module wraps it in its own module-scoped `pki` fixture.
- `Pki.client(...)` -> gRPC channel credentials, `Pki.https(...)` -> an ssl client context for
  /metrics scrapes, with or without the client certificate, trusting the test CA or another.
No tests here.
"""

from __future__ import annotations

import datetime
import ipaddress
import pathlib
import ssl
from dataclasses import dataclass

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from common.tls import channel_credentials


@dataclass(frozen=True)
class Pki:
    ca: str
    other_ca: str  # a CA that signed nothing here
    server_cert: str  # 127.0.0.1 and localhost, for the router and the worker
    server_key: str
    client_cert: str  # for the router (to workers) and for clients (to a router)
    client_key: str

    def https(self, with_cert: bool = True, ca: str | None = None) -> ssl.SSLContext:
        """A client context for HTTPS scrapes of /metrics."""
        context = ssl.create_default_context(cafile=ca or self.ca)
        if with_cert:
            context.load_cert_chain(self.client_cert, self.client_key)
        return context

    def client(self, with_cert: bool = True, ca: str | None = None) -> grpc.ChannelCredentials:
        if not with_cert:
            return channel_credentials(ca or self.ca)
        return channel_credentials(ca or self.ca, self.client_cert, self.client_key)


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _issue(subject: str, key, issuer: x509.Name, issuer_key, extensions: list) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
    )
    for extension, critical in extensions:
        builder = builder.add_extension(extension, critical=critical)
    return builder.sign(issuer_key, hashes.SHA256())


def _write(directory: pathlib.Path, stem: str, cert: x509.Certificate, key=None) -> tuple[str, str]:
    cert_path = directory / f"{stem}.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    if key is None:
        return str(cert_path), ""
    key_path = directory / f"{stem}-key.pem"
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return str(cert_path), str(key_path)


def _make_ca(name: str):
    key = ec.generate_private_key(ec.SECP256R1())
    usage = x509.KeyUsage(
        digital_signature=True,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=True,
        crl_sign=True,
        encipher_only=False,
        decipher_only=False,
    )
    cert = _issue(
        name, key, _name(name), key, [(x509.BasicConstraints(ca=True, path_length=0), True), (usage, True)]
    )
    return cert, key


def make_pki(directory: pathlib.Path) -> Pki:
    ca, ca_key = _make_ca("test CA")
    other_ca, _ = _make_ca("another CA")
    leaf = (x509.BasicConstraints(ca=False, path_length=None), True)
    server_key = ec.generate_private_key(ec.SECP256R1())
    server = _issue(
        "localhost",
        server_key,
        ca.subject,
        ca_key,
        [
            leaf,
            (
                x509.SubjectAlternativeName(
                    [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
                ),
                False,
            ),
            (x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), False),
        ],
    )
    client_key = ec.generate_private_key(ec.SECP256R1())
    client_cert = _issue(
        "llm-router",
        client_key,
        ca.subject,
        ca_key,
        [leaf, (x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), False)],
    )
    server_paths = _write(directory, "server", server, server_key)
    client_paths = _write(directory, "client", client_cert, client_key)
    return Pki(
        ca=_write(directory, "ca", ca)[0],
        other_ca=_write(directory, "other-ca", other_ca)[0],
        server_cert=server_paths[0],
        server_key=server_paths[1],
        client_cert=client_paths[0],
        client_key=client_paths[1],
    )
