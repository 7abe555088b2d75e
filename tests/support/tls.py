"""A throwaway certificate authority for TLS tests, made with the `openssl` command line:
a CA, and certificates it signs for 127.0.0.1 / localhost (server and client use)."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

EXTENSIONS = """basicConstraints=CA:FALSE
keyUsage=digitalSignature,keyEncipherment
extendedKeyUsage=serverAuth,clientAuth
subjectAltName=IP:127.0.0.1,DNS:localhost
"""


@dataclass(frozen=True)
class Issued:
    cert: Path
    key: Path


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def make_ca(root: Path, name: str = "ca") -> Issued:
    root.mkdir(parents=True, exist_ok=True)
    ca = Issued(root / f"{name}.pem", root / f"{name}.key")
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
             "-nodes", "-keyout", str(ca.key), "-out", str(ca.cert), "-days", "2",
             "-subj", f"/CN=baton test {name}")
    return ca


def issue(ca: Issued, root: Path, name: str) -> Issued:
    """A certificate signed by `ca` for 127.0.0.1 and localhost."""
    out = Issued(root / f"{name}.pem", root / f"{name}.key")
    csr, ext = root / f"{name}.csr", root / f"{name}.ext"
    ext.write_text(EXTENSIONS)
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", str(out.key), "-out", str(csr), "-subj", f"/CN=baton {name}")
    _openssl("x509", "-req", "-in", str(csr), "-CA", str(ca.cert), "-CAkey", str(ca.key),
             "-CAcreateserial", "-out", str(out.cert), "-days", "2", "-extfile", str(ext))
    return out
