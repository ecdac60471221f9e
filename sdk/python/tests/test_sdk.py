"""Unit tests of the tryboxi SDK against a fake daemon (``fake_daemon.py``): what each call
sends, how answers and errors come back, and the exec stream read as it arrives.

Run: ``python3 -m unittest discover -s sdk/python/tests -v`` (``tests/python_sdk_e2e.rs`` does,
so ``cargo test`` runs them).
"""

from __future__ import annotations

import base64
import io
import json
import os
import shutil
import ssl
import subprocess
import sys
import tempfile
import threading
import unittest
from contextlib import redirect_stdout
from pathlib import Path
from typing import List
from unittest import mock

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
if os.environ.get("TRYBOXI_SDK_INSTALLED") != "1":
    # Test the source tree unless told the package under test is installed.
    sys.path.insert(0, str(HERE.parent / "src"))

import tryboxi  # noqa: E402
from fake_daemon import SANDBOX, FakeDaemon, Reply, Step, error, ndjson  # noqa: E402
from tryboxi._transport import Endpoint, data_root, parse_fingerprint  # noqa: E402

SBX: str = SANDBOX["id"]
BASE = f"/v1/sandboxes/{SBX}"


class FakeTest(unittest.TestCase):
    def setUp(self) -> None:
        self.fake = FakeDaemon.unix()
        self.addCleanup(self.fake.close)
        self.client = tryboxi.Client(socket=self.fake.socket_path)


class CreateAndList(FakeTest):
    def test_create_sends_the_request_the_api_describes(self) -> None:
        self.fake.route("POST", "/v1/sandboxes", Reply(201, SANDBOX))
        with tempfile.TemporaryDirectory() as repo:
            sbx = self.client.create(
                repo,
                template="python",
                network=["registries", "api.example.com"],
                secrets=["API_KEY"],
                vcpus=2,
                memory_mib=1024,
                exclude=["node_modules/"],
            )
            body = self.fake.last().body
            self.assertEqual(
                body,
                {
                    "workspace": {"host_path": repo, "exclude": ["node_modules/"]},
                    "template": "python",
                    "network": {"policy": ["registries", "api.example.com"]},
                    "secrets": ["API_KEY"],
                    "vcpus": 2,
                    "memory_mib": 1024,
                },
            )
        self.assertEqual(sbx.id, SBX)
        self.assertEqual(sbx.state, "ready")
        self.assertEqual(sbx.template, "base")
        self.assertEqual(sbx.workspace, "/tmp/repo")
        self.assertEqual(self.fake.last().headers["content-type"], "application/json")
        self.assertNotIn("authorization", self.fake.last().headers)

    def test_create_without_workspace_and_relative_paths(self) -> None:
        self.fake.route("POST", "/v1/sandboxes", Reply(201, SANDBOX))
        self.client.create()
        self.assertEqual(self.fake.last().body, {})
        self.client.create(".", network="none")
        self.assertEqual(self.fake.last().body["workspace"]["host_path"], os.getcwd())
        self.assertEqual(self.fake.last().body["network"], {"policy": ["none"]})

    def test_list_get_and_hostile_ids(self) -> None:
        other = dict(SANDBOX, id="sbx_fedcba9876543210", state="paused")
        self.fake.route("GET", "/v1/sandboxes", Reply(200, {"sandboxes": [SANDBOX, other]}))
        self.fake.route("GET", BASE, Reply(200, SANDBOX))
        got = self.client.list()
        self.assertEqual([s.id for s in got], [SBX, other["id"]])
        self.assertEqual(got[1].state, "paused")
        self.assertEqual(self.client.get(SBX).template, "base")
        with self.assertRaises(tryboxi.NotFound):
            self.client.get("sbx_1/../../v1/gc")
        self.assertEqual(self.fake.last().path, "/v1/sandboxes/sbx_1%2F..%2F..%2Fv1%2Fgc")


