// E2B JS SDK (npm `e2b`, unmodified) scenario against tryboxi's E2B face, on Node.
//
// Run by tests/e2b_e2e.rs with E2B_API_URL, E2B_SANDBOX_URL and E2B_API_KEY pointing at a daemon
// started with `--e2b`; `cargo xtask deps` installs the pinned SDK under `_out/e2b-node/`
// (NODE_PATH is not used: the test runs this file with that directory as the module root).
// Prints one JSON object (the observations) on its last stdout line.
import { Sandbox, CommandExitError } from 'e2b'

const obs = {}
async function step(name, fn) {
  try {
    obs[name] = await fn()
  } catch (e) {
    obs[name] = { exception: e?.constructor?.name, message: String(e?.message ?? e).slice(0, 500) }
  }
}

const sbx = await Sandbox.create('base', {
  envs: { FROM_CREATE: 'c1' },
  metadata: { suite: 'tryboxi-js', run: String(process.pid) },
  timeoutMs: 600_000,
})
obs.sandbox_id = sbx.sandboxId

await step('run', async () => {
  const out = []
  const r = await sbx.commands.run('echo hi $FROM_CREATE; id -un; pwd', { onStdout: (d) => out.push(d) })
  return { stdout: r.stdout, exit_code: r.exitCode, cb_out: out.join('') }
})

await step('exit_code', async () => {
  try {
    await sbx.commands.run('echo before; exit 3')
    return { raised: false }
  } catch (e) {
    return { raised: e instanceof CommandExitError, exit_code: e.exitCode, stdout: e.stdout }
  }
})

await step('background_stdin', async () => {
  const h = await sbx.commands.run('read x; echo got $x', { background: true, stdin: true })
  await sbx.commands.sendStdin(h.pid, 'hello\n')
  const r = await h.wait()
  return { stdout: r.stdout }
})

await step('files', async () => {
  await sbx.files.write('js/a.txt', 'content js')
  const read = await sbx.files.read('js/a.txt')
  const list = (await sbx.files.list('js')).map((e) => e.name)
  const exists = await sbx.files.exists('js/a.txt')
  await sbx.files.remove('js')
  return { read, list, exists, gone: !(await sbx.files.exists('js')) }
})

await step('watch_dir', async () => {
  await sbx.files.makeDir('jw')
  const events = []
  const w = await sbx.files.watchDir('jw', (ev) => events.push(ev))
  const is = (e, name, kind) => e.name === name && String(e.type).toLowerCase().includes(kind)
  // Waits (bounded) until an event matches; the milliseconds it took, or null.
  const waitFor = async (pred) => {
    const start = Date.now()
    while (Date.now() - start < 30_000) {
      if (events.some(pred)) return Date.now() - start
      await new Promise((r) => setTimeout(r, 20))
    }
    return null
  }
  await sbx.files.write('jw/new.txt', 'x')
  const created = await waitFor((e) => is(e, 'new.txt', 'create'))
  await sbx.files.rename('jw/new.txt', 'jw/moved.txt')
  const renamed = await waitFor((e) => is(e, 'new.txt', 'rename'))
  const moved = await waitFor((e) => is(e, 'moved.txt', 'create'))
  await w.stop()
  return {
    created: created !== null,
    renamed: renamed !== null,
    moved_created: moved !== null,
    rename_ms: renamed,
    rename_prompt: renamed !== null && renamed < 2000,
  }
})

await step('list', async () => {
  const page = await Sandbox.list({ query: { metadata: { suite: 'tryboxi-js' } } }).nextItems()
  return { mine: page.map((s) => s.sandboxId) }
})

await step('snapshot', async () => {
  // Sandbox.create(snapshotId): the snapshot's files, not what the source did afterwards.
  await sbx.commands.run('echo js-before > /home/user/s.txt')
  const snap = await sbx.createSnapshot()
  await sbx.commands.run('echo js-after > /home/user/s.txt')
  const child = await Sandbox.create(snap.snapshotId, { timeoutMs: 600_000 })
  const seen = (await child.commands.run('cat /home/user/s.txt')).stdout
  const listed = (await Sandbox.listSnapshots({ sandboxId: sbx.sandboxId }).nextItems())
    .map((s) => s.snapshotId)
  const killed = await child.kill()
  const deleted = await Sandbox.deleteSnapshot(snap.snapshotId)
  const deletedAgain = await Sandbox.deleteSnapshot(snap.snapshotId)
  return { seen, listed: listed.length === 1 && listed[0] === snap.snapshotId, killed, deleted,
    deleted_again: deletedAgain }
})

await step('kill', async () => ({ first: await sbx.kill(), second: await Sandbox.kill(sbx.sandboxId) }))

console.log(JSON.stringify(obs))
