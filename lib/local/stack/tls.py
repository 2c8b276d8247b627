"""The stack's own certificates: a private CA and a server certificate for localhost, under <stack dir>/tls/.

Made once with `cryptography` and kept: ca.pem (give it to clients), ca-key.pem, server.pem, server-key.pem
and server-keystore.pem (key, certificate and CA for Kafka's PEM keystore). Keys are 0600. other-ca.pem is
an unrelated CA that tests use to show that a server certificate it did not sign is refused.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

CA_DAYS = 5 * 365
SERVER_DAYS = 3 * 365
RENEW_DAYS = 30  # a certificate that expires sooner is made again
HOSTS = ("localhost",)
ADDRESSES = ("127.0.0.1",)


def paths(stack_dir: Path) -> dict[str, Path]:
    """Where the CA, the server certificate and key, Kafka's keystore and the unrelated CA live."""
    folder = stack_dir / "tls"
    return {"dir": folder, "ca": folder / "ca.pem", "ca_key": folder / "ca-key.pem",
            "cert": folder / "server.pem", "key": folder / "server-key.pem",
            "keystore": folder / "server-keystore.pem", "other_ca": folder / "other-ca.pem"}


def write(path: Path, data: bytes, private: bool = False) -> None:
    """Write a file atomically; a private one is 0600 from the start."""
    staging = path.with_name(path.name + ".tmp")
    staging.unlink(missing_ok=True)
    descriptor = os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600 if private else 0o644)
    with os.fdopen(descriptor, "wb") as handle:
        handle.write(data)
    staging.replace(path)


def new_key() -> rsa.RSAPrivateKey:
    """An RSA key every client here accepts (libpq, librdkafka, Java, Python)."""
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


def pem_key(key) -> bytes:
    """A private key as unencrypted PKCS#8 PEM (what Kafka's PEM keystore reads)."""
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def pem_cert(cert: x509.Certificate) -> bytes:
    """A certificate as PEM."""
    return cert.public_bytes(serialization.Encoding.PEM)


def name(common_name: str) -> x509.Name:
    """A subject or issuer name."""
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "cdc-pipeline local stack"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def make_ca(common_name: str) -> tuple[rsa.RSAPrivateKey, x509.Certificate]:
    """A self-signed CA key and certificate."""
    key = new_key()
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name(common_name)).issuer_name(name(common_name))
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=CA_DAYS))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                         crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))
    return key, cert


def make_server(ca_key, ca_cert: x509.Certificate) -> tuple[rsa.RSAPrivateKey, x509.Certificate]:
    """A server key and certificate for localhost and 127.0.0.1, signed by the CA."""
    key = new_key()
    now = datetime.datetime.now(datetime.timezone.utc)
    names = [x509.DNSName(host) for host in HOSTS] + [x509.IPAddress(ipaddress.ip_address(a)) for a in ADDRESSES]
    cert = (x509.CertificateBuilder().subject_name(name("localhost")).issuer_name(ca_cert.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(min(now + datetime.timedelta(days=SERVER_DAYS), ca_cert.not_valid_after_utc))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=True,
                                         data_encipherment=False, key_agreement=False, key_cert_sign=False,
                                         crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    return key, cert


def usable(path: Path, issuer: x509.Certificate | None = None) -> bool:
    """True when path holds a certificate valid for RENEW_DAYS more days (and issued by issuer, if given)."""
    if not path.is_file():
        return False
    try:
        cert = x509.load_pem_x509_certificate(path.read_bytes())
    except ValueError:
        return False
    soon = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(days=RENEW_DAYS)
    if cert.not_valid_after_utc < soon:
        return False
    return issuer is None or (cert.issuer == issuer.subject and verifies(cert, issuer))


def verifies(cert: x509.Certificate, issuer: x509.Certificate) -> bool:
    """True when issuer's key signed cert."""
    try:
        cert.verify_directly_issued_by(issuer)
    except (ValueError, TypeError, InvalidSignature):
        return False
    return True


def pairs(cert_path: Path, key_path: Path) -> bool:
    """True when the key file holds the private key of the certificate (a write cut short leaves them apart)."""
    if not key_path.is_file():
        return False
    public = serialization.PublicFormat.SubjectPublicKeyInfo
    try:
        cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
        key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
    except ValueError:
        return False
    return (cert.public_key().public_bytes(serialization.Encoding.DER, public)
            == key.public_key().public_bytes(serialization.Encoding.DER, public))


def ensure(stack_dir: Path, log=print) -> bool:
    """Make what is missing or expires soon (CA, server certificate, other-ca.pem); True for a new server cert."""
    where = paths(stack_dir)
    where["dir"].mkdir(parents=True, exist_ok=True)
    made = False
    if not (usable(where["ca"]) and pairs(where["ca"], where["ca_key"])):
        ca_key, ca_cert = make_ca("cdc-pipeline local stack CA")
        write(where["ca_key"], pem_key(ca_key), private=True)
        write(where["ca"], pem_cert(ca_cert))
        made = True
        log(f"tls       made a private CA: {where['ca']} (its key {where['ca_key']}, mode 0600)")
    ca_cert = x509.load_pem_x509_certificate(where["ca"].read_bytes())
    if made or not (usable(where["cert"], ca_cert) and pairs(where["cert"], where["key"])
                    and keystore_current(where)):
        ca_key = serialization.load_pem_private_key(where["ca_key"].read_bytes(), password=None)
        key, cert = make_server(ca_key, ca_cert)
        write(where["key"], pem_key(key), private=True)
        write(where["keystore"], pem_key(key) + pem_cert(cert) + pem_cert(ca_cert), private=True)
        write(where["cert"], pem_cert(cert))
        made = True
        log(f"tls       made a server certificate for {', '.join(HOSTS + ADDRESSES)}: {where['cert']}")
    other_ca(stack_dir)
    return made


def keystore_current(where: dict[str, Path]) -> bool:
    """True when Kafka's keystore holds the current server key, certificate and CA."""
    parts = [where["key"], where["cert"], where["ca"]]
    return where["keystore"].is_file() and where["keystore"].read_bytes() == b"".join(p.read_bytes() for p in parts)


def other_ca(stack_dir: Path) -> Path:
    """An unrelated CA certificate (its key is thrown away): a client trusting only it must refuse the stack."""
    where = paths(stack_dir)
    if not usable(where["other_ca"]):
        where["dir"].mkdir(parents=True, exist_ok=True)
        write(where["other_ca"], pem_cert(make_ca("unrelated CA (tests)")[1]))
    return where["other_ca"]


def fingerprint(path: Path) -> str:
    """SHA-256 fingerprint of a PEM certificate, to tell a renewed one from the one a service loaded."""
    return x509.load_pem_x509_certificate(path.read_bytes()).fingerprint(hashes.SHA256()).hex()