class Errors(FakeTest):
    CASES = [
        (400, "bad_request", tryboxi.BadRequest),
        (401, "unauthorized", tryboxi.Unauthorized),
        (403, "forbidden", tryboxi.Forbidden),
        (404, "not_found", tryboxi.NotFound),
        (408, "timeout", tryboxi.RequestTimeout),
        (409, "conflict", tryboxi.Conflict),
        (409, "no_workspace", tryboxi.NoWorkspace),
        (413, "too_large", tryboxi.PayloadTooLarge),
        (422, "unprocessable", tryboxi.Unprocessable),
        (429, "host_full", tryboxi.HostFull),
        (500, "internal", tryboxi.InternalError),
        (502, "port_not_open", tryboxi.PortNotOpen),
        (503, "unavailable", tryboxi.Unavailable),
        (503, "too_many_connections", tryboxi.Unavailable),
        (507, "no_space", tryboxi.NoSpace),
    ]

    def test_every_api_error_code_has_its_exception(self) -> None:
        for status, code, cls in self.CASES:
            with self.subTest(code=code):
                self.fake.route("GET", BASE, error(status, code, f"the {code} message"))
                with self.assertRaises(cls) as cm:
                    self.client.get(SBX)
                e = cm.exception
                self.assertIsInstance(e, tryboxi.ApiError)
                self.assertIsInstance(e, tryboxi.TryboxiError)
                self.assertEqual(
                    (e.status, e.code, e.message), (status, code, f"the {code} message")
                )
                self.assertIn(code, str(e))

    def test_subclasses_and_aliases(self) -> None:
        self.assertTrue(issubclass(tryboxi.NoWorkspace, tryboxi.Conflict))
        self.assertIs(tryboxi.Busy, tryboxi.HostFull)
        self.assertTrue(issubclass(tryboxi.FingerprintMismatch, tryboxi.ProtocolError))

    def test_unknown_codes_fall_back_to_the_status_and_bodies_that_are_not_json(self) -> None:
        self.fake.route("GET", BASE, error(409, "some_new_code", "later daemons"))
        with self.assertRaises(tryboxi.Conflict) as cm:
            self.client.get(SBX)
        self.assertEqual(cm.exception.code, "some_new_code")
        self.fake.route("GET", BASE, error(418, "teapot", "short and stout"))
        with self.assertRaises(tryboxi.ApiError) as cm2:
            self.client.get(SBX)
        self.assertIs(type(cm2.exception), tryboxi.ApiError)
        self.fake.route("GET", BASE, Reply(502, raw=b"Bad Gateway from a proxy"))
        with self.assertRaises(tryboxi.PortNotOpen) as cm3:
            self.client.get(SBX)
        self.assertEqual(cm3.exception.code, "502")
        self.assertEqual(cm3.exception.message, "Bad Gateway from a proxy")

    def test_no_daemon_is_daemon_unreachable(self) -> None:
        with tempfile.TemporaryDirectory() as d:
            client = tryboxi.Client(socket=os.path.join(d, "tryboxi.sock"))
            with self.assertRaises(tryboxi.DaemonUnreachable) as cm:
                client.list()
            self.assertIn(d, str(cm.exception))
            self.assertIn("tryboxi serve", str(cm.exception))

    def test_a_reply_that_is_not_json_is_a_protocol_error(self) -> None:
        self.fake.route("GET", BASE, Reply(200, raw=b"<html>"))
        with self.assertRaises(tryboxi.ProtocolError):
            self.client.get(SBX)


def started() -> dict:
    return {"type": "started", "exec_id": "exe_0123456789abcdef", "sandbox_id": SBX, "pid": 7}


def exit_event(code: int = 0) -> dict:
    return {
        "type": "exit",
        "exit_code": code,
        "signal": None,
        "timed_out": False,
        "duration_ms": 12,
    }


