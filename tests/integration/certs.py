"""Certificates and keys of the integration-test control plane, made with ``cryptography``.

This module sits under ``controlplane.py`` beside ``kubeconfig.py`` (which inlines the client
certificates made here): :class:`CertificateAuthority` is a self-signed CA that issues the
kube-apiserver serving certificate and the client certificates of the admin, the components and
test users; :func:`write_service_account_keys` makes the RSA pair that signs ServiceAccount
tokens.  Private keys are written with mode 0600.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import ssl
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

# Certificates are back-dated so that a small clock skew between processes cannot make a
# fresh certificate "not yet valid".
_BACKDATE = dt.timedelta(minutes=5)
_CA_LIFETIME = dt.timedelta(days=2)
_LEAF_LIFETIME = dt.timedelta(days=1)


@dataclass(frozen=True)
class KeyPair:
    """A PEM certificate and private key written to disk."""

    cert_path: Path
    key_path: Path

    @property
    def cert_pem(self) -> bytes:
        """The certificate, PEM encoded."""
        return self.cert_path.read_bytes()

    @property
    def key_pem(self) -> bytes:
        """The private key, PEM encoded."""
        return self.key_path.read_bytes()


def write_private(path: Path, data: bytes) -> None:
    """Write secret material (a key, a kubeconfig with credentials) readable by us only."""
    path.write_bytes(data)
    path.chmod(0o600)


def _key_pem(key: ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _write_pair(
    pair: KeyPair, *, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey
) -> KeyPair:
    pair.cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    write_private(pair.key_path, _key_pem(key))
    return pair


def _build_certificate(
    *,
    subject: x509.Name,
    issuer: x509.Name,
    public_key: ec.EllipticCurvePublicKey,
    signing_key: ec.EllipticCurvePrivateKey,
    is_ca: bool,
    lifetime: dt.timedelta,
    extensions: Sequence[x509.ExtensionType] = (),
) -> x509.Certificate:
    """Sign one X.509 v3 certificate; the CA and every leaf certificate are made here.

    Basic constraints and key usage are critical and follow from ``is_ca`` (a CA signs
    certificates and CRLs, a leaf only signs handshakes); ``extensions`` are added as
    non-critical.
    """
    now = dt.datetime.now(dt.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _BACKDATE)
        .not_valid_after(now + lifetime)
        .add_extension(x509.BasicConstraints(ca=is_ca, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=is_ca,
                crl_sign=is_ca,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
    )
    for extension in extensions:
        builder = builder.add_extension(extension, critical=False)
    return builder.sign(signing_key, hashes.SHA256())


class CertificateAuthority:
    """A self-signed CA that issues the serving and client certificates of the cluster."""

    def __init__(self, directory: Path, common_name: str = "adaptis-test-ca") -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self._key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
        self._cert = _build_certificate(
            subject=name,
            issuer=name,
            public_key=self._key.public_key(),
            signing_key=self._key,
            is_ca=True,
            lifetime=_CA_LIFETIME,
            extensions=[x509.SubjectKeyIdentifier.from_public_key(self._key.public_key())],
        )
        self.pair = _write_pair(
            KeyPair(directory / "ca.crt", directory / "ca.key"), cert=self._cert, key=self._key
        )

    @property
    def cert_path(self) -> Path:
        """Path of the CA certificate (PEM)."""
        return self.pair.cert_path

    def issue(
        self,
        name: str,
        *,
        common_name: str,
        organizations: Sequence[str] = (),
        server: bool = False,
        client: bool = False,
        dns_names: Sequence[str] = (),
        ip_addresses: Sequence[str] = (),
    ) -> KeyPair:
        """Issue a certificate for ``common_name`` and write ``<name>.crt`` / ``<name>.key``.

        Kubernetes reads the user name from the CN and the groups from the organizations.
        """
        key = ec.generate_private_key(ec.SECP256R1())
        attributes = [x509.NameAttribute(NameOID.COMMON_NAME, common_name)]
        attributes += [x509.NameAttribute(NameOID.ORGANIZATION_NAME, org) for org in organizations]
        usages = []
        if server:
            usages.append(ExtendedKeyUsageOID.SERVER_AUTH)
        if client:
            usages.append(ExtendedKeyUsageOID.CLIENT_AUTH)
        extensions: list[x509.ExtensionType] = [
            x509.ExtendedKeyUsage(usages),
            x509.AuthorityKeyIdentifier.from_issuer_public_key(self._key.public_key()),
        ]
        sans: list[x509.GeneralName] = [x509.DNSName(d) for d in dns_names]
        sans += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ip_addresses]
        if sans:
            extensions.append(x509.SubjectAlternativeName(sans))
        cert = _build_certificate(
            subject=x509.Name(attributes),
            issuer=self._cert.subject,
            public_key=key.public_key(),
            signing_key=self._key,
            is_ca=False,
            lifetime=_LEAF_LIFETIME,
            extensions=extensions,
        )
        pair = KeyPair(self.directory / f"{name}.crt", self.directory / f"{name}.key")
        return _write_pair(pair, cert=cert, key=key)


def write_service_account_keys(directory: Path) -> tuple[Path, Path]:
    """Write an RSA key pair for signing service-account tokens; return (private, public)."""
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    private = directory / "sa.key"
    public = directory / "sa.pub"
    write_private(private, _key_pem(key))
    public.write_bytes(
        key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    return private, public


def client_ssl_context(*, ca_cert: Path, client: KeyPair) -> ssl.SSLContext:
    """A TLS context that trusts ``ca_cert`` and presents ``client`` (mutual TLS)."""
    context = ssl.create_default_context(cafile=str(ca_cert))
    context.load_cert_chain(str(client.cert_path), str(client.key_path))
    return context
