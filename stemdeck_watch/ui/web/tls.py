"""HTTPS for the page: the owner's certificate, or a self-signed one made at the first start.

A self-signed certificate cannot be checked against any authority, so the browser warns once;
its SHA-256 fingerprint (in the log and `status`) is what the owner compares with what the
browser shows before accepting it. It is made with `openssl` (a subprocess with a time limit)
into `<state>/tls/`, the key readable by the owner only, and kept: its fingerprint stays the
same from start to start.
"""

from __future__ import annotations

import hashlib
import ipaddress
import logging
import os
import shutil
import ssl
import subprocess
import tempfile
from pathlib import Path

from stemdeck_watch.core.errors import ConfigError

log = logging.getLogger(__name__)

FOLDER = "tls"
CERT, KEY = "cert.pem", "key.pem"
OPENSSL_TIMEOUT = 60.0
DAYS = 3650


def server_context(cert: Path, key: Path) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(
            f"could not load the HTTPS certificate {cert} with its key {key}: {exc}; check "
            f"api.tls_cert and api.tls_key (PEM files, the key not encrypted)"
        ) from None
    return context


def client_context(cert: Path) -> ssl.SSLContext:
    """For the CLI on this machine: trusts exactly the service's certificate, whatever names
    it carries (the CLI reaches the service by a loopback address)."""
    context = ssl.create_default_context(cafile=str(cert))
    context.check_hostname = False
    context.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN
    return context


def fingerprint(cert: Path) -> str:
    """`AB:CD:…`, the SHA-256 of the certificate as browsers show it."""
    der = ssl.PEM_cert_to_DER_cert(cert.read_text(encoding="ascii"))
    return ":".join(f"{b:02X}" for b in hashlib.sha256(der).digest())


def self_signed(state_dir: Path, names: list[str]) -> tuple[Path, Path]:
    """The certificate and key in `<state>/tls/`, made now if they are not there yet."""
    folder = state_dir / FOLDER
    cert, key = folder / CERT, folder / KEY
    if cert.is_file() and key.is_file():
        return cert, key
    openssl = shutil.which("openssl")
    if openssl is None:
        raise ConfigError(
            "api.https = true needs a certificate: set api.tls_cert and api.tls_key, or "
            "install openssl so the service can make a self-signed one"
        )
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    work = Path(tempfile.mkdtemp(prefix=".new-", dir=folder))  # 0700
    try:
        subprocess.run(
            [
                openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt",
                "ec_paramgen_curve:prime256v1", "-nodes", "-sha256", "-days", str(DAYS),
                "-subj", "/CN=stemdeck-watch", "-addext",
                f"subjectAltName={','.join(_alt_names(names))}",
                "-keyout", str(work / KEY), "-out", str(work / CERT),
            ],
            check=True, capture_output=True, timeout=OPENSSL_TIMEOUT, stdin=subprocess.DEVNULL,
        )  # fmt: skip
        os.chmod(work / KEY, 0o600)
        os.replace(work / KEY, key)
        os.replace(work / CERT, cert)  # last: a certificate there means a whole pair
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", b"") or b""
        raise ConfigError(
            f"could not make a self-signed certificate with openssl: {exc} "
            f"{detail.decode(errors='replace').strip()[:300]}; set api.tls_cert and api.tls_key"
        ) from None
    finally:
        shutil.rmtree(work, ignore_errors=True)
    log.info("made a self-signed HTTPS certificate in %s, SHA-256 %s", cert, fingerprint(cert))
    return cert, key


def _alt_names(names: list[str]) -> list[str]:
    seen: list[str] = []
    for name in ["localhost", "127.0.0.1", "::1", *filter(None, names)]:
        try:
            entry = f"IP:{ipaddress.ip_address(name)}"
        except ValueError:
            entry = f"DNS:{name}"
        if entry not in seen and name not in ("0.0.0.0", "::"):
            seen.append(entry)
    return seen