class Exec(FakeTest):
    def test_output_reaches_the_callbacks_as_it_arrives_whatever_the_chunking(self) -> None:
        client_saw_first_line = threading.Event()
        server_waited = []

        def wait_for_client() -> None:
            server_waited.append(client_saw_first_line.wait(10))

        lines = ndjson(started(), {"type": "stdout", "data": "hello\n"})
        cut = lines.index(b'"stdout"') + 4  # inside the second line
        stream: List[Step] = [
            lines[:cut],
            lines[cut:-3],
            lines[-3:],  # the newline that completes the stdout line
            wait_for_client,  # nothing more until the client has handed "hello" on
            # "é" split between two events: each half alone is not UTF-8, so data_b64.
            ndjson({"type": "stdout", "data_b64": base64.b64encode(b"caf\xc3").decode()}),
            ndjson({"type": "stdout", "data_b64": base64.b64encode(b"\xa9\n").decode()}),
            ndjson({"type": "stderr", "data_b64": base64.b64encode(b"\xff\x00raw").decode()}),
            ndjson({"type": "stderr", "data": "warn\n"}) + ndjson(exit_event(3)),
        ]
        self.fake.route("POST", f"{BASE}/exec", Reply(stream=stream))
        out: List[str] = []
        err: List[str] = []

        def on_stdout(text: str) -> None:
            out.append(text)
            if "hello" in text:
                client_saw_first_line.set()

        r = self.client.sandbox(SBX).exec("make test", on_stdout=on_stdout, on_stderr=err.append)
        self.assertEqual(
            server_waited, [True], "the first chunk was not handed on before the stream ended"
        )
        self.assertEqual(out, ["hello\n", "caf", "é\n"])
        self.assertEqual("".join(err), "\ufffd\x00rawwarn\n")
        self.assertEqual(r.exit_code, 3)
        self.assertFalse(r.ok)
        self.assertEqual(r.stdout_bytes, b"hello\ncaf\xc3\xa9\n")
        self.assertEqual(r.stdout, "hello\ncafé\n")
        self.assertEqual(r.stderr_bytes, b"\xff\x00rawwarn\n")
        self.assertEqual(
            (r.exec_id, r.duration_ms, r.signal, r.timed_out),
            ("exe_0123456789abcdef", 12, None, False),
        )
        self.assertEqual(self.fake.last().body, {"cmd": "make test"})
        self.assertEqual(self.fake.last().headers["accept"], "application/x-ndjson")

    def test_request_fields(self) -> None:
        self.fake.route("POST", f"{BASE}/exec", Reply(stream=[ndjson(started(), exit_event())]))
        sbx = self.client.sandbox(SBX)
        r = sbx.exec(
            ["python3", "-c", "print(1)"],
            env={"A": "1"},
            cwd="/tmp",
            timeout=5,
            stdin=b"\x00\x01",
            user="nobody",
        )
        self.assertTrue(r.ok)
        self.assertEqual(
            self.fake.last().body,
            {
                "argv": ["python3", "-c", "print(1)"],
                "env": {"A": "1"},
                "cwd": "/tmp",
                "timeout_s": 5.0,
                "stdin_b64": "AAE=",
                "user": "nobody",
            },
        )
        sbx.exec("cat", stdin="text in")
        self.assertEqual(self.fake.last().body, {"cmd": "cat", "stdin": "text in"})
        with self.assertRaises(ValueError):
            sbx.exec([])

    def test_signal_and_timeout(self) -> None:
        ev = {
            "type": "exit",
            "exit_code": None,
            "signal": 9,
            "timed_out": True,
            "duration_ms": 5000,
        }
        self.fake.route("POST", f"{BASE}/exec", Reply(stream=[ndjson(started(), ev)]))
        r = self.client.sandbox(SBX).exec("sleep 100", timeout=5)
        self.assertEqual((r.exit_code, r.signal, r.timed_out, r.ok), (None, 9, True, False))

    def test_an_error_event_raises_exec_error_with_the_output_so_far(self) -> None:
        stream = [
            ndjson(
                started(),
                {"type": "stdout", "data": "partial"},
                {"type": "error", "code": "vm_lost", "message": "the VM died"},
            )
        ]
        self.fake.route("POST", f"{BASE}/exec", Reply(stream=stream))
        with self.assertRaises(tryboxi.ExecError) as cm:
            self.client.sandbox(SBX).exec("x")
        self.assertEqual(
            (cm.exception.code, cm.exception.message, cm.exception.stdout),
            ("vm_lost", "the VM died", b"partial"),
        )

    def test_truncated_streams_are_protocol_errors(self) -> None:
        sbx = self.client.sandbox(SBX)
        self.fake.route("POST", f"{BASE}/exec", Reply(stream=[ndjson(started())]))
        with self.assertRaises(tryboxi.ProtocolError):
            sbx.exec("x")
        self.fake.route("POST", f"{BASE}/exec", Reply(stream=[ndjson(started()) + b'{"type":"std']))
        with self.assertRaises(tryboxi.ProtocolError) as cm:
            sbx.exec("x")
        self.assertIn("mid-line", str(cm.exception))

    def test_exec_refused_before_streaming_is_typed(self) -> None:
        self.fake.route("POST", f"{BASE}/exec", error(409, "conflict", "64 execs already"))
        with self.assertRaises(tryboxi.Conflict):
            self.client.sandbox(SBX).exec("x")

    def test_exec_events_yields_raw_events_with_bytes(self) -> None:
        stream = [ndjson(started(), {"type": "stdout", "data_b64": "AP8="}, exit_event())]
        self.fake.route("POST", f"{BASE}/exec", Reply(stream=stream))
        events = list(self.client.sandbox(SBX).exec_events("x"))
        self.assertEqual([e["type"] for e in events], ["started", "stdout", "exit"])
        self.assertEqual(events[1]["bytes"], b"\x00\xff")


