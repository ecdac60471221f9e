#!/usr/bin/python3
"""tryboxi's code interpreter server: E2B's `/execute` and `/contexts` on port 49999.

Runs in the guest of a `code-interpreter` sandbox as `user` (the E2B face starts it as a
detached exec). Each context is one Jupyter kernel (ipykernel) driven through jupyter_client;
a default Python context is started before the port opens, so "the port accepts connections"
means "the kernel is ready".

Wire (what the e2b-code-interpreter SDK parses):
  POST /execute {"code","context_id"?,"language"?,"env_vars"?} -> 200, NDJSON lines:
    {"type":"stdout"|"stderr","text","timestamp"}   (timestamp: Unix ns)
    {"type":"result", "text"?,"html"?,"png"?,..., "is_main_result"}
    {"type":"error","name","value","traceback"}
    {"type":"number_of_executions","execution_count"}
    {"type":"end_of_execution"}
  POST /contexts {"language"?,"cwd"?} -> {"id","language","cwd"}
  GET /contexts -> [{"id","language","cwd"}...]
  DELETE /contexts/{id}; POST /contexts/{id}/restart; GET /health
Bounded: request bodies (MAX_BODY), contexts (MAX_CONTEXTS), one execution at a time per
context (others wait their turn).
"""

import json
import os
import queue
import select
import socket
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from jupyter_client.manager import KernelManager

PORT = 49999
MAX_BODY = 8 << 20
MAX_CONTEXTS = 16
HOME = os.environ.get("HOME") or "/home/user"
KERNEL_READY_S = 300
LOG = "/tmp/tryboxi-interpreter.log"
# The sandbox's env vars (E2B `envs` at create), as a JSON object: written by the E2B face
# when it finds the server already running (a sandbox cloned from the golden snapshot, whose
# server started before the sandbox had any); applied to each kernel before its next cell.
ENV_FILE = "/tmp/tryboxi-interpreter-env.json"

# Kernel MIME bundle key -> the SDK's `Result` field.
MIME = {
    "text/plain": "text",
    "text/html": "html",
    "text/markdown": "markdown",
    "image/svg+xml": "svg",
    "image/png": "png",
    "image/jpeg": "jpeg",
    "application/pdf": "pdf",
    "text/latex": "latex",
    "application/json": "json",
    "application/javascript": "javascript",
}

BASE64 = ("png", "jpeg", "pdf")


class HttpError(Exception):
    def __init__(self, status, message):
        super().__init__(message)
        self.status = status
        self.message = message


