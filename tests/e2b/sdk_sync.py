"""E2B Python SDK (sync) scenario against tryboxi's E2B face.

Run by tests/e2b_e2e.rs with E2B_API_URL, E2B_SANDBOX_URL and E2B_API_KEY pointing at a
daemon started with `--e2b`. Unmodified SDK calls only: this is the code people already have.
Prints one JSON object (the observations) on its last stdout line; the Rust test checks it.
Every step records what it saw; an exception in a step is recorded, not fatal, so one run
shows every failure.
"""

import json
import os
import sys
import time
import traceback

import asyncio

from e2b import AsyncSandbox, PtySize, Sandbox, SandboxQuery, SandboxState
from e2b.exceptions import AuthenticationException, NotFoundException
from e2b.sandbox.commands.command_handle import CommandExitException

obs = {}


def step(name):
    def wrap(fn):
        try:
            obs[name] = fn()
        except Exception as e:  # recorded for the Rust side to report
            obs[name] = {"exception": type(e).__name__, "message": str(e)[:500],
                         "trace": traceback.format_exc()[-1500:]}
        return fn
    return wrap


IKEY = "tryboxi-e2e-%d" % os.getpid()
sbx = Sandbox.create(template="base", timeout=600, envs={"FROM_CREATE": "c1"},
                     metadata={"suite": "tryboxi-e2e", "run": str(os.getpid())},
                     idempotency_key=IKEY)
obs["sandbox_id"] = sbx.sandbox_id


@step("idempotent_create")
def _():
    # The same Idempotency-Key again: the first create's sandbox, not a second one.
    again = Sandbox.create(template="base", timeout=600, idempotency_key=IKEY)
    return {"same": again.sandbox_id == sbx.sandbox_id}


@step("run")
def _():
    out, err = [], []
    r = sbx.commands.run("echo hi $FROM_CREATE $FROM_RUN; echo oops >&2; id -un; pwd",
                         envs={"FROM_RUN": "r1"},
                         on_stdout=lambda s: out.append(s), on_stderr=lambda s: err.append(s))
    return {"stdout": r.stdout, "stderr": r.stderr, "exit_code": r.exit_code,
            "cb_out": "".join(out), "cb_err": "".join(err)}


@step("metrics")
def _():
    m = sbx.get_metrics()
    if not m:
        return {"samples": 0}
    first = len(m)
    # The history gains a sample every 5 s: wait (bounded) for a second one.
    deadline = time.time() + 60
    while len(m) < 2 and time.time() < deadline:
        time.sleep(0.5)
        m = sbx.get_metrics()
    x = m[-1]
    t0 = m[0].timestamp
    one = sbx.get_metrics(start=t0, end=t0)
    later = sbx.get_metrics(start=m[-1].timestamp)
    return {"first_call": first >= 1, "history": len(m) >= 2, "cpu_count": x.cpu_count,
            "range_one": len(one) == 1 and one[0].timestamp == t0,
            "range_from": len(later) >= 1 and all(s.timestamp >= m[-1].timestamp for s in later),
            "cpu_pct_ok": all(0.0 <= s.cpu_used_pct <= 100.0 for s in m),
            "mem_ok": all(0 < s.mem_used <= s.mem_total for s in m),
            "disk_ok": all(0 < s.disk_used < s.disk_total for s in m)}


@step("exit_code")
def _():
    try:
        sbx.commands.run("echo before; exit 3")
        return {"raised": False}
    except CommandExitException as e:
        return {"raised": True, "exit_code": e.exit_code, "stdout": e.stdout}


@step("background_stdin")
def _():
    h = sbx.commands.run("read x; echo got $x", background=True, stdin=True)
    listed = [p.pid for p in sbx.commands.list()]
    sbx.commands.send_stdin(h.pid, "hello\n")
    r = h.wait()
    return {"pid_listed": h.pid in listed, "stdout": r.stdout, "exit_code": r.exit_code}


@step("reattach")
def _():
    """commands.connect(pid): a detached command's output so far is replayed, then it goes on."""
    h = sbx.commands.run("echo one; touch /tmp/one.flag; read x; echo two $x",
                         background=True, stdin=True)
    # Its first line is out before we leave (bounded).
    start = time.time()
    while not sbx.files.exists("/tmp/one.flag") and time.time() - start < 30:
        time.sleep(0.05)
    h.disconnect()
    again = sbx.commands.connect(h.pid)
    sbx.commands.send_stdin(h.pid, "z\n")
    return {"stdout": again.wait().stdout}


