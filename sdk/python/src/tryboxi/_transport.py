"""How the SDK reaches the daemon: its unix socket (the default), or TCP named by ``TRYBOXI_URL``
with the bearer token ``TRYBOXI_TOKEN`` (and, for ``https://``, the certificate pinned by
``TRYBOXI_FINGERPRINT``), the same rules as the Rust client (``src/client/transport.rs``).

Owns: finding the data root, refusing to send the token in plain text to anything but a loopback
address, TLS with the daemon's certificate pinned by its SHA-256, one HTTP/1.1 connection per
request, and reading a streamed body as it arrives. Never: what the requests mean (``client``).
"""

from __future__ import annotations

import hashlib
import http.client
import ipaddress
import os
import socket
import ssl
from pathlib import Path
from typing import Dict, Iterator, Mapping, Optional, Tuple
from urllib.parse import urlsplit

from .errors import (
    ConfigError,
    DaemonUnreachable,
    FingerprintMismatch,
    ProtocolError,
    api_error,
)

#: How long connecting (and the TLS handshake) may take.
CONNECT_TIMEOUT_S = 30.0


def data_root() -> Path:
    """The daemon's data root as ``tryboxi`` finds it: ``$TRYBOXI_HOME``, else
    ``/var/lib/tryboxi`` for root, else ``$XDG_DATA_HOME/tryboxi``, else
    ``~/.local/share/tryboxi``."""
    home = os.environ.get("TRYBOXI_HOME")
    if home:
        return Path(os.path.abspath(home))
    if os.geteuid() == 0:
        return Path("/var/lib/tryboxi")
    xdg = os.environ.get("XDG_DATA_HOME")
    if xdg:
        return Path(xdg) / "tryboxi"
    user_home = os.environ.get("HOME")
    if not user_home:
        raise ConfigError("cannot find a data root: set TRYBOXI_HOME, or HOME/XDG_DATA_HOME")
    return Path(user_home) / ".local/share/tryboxi"


def parse_fingerprint(text: str) -> bytes:
    """The 32 bytes of ``sha256:<hex>`` (prefix optional, ``:`` between bytes allowed, any case)."""
    t = text.strip()
    if t[:7].lower() == "sha256:":
        t = t[7:]
    digits = t.replace(":", "")
    try:
        raw = bytes.fromhex(digits)
    except ValueError:
        raw = b""
    if len(raw) != 32:
        raise ConfigError(
            f"TRYBOXI_FINGERPRINT `{text}` is not a SHA-256 fingerprint (sha256:<64 hex digits>)"
        )
    return raw


def fingerprint_of(cert_der: bytes) -> str:
    """``sha256:`` + the lowercase hex SHA-256 of a certificate's DER bytes (what
    ``tryboxi token`` prints)."""
    return "sha256:" + hashlib.sha256(cert_der).hexdigest()


def _is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class _UnixConnection(http.client.HTTPConnection):
    """HTTP/1.1 over a unix socket (``Host: localhost``)."""

    def __init__(self, path: str, timeout: Optional[float]) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(CONNECT_TIMEOUT_S)
            sock.connect(self._path)
            sock.settimeout(self.timeout)
        except BaseException:
            sock.close()
            raise
        self.sock = sock


class _PinnedTlsConnection(http.client.HTTPConnection):
    """HTTP/1.1 over TLS that trusts exactly one certificate, named by its SHA-256. The
    handshake's signatures are still checked against that certificate's key by OpenSSL, so only
    the holder of the daemon's private key passes. Nothing is sent before the pin matched."""

    def __init__(self, host: str, port: int, pin: bytes, timeout: Optional[float]) -> None:
        super().__init__(host, port, timeout=timeout)
        self._pin = pin

    def connect(self) -> None:
        raw = socket.create_connection((self.host, self.port), CONNECT_TIMEOUT_S)
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE  # the pin below is the whole trust decision
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.set_alpn_protocols(["http/1.1"])
        try:
            ipaddress.ip_address(self.host)
            sni: Optional[str] = None
        except ValueError:
            sni = self.host
        try:
            tls = ctx.wrap_socket(raw, server_hostname=sni)
        except BaseException:
            raw.close()
            raise
        der = tls.getpeercert(binary_form=True) or b""
        if hashlib.sha256(der).digest() != self._pin:
            tls.close()
            raise FingerprintMismatch(fingerprint_of(der))
        tls.settimeout(self.timeout)
        self.sock = tls


