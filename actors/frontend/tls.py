"""HTTPS (vLLM's --ssl-keyfile, --ssl-certfile, --ssl-ca-certs, --ssl-cert-reqs, --ssl-ciphers
and --enable-ssl-refresh): the server's TLS context, and the watcher that loads renewed
certificate files into it without a restart (new connections get them; open ones keep theirs)."""
from __future__ import annotations

import asyncio
import logging
import os
import ssl
from dataclasses import dataclass

log = logging.getLogger("troupe.frontend")

REFRESH_POLL_S = 1.0          # how often --enable-ssl-refresh looks at the files


@dataclass(frozen=True, slots=True)
class TlsFiles:
    certfile: str
    keyfile: str | None = None           # None: the key is in certfile
    ca_certs: str | None = None          # to verify clients' certificates (--ssl-cert-reqs)
    cert_reqs: int = int(ssl.CERT_NONE)
    ciphers: str | None = None

    @classmethod
    def of(cls, keyfile: str | None, certfile: str | None, ca_certs: str | None = None,
           cert_reqs: int = int(ssl.CERT_NONE), ciphers: str | None = None) -> TlsFiles | None:
        """The files the flags name; None for plain HTTP. ValueError for a combination that
        cannot serve (a key without its certificate; client certificates required with no CA)."""
        if certfile is None:
            if keyfile is not None:
                raise ValueError("--ssl-keyfile needs --ssl-certfile (the certificate that goes with the key)")
            if ca_certs is not None or cert_reqs != ssl.CERT_NONE or ciphers is not None:
                raise ValueError("--ssl-ca-certs, --ssl-cert-reqs and --ssl-ciphers need --ssl-certfile")
            return None
        if cert_reqs not in (ssl.CERT_NONE, ssl.CERT_OPTIONAL, ssl.CERT_REQUIRED):
            raise ValueError(f"--ssl-cert-reqs {cert_reqs}: 0 (none), 1 (optional) or 2 (required)")
        if cert_reqs != ssl.CERT_NONE and ca_certs is None:
            raise ValueError("--ssl-cert-reqs 1 or 2 needs --ssl-ca-certs (the CA that signs clients' certificates)")
        return cls(certfile, keyfile, ca_certs, cert_reqs, ciphers)

    def context(self) -> ssl.SSLContext:
        """A server context over the files; ValueError naming the file that cannot be used."""
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self._load(ctx)
        ctx.verify_mode = ssl.VerifyMode(self.cert_reqs)
        if self.ciphers:
            try:
                ctx.set_ciphers(self.ciphers)
            except ssl.SSLError as exc:
                raise ValueError(f"--ssl-ciphers {self.ciphers!r}: {_reason(exc)}") from None
        return ctx

    def _load(self, ctx: ssl.SSLContext) -> None:
        try:
            ctx.load_cert_chain(self.certfile, self.keyfile)
        except (OSError, ssl.SSLError) as exc:
            files = self.certfile if self.keyfile is None else f"{self.certfile} and {self.keyfile}"
            raise ValueError(f"--ssl-certfile/--ssl-keyfile: cannot load {files}: {_reason(exc)}") from None
        if self.ca_certs is not None:
            try:
                ctx.load_verify_locations(self.ca_certs)
            except (OSError, ssl.SSLError) as exc:
                raise ValueError(f"--ssl-ca-certs: cannot load {self.ca_certs}: {_reason(exc)}") from None

    def paths(self) -> tuple[str, ...]:
        return tuple(p for p in (self.certfile, self.keyfile, self.ca_certs) if p is not None)

    async def refresh(self, ctx: ssl.SSLContext, poll_s: float = REFRESH_POLL_S) -> None:
        """Until cancelled: when a file changes, load the files into ``ctx`` again (a half-written
        pair that does not load is tried again at the next change; the old one keeps serving)."""
        seen = _stamps(self.paths())
        while True:
            await asyncio.sleep(poll_s)
            now = _stamps(self.paths())
            if now == seen:
                continue
            seen = now
            try:
                self._load(ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER))   # loads whole, or ctx stays as it was
                self._load(ctx)
            except ValueError as exc:
                log.warning("TLS files changed but were not loaded: %s", exc)
            else:
                log.info("TLS files changed: new connections get the new certificate")


def _stamps(paths: tuple[str, ...]) -> tuple:
    out = []
    for p in paths:
        try:
            st = os.stat(p)
            out.append((st.st_mtime_ns, st.st_size, st.st_ino))
        except OSError:
            out.append(None)
    return tuple(out)


def _reason(exc: Exception) -> str:
    if isinstance(exc, ssl.SSLError):
        return getattr(exc, "reason", None) or str(exc)
    return getattr(exc, "strerror", None) or str(exc)