@step("uploads")
def _():
    import io
    sbx.files.write("/tmp/up/io.txt", io.BytesIO(b"via octet-stream"))
    sbx.files.write("/tmp/up/gz.txt", b"gz " * 1000, gzip=True)
    sbx.files.write_files([{"path": "/tmp/up/m1.txt", "data": "first"},
                           {"path": "/tmp/up/m2.txt", "data": b"second"}])
    r = sbx.commands.run("cat /tmp/up/io.txt; echo; wc -c < /tmp/up/gz.txt; "
                         "cat /tmp/up/m1.txt /tmp/up/m2.txt")
    return {"seen": r.stdout}


@step("kill")
def _():
    h = sbx.commands.run("sleep 1000", background=True)
    killed = sbx.commands.kill(h.pid)
    try:
        h.wait()
        raised = False
    except CommandExitException as e:
        raised = True
    gone = h.pid not in [p.pid for p in sbx.commands.list()]
    return {"killed": killed, "wait_raised": raised, "gone": gone,
            "kill_unknown": sbx.commands.kill(999999)}


@step("stream_input")
def _():
    h = sbx.commands.run("cat", background=True, stdin=True)
    sbx.commands.stream_input(h.pid, ["one\n", "two\n"])
    sbx.commands.close_stdin(h.pid)
    return {"stdout": h.wait().stdout}


@step("pty")
def _():
    h = sbx.pty.create(PtySize(rows=24, cols=80))
    sbx.pty.resize(h.pid, PtySize(rows=30, cols=100))
    sbx.pty.send_stdin(h.pid, b"stty size; tty; exit\n")
    chunks = []
    try:
        h.wait(on_pty=lambda b: chunks.append(bytes(b)))
    except CommandExitException:
        pass
    out = b"".join(chunks).decode(errors="replace")
    return {"resized": "30 100" in out, "tty": "/dev/pts/" in out}


@step("async_client")
def _():
    async def go():
        a = await AsyncSandbox.connect(sbx.sandbox_id)
        r = await a.commands.run("echo async $FROM_CREATE")
        await a.files.write("async.txt", "from async")
        return {"stdout": r.stdout, "read": await a.files.read("async.txt")}
    return asyncio.run(go())


@step("port")
def _():
    import urllib.request
    import urllib.error
    sbx.commands.run("mkdir -p /tmp/www && echo served-from-vm > /tmp/www/x.txt")
    srv = sbx.commands.run("cd /tmp/www && exec python3 -m http.server 8000", background=True)
    base = os.environ["E2B_SANDBOX_URL"]

    def get(token):
        req = urllib.request.Request(base + "/x.txt", headers={
            "E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "8000",
            "E2B-Traffic-Access-Token": token})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    deadline = time.time() + 60
    status, body = get(sbx.traffic_access_token)
    while status == 502 and time.time() < deadline:  # the server is still starting
        time.sleep(0.5)
        status, body = get(sbx.traffic_access_token)
    bad_status, _ = get("wrong")
    srv.kill()
    return {"status": status, "body": body, "wrong_token": bad_status}


