"""A throwaway PKI for the TLS tests: a CA, and server and client certificates it signs, written
as PEM files. EC P-256 keys (what cert-manager issues in deploy/), generated in milliseconds."""
from __future__ import annotations

import datetime
import ipaddress
import pathlib
from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True, slots=True)
class Leaf:
    cert: str
    key: str


@dataclass(frozen=True, slots=True)
class Pki:
    ca: str
    server: Leaf
    client: Leaf
    # Signed by another CA: a certificate the servers must refuse.
    stranger: Leaf
    # Names only "cache.test": reachable on 127.0.0.1 only with a server-name override.
    named_server: Leaf


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _builder(subject: str, issuer: x509.Name,
             key: ec.EllipticCurvePrivateKey) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.timezone.utc)
    return (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(issuer)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1)))


def _write(path: pathlib.Path, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> Leaf:
    cert_path, key_path = path.with_suffix(".crt"), path.with_suffix(".key")
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return Leaf(str(cert_path), str(key_path))


class _Ca:
    def __init__(self, name: str):
        self.key = ec.generate_private_key(ec.SECP256R1())
        self.name = _name(name)
        self.cert = (_builder(name, self.name, self.key)
                     .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                     .add_extension(x509.KeyUsage(
                         digital_signature=True, key_cert_sign=True, crl_sign=True,
                         content_commitment=False, key_encipherment=False,
                         data_encipherment=False, key_agreement=False, encipher_only=False,
                         decipher_only=False), critical=True)
                     .sign(self.key, hashes.SHA256()))

    def save(self, path: pathlib.Path) -> str:
        """Writes the CA's certificate (what clients and servers trust) as PEM; returns the path."""
        path.write_bytes(self.cert.public_bytes(serialization.Encoding.PEM))
        return str(path)

    def issue(self, path: pathlib.Path, subject: str, *, server: bool,
              dns: tuple[str, ...] = ("localhost",), ips: tuple[str, ...] = ("127.0.0.1",)) -> Leaf:
        key = ec.generate_private_key(ec.SECP256R1())
        usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
        sans = [x509.DNSName(d) for d in dns] + [x509.IPAddress(ipaddress.ip_address(i))
                                                 for i in ips]
        cert = (_builder(subject, self.name, key)
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
                .add_extension(x509.SubjectAlternativeName(sans), critical=False)
                .sign(self.key, hashes.SHA256()))
        return _write(path, cert, key)


def make_pki(directory: pathlib.Path) -> Pki:
    ca, other = _Ca("prefixcache-test-ca"), _Ca("someone-elses-ca")
    return Pki(ca=ca.save(directory / "ca.crt"),
               server=ca.issue(directory / "server", "server", server=True),
               client=ca.issue(directory / "client", "client", server=False),
               stranger=other.issue(directory / "stranger", "stranger", server=False),
               named_server=ca.issue(directory / "named", "cache.test", server=True,
                                     dns=("cache.test",), ips=()))


def server_of_another_ca(directory: pathlib.Path) -> tuple[str, Leaf]:
    """(the new CA's certificate, a server certificate it signs): a renewal that only a client
    trusting the new CA accepts, so a test can tell which certificate a server serves."""
    ca = _Ca("renewed-ca")
    return ca.save(directory / "renewed-ca.crt"), ca.issue(directory / "renewed-server", "server",
                                                           server=True)
