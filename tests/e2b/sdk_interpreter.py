"""E2B code interpreter SDK (`e2b-code-interpreter`, sync) scenario against tryboxi's E2B face.

Run by tests/e2b_e2e.rs with E2B_API_URL, E2B_SANDBOX_URL and E2B_API_KEY pointing at a
daemon started with `--e2b`. Unmodified SDK calls only (template `code-interpreter-v1`, the
SDK's default). One sandbox. Prints one JSON object (the observations) on its last stdout
line; the Rust test checks it. A failing step is recorded, not fatal.
"""

import asyncio
import base64
import json
import re
import sys
import time
import traceback

from e2b_code_interpreter import AsyncSandbox, Sandbox

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


if sys.argv[1:] == ["golden"]:
    # Second run, once the golden snapshot is built: the sandbox comes with the server and
    # its kernel running (no server exec of ours in its process list), and create's envs
    # still reach the kernel.
    t0 = time.monotonic()
    g = Sandbox.create(timeout=600, envs={"FROM_CREATE": "g1"})
    try:
        r = g.run_code("import os\nos.environ.get('FROM_CREATE')")
        obs["first_run_s"] = round(time.monotonic() - t0, 1)
        obs["env"] = r.text
        g.run_code("z = 3")
        obs["state"] = g.run_code("z * 2").text
        obs["server_exec"] = any(p.tag == "e2b-code-interpreter" for p in g.commands.list())
    except Exception as e:
        obs["exception"] = f"{type(e).__name__}: {e}"[:500]
    finally:
        obs["kill"] = g.kill()
        print(json.dumps(obs))
    sys.exit(0)

t0 = time.monotonic()
sbx = Sandbox.create(timeout=600, envs={"FROM_CREATE": "c1"})
obs["sandbox_id"] = sbx.sandbox_id


@step("server_exec")
def _():
    # Cold boot: the face started the server as a detached exec.
    return any(p.tag == "e2b-code-interpreter" for p in sbx.commands.list())


@step("state")
def _():
    # The first call waits for the kernel to start (slow under TCG on a loaded machine).
    first = sbx.run_code("x = 1", timeout=300, request_timeout=300)
    # The first call waits for the kernel: how long from create is worth seeing.
    obs["first_run_s"] = round(time.monotonic() - t0, 1)
    second = sbx.run_code("x + 1")
    return {"first_results": len(first.results), "first_error": first.error is not None,
            "text": second.text, "main": [r.is_main_result for r in second.results],
            "count_grows": (second.execution_count or 0) > (first.execution_count or 0)}


@step("stdout")
def _():
    seen = []
    ex = sbx.run_code(
        "import os, sys\nprint('hello', x)\nprint('to err', file=sys.stderr)\n"
        "print(os.environ.get('FROM_CREATE'), os.environ.get('FROM_RUN'), os.getcwd(), "
        "os.getuid() != 0)",
        envs={"FROM_RUN": "r1"}, on_stdout=lambda m: seen.append(m.line))
    after = sbx.run_code("import os\nprint(os.environ.get('FROM_RUN'))")
    return {"stdout": "".join(ex.logs.stdout), "stderr": "".join(ex.logs.stderr),
            "callback": "".join(seen), "env_reset": "".join(after.logs.stdout)}


@step("error")
def _():
    seen = []
    ex = sbx.run_code("def f():\n    raise ValueError('bad value')\nf()",
                      on_error=lambda e: seen.append(e.name))
    e = ex.error
    # IPython colours its tracebacks (ANSI escapes, as E2B's do): look past them.
    plain = re.sub(r"\x1b\[[0-9;]*m", "", e.traceback)
    return {"name": e.name, "value": e.value,
            "traceback_has_f": "----> 3 f()" in plain and "raise ValueError" in plain,
            "callback": seen, "results": len(ex.results)}


