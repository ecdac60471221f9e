// E2B code interpreter JS SDK (npm `@e2b/code-interpreter`, unmodified) against tryboxi's E2B
// face, on Node: state kept across runCode calls, the last value as the main result, stdout
// streamed, errors with name/value/traceback, a context of its own.
//
// Run by tests/e2b_e2e.rs (copied next to `node_modules/`) with only E2B_API_URL,
// E2B_SANDBOX_URL and E2B_API_KEY set. Prints one JSON object on its last stdout line.
import { Sandbox } from '@e2b/code-interpreter'

const obs = {}
async function step(name, fn) {
  try {
    obs[name] = await fn()
  } catch (e) {
    obs[name] = { exception: e?.constructor?.name, message: String(e?.message ?? e).slice(0, 500) }
  }
}

const sbx = await Sandbox.create({ envs: { FROM_CREATE: 'j1' }, timeoutMs: 600_000 })
obs.sandbox_id = sbx.sandboxId

await step('state', async () => {
  // The first call waits for the kernel to start in the guest: under TCG on a loaded machine
  // that can take longer than the SDK's default 60 s request timeout (ci12).
  const first = await sbx.runCode('x = 41', { timeoutMs: 300_000, requestTimeoutMs: 300_000 })
  const out = []
  const r = await sbx.runCode('import os\nprint("hi", os.environ.get("FROM_CREATE"))\nx + 1', {
    onStdout: (m) => out.push(m.line),
  })
  return { first_error: first.error ?? null, text: r.text, stdout: r.logs.stdout.join(''), callback: out.join('') }
})

await step('error', async () => {
  const r = await sbx.runCode('def f():\n    raise ValueError("bad js")\nf()')
  // IPython colours its tracebacks (ANSI escapes, as E2B's do): look past them.
  const plain = String(r.error?.traceback ?? '').replace(/\x1b\[[0-9;]*m/g, '')
  return {
    name: r.error?.name,
    value: r.error?.value,
    traceback_has_f: plain.includes('----> 3 f()') && plain.includes('raise ValueError'),
  }
})

await step('context', async () => {
  const ctx = await sbx.createCodeContext({ cwd: '/tmp' })
  const inCtx = await sbx.runCode('import os\nos.getcwd()', { context: ctx })
  const isolated = await sbx.runCode("'x' in globals()", { context: ctx })
  return { cwd: inCtx.text, isolated: isolated.text }
})

await step('kill', async () => await sbx.kill())

console.log(JSON.stringify(obs))
