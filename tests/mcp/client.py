"""Drive `tryboxi mcp` with the official MCP Python SDK (`pip install mcp`, 2.x) as a real
agent would: connect, list tools, run commands, page output, time out, cancel, diff/apply,
checkpoint/restore, fork, pause, a dev server in the background behind `expose_port`.

Usage: client.py TRYBOXI_BIN TRYBOXI_HOME WORKSPACE
Asserts as it goes (a failure exits non-zero with a traceback) and prints one JSON summary line
prefixed with `SUMMARY ` for the Rust test (tests/mcp_e2e.rs) to check.
"""

import json
import os
import sys

import anyio
from mcp.client import Client
from mcp.client.stdio import StdioServerParameters

BIN, HOME, WORKSPACE = sys.argv[1:4]
summary: dict = {}


def params(extra_args=()):
    return StdioServerParameters(
        command=BIN,
        args=["mcp", *extra_args],
        env={
            "TRYBOXI_HOME": HOME,
            "SANDBOX_WORKSPACE": WORKSPACE,
            "SANDBOX_CLIENT": "python-sdk-test",
            "TRYBOXI_LOG": "debug",
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        },
    )


def text(result) -> str:
    return "".join(getattr(c, "text", "") for c in result.content)


async def call(client, name, args=None, **kw):
    r = await client.call_tool(name, args or {}, **kw)
    return r, text(r), r.structured_content or {}


async def main_session():
    async with Client(params(), read_timeout_seconds=900) as client:
        summary["protocol_version"] = client.protocol_version
        tools = await client.list_tools()
        names = sorted(t.name for t in tools.tools)
        summary["tools"] = names
        for t in tools.tools:
            assert t.input_schema.get("type") == "object", t

        # exec echo: boots the workspace's sandbox on first use.
        r, t, s = await call(client, "exec", {"cmd": "echo hello-from-mcp; echo oops >&2"})
        assert not r.is_error, t
        assert s["exit_code"] == 0 and s["stdout"] == "hello-from-mcp\n", s
        assert s["stderr"] == "oops\n", s
        summary["sandbox_id"] = s["sandbox_id"]

        # The same sandbox is reused; a non-zero exit is a result, not a tool error.
        r, t, s = await call(client, "exec", {"cmd": "pwd; exit 3"})
        assert not r.is_error and s["exit_code"] == 3, t
        assert s["sandbox_id"] == summary["sandbox_id"], s
        assert s["stdout"] == "/workspace\n", s
        assert "exit code: 3" in t, t

        # Large output is cut, and every byte can be paged back.
        r, t, s = await call(client, "exec", {"cmd": "seq 1 100000"})
        assert s.get("output_id"), s
        assert "[... " in s["stdout"] and "read_output" in t, t
        full, off = "", 0
        while off is not None:
            _, _, page = await call(
                client, "read_output",
                {"output_id": s["output_id"], "offset": off, "limit": 65536},
            )
            full += page["text"]
            off = page["next_offset"]
        assert full == "".join(f"{i}\n" for i in range(1, 100001)), len(full)
        summary["paged_bytes"] = len(full)

        # Progress notifications while a command runs.
        progress = []

        async def on_progress(p, total, message):
            progress.append((p, total, message))

        r, t, s = await call(
            client, "exec",
            {"cmd": "for i in 1 2 3 4; do echo tick$i; sleep 1; done", "timeout_s": 60},
            progress_callback=on_progress,
        )
        assert s["exit_code"] == 0, t
        assert len(progress) >= 2, progress
        assert all(b[0] > a[0] for a, b in zip(progress, progress[1:])), progress
        assert progress[0][1] == 60, progress
        summary["progress_notifications"] = len(progress)

        # Timeout: a tool error that says so.
        r, t, s = await call(client, "exec", {"cmd": "sleep 30", "timeout_s": 2})
        assert r.is_error and s["timed_out"], t
        assert "TIMED OUT" in t, t

        # Cancellation kills the command in the VM. (It prints: the daemon notices a caller
        # that went away when it next has output to send.)
        with anyio.move_on_after(3):
            await call(
                client, "exec",
                {"cmd": "echo $$ > /tmp/victim.pid; while :; do echo tick; sleep 0.2; done"},
            )
        gone = False
        with anyio.fail_after(60):
            while not gone:
                _, _, s = await call(
                    client, "exec",
                    {"cmd": "kill -0 $(cat /tmp/victim.pid) 2>/dev/null && echo alive || echo gone"},
                )
                gone = s["stdout"].strip() == "gone"
                if not gone:
                    await anyio.sleep(0.2)
        summary["cancel_killed"] = gone

        # Unknown sandbox: a clear tool error.
        r, t, _ = await call(client, "exec", {"cmd": "true", "sandbox_id": "sbx_doesnotexist00000000"})
        assert r.is_error and "Unknown sandbox" in t, t

        # Workspace round trip: write in the VM, diff, apply to the host, undo.
        r, t, _ = await call(client, "diff", {})
        if r.is_error:
            assert "not available" in t and "restart the daemon" in t, t
            summary["workspace_routes"] = False
            r, t, _ = await call(client, "apply", {})
            assert r.is_error and "not available" in t, t
        else:
            summary["workspace_routes"] = True
            r, t, s = await call(client, "exec", {"cmd": "cat marker.txt"})
            assert s["stdout"] == "synced from the host\n", t
            r, t, _ = await call(client, "write_file", {"path": "from_vm.txt", "content": "made in the VM\n"})
            assert not r.is_error, t
            r, t, s = await call(client, "diff", {})
            assert not r.is_error and any(f["path"] == "from_vm.txt" for f in s["files"]), t
            r, t, s = await call(client, "apply", {"paths": ["from_vm.txt"]})
            assert not r.is_error and "from_vm.txt" in s["applied"], t
            with open(os.path.join(WORKSPACE, "from_vm.txt")) as f:
                assert f.read() == "made in the VM\n"
            r, t, _ = await call(client, "undo", {"artifact_id": s["artifact_id"]})
            assert not r.is_error, t
            assert not os.path.exists(os.path.join(WORKSPACE, "from_vm.txt"))

        await checkpoints_fork_and_pause(client)
        await dev_server_in_the_background(client)

        r, t, s = await call(client, "list", {})
        mine = [x for x in s["sandboxes"] if x["id"] == summary["sandbox_id"]]
        assert mine and mine[0]["this_workspace"], s