@step("rich")
def _():
    html = sbx.run_code(
        "class H:\n    def _repr_html_(self):\n        return '<b>bold</b>'\n"
        "    def __repr__(self):\n        return 'H()'\nH()")
    png = sbx.run_code(
        "import base64\nclass P:\n    def _repr_png_(self):\n"
        "        return base64.b64decode('iVBORw0KGgo=')\nP()")
    shown = sbx.run_code("from IPython.display import display, HTML\n"
                         "display(HTML('<i>shown</i>'))\n7")
    main = [r for r in shown.results if r.is_main_result]
    side = [r for r in shown.results if not r.is_main_result]
    return {"html": html.results[0].html, "text": html.text,
            "png": png.results[0].png, "formats": sorted(html.results[0].formats()),
            "display_html": [r.html for r in side], "display_main": [r.text for r in main]}


@step("chart")
def _():
    ex = sbx.run_code("import matplotlib.pyplot as plt\n"
                      "plt.plot([1, 2, 3], [1, 4, 9])\nplt.title('squares')\nplt.show()")
    pngs = [r.png for r in ex.results if r.png]
    raw = base64.b64decode(pngs[0]) if pngs else b""
    return {"pngs": len(pngs), "is_png": raw[:8] == b"\x89PNG\r\n\x1a\n",
            "big": len(raw) > 1000, "error": ex.error.name if ex.error else None}


@step("contexts")
def _():
    ctx = sbx.create_code_context(cwd="/tmp")
    sbx.run_code("y = 'in ctx'", context=ctx)
    in_ctx = sbx.run_code("import os\n(y, os.getcwd())", context=ctx).text
    # The default context does not see the other context's state.
    default = sbx.run_code("'y' in dir()").text
    listed = [c.id for c in sbx.list_code_contexts()]
    sbx.restart_code_context(ctx)
    after_restart = sbx.run_code("'y' in dir()", context=ctx).text
    sbx.remove_code_context(ctx)
    listed_after = [c.id for c in sbx.list_code_contexts()]
    try:
        sbx.run_code("1", context=ctx)
        removed_raises = None
    except Exception as e:
        removed_raises = type(e).__name__
    return {"cwd": ctx.cwd, "language": ctx.language, "in_ctx": in_ctx, "default": default,
            "listed": ctx.id in listed, "after_restart": after_restart,
            "listed_after": ctx.id in listed_after, "removed_raises": removed_raises}


@step("state_kept")
def _():
    return sbx.run_code("x").text


@step("timeout")
def _():
    # The SDK's timeout closes the request: the server interrupts the cell, so the context
    # is free again at once (not after the sleep).
    t = time.monotonic()
    try:
        sbx.run_code("import time\ntime.sleep(600)", timeout=5)
        raised = None
    except Exception as e:
        raised = type(e).__name__
    after = sbx.run_code("x", timeout=60)
    return {"raised": raised, "after": after.text, "quick": time.monotonic() - t < 60}


@step("async_client")
def _():
    async def go():
        a = await AsyncSandbox.connect(sbx.sandbox_id)
        out = []
        r = await a.run_code("print('async', x)\nx * 10", on_stdout=lambda m: out.append(m.line))
        return {"text": r.text, "stdout": "".join(out)}
    return asyncio.run(go())


@step("server_log")
def _():
    # The server writes its own log file (not the exec stream nobody follows).
    return "ready on port 49999" in sbx.commands.run("cat /tmp/tryboxi-interpreter.log").stdout


@step("fork")
def _():
    # A fork is the VM's memory: its server and kernel (with `x`) run on in the child.
    child = sbx.fork(count=1)[0]
    if isinstance(child, Exception):
        raise child
    try:
        return {"x": child.run_code("x").text, "set": child.run_code("x = 5; x").text,
                "parent_x": sbx.run_code("x").text}
    finally:
        child.kill()


try:
    obs["kill"] = sbx.kill()
finally:
    print(json.dumps(obs))
