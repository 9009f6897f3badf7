"""TLS credentials from PEM files, for the router's client port and router <-> worker channels.

Contract
- input: paths of PEM files (certificate chain, private key, CA bundle) and the command-line flags
  they came from (always in the order cert, key, CA), so that every error names flag and path.
- output: `server_credentials(cert, key, client_ca)` -> `grpc.ServerCredentials` (with a client CA
  the server requires client certificates signed by it: mutual TLS); `server_ssl_context(cert,
  key, client_ca)` -> the same as an `ssl.SSLContext`, for the Prometheus /metrics endpoints
  (TLS 1.2+); `channel_credentials(ca,
  cert, key)` -> `grpc.ChannelCredentials` (ca None = the system's trusted CAs; cert + key = the
  client certificate for mutual TLS). `check_files` / `check_server_files` are what config
  dataclasses call in `__post_init__`.
- state: none; files are read when credentials are built (at start-up), so a renewed certificate
  takes effect on restart.
- failure modes: ValueError naming the flag and path when a file is missing, unreadable or not
  PEM, or when a certificate comes without its key (or the reverse).
- proven by: tests/test_tls.py (served), tests/test_tls_config.py (the file checks).
"""

from __future__ import annotations

import pathlib
import ssl

import grpc

SERVER_FLAGS = ("--tls-cert", "--tls-key", "--tls-client-ca")
CLIENT_FLAGS = ("--tls-cert", "--tls-key", "--tls-ca")
METRICS_FLAGS = ("--metrics-tls-cert", "--metrics-tls-key", "--metrics-tls-client-ca")


def read_pem(path: str, flag: str) -> bytes:
    try:
        data = pathlib.Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"{flag} {path}: cannot read the file ({exc.strerror or exc})") from None
    if b"-----BEGIN " not in data:
        raise ValueError(f"{flag} {path}: not a PEM file (no '-----BEGIN' line)")
    return data


def check_files(cert: str | None, key: str | None, ca: str | None, flags: tuple[str, str, str]) -> None:
    """Certificate and key come together; every file given is a readable PEM file.
    `flags` names cert, key and ca, in that order."""
    cert_flag, key_flag, ca_flag = flags
    if (cert is None) != (key is None):
        given, missing = (cert_flag, key_flag) if cert is not None else (key_flag, cert_flag)
        raise ValueError(f"{given} needs {missing}: a certificate and its private key go together")
    for path, flag in ((cert, cert_flag), (key, key_flag), (ca, ca_flag)):
        if path is not None:
            read_pem(path, flag)


def check_server_files(
    cert: str | None, key: str | None, client_ca: str | None, flags: tuple[str, str, str] = SERVER_FLAGS
) -> None:
    """`check_files`, and a client CA only on a TLS port."""
    check_files(cert, key, client_ca, flags)
    if client_ca is not None and cert is None:
        raise ValueError(
            f"{flags[2]} needs {flags[0]} and {flags[1]}: client certificates are checked only on a TLS port"
        )


def server_credentials(
    cert: str, key: str, client_ca: str | None = None, flags: tuple[str, str, str] = SERVER_FLAGS
) -> grpc.ServerCredentials:
    """`flags` names the cert, key and client CA flags, in that order, for error messages."""
    cert_flag, key_flag, ca_flag = flags
    return grpc.ssl_server_credentials(
        [(read_pem(key, key_flag), read_pem(cert, cert_flag))],
        root_certificates=read_pem(client_ca, ca_flag) if client_ca else None,
        require_client_auth=client_ca is not None,
    )


def server_ssl_context(
    cert: str, key: str, client_ca: str | None = None, flags: tuple[str, str, str] = METRICS_FLAGS
) -> ssl.SSLContext:
    """An HTTPS server context; with a client CA, clients must present a certificate it signed."""
    cert_flag, key_flag, ca_flag = flags
    check_server_files(cert, key, client_ca, flags)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(cert, key)
    except ssl.SSLError as exc:
        raise ValueError(
            f"{cert_flag} {cert} / {key_flag} {key}: not a matching certificate and "
            f"private key ({exc.reason or exc})"
        ) from None
    if client_ca is not None:
        try:
            context.load_verify_locations(cafile=client_ca)
        except ssl.SSLError as exc:
            raise ValueError(
                f"{ca_flag} {client_ca}: no usable CA certificate ({exc.reason or exc})"
            ) from None
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def channel_credentials(
    ca: str | None,
    cert: str | None = None,
    key: str | None = None,
    flags: tuple[str, str, str] = CLIENT_FLAGS,
) -> grpc.ChannelCredentials:
    """`flags` names the cert, key and CA flags, in that order, for error messages."""
    cert_flag, key_flag, ca_flag = flags
    check_files(cert, key, None, flags)
    return grpc.ssl_channel_credentials(
        root_certificates=read_pem(ca, ca_flag) if ca else None,
        private_key=read_pem(key, key_flag) if key else None,
        certificate_chain=read_pem(cert, cert_flag) if cert else None,
    )