async def checkpoints_fork_and_pause(client):
    """The spec's prompt: checkpoint, try a change, run the tests; they fail: restore."""
    sid = summary["sandbox_id"]
    r, t, s = await call(client, "checkpoint", {"name": "before-upgrade"})
    assert not r.is_error and s["name"] == "before-upgrade", t
    assert s["checkpoint_id"].startswith("snap_") and s["sandbox_id"] == sid, s
    r, t, _ = await call(client, "checkpoint", {"name": "before-upgrade"})
    assert r.is_error and "already has a snapshot named" in t, t
    r, t, s = await call(
        client, "exec",
        {"cmd": "echo upgraded > marker.txt && touch /tmp/new-dep && cat marker.txt; exit 1"},
    )
    assert s["exit_code"] == 1 and s["stdout"] == "upgraded\n", t
    r, t, s = await call(client, "list_checkpoints", {})
    assert [c["name"] for c in s["checkpoints"]] == ["before-upgrade"], t
    r, t, s = await call(client, "restore", {"checkpoint": "before-upgrade"})
    assert not r.is_error and s["sandbox_id"] == sid and s["state"] == "ready", t
    # The file is back (read without a sync first), and so is the rest of the VM.
    r, t, s = await call(client, "read_file", {"path": "marker.txt"})
    assert not r.is_error and s["content"] == "synced from the host\n", t
    r, t, s = await call(
        client, "exec", {"cmd": "cat marker.txt; test -e /tmp/new-dep && echo dep || echo no-dep"},
    )
    assert s["stdout"] == "synced from the host\nno-dep\n" and s["sandbox_id"] == sid, t
    r, t, _ = await call(client, "restore", {"checkpoint": "no-such-checkpoint"})
    assert r.is_error and "no snapshot" in t, t
    summary["restored"] = True

    # Fork: a copy with its own id, the same files; the original is still the default.
    r, t, s = await call(client, "exec", {"cmd": "echo forked-state > /tmp/state"})
    r, t, s = await call(client, "fork", {})
    assert not r.is_error and s["parent"] == sid and len(s["sandboxes"]) == 1, t
    child = s["sandboxes"][0]["sandbox_id"]
    assert child != sid and child.startswith("sbx_"), s
    r, t, s = await call(client, "exec", {"cmd": "cat /tmp/state marker.txt", "sandbox_id": child})
    assert s["sandbox_id"] == child and s["stdout"] == "forked-state\nsynced from the host\n", t
    r, t, s = await call(client, "fork", {"count": 9})
    assert r.is_error and "count" in t, t
    r, t, s = await call(client, "rm", {"sandbox_id": child})
    assert not r.is_error and s["removed"] == child, t
    summary["forked"] = child

    # Pause: the next tool call resumes the same sandbox (not a new one).
    r, t, s = await call(client, "pause", {})
    assert not r.is_error and s["state"] == "paused" and s["sandbox_id"] == sid, t
    r, t, s = await call(client, "list", {})
    assert [x["state"] for x in s["sandboxes"] if x["id"] == sid] == ["paused"], t
    r, t, s = await call(client, "exec", {"cmd": "cat /tmp/state"})
    assert s["sandbox_id"] == sid and s["stdout"] == "forked-state\n", t
    summary["paused_and_resumed"] = True