class Context:
    """One kernel, its client, and the lock that makes its executions one at a time."""

    def __init__(self, language, cwd):
        self.id = str(uuid.uuid4())
        self.language = language
        self.cwd = cwd
        self.lock = threading.Lock()
        self.env_seen = None
        self.km = KernelManager(kernel_name="python3")
        self.km.start_kernel(cwd=cwd)
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=KERNEL_READY_S)

    def json(self):
        return {"id": self.id, "language": self.language, "cwd": self.cwd}

    def restart(self):
        with self.lock:
            self.km.restart_kernel(now=True)
            self.kc.wait_for_ready(timeout=KERNEL_READY_S)

    def shutdown(self):
        try:
            self.kc.stop_channels()
        finally:
            self.km.shutdown_kernel(now=True)

    def _drain(self, msg_id, deadline):
        """Skip iopub messages up to the idle status of `msg_id` (silent helper executions)."""
        while time.monotonic() < deadline:
            try:
                m = self.kc.get_iopub_msg(timeout=1)
            except queue.Empty:
                if not self.km.is_alive():
                    return
                continue
            if (
                m["parent_header"].get("msg_id") == msg_id
                and m["msg_type"] == "status"
                and m["content"].get("execution_state") == "idle"
            ):
                return

    def _silent(self, code):
        msg_id = self.kc.execute(code, silent=True, store_history=False)
        self._drain(msg_id, time.monotonic() + 60)

    def _sandbox_env(self):
        try:
            st = os.stat(ENV_FILE)
            if st.st_mtime_ns == self.env_seen:
                return
            with open(ENV_FILE, encoding="utf-8") as f:
                env = json.loads(f.read(1 << 20))
        except (OSError, ValueError):
            return
        if isinstance(env, dict):
            env = {k: v for k, v in env.items() if isinstance(k, str) and isinstance(v, str)}
            self._silent(f"import os as _tb_os\n_tb_os.environ.update({env!r})\ndel _tb_os\n")
        self.env_seen = st.st_mtime_ns

    def execute(self, code, env_vars, emit, gone):
        """Runs `code`, calling `emit(dict)` for each output line as it arrives. `emit`
        raising, or `gone()` saying so while the cell is quiet (the client went away, e.g. its
        timeout), interrupts the kernel."""
        with self.lock:
            self._sandbox_env()
            if env_vars:
                self._silent(
                    "import os as _tb_os\n"
                    f"_tb_saved_env = {{k: _tb_os.environ.get(k) for k in {list(env_vars)!r}}}\n"
                    f"_tb_os.environ.update({dict(env_vars)!r})\n"
                )
            try:
                self._run(code, emit, gone)
            finally:
                if env_vars:
                    self._silent(
                        "for _tb_k, _tb_v in _tb_saved_env.items():\n"
                        "    if _tb_v is None: _tb_os.environ.pop(_tb_k, None)\n"
                        "    else: _tb_os.environ[_tb_k] = _tb_v\n"
                        "del _tb_saved_env, _tb_k, _tb_v, _tb_os\n"
                    )

    def _run(self, code, emit, client_gone):
        msg_id = self.kc.execute(code, store_history=True, allow_stdin=False)
        gone = False
        while True:
            try:
                m = self.kc.get_iopub_msg(timeout=1)
            except queue.Empty:
                if not gone and client_gone():
                    gone = True
                    self.km.interrupt_kernel()
                if not self.km.is_alive():
                    if not gone:
                        emit(
                            {
                                "type": "error",
                                "name": "KernelDied",
                                "value": "the kernel exited; restart the context",
                                "traceback": "",
                            }
                        )
                    return
                continue
            if m["parent_header"].get("msg_id") != msg_id:
                continue
            t = m["msg_type"]
            c = m["content"]
            line = None
            if t == "stream":
                line = {"type": c.get("name", "stdout"), "text": c.get("text", "")}
                line["timestamp"] = time.time_ns()
            elif t in ("execute_result", "display_data"):
                line = result(c.get("data", {}), t == "execute_result")
            elif t == "error":
                line = {
                    "type": "error",
                    "name": c.get("ename", ""),
                    "value": c.get("evalue", ""),
                    "traceback": "\n".join(c.get("traceback", [])),
                }
            elif t == "execute_input":
                line = {
                    "type": "number_of_executions",
                    "execution_count": c.get("execution_count"),
                }
            elif t == "status" and c.get("execution_state") == "idle":
                if not gone:
                    emit({"type": "end_of_execution"})
                return
            if line is not None and not gone:
                try:
                    emit(line)
                except OSError:
                    # The caller went away: stop the cell, then wait for the kernel to settle
                    # so the next execution starts clean.
                    gone = True
                    self.km.interrupt_kernel()


def result(data, main):
    out = {"type": "result", "is_main_result": main}
    extra = {}
    for k, v in data.items():
        field = MIME.get(k)
        if field in BASE64 and isinstance(v, str):
            # The kernel's base64 may end in a newline (binascii's default): the SDK's users
            # get the bare base64, as from E2B.
            out[field] = v.strip()
        elif field:
            out[field] = v
        else:
            extra[k] = v
    if extra:
        out["extra"] = extra
    return out


class State:
    def __init__(self):
        self.lock = threading.Lock()
        self.contexts = {}
        self.default = Context("python", HOME)
        self.contexts[self.default.id] = self.default

    def get(self, cid):
        with self.lock:
            ctx = self.contexts.get(cid)
        if ctx is None:
            raise HttpError(404, f"context {cid} not found")
        return ctx

    def create(self, language, cwd):
        if language not in (None, "", "python"):
            raise HttpError(400, f"language {language!r} is not available here: only python")
        cwd = cwd or HOME
        if not os.path.isdir(cwd):
            raise HttpError(400, f"cwd {cwd!r} is not a directory")
        with self.lock:
            if len(self.contexts) >= MAX_CONTEXTS:
                raise HttpError(
                    429, f"at most {MAX_CONTEXTS} contexts; remove one first"
                )
        ctx = Context("python", cwd)
        with self.lock:
            if len(self.contexts) >= MAX_CONTEXTS:
                ctx.shutdown()
                raise HttpError(429, f"at most {MAX_CONTEXTS} contexts; remove one first")
            self.contexts[ctx.id] = ctx
        return ctx

    def remove(self, cid):
        with self.lock:
            ctx = self.contexts.pop(cid, None)
        if ctx is None:
            raise HttpError(404, f"context {cid} not found")
        ctx.shutdown()
        if ctx is self.default:
            # The next default-context execution starts a fresh kernel.
            self.default = None

    def for_execute(self, cid, language):
        if cid:
            return self.get(cid)
        if language not in (None, "", "python"):
            raise HttpError(400, f"language {language!r} is not available here: only python")
        with self.lock:
            d = self.default
        if d is None:
            d = self.create("python", HOME)
            with self.lock:
                self.default = d
        return d