@step("envd_token")
def _():
    """envd refuses a call that knows the sandbox id but not its access token."""
    import urllib.request
    import urllib.error
    base = os.environ["E2B_SANDBOX_URL"]

    def call(path, token, body=None):
        headers = {"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "49983"}
        if body is not None:
            headers["Content-Type"] = "application/json"
        if token is not None:
            headers["X-Access-Token"] = token
        req = urllib.request.Request(base + path, data=body, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code

    listing = "/process.Process/List"
    return {"none": call(listing, None, b"{}"), "wrong": call(listing, "0" * 64, b"{}"),
            "files_wrong": call("/files?path=/etc/hostname", "0" * 64),
            "right": call(listing, sbx._envd_access_token, b"{}")}


@step("files")
def _():
    info = sbx.files.write("dir/a.txt", "content one")
    read = sbx.files.read("dir/a.txt")
    listing = sorted(e.name for e in sbx.files.list("dir"))
    made = sbx.files.make_dir("made/deep")
    made_again = sbx.files.make_dir("made/deep")
    renamed = sbx.files.rename("dir/a.txt", "dir/b.txt")
    exists_old = sbx.files.exists("dir/a.txt")
    exists_new = sbx.files.exists("dir/b.txt")
    owner = sbx.commands.run("stat -c %U /home/user/dir/b.txt").stdout.strip()
    sbx.files.remove("dir")
    exists_dir = sbx.files.exists("dir")
    try:
        sbx.files.read("nope.txt")
        missing = "no error"
    except NotFoundException:
        missing = "NotFoundException"
    binary = bytes(range(256))
    sbx.files.write("/tmp/bin.dat", binary)
    back = sbx.files.read("/tmp/bin.dat", format="bytes")
    return {"write_path": info.path, "read": read, "list": listing, "made": made,
            "made_again": made_again, "renamed_path": renamed.path, "exists_old": exists_old,
            "exists_new": exists_new, "owner": owner, "exists_dir_after_remove": exists_dir,
            "missing": missing, "binary_ok": bytes(back) == binary}


@step("watch_dir")
def _():
    sbx.files.make_dir("wdir")
    w = sbx.files.watch_dir("wdir")
    seen = []

    def wait_for(pred, within=30.0):
        """Reads events until one matches `pred` (bounded); the seconds it took, or None."""
        start = time.time()
        while time.time() - start < within:
            seen.extend(w.get_new_events())
            if any(pred(e) for e in seen):
                return time.time() - start
            time.sleep(0.05)
        return None

    sbx.files.write("wdir/new.txt", "x")
    created = wait_for(lambda e: e.name == "new.txt" and "CREATE" in str(e.type))
    # The append is over when `run` returns: its event must follow promptly (the guest reports
    # it as it happens, not at the next listing).
    sbx.commands.run("printf more >> ~/wdir/new.txt")
    # (files.write lands as a temporary file renamed over new.txt: new.txt's only WRITE is this.)
    wrote = wait_for(lambda e: e.name == "new.txt" and "WRITE" in str(e.type))
    sbx.files.rename("wdir/new.txt", "wdir/moved.txt")
    renamed = wait_for(lambda e: e.name == "new.txt" and "RENAME" in str(e.type))
    moved = wait_for(lambda e: e.name == "moved.txt" and "CREATE" in str(e.type))
    sbx.files.remove("wdir/moved.txt")
    removed = wait_for(lambda e: e.name == "moved.txt" and "REMOVE" in str(e.type))
    w.stop()
    return {"created": created is not None,
            "write_prompt": wrote is not None and wrote < 2.0, "write_latency_s": wrote,
            "renamed": renamed is not None, "moved_created": moved is not None,
            "removed": removed is not None,
            # the agent's temporary file of a whole-file write never shows
            "temp_names": sorted({e.name for e in seen if ".tryboxi-" in e.name}),
            # a rename is not a remove of the old name
            "old_name_removed": any(e.name == "new.txt" and "REMOVE" in str(e.type) for e in seen)}


@step("list")
def _():
    mine = Sandbox.list(query=SandboxQuery(metadata={"suite": "tryboxi-e2e"})).next_items()
    other = Sandbox.list(query=SandboxQuery(metadata={"suite": "no-such"})).next_items()
    import datetime
    now = datetime.datetime.now()
    hour = datetime.timedelta(hours=1)
    by = lambda q: [x.sandbox_id for x in Sandbox.list(query=q).next_items()]
    filters = {"template_base": by(SandboxQuery(template="base")),
               "template_other": by(SandboxQuery(template="code-interpreter-v1")),
               "started_before": by(SandboxQuery(started_after=now - hour)),
               "started_later": by(SandboxQuery(started_after=now + hour))}
    return {"mine": [s.sandbox_id for s in mine], "other": len(other), "filters": filters,
            "state": [str(s.state) for s in mine],
            "metadata": mine[0].metadata if mine else None}


@step("info_timeout")
def _():
    sbx.set_timeout(900)
    info = sbx.get_info()
    return {"template": info.template_id, "running": sbx.is_running(),
            "end_after_start": info.end_at > info.started_at}


@step("pause_connect")
def _():
    sbx.files.write("/tmp/keep.txt", "kept across pause")
    w = sbx.files.watch_dir("/tmp")
    paused = sbx.pause()
    running_while_paused = sbx.is_running()
    again = Sandbox.connect(sbx.sandbox_id)
    kept = again.files.read("/tmp/keep.txt")
    r = again.commands.run("echo back")
    # The watcher's VM went away with the pause: reading it raises (bounded; never a hang).
    watch_error = None
    start = time.time()
    while watch_error is None and time.time() - start < 30:
        try:
            w.get_new_events()
            time.sleep(0.1)
        except Exception as e:
            watch_error = type(e).__name__ + ": " + str(e)[:200]
    return {"paused": paused, "running_while_paused": running_while_paused,
            "kept": kept, "after": r.stdout, "watch_raised": watch_error is not None,
            "watch_error": watch_error}


@step("pause_filesystem")
def _():
    """mode="filesystem" keeps the disk alone: connect boots it afresh (files kept, processes
    gone). A full pause then connect(on_resume="reboot") drops the memory the same way."""
    sleeping = lambda s: any("sleep 600" in " ".join([p.cmd] + list(p.args))
                             for p in s.commands.list())
    sbx.files.write("/home/user/fs.txt", "on disk")
    sbx.commands.run("sleep 600", background=True)
    before = sleeping(sbx)
    paused = sbx.pause(mode="filesystem")
    state = [str(x.state) for x in Sandbox.list().next_items() if x.sandbox_id == sbx.sandbox_id]
    again = Sandbox.connect(sbx.sandbox_id)
    kept = again.files.read("/home/user/fs.txt")
    after_fs = sleeping(again)
    r = again.commands.run("echo rebooted")
    again.commands.run("sleep 600", background=True)
    sbx.pause()
    third = Sandbox.connect(sbx.sandbox_id, on_resume="reboot")
    return {"paused": paused, "state": state, "kept": kept, "sleeping_before": before,
            "sleeping_after_fs": after_fs, "after": r.stdout,
            "sleeping_after_reboot": sleeping(third),
            "kept_after_reboot": third.files.read("/home/user/fs.txt")}


@step("wrong_key")
def _():
    try:
        Sandbox.list(api_key="wrong-key").next_items()
        return "no error"
    except AuthenticationException:
        return "AuthenticationException"


@step("short_timeout")
def _():
    s = Sandbox.create(template="base", timeout=5)
    start = time.time()
    gone = False
    while time.time() - start < 120:
        if not s.is_running():
            gone = True
            break
        time.sleep(1)
    try:
        Sandbox.connect(s.sandbox_id)
        connect = "connected"
    except NotFoundException:
        connect = "NotFoundException"
    except Exception as e:
        connect = type(e).__name__
    return {"gone": gone, "connect_after": connect}


@step("foreign")
def _():
    """A sandbox made with our own API (id in TRYBOXI_NATIVE_ID) is invisible to the E2B face."""
    native = os.environ["TRYBOXI_NATIVE_ID"]
    listed = [s.sandbox_id for s in Sandbox.list().next_items()]
    try:
        Sandbox.connect(native)
        connect = "connected"
    except NotFoundException:
        connect = "NotFoundException"
    return {"listed": native in listed, "kill": Sandbox.kill(native), "connect": connect}


@step("unknown_template")
def _():
    try:
        Sandbox.create(template="no-such-template")
        return {"raised": None}
    except Exception as e:
        return {"raised": type(e).__name__, "lists_ours": "base" in str(e)}


@step("auto_pause")
def _():
    """`on_timeout: pause`: the deadline pauses it; connect resumes it with a fresh deadline.
    Meanwhile two sandboxes exist: list pages of one, and the state filter."""
    s = Sandbox.create(template="base", timeout=5, metadata={"suite": "tryboxi-e2e"},
                       lifecycle={"on_timeout": "pause"})
    pager = Sandbox.list(query=SandboxQuery(metadata={"suite": "tryboxi-e2e"}), limit=1)
    pages = []
    while pager.has_next and len(pages) < 5:
        pages.append([x.sandbox_id for x in pager.next_items()])
    start = time.time()
    state = None
    while time.time() - start < 120:
        st = Sandbox.get_info(s.sandbox_id).state
        state = str(getattr(st, "value", st))
        if state == "paused":
            break
        time.sleep(0.5)
    paused = [x.sandbox_id for x in Sandbox.list(
        query=SandboxQuery(state=[SandboxState.PAUSED])).next_items()]
    again = Sandbox.connect(s.sandbox_id)
    out = again.commands.run("echo resumed").stdout
    info = again.get_info()
    left_s = info.end_at.timestamp() - time.time()
    killed = again.kill()
    return {"state": state, "paused_listed": paused == [s.sandbox_id], "after": out,
            "fresh_deadline": left_s > 60, "deadline_left_s": left_s, "killed": killed,
            "pages": [len(p) for p in pages],
            "paged_all": sorted(sum(pages, [])) == sorted([sbx.sandbox_id, s.sandbox_id])}


SNAP = {}


@step("snapshot")
def _():
    sbx.commands.run("echo before > /home/user/snap.txt")
    snap = sbx.create_snapshot()
    SNAP["id"] = snap.snapshot_id
    r = sbx.commands.run("echo after > /home/user/snap.txt; echo still here").stdout
    listed = [s.snapshot_id for s in
              Sandbox.list_snapshots(sandbox_id=sbx.sandbox_id).next_items()]
    # E2B's snapshot workflow: a new sandbox from the snapshot has the files (and memory) of
    # that instant, not what the source did afterwards.
    child = Sandbox.create(snap.snapshot_id, timeout=600)
    SNAP["child"] = child
    seen = child.commands.run("cat /home/user/snap.txt").stdout
    return {"has_id": bool(snap.snapshot_id), "after": r, "listed": listed == [snap.snapshot_id],
            "child_new": child.sandbox_id not in (sbx.sandbox_id, ""), "child_sees": seen,
            "source_sees": sbx.commands.run("cat /home/user/snap.txt").stdout}


@step("snapshot_filesystem")
def _():
    """create_snapshot(mode="filesystem"): the disk alone; a sandbox made from it boots afresh
    on that disk (the files, not the processes)."""
    sbx.commands.run("echo disk > /home/user/fs-snap.txt")
    sbx.commands.run("sleep 600", background=True)
    snap = sbx.create_snapshot(mode="filesystem")
    child = Sandbox.create(snap.snapshot_id, timeout=600)
    seen = child.commands.run("cat /home/user/fs-snap.txt").stdout
    sleeping = any("sleep 600" in " ".join([p.cmd] + list(p.args))
                   for p in child.commands.list())
    killed = child.kill()
    return {"seen": seen, "child_sleeping": sleeping, "killed": killed,
            "deleted": Sandbox.delete_snapshot(snap.snapshot_id)}


@step("network")
def _():
    """E2B's network options, left running: the Rust side reads the policy each one got."""
    none = Sandbox.create(template="base", allow_internet_access=False)
    only = Sandbox.create(template="base", network={"allow_out": ["example.com"],
                                                    "deny_out": ["0.0.0.0/0"]})
    more = Sandbox.create(template="base", network={"allow_out": ["example.com"]})
    return {"none": none.sandbox_id, "only": only.sandbox_id, "more": more.sandbox_id}


@step("kill_twice")
def _():
    return {"first": sbx.kill(), "second": sbx.kill()}


@step("snapshot_outlives_kill")
def _():
    # The source is killed (above); its snapshot still makes sandboxes, its first child runs
    # on, and deleting the snapshot once they are gone lets the source's files go.
    # Named as E2B names it (`team/name:tag`): the namespace and tag are read past.
    again = Sandbox.create(f"my-team/{SNAP['id']}:default", timeout=600)
    seen = again.commands.run("cat /home/user/snap.txt").stdout
    first = SNAP["child"].commands.run("echo alive").stdout
    listed = [s.snapshot_id for s in Sandbox.list_snapshots().next_items()]
    killed = [again.kill(), SNAP["child"].kill()]
    return {"seen": seen, "first_child": first, "listed": SNAP["id"] in listed,
            "killed": killed, "deleted": Sandbox.delete_snapshot(SNAP["id"]),
            "deleted_again": Sandbox.delete_snapshot(SNAP["id"])}


print(json.dumps(obs))
sys.stdout.flush()
