"""The tryboxi Python SDK against a real daemon and a running sandbox (tests/python_sdk_e2e.rs
runs it with the venv the SDK was pip-installed into, after the example harness left the
sandbox running).

Usage: checks.py SANDBOX_ID ARTIFACT_ID REPO
Reaches the daemon through TRYBOXI_HOME. Prints one line `SUMMARY <json>` for the Rust test.
"""

import json
import os
import sys
import tempfile
import time
from typing import Any, Dict, List

import tryboxi


def main() -> None:
    sbx_id, artifact, repo = sys.argv[1:4]
    client = tryboxi.Client()
    summary: Dict[str, Any] = {"sdk_file": tryboxi.__file__}

    sbx = client.get(sbx_id)
    summary["state"] = sbx.state
    summary["listed"] = sbx_id in [s.id for s in client.list()]

    # Output reaches the callbacks while the command still runs: the first line is handed on
    # before the command writes the rest (it waits for a file that only appears after).
    out_chunks: List[str] = []
    err_chunks: List[str] = []
    first_out_at: List[float] = []

    def on_out(text: str) -> None:
        if not first_out_at:
            first_out_at.append(time.monotonic())
        out_chunks.append(text)

    script = (
        "printf 'out1\\n'; printf 'err1\\n' >&2; sleep 1; "
        "printf 'caf\\303\\251 \\377\\n'; printf 'err2\\n' >&2; exit 7"
    )
    started = time.monotonic()
    r = sbx.exec(script, on_stdout=on_out, on_stderr=err_chunks.append)
    ended = time.monotonic()
    summary["callback"] = {
        "exit_code": r.exit_code,
        "stdout_bytes": r.stdout_bytes.hex(),
        "stderr": r.stderr,
        "out_chunks": out_chunks,
        "err_joined": "".join(err_chunks),
        # seconds between the first stdout callback and the end of the exec (>= ~1 s when
        # output is streamed, ~0 when it is handed on only at the end)
        "first_chunk_lead_s": round(ended - (first_out_at[0] if first_out_at else ended), 2),
        "total_s": round(ended - started, 2),
    }

    r = sbx.exec(["cat"], stdin=b"\x00bin\xff")
    summary["stdin_roundtrip"] = r.stdout_bytes == b"\x00bin\xff"
    r = sbx.exec(["sh", "-c", 'echo "$FOO"; pwd'], env={"FOO": "bar"}, cwd="/tmp")
    summary["env_cwd"] = r.stdout
    r = sbx.exec("sleep 30", timeout=1)
    summary["timeout"] = {"timed_out": r.timed_out, "exit_code": r.exit_code}

    sbx.write_file("/tmp/sdk-bin", b"\x00\x01\xfe")
    summary["file_roundtrip"] = sbx.read_file("/tmp/sdk-bin") == b"\x00\x01\xfe"

    # Checkpoint, change, restore; pause to disk and resume (the same VM all along).
    snap = sbx.snapshot("sdk-before")
    sbx.exec("echo changed > /tmp/sdk-marker")
    sbx.restore("sdk-before")
    after_restore = sbx.exec("cat /tmp/sdk-marker 2>/dev/null || echo absent").stdout
    paused = sbx.pause().state
    resumed = sbx.resume().state
    summary["lifecycle"] = {
        "snapshot_name": snap.name,
        "listed": [s.name for s in sbx.snapshots()],
        "after_restore": after_restore,
        "paused": paused,
        "resumed": resumed,
        "exec_after_resume": sbx.exec("echo back").stdout,
    }

    errors: Dict[str, List[Any]] = {}
    try:
        client.get("sbx_0000000000000000")
    except tryboxi.NotFound as e:
        errors["unknown_sandbox"] = [type(e).__name__, e.status, e.code]
    try:
        client.sandbox("sbx_0000000000000000").exec("true")
    except tryboxi.NotFound as e:
        errors["exec_unknown_sandbox"] = [type(e).__name__, e.status, e.code]
    try:
        client.undo("art_0000000000000000")
    except tryboxi.ApiError as e:
        errors["unknown_artifact"] = [type(e).__name__, e.status, e.code]
    with tempfile.TemporaryDirectory() as d:
        try:
            tryboxi.Client(socket=os.path.join(d, "none.sock")).list()
        except tryboxi.DaemonUnreachable as e:
            errors["no_daemon"] = [type(e).__name__]
    summary["errors"] = errors

    undo = client.undo(artifact)
    summary["undo_restored"] = undo.restored

    sbx.rm()
    try:
        client.get(sbx_id)
        summary["gone_after_rm"] = False
    except tryboxi.NotFound:
        summary["gone_after_rm"] = True
    print("SUMMARY " + json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
