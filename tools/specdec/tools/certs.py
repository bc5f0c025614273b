"""A throwaway certificate authority for local stacks and tests, with the `openssl` command.

`make_pki(dir)` writes a CA, a server certificate for 127.0.0.1 / localhost and a client
certificate, each signed by that CA (EC P-256, valid for a few days). Nothing here is for
production: a real deployment mounts its certificates from Secrets.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

_KEY = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


@dataclass(frozen=True)
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def _openssl(*args: str, cwd: Path) -> None:
    exe = shutil.which("openssl")
    if exe is None:
        raise RuntimeError("the openssl command is needed to make throwaway certificates")
    subprocess.run([exe, *args], cwd=cwd, check=True, capture_output=True)


def _signed(directory: Path, name: str, ca: str, extensions: str) -> tuple[Path, Path]:
    _openssl("req", "-new", *_KEY, "-keyout", f"{name}.key", "-out", f"{name}.csr",
             "-subj", f"/CN=specdec-{name}", cwd=directory)  # fmt: skip
    (directory / f"{name}.ext").write_text(extensions + "\n")
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
             "-CAcreateserial", "-days", "3", "-out", f"{name}.pem",
             "-extfile", f"{name}.ext", cwd=directory)  # fmt: skip
    return directory / f"{name}.pem", directory / f"{name}.key"


def make_pki(
    directory: Path, name: str = "ca", server_names: str = "IP:127.0.0.1,DNS:localhost"
) -> Pki:
    """A CA named `name` and a server (for `server_names`, subjectAltName syntax) and a
    client certificate signed by it."""
    directory.mkdir(parents=True, exist_ok=True)
    _openssl("req", "-x509", *_KEY, "-keyout", f"{name}.key", "-out", f"{name}.pem",
             "-days", "3", "-subj", f"/CN=specdec-throwaway-{name}", cwd=directory)  # fmt: skip
    server = _signed(
        directory,
        f"{name}-server",
        name,
        f"subjectAltName={server_names}\nextendedKeyUsage=serverAuth",
    )
    client = _signed(directory, f"{name}-client", name, "extendedKeyUsage=clientAuth")
    return Pki(directory / f"{name}.pem", *server, *client)