class Workspace(FakeTest):
    def test_diff_apply_pull_undo(self) -> None:
        change = {
            "path": "a b.txt",
            "kind": "modified",
            "binary": False,
            "additions": 1,
            "deletions": 1,
            "patch": "-x\n+y",
        }
        self.fake.route(
            "GET",
            f"{BASE}/diff",
            Reply(200, {"files": [change], "refused": [".git/x: git metadata"]}),
        )
        report = {
            "artifact_id": "art_0123456789abcdef",
            "applied": ["a b.txt"],
            "conflicts": [],
            "refused": [],
        }
        self.fake.route("POST", f"{BASE}/apply", Reply(200, report))
        self.fake.route("POST", f"{BASE}/pull", Reply(200, dict(report, applied=["dist/"])))
        undo = {"artifact_id": "art_0123456789abcdef", "restored": ["a b.txt"], "removed": []}
        self.fake.route("POST", "/v1/artifacts/art_0123456789abcdef/undo", Reply(200, undo))
        sbx = self.client.sandbox(SBX)

        d = sbx.diff(["a b.txt", "src/x&y"], stat=True)
        self.assertEqual(self.fake.last().query, "stat=true&path=a%20b.txt&path=src/x%26y")
        self.assertTrue(d)
        self.assertEqual(d.files[0].path, "a b.txt")
        self.assertEqual(d.patch, "-x\n+y\n")
        self.assertEqual(d.refused, [".git/x: git metadata"])
        sbx.diff()
        self.assertEqual(self.fake.last().path, f"{BASE}/diff")

        a = sbx.apply()
        self.assertEqual(self.fake.last().body, {})
        self.assertEqual((a.artifact_id, a.applied), ("art_0123456789abcdef", ["a b.txt"]))
        sbx.apply(paths=["src"])
        self.assertEqual(self.fake.last().body, {"paths": ["src"]})

        p = sbx.pull(["dist/"], force=True)
        self.assertEqual(self.fake.last().body, {"paths": ["dist/"], "force": True})
        self.assertEqual(p.applied, ["dist/"])
        with self.assertRaises(ValueError):
            sbx.pull([])

        u = self.client.undo("art_0123456789abcdef", within=["/tmp"])
        self.assertEqual(self.fake.last().body, {"force": False, "within": ["/tmp"]})
        self.assertEqual(u.restored, ["a b.txt"])

    def test_no_workspace_is_a_conflict(self) -> None:
        self.fake.route(
            "GET", f"{BASE}/diff", error(409, "no_workspace", "created without a workspace")
        )
        with self.assertRaises(tryboxi.NoWorkspace):
            self.client.sandbox(SBX).diff()

    def test_files(self) -> None:
        self.fake.route(
            "GET", f"{BASE}/files", Reply(200, {"path": "/x", "content_b64": "AP8=", "mode": 420})
        )
        self.fake.route("PUT", f"{BASE}/files", Reply(200, {"path": "/x", "mode": 420}))
        sbx = self.client.sandbox(SBX)
        self.assertEqual(sbx.read_file("/workspace/a b"), b"\x00\xff")
        self.assertEqual(self.fake.last().query, "path=/workspace/a%20b")
        self.fake.route("GET", f"{BASE}/files", Reply(200, {"path": "/x", "content": "héllo"}))
        self.assertEqual(sbx.read_text("/x"), "héllo")
        sbx.write_file("/workspace/bin", b"\x00\x01", mode=0o755)
        self.assertEqual(
            self.fake.last().body, {"path": "/workspace/bin", "content_b64": "AAE=", "mode": 0o755}
        )
        sbx.write_file("/workspace/t", "text")
        self.assertEqual(self.fake.last().body, {"path": "/workspace/t", "content": "text"})


