"""A throwaway PKI for the test API server (gpunode_testing.kube_api), made with openssl: a CA,
the server's certificate for 127.0.0.1, and client certificates whose subject is the Kubernetes
user (CN) and groups (O), e.g. the kubelet's `system:node:<name>` in `system:nodes`."""

from __future__ import annotations

import secrets
import ssl
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

_OPENSSL_CNF = """\
[req]
distinguished_name = dn
[dn]
[v3_ca]
basicConstraints = critical, CA:TRUE
keyUsage = critical, keyCertSign, cRLSign, digitalSignature
subjectKeyIdentifier = hash
[v3_server]
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature, keyEncipherment
extendedKeyUsage = serverAuth
subjectAltName = IP:127.0.0.1, DNS:localhost
authorityKeyIdentifier = keyid
[v3_client]
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature, keyEncipherment
extendedKeyUsage = clientAuth
authorityKeyIdentifier = keyid
"""
_EC = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes"]


@dataclass(frozen=True)
class Pki:
    directory: Path
    node_name: str
    ca_cert: Path
    ca_key: Path
    ca_pem: bytes
    server_cert: Path
    server_key: Path
    client_cert: Path  # CN=system:node:<node_name>, O=system:nodes
    client_key: Path  # SEC1 "EC PRIVATE KEY", as the kubelet writes it
    kubelet_client_current: Path  # client cert + key in one file, like /var/lib/kubelet/pki/
    untrusted_ca_cert: Path
    untrusted_client_cert: Path  # same subject as client_cert, signed by untrusted_ca_cert
    untrusted_client_key: Path

    def server_context(self, foreign_cas: Iterable[Path] = ()) -> ssl.SSLContext:
        """The API server's TLS context: it asks for a client certificate (a bearer token
        needs none) of the CA or of `foreign_cas` — the test API server refuses the latter
        with 401, as kube-apiserver's x509 authenticator does (Python's ssl verifies any
        certificate it asks for, so a foreign CA must be trusted here to get that far)."""
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.load_cert_chain(self.server_cert, self.server_key)
        context.verify_mode = ssl.CERT_OPTIONAL
        context.load_verify_locations(cadata=self.ca_pem.decode())
        for foreign in foreign_cas:
            if ca_subject(foreign) == ca_subject(self.ca_cert):  # told apart by the issuer
                raise ValueError(f"{foreign}: a foreign CA needs a subject of its own")
            context.load_verify_locations(cafile=str(foreign))
        return context

    def client_context(self, cert: Path | None = None, key: Path | None = None) -> ssl.SSLContext:
        """A client TLS context trusting the CA, presenting `cert` (default: the kubelet's)."""
        context = ssl.create_default_context(cadata=self.ca_pem.decode())
        context.load_cert_chain(cert or self.kubelet_client_current, key)
        return context


def _openssl(directory: Path, *args: str) -> None:
    try:
        subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True,
                       text=True, timeout=30)
    except subprocess.CalledProcessError as exc:
        raise RuntimeError(f"openssl {' '.join(args)}: {exc.stderr.strip()}") from exc


def _make_ca(directory: Path, stem: str, subject: str) -> None:
    _openssl(directory, "req", "-x509", "-new", "-config", "openssl.cnf", "-extensions", "v3_ca",
             *_EC, "-keyout", f"{stem}.key", "-out", f"{stem}.crt", "-days", "1", "-subj", subject)


def _issue(directory: Path, ca: str, stem: str, subject: str, extensions: str,
           key_args: Iterable[str] = _EC) -> tuple[Path, Path]:
    _openssl(directory, "req", "-new", "-config", "openssl.cnf", *key_args,
             "-out", f"{stem}.csr", "-subj", subject)
    _openssl(directory, "x509", "-req", "-in", f"{stem}.csr", "-CA", f"{ca}.crt", "-CAkey",
             f"{ca}.key", "-set_serial", str(secrets.randbits(63)), "-days", "1",
             "-extfile", "openssl.cnf", "-extensions", extensions, "-out", f"{stem}.crt")
    (directory / f"{stem}.csr").unlink()
    return directory / f"{stem}.crt", directory / f"{stem}.key"


def issue_client_cert(pki: Pki, stem: str, subject: str) -> tuple[Path, Path]:
    """Another client certificate from the trusted CA, e.g. "/O=system:masters/CN=admin"."""
    return _issue(pki.directory, "ca", stem, subject, "v3_client",
                  [*_EC, "-keyout", f"{stem}.key"])


def make_pki(directory: Path, node_name: str = "gpu-node-1") -> Pki:
    """CA, API server certificate for 127.0.0.1, the kubelet's client certificate, and a client
    certificate of another CA. EC P-256, valid one day."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "openssl.cnf").write_text(_OPENSSL_CNF)
    _make_ca(directory, "ca", "/CN=kubernetes")
    _make_ca(directory, "untrusted-ca", "/CN=someone-else")
    server = _issue(directory, "ca", "apiserver", "/CN=kube-apiserver", "v3_server",
                    [*_EC, "-keyout", "apiserver.key"])
    node_subject = f"/O=system:nodes/CN=system:node:{node_name}"
    _openssl(directory, "ecparam", "-name", "prime256v1", "-genkey", "-noout",
             "-out", "kubelet-client.key")
    client = _issue(directory, "ca", "kubelet-client", node_subject, "v3_client",
                    ["-key", "kubelet-client.key"])
    untrusted = _issue(directory, "untrusted-ca", "untrusted-client", node_subject, "v3_client",
                       [*_EC, "-keyout", "untrusted-client.key"])
    combined = directory / "kubelet-client-current.pem"
    combined.write_bytes(client[0].read_bytes() + client[1].read_bytes())
    for key in directory.glob("*.key"):
        key.chmod(0o600)
    combined.chmod(0o600)
    return Pki(directory=directory, node_name=node_name,
               ca_cert=directory / "ca.crt", ca_key=directory / "ca.key",
               ca_pem=(directory / "ca.crt").read_bytes(),
               server_cert=server[0], server_key=server[1],
               client_cert=client[0], client_key=client[1], kubelet_client_current=combined,
               untrusted_ca_cert=directory / "untrusted-ca.crt",
               untrusted_client_cert=untrusted[0], untrusted_client_key=untrusted[1])


def ca_subject(cert: Path) -> tuple[object, ...]:
    """A CA certificate's subject, as ssl's getpeercert() gives a peer certificate's issuer."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.load_verify_locations(cafile=str(cert))
    return tuple(context.get_ca_certs()[0]["subject"])