STATE = None


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "tryboxi-interpreter/1"

    def log_message(self, fmt, *args):
        # Requests are not logged (the log would grow without bound); errors are (log_error).
        pass

    def log_error(self, fmt, *args):
        log(fmt % args)

    def _body(self):
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            raise HttpError(411, "send a Content-Length")
        try:
            n = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            raise HttpError(400, "bad Content-Length")
        if n < 0 or n > MAX_BODY:
            raise HttpError(413, f"request body over {MAX_BODY} bytes")
        raw = self.rfile.read(n) if n else b""
        if not raw:
            return {}
        try:
            v = json.loads(raw)
        except ValueError as e:
            raise HttpError(400, f"body is not JSON: {e}")
        if not isinstance(v, dict):
            raise HttpError(400, "body must be a JSON object")
        return v

    def _send(self, status, value):
        data = b"" if value is None else json.dumps(value).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _guard(self, fn):
        try:
            fn()
        except HttpError as e:
            self._send(e.status, {"error": e.message})
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        except Exception as e:  # a bug here must not kill the server
            self.log_error("error: %r", e)
            try:
                self._send(500, {"error": repr(e)})
            except OSError:
                self.close_connection = True

    def do_GET(self):
        def go():
            if self.path == "/health":
                self._send(200, {"status": "ok"})
            elif self.path == "/contexts":
                with STATE.lock:
                    items = [c.json() for c in STATE.contexts.values()]
                self._send(200, items)
            else:
                raise HttpError(404, f"no route GET {self.path}")

        self._guard(go)

    def do_DELETE(self):
        def go():
            parts = self.path.strip("/").split("/")
            if len(parts) == 2 and parts[0] == "contexts":
                STATE.remove(parts[1])
                self._send(200, None)
            else:
                raise HttpError(404, f"no route DELETE {self.path}")

        self._guard(go)

    def do_POST(self):
        def go():
            body = self._body()
            parts = self.path.strip("/").split("/")
            if parts == ["execute"]:
                self._execute(body)
            elif parts == ["contexts"]:
                ctx = STATE.create(body.get("language"), body.get("cwd"))
                self._send(200, ctx.json())
            elif len(parts) == 3 and parts[0] == "contexts" and parts[2] == "restart":
                STATE.get(parts[1]).restart()
                self._send(200, None)
            else:
                raise HttpError(404, f"no route POST {self.path}")

        self._guard(go)

    def _execute(self, body):
        code = body.get("code")
        if not isinstance(code, str):
            raise HttpError(400, "`code` (a string) is required")
        env = body.get("env_vars") or {}
        if not isinstance(env, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in env.items()
        ):
            raise HttpError(400, "`env_vars` must map strings to strings")
        ctx = STATE.for_execute(body.get("context_id"), body.get("language"))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-ndjson")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

        def emit(line):
            data = json.dumps(line).encode() + b"\n"
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            self.wfile.flush()

        def gone():
            # The client closed its connection (readable with nothing to read = EOF).
            try:
                r, _, _ = select.select([self.connection], [], [], 0)
                return bool(r) and self.connection.recv(1, socket.MSG_PEEK) == b""
            except OSError:
                return True

        ctx.execute(code, env, emit, gone)
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()


def log(line):
    sys.stderr.write(f"interpreter: {line}\n")
    sys.stderr.flush()


def main():
    global STATE
    # Our output (and the kernels', which inherit it) goes to a file of our own, not to the
    # exec that started us: nobody follows that stream, and a fork or snapshot of the VM
    # carries this process into a sandbox whose daemon has no record of that exec.
    fd = os.open(LOG, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.chdir(HOME)
    STATE = State()
    srv = ThreadingHTTPServer(("0.0.0.0", PORT), Handler)
    srv.daemon_threads = True
    log(f"ready on port {PORT}")
    srv.serve_forever()


if __name__ == "__main__":
    main()