class Lifecycle(FakeTest):
    def test_snapshot_restore_fork_pause_resume_rm(self) -> None:
        snap = {
            "id": "snap_0123456789abcdef",
            "sandbox_id": SBX,
            "name": "before",
            "created_at": "t",
            "state_bytes": 9,
            "duration_ms": 3,
        }
        child = dict(SANDBOX, id="sbx_1111111111111111")
        self.fake.route("POST", f"{BASE}/snapshots", Reply(201, snap))
        self.fake.route("GET", f"{BASE}/snapshots", Reply(200, {"snapshots": [snap]}))
        self.fake.route("POST", f"{BASE}/restore", Reply(200, SANDBOX))
        self.fake.route(
            "POST",
            f"{BASE}/fork",
            Reply(
                201,
                {"parent": SBX, "sandboxes": [child], "failed": ["host full"], "duration_ms": 40},
            ),
        )
        self.fake.route("POST", f"{BASE}/pause", Reply(200, dict(SANDBOX, state="paused")))
        self.fake.route("POST", f"{BASE}/resume", Reply(200, SANDBOX))
        self.fake.route("DELETE", BASE, Reply(200, dict(SANDBOX, state="removing")))
        sbx = self.client.sandbox(SBX)

        s = sbx.snapshot("before")
        self.assertEqual(self.fake.last().body, {"name": "before"})
        self.assertEqual((s.id, s.name, s.state_bytes), ("snap_0123456789abcdef", "before", 9))
        self.assertEqual([x.name for x in sbx.snapshots()], ["before"])
        sbx.restore("before")
        self.assertEqual(self.fake.last().body, {"snapshot": "before"})
        sbx.restore(s)
        self.assertEqual(self.fake.last().body, {"snapshot": "snap_0123456789abcdef"})
        self.assertEqual(sbx.state, "ready")

        kids = sbx.fork(2)
        self.assertEqual(self.fake.last().body, {"count": 2})
        self.assertEqual([k.id for k in kids], ["sbx_1111111111111111"])
        self.assertEqual(
            (len(kids), kids[0].id, kids.failed), (1, "sbx_1111111111111111", ["host full"])
        )

        self.assertEqual(sbx.pause().state, "paused")
        self.assertEqual(sbx.resume().state, "ready")
        with sbx:
            pass
        self.assertEqual((self.fake.last().method, self.fake.last().path), ("DELETE", BASE))

    def test_the_context_manager_tolerates_a_sandbox_already_gone(self) -> None:
        self.fake.route("DELETE", BASE, error(404, "not_found", "no sandbox"))
        with self.client.sandbox(SBX):
            pass
        with self.assertRaises(tryboxi.NotFound):
            self.client.sandbox(SBX).rm()