class Endpoint:
    """Where the daemon is and how to talk to it.

    Build one with :meth:`from_env` (what ``tryboxi`` itself does) or :meth:`unix` /
    :meth:`from_url`.
    """

    def __init__(
        self,
        *,
        socket_path: Optional[str] = None,
        host: Optional[str] = None,
        port: Optional[int] = None,
        token: Optional[str] = None,
        pin: Optional[bytes] = None,
        tls: bool = False,
    ) -> None:
        self.socket_path = socket_path
        self.host = host
        self.port = port
        self.token = token
        self.pin = pin
        self.tls = tls

    @classmethod
    def unix(cls, path: "os.PathLike[str] | str") -> "Endpoint":
        """The daemon listening on this unix socket."""
        return cls(socket_path=os.fspath(path))

    @classmethod
    def from_env(cls, environ: Optional[Mapping[str, str]] = None) -> "Endpoint":
        """``TRYBOXI_URL`` when set (with ``TRYBOXI_TOKEN``, and ``TRYBOXI_FINGERPRINT`` for
        https), else the data root's unix socket ``tryboxi.sock``."""
        env = os.environ if environ is None else environ
        url = (env.get("TRYBOXI_URL") or "").strip()
        if not url:
            return cls.unix(data_root() / "tryboxi.sock")
        return cls.from_url(
            url,
            token=(env.get("TRYBOXI_TOKEN") or "").strip() or None,
            fingerprint=(env.get("TRYBOXI_FINGERPRINT") or "").strip() or None,
        )

    @classmethod
    def from_url(
        cls, url: str, token: Optional[str] = None, fingerprint: Optional[str] = None
    ) -> "Endpoint":
        """A daemon's TCP listener: ``http://127.0.0.1:7070`` (loopback only) or
        ``https://host:7443``. Without ``token``/``fingerprint``, this machine's data root
        provides them (its ``token`` file and ``tls-cert.pem``), as for ``tryboxi``."""
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https"):
            raise ConfigError(f"TRYBOXI_URL `{url}`: use http:// or https://")
        if parts.path not in ("", "/") or parts.query or parts.fragment:
            raise ConfigError(f"TRYBOXI_URL `{url}`: give only scheme, host and port")
        host = parts.hostname
        try:
            port = parts.port
        except ValueError:
            port = None
        if not host:
            raise ConfigError(f"TRYBOXI_URL `{url}` has no host")
        if port is None:
            raise ConfigError(f"TRYBOXI_URL `{url}` has no port")
        tls = parts.scheme == "https"
        if not tls and not _is_loopback(host):
            raise ConfigError(
                f"TRYBOXI_URL `{url}`: refusing to send the API token in plain text to "
                f"`{host}`; use https:// (the daemon's `tcp_tls = true`)"
            )
        if token is None:
            try:
                token = (data_root() / "token").read_text().strip() or None
            except (OSError, ConfigError):
                token = None
            if token is None:
                raise ConfigError(
                    "TRYBOXI_URL needs TRYBOXI_TOKEN (`tryboxi token` on the daemon's machine)"
                )
        pin: Optional[bytes] = None
        if tls:
            if fingerprint is None:
                fingerprint = _local_fingerprint()
            if fingerprint is None:
                raise ConfigError(
                    "an https:// TRYBOXI_URL needs TRYBOXI_FINGERPRINT (`tryboxi token` on the "
                    "daemon's machine prints it)"
                )
            pin = parse_fingerprint(fingerprint)
        return cls(host=host, port=port, token=token.strip(), pin=pin, tls=tls)

    def describe(self) -> str:
        """The address to name in messages."""
        if self.socket_path is not None:
            return self.socket_path
        scheme = "https" if self.tls else "http"
        host = f"[{self.host}]" if self.host and ":" in self.host else self.host
        return f"{scheme}://{host}:{self.port}"

    def connection(self, timeout: Optional[float]) -> http.client.HTTPConnection:
        """A new, not yet connected, HTTP connection."""
        if self.socket_path is not None:
            return _UnixConnection(self.socket_path, timeout)
        assert self.host is not None and self.port is not None
        if self.tls:
            assert self.pin is not None
            return _PinnedTlsConnection(self.host, self.port, self.pin, timeout)
        return http.client.HTTPConnection(self.host, self.port, timeout=timeout)

    def request(
        self,
        method: str,
        path: str,
        body: Optional[bytes] = None,
        headers: Optional[Mapping[str, str]] = None,
        timeout: Optional[float] = None,
    ) -> Tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        """Send one request; returns the connection and its (2xx) response with the body
        unread. A 4xx/5xx answer is raised as its typed :class:`~tryboxi.ApiError`."""
        conn = self.connection(timeout)
        hdrs: Dict[str, str] = {"Connection": "close", "Accept": "application/json"}
        if self.token is not None:
            hdrs["Authorization"] = f"Bearer {self.token}"
        if body is not None:
            hdrs["Content-Type"] = "application/json"
        hdrs.update(headers or {})
        try:
            conn.connect()
        except FingerprintMismatch:
            raise
        except (OSError, ssl.SSLError) as e:
            conn.close()
            raise DaemonUnreachable(self.describe(), _reason(e)) from e
        try:
            conn.request(method, path, body=body, headers=hdrs)
            resp = conn.getresponse()
        except (OSError, http.client.HTTPException) as e:
            conn.close()
            raise ProtocolError(f"{method} {path}: {_reason(e)}") from e
        if not 200 <= resp.status < 300:
            try:
                data = resp.read()
            except (OSError, http.client.HTTPException):
                data = b""
            finally:
                conn.close()
            raise api_error(resp.status, data)
        return conn, resp


def _reason(e: BaseException) -> str:
    if isinstance(e, http.client.BadStatusLine):
        return f"not an HTTP answer ({e!r}; a TLS listener answering http://?)"
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


def _local_fingerprint() -> Optional[str]:
    """The fingerprint of this machine's daemon certificate, when this user can read it."""
    try:
        pem = (data_root() / "tls-cert.pem").read_text()
        return fingerprint_of(ssl.PEM_cert_to_DER_cert(pem))
    except (OSError, ValueError, ConfigError):
        return None


def iter_lines(resp: http.client.HTTPResponse, what: str) -> Iterator[bytes]:
    """The lines (without their ``\\n``) of a streamed body, each as soon as it is complete,
    whatever the chunking. A body that ends inside a line is a :class:`ProtocolError`."""
    buf = b""
    while True:
        try:
            data = resp.read1(65536)
        except (OSError, http.client.HTTPException) as e:
            raise ProtocolError(f"{what} stream broke: {_reason(e)}") from e
        if not data:
            break
        buf += data
        while True:
            nl = buf.find(b"\n")
            if nl < 0:
                break
            line, buf = buf[:nl], buf[nl + 1 :]
            if line.strip():
                yield line
    if buf.strip():
        raise ProtocolError(f"{what} stream ended mid-line")