async def dev_server_in_the_background(client):
    """The spec's prompt: start the dev server and give me the URL."""
    r, t, s = await call(
        client, "exec",
        {"cmd": "mkdir -p /tmp/site && echo hello-from-the-dev-server > /tmp/site/index.html"
                " && cd /tmp/site && exec python3 -u -m http.server 8000",
         "background": True},
    )
    assert not r.is_error and s["running"] and s["exec_id"].startswith("exe_"), t
    exe = s["exec_id"]
    assert "exec_output" in t and "stop_exec" in t, t
    # Its output, read as it comes (waiting at the end), until it says it listens.
    text, off = "", 0
    with anyio.fail_after(120):
        while "Serving HTTP" not in text:
            _, t, s = await call(client, "exec_output", {"exec_id": exe, "offset": off, "wait_s": 5})
            assert s["running"], t
            text += s["text"]
            off = s["next_offset"]
    r, t, s = await call(client, "expose_port", {"port": 8000})
    assert not r.is_error and s["url"].startswith("http://127.0.0.1:"), t
    url = s["url"]
    body = None
    with anyio.fail_after(60):
        while body is None:
            try:
                body = await anyio.to_thread.run_sync(fetch, url)
            except OSError:
                await anyio.sleep(0.5)
    assert body == "hello-from-the-dev-server\n", body
    summary["dev_server_url"] = url
    # The server logged the request.
    with anyio.fail_after(60):
        while '"GET / HTTP/1.1" 200' not in text:
            _, t, s = await call(client, "exec_output", {"exec_id": exe, "offset": off, "wait_s": 5})
            text += s["text"]
            off = s["next_offset"]
    r, t, s = await call(client, "stop_exec", {"exec_id": exe})
    assert not r.is_error and s["running"] is False, t
    _, t, s = await call(client, "exec_output", {"exec_id": exe, "offset": off})
    assert s["running"] is False and s["eof"], t
    r, t, s = await call(client, "stop_exec", {"exec_id": exe})
    assert not r.is_error and "already ended" in t, t
    r, t, _ = await call(client, "exec_output", {"exec_id": "exe_0123456789abcdef"})
    assert r.is_error, t
    summary["background_stopped"] = True


def fetch(url: str) -> str:
    import urllib.request
    with urllib.request.urlopen(url, timeout=10) as resp:
        return resp.read().decode()


async def second_session_reuses_and_removes():
    # A new server process (the harness restarted it) finds the workspace's sandbox again;
    # this one speaks the initialize handshake and runs with --no-apply.
    async with Client(params(["--no-apply"]), mode="legacy", read_timeout_seconds=900) as client:
        summary["legacy_protocol_version"] = client.protocol_version
        names = {t.name for t in (await client.list_tools()).tools}
        assert "apply" not in names and "pull" not in names, names
        r, t, s = await call(client, "exec", {"cmd": "true"})
        assert not r.is_error and s["sandbox_id"] == summary["sandbox_id"], (t, summary)
        r, t, s = await call(client, "rm", {})
        assert not r.is_error and s["removed"] == summary["sandbox_id"], t
        r, t, _ = await call(client, "diff", {})
        assert r.is_error and "No sandbox for workspace" in t, t


async def main():
    await main_session()
    await second_session_reuses_and_removes()
    print("SUMMARY " + json.dumps(summary), flush=True)


anyio.run(main)