class Discovery(unittest.TestCase):
    def test_data_root_follows_the_rust_rule(self) -> None:
        with mock.patch.dict(os.environ, {"TRYBOXI_HOME": "rel/home"}):
            self.assertEqual(data_root(), Path(os.path.abspath("rel/home")))
        env = {"TRYBOXI_HOME": "", "XDG_DATA_HOME": "/xdg", "HOME": "/home/u"}
        with mock.patch.dict(os.environ, env), mock.patch("os.geteuid", return_value=1000):
            self.assertEqual(data_root(), Path("/xdg/tryboxi"))
            with mock.patch.dict(os.environ, {"XDG_DATA_HOME": ""}):
                self.assertEqual(data_root(), Path("/home/u/.local/share/tryboxi"))
        with mock.patch.dict(os.environ, env), mock.patch("os.geteuid", return_value=0):
            self.assertEqual(data_root(), Path("/var/lib/tryboxi"))

    def test_the_default_client_uses_the_data_roots_socket(self) -> None:
        with FakeDaemon.unix() as fake:
            fake.route("GET", "/v1/health", Reply(200, {"status": "ok"}))
            home = os.path.dirname(fake.socket_path or "")
            with mock.patch.dict(os.environ, {"TRYBOXI_HOME": home, "TRYBOXI_URL": ""}):
                self.assertEqual(tryboxi.Client().health(), {"status": "ok"})

    def test_fingerprints_parse_in_every_usual_spelling(self) -> None:
        hexs = "ab" * 32
        for s in (hexs, "sha256:" + hexs, "SHA256:" + ":".join(["AB"] * 32)):
            self.assertEqual(parse_fingerprint(s), b"\xab" * 32)
        with self.assertRaises(tryboxi.ConfigError):
            parse_fingerprint("sha256:abcd")

    def test_urls(self) -> None:
        with self.assertRaises(tryboxi.ConfigError) as cm:
            Endpoint.from_url("http://10.0.0.5:7070", token="t")
        self.assertIn("plain text", str(cm.exception))
        for ok in ("http://127.0.0.1:7070", "http://localhost:7070", "http://[::1]:7070"):
            self.assertEqual(Endpoint.from_url(ok, token="t").token, "t")
        with (
            tempfile.TemporaryDirectory() as home,
            mock.patch.dict(os.environ, {"TRYBOXI_HOME": home}),
        ):
            with self.assertRaises(tryboxi.ConfigError) as cm:
                Endpoint.from_url("https://10.0.0.5:7443", token="t")
            self.assertIn("TRYBOXI_FINGERPRINT", str(cm.exception))
            with self.assertRaises(tryboxi.ConfigError) as cm:
                Endpoint.from_url("http://127.0.0.1:7070")
            self.assertIn("TRYBOXI_TOKEN", str(cm.exception))
            Path(home, "token").write_text("from-the-file\n")
            self.assertEqual(Endpoint.from_url("http://127.0.0.1:7070").token, "from-the-file")
        ep = Endpoint.from_url("https://10.0.0.5:7443", token="t", fingerprint="00" * 32)
        self.assertEqual(ep.describe(), "https://10.0.0.5:7443")
        for bad in ("ftp://127.0.0.1:1", "http://127.0.0.1", "http://127.0.0.1:1/v1"):
            with self.assertRaises(tryboxi.ConfigError):
                Endpoint.from_url(bad, token="t")


class Tcp(unittest.TestCase):
    def test_http_on_loopback_sends_the_token(self) -> None:
        with FakeDaemon.tcp() as fake:
            fake.route("GET", "/v1/sandboxes", Reply(200, {"sandboxes": []}))
            env = {"TRYBOXI_URL": f"http://127.0.0.1:{fake.port}", "TRYBOXI_TOKEN": "s3cret"}
            with mock.patch.dict(os.environ, env):
                self.assertEqual(tryboxi.Client().list(), [])
            self.assertEqual(fake.last().headers["authorization"], "Bearer s3cret")
            self.assertEqual(fake.last().headers["host"], f"127.0.0.1:{fake.port}")
            fake.route("GET", "/v1/sandboxes", error(401, "unauthorized", "bad token"))
            with self.assertRaises(tryboxi.Unauthorized):
                tryboxi.Client(url=f"http://127.0.0.1:{fake.port}", token="wrong").list()

    def test_https_pins_the_certificate_and_sends_nothing_to_another(self) -> None:
        openssl = shutil.which("openssl")
        if openssl is None:
            if os.environ.get("CI"):
                self.fail("openssl is needed under CI to make the test certificate")
            self.skipTest("no openssl to make a test certificate")
        with tempfile.TemporaryDirectory() as d:
            cert, key = os.path.join(d, "cert.pem"), os.path.join(d, "key.pem")
            subprocess.run(
                [
                    openssl,
                    "req",
                    "-x509",
                    "-newkey",
                    "ec",
                    "-pkeyopt",
                    "ec_paramgen_curve:prime256v1",
                    "-nodes",
                    "-keyout",
                    key,
                    "-out",
                    cert,
                    "-days",
                    "2",
                    "-subj",
                    "/CN=localhost",
                ],
                check=True,
                capture_output=True,
            )
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.load_cert_chain(cert, key)
            der = ssl.PEM_cert_to_DER_cert(Path(cert).read_text())
            import hashlib

            good = "sha256:" + hashlib.sha256(der).hexdigest()
            with FakeDaemon.tcp(tls=ctx) as fake:
                fake.route("GET", "/v1/health", Reply(200, {"status": "ok"}))
                url = f"https://127.0.0.1:{fake.port}"
                self.assertEqual(
                    tryboxi.Client(url=url, token="tok", fingerprint=good).health(),
                    {"status": "ok"},
                )
                self.assertEqual(fake.last().headers["authorization"], "Bearer tok")
                n = len(fake.requests)
                wrong = "sha256:" + "00" * 32
                with self.assertRaises(tryboxi.FingerprintMismatch) as cm:
                    tryboxi.Client(url=url, token="tok", fingerprint=wrong).health()
                self.assertIn(good, str(cm.exception))
                self.assertEqual(len(fake.requests), n, "a request went to an unpinned certificate")
                # The local daemon's certificate is pinned when no fingerprint is given.
                with mock.patch.dict(os.environ, {"TRYBOXI_HOME": d}):
                    shutil.copy(cert, os.path.join(d, "tls-cert.pem"))
                    self.assertEqual(
                        tryboxi.Client(url=url, token="tok").health(), {"status": "ok"}
                    )


