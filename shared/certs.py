"""TLS for a deployment's NATS: a private CA and one node certificate, for nats-server's clients
and for the routes between the nodes of a NATS cluster.

    radixflow creds DIR --tls [--host NAME ...]
        DIR/tls/ca.pem            the CA (services verify the server with it: RADIXFLOW_BUS_TLS_CA_FILE)
        DIR/tls/node.pem, node.key the nodes' certificate (serverAuth and clientAuth: a route is both)
        DIR/tls.conf              nats-server's `tls {}` for clients (`include tls.conf` at the top level)
        DIR/route_tls.conf        the `tls {}` of routes (`include route_tls.conf` inside `cluster {}`)

A route presents the node certificate and verifies its peer's (`verify: true`): a nats-server
without a certificate from this CA cannot join the cluster, so it can neither read the services'
traffic nor inject into it; a client speaking plain TCP is refused. The CA's key is not kept (the
set is made once; re-running with --tls makes a new CA and certificate, and every node and service
takes the new files). One certificate for every node keeps a deployment one command; its names are
the hosts the nodes are reached by (localhost and 127.0.0.1 always).
"""
from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

_DAYS = 825         # the longest lifetime clients still accept for a server certificate


@dataclass(frozen=True)
class TlsFiles:
    ca: str
    cert: str
    key: str

    def server_block(self, timeout_s: float = 5.0) -> str:
        """nats-server's client-facing TLS: clients must speak TLS and check the node against ca."""
        return (f'tls {{\n  cert_file: "{self.cert}"\n  key_file: "{self.key}"\n  ca_file: "{self.ca}"\n'
                f"  timeout: {timeout_s}\n}}\n")

    def route_block(self, timeout_s: float = 5.0) -> str:
        """The `tls` inside a `cluster {}`: both ends of a route show a certificate of the CA."""
        return (f'  tls {{\n    cert_file: "{self.cert}"\n    key_file: "{self.key}"\n    ca_file: "{self.ca}"\n'
                f"    verify: true\n    timeout: {timeout_s}\n  }}\n")


def _names(hosts) -> list:
    from cryptography import x509
    out, seen = [], set()
    for h in ("localhost", "127.0.0.1", *hosts):
        if not h or h in seen:
            continue
        seen.add(h)
        try:
            out.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            out.append(x509.DNSName(h))
    return out


def _write(path: Path, data: bytes, mode: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(path, mode)        # an existing file keeps its old mode through O_CREAT


def generate(directory: str | os.PathLike, hosts: tuple[str, ...] = (), server_dir: str = "") -> TlsFiles:
    """A CA and a node certificate under `directory`/tls, and `directory`/tls.conf and route_tls.conf.
    server_dir: where nats-server will read the tls directory's files (a container's mount), when not
    where they are written; the returned paths are the written ones."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    d = Path(directory).resolve() / "tls"     # absolute: nats-server reads them from its own cwd
    d.mkdir(parents=True, exist_ok=True)
    os.chmod(d, 0o700)
    now = datetime.datetime.now(datetime.timezone.utc)
    start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=_DAYS)

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "radixflow NATS CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(start).not_valid_after(end)
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
          .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
          .sign(ca_key, hashes.SHA256()))

    key = ec.generate_private_key(ec.SECP256R1())
    node = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "radixflow NATS node")]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(start).not_valid_after(end)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.SubjectAlternativeName(_names(hosts)), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))

    pem = serialization.Encoding.PEM
    files = TlsFiles(ca=str(d / "ca.pem"), cert=str(d / "node.pem"), key=str(d / "node.key"))
    _write(Path(files.ca), ca.public_bytes(pem), 0o644)
    _write(Path(files.cert), node.public_bytes(pem), 0o644)
    _write(Path(files.key), key.private_bytes(pem, serialization.PrivateFormat.PKCS8,
                                              serialization.NoEncryption()), 0o600)
    # two files: a second `cluster {}` block would replace the node's own, not add to it
    seen = files if not server_dir else TlsFiles(*(os.path.join(server_dir, os.path.basename(p))
                                                   for p in (files.ca, files.cert, files.key)))
    _write(d.parent / "tls.conf", seen.server_block().encode(), 0o600)
    _write(d.parent / "route_tls.conf", seen.route_block().encode(), 0o600)
    return files
