"""A fake tryboxi daemon for the SDK's unit tests: a threaded HTTP/1.1 server on a temporary unix
socket (or loopback TCP, optionally TLS) whose answers each test scripts.

A route is ``(METHOD, path-without-query) -> handler(request) -> Reply``. Every request is
recorded (method, path with query, headers, JSON body) for the test to check.
"""

from __future__ import annotations

import http.server
import json
import os
import socket
import socketserver
import ssl
import tempfile
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union


@dataclass
class Request:
    method: str
    path: str
    headers: Dict[str, str]
    body: Any

    @property
    def route(self) -> str:
        return self.path.split("?", 1)[0]

    @property
    def query(self) -> str:
        return self.path.split("?", 1)[1] if "?" in self.path else ""


#: A step of a streamed answer: bytes to send as one chunk, or a callable run between chunks
#: (e.g. waiting for the client to have seen what came before).
Step = Union[bytes, Callable[[], None]]


@dataclass
class Reply:
    status: int = 200
    json: Any = None
    raw: Optional[bytes] = None
    #: When set, the body is sent chunked, one HTTP chunk per bytes step, as NDJSON.
    stream: Optional[Sequence[Step]] = None
    headers: Dict[str, str] = field(default_factory=dict)


def error(status: int, code: str, message: str) -> Reply:
    return Reply(status, {"error": {"code": code, "message": message}})


Handler = Callable[[Request], Reply]


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass

    def address_string(self) -> str:
        return "fake-client"

    def _serve(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        body = json.loads(raw) if raw else None
        req = Request(
            self.command, self.path, {k.lower(): v for k, v in self.headers.items()}, body
        )
        fake: FakeDaemon = self.server.fake  # type: ignore[attr-defined]
        with fake.lock:
            fake.requests.append(req)
        handler = fake.routes.get((self.command, req.route))
        reply = handler(req) if handler else error(404, "not_found", f"no route {req.route}")
        if reply.stream is not None:
            self.send_response(reply.status)
            self.send_header("Content-Type", "application/x-ndjson")
            self.send_header("Transfer-Encoding", "chunked")
            self.send_header("Connection", "close")
            for k, v in reply.headers.items():
                self.send_header(k, v)
            self.end_headers()
            self.close_connection = True
            try:
                for step in reply.stream:
                    if callable(step):
                        step()
                        continue
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(step), step))
                    self.wfile.flush()
                self.wfile.write(b"0\r\n\r\n")
                self.wfile.flush()
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client stops reading after `exit`, as a real one may
            return
        data = reply.raw if reply.raw is not None else json.dumps(reply.json).encode() + b"\n"
        self.send_response(reply.status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Connection", "close")
        for k, v in reply.headers.items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)
        self.close_connection = True

    do_GET = do_POST = do_PUT = do_DELETE = _serve


class _UnixServer(socketserver.ThreadingUnixStreamServer):
    daemon_threads = True
    fake: "FakeDaemon"


class _TcpServer(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True
    fake: "FakeDaemon"
    tls: Optional[ssl.SSLContext] = None

    def get_request(self) -> Tuple[socket.socket, Any]:
        sock, addr = super().get_request()
        if self.tls is not None:
            sock = self.tls.wrap_socket(sock, server_side=True)
        return sock, addr


class FakeDaemon:
    """Start with :meth:`unix` or :meth:`tcp`; stop with :meth:`close` (or ``with``)."""

    def __init__(self) -> None:
        self.routes: Dict[Tuple[str, str], Handler] = {}
        self.requests: List[Request] = []
        self.lock = threading.Lock()
        self._dir: Optional[tempfile.TemporaryDirectory] = None
        self.socket_path: Optional[str] = None
        self.port: Optional[int] = None
        self._server: Any = None

    @classmethod
    def unix(cls) -> "FakeDaemon":
        fake = cls()
        fake._dir = tempfile.TemporaryDirectory(prefix="tbx-fake-")
        fake.socket_path = os.path.join(fake._dir.name, "tryboxi.sock")
        server = _UnixServer(fake.socket_path, _Handler)
        fake._start(server)
        return fake

    @classmethod
    def tcp(cls, tls: Optional[ssl.SSLContext] = None) -> "FakeDaemon":
        fake = cls()
        server = _TcpServer(("127.0.0.1", 0), _Handler, bind_and_activate=True)
        server.tls = tls
        fake.port = server.server_address[1]
        fake._start(server)
        return fake

    def _start(self, server: Any) -> None:
        server.fake = self
        self._server = server
        threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        ).start()

    def route(self, method: str, path: str, handler: Union[Handler, Reply]) -> None:
        if isinstance(handler, Reply):
            reply = handler
            self.routes[(method, path)] = lambda _req: reply
        else:
            self.routes[(method, path)] = handler

    def last(self) -> Request:
        with self.lock:
            return self.requests[-1]

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._dir is not None:
            self._dir.cleanup()

    def __enter__(self) -> "FakeDaemon":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def ndjson(*events: Dict[str, Any]) -> bytes:
    return b"".join(json.dumps(e).encode() + b"\n" for e in events)


SANDBOX: Dict[str, Any] = {
    "id": "sbx_0123456789abcdef",
    "state": "ready",
    "template": "base",
    "vcpus": 1,
    "memory_mib": 512,
    "created_at": "2026-01-01T00:00:00Z",
    "workspace": {"host_path": "/tmp/repo"},
}
