"""The cluster's TLS identity: a private certificate authority signs one certificate every node
presents, made once by `shoal cluster-init` and kept in the secret file; links are then
encrypted and mutually authenticated."""

from __future__ import annotations

import base64
import datetime
import hashlib
import hmac
import re
from dataclasses import dataclass

NAME = "shoal"  # every node's certificate names this; clients check it, whatever the address
_BLOCK = re.compile(r"-----BEGIN ([A-Z ]+)-----\n.*?\n-----END \1-----\n?", re.S)


@dataclass(frozen=True)
class Identity:
    """PEM bytes: the authority's certificate, the shared node certificate and its key."""

    authority: bytes
    certificate: bytes
    key: bytes

    def to_pem(self) -> str:
        return (self.authority + self.certificate + self.key).decode()


def door_pass(identity: Identity) -> str:
    """What a cluster member shows a worker's front doors before its TLS handshake, so that
    they keep it a place no stranger can take: made from the cluster's private key."""
    return hmac.new(identity.key, b"shoal: a worker's front door", hashlib.sha256).hexdigest()


# The pass travels as an HTTP CONNECT's Proxy-Authorization, which grpcio sends by itself
# to a proxy named with a user (its channel option "grpc.http_proxy"): the worker's front
# door plays that proxy, and the expert lane's client sends the same request.
def door_proxy(address: str, identity: Identity) -> str:
    return f"http://{NAME}:{door_pass(identity)}@{address}"


def door_request(target: str, identity: Identity) -> bytes:
    user = base64.b64encode(f"{NAME}:{door_pass(identity)}".encode()).decode()
    return (f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n"
            f"Proxy-Authorization: Basic {user}\r\n\r\n").encode()


def shown_pass(request: bytes) -> str:
    """The pass in a CONNECT request's head ("" if it shows none)."""
    for line in request.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        kind, _, user = value.strip().partition(b" ")
        if name.strip().lower() == b"proxy-authorization" and kind.lower() == b"basic":
            try:
                return base64.b64decode(user, validate=True).decode().partition(":")[2]
            except ValueError:
                return ""
    return ""


def shows_pass(request: bytes, identity: Identity) -> bool:
    return hmac.compare_digest(shown_pass(request).encode(), door_pass(identity).encode())


# The authority's own key is thrown away once it has signed, so no one, not even the holder of
# the file, can mint a second identity: re-running cluster-init makes a new cluster.
def make_identity(years: int = 20) -> Identity:
    """A new authority and a node certificate it signed for NAME, for servers and clients."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.UTC) - datetime.timedelta(days=1)  # clock skew
    until = now + datetime.timedelta(days=365 * years)
    ca_key, node_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(
        ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "shoal cluster authority")])
    authority = (
        x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
        .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now).not_valid_after(until)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False,
                                     key_encipherment=False, data_encipherment=False,
                                     key_agreement=False, key_cert_sign=True, crl_sign=True,
                                     encipher_only=False, decipher_only=False), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    node = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, NAME)]))
        .issuer_name(ca_name).public_key(node_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now).not_valid_after(until)
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(NAME)]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                              ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    key = node_key.private_bytes(pem, serialization.PrivateFormat.PKCS8,
                                 serialization.NoEncryption())
    return Identity(authority.public_bytes(pem), node.public_bytes(pem), key)


def read_identity(text: str) -> Identity | None:
    """The identity in a secret file's text (its PEM blocks), or None if it has none."""
    blocks = [m.group(0).encode() for m in _BLOCK.finditer(text)]
    certificates = [b for b in blocks if b.startswith(b"-----BEGIN CERTIFICATE")]
    keys = [b for b in blocks if b"PRIVATE KEY" in b.split(b"\n", 1)[0]]
    if len(certificates) != 2 or len(keys) != 1:
        return None
    return Identity(certificates[0], certificates[1], keys[0])