class Harness(unittest.TestCase):
    """The example harness's loop against the fake daemon (the real-VM run is in
    tests/python_sdk_e2e.rs)."""

    def test_fix_round_then_diff_apply_and_artifact(self) -> None:
        sys.path.insert(0, str(HERE.parents[2] / "examples" / "python-harness"))
        import harness  # type: ignore[import-not-found]

        runs = iter(
            [
                [ndjson(started(), {"type": "stdout", "data": "FAIL\n"}, exit_event(1))],
                [ndjson(started(), exit_event(0))],
                [ndjson(started(), {"type": "stdout", "data": "ok\n"}, exit_event(0))],
            ]
        )
        change = {
            "path": "v.txt",
            "kind": "modified",
            "binary": False,
            "additions": 1,
            "deletions": 1,
            "patch": "-broken\n+fixed\n",
        }
        with FakeDaemon.unix() as fake, tempfile.TemporaryDirectory() as repo:
            fake.route("POST", "/v1/sandboxes", Reply(201, SANDBOX))
            fake.route("POST", f"{BASE}/exec", lambda _r: Reply(stream=next(runs)))
            fake.route("GET", f"{BASE}/diff", Reply(200, {"files": [change]}))
            fake.route(
                "POST",
                f"{BASE}/apply",
                Reply(
                    200,
                    {
                        "artifact_id": "art_0123456789abcdef",
                        "applied": ["v.txt"],
                        "conflicts": [],
                        "refused": [],
                    },
                ),
            )
            fake.route("DELETE", BASE, Reply(200, SANDBOX))
            buf = io.StringIO()
            env = {"TRYBOXI_HOME": os.path.dirname(fake.socket_path or ""), "TRYBOXI_URL": ""}
            with mock.patch.dict(os.environ, env), redirect_stdout(buf):
                code = harness.main(
                    [
                        "--repo",
                        repo,
                        "--test",
                        "sh check.sh",
                        "--fix",
                        "sed -i s/a/b/ v.txt",
                        "--apply",
                    ]
                )
            text = buf.getvalue()
            self.assertEqual(code, 0, text)
            execs = [r.body["cmd"] for r in fake.requests if r.route.endswith("/exec")]
            self.assertEqual(execs, ["sh check.sh", "sed -i s/a/b/ v.txt", "sh check.sh"])
            for want in (
                "FAIL\n",
                "tests: passed",
                "+fixed",
                "applied: v.txt",
                "artifact: art_0123456789abcdef",
            ):
                self.assertIn(want, text)
            self.assertEqual(fake.last().method, "DELETE")


if __name__ == "__main__":
    unittest.main()
