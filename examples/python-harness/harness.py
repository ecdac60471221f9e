#!/usr/bin/env python3
"""An agent harness loop on the tryboxi Python SDK (standard library only).

It does what an agent harness does with a sandbox: boot one from a repo, run the tests in the
VM, let the "agent" change files there (here: an optional ``--fix`` command stands in for the
model's edits), run the tests again, show the diff, and bring the change back to the repo only
when asked (``--apply``, or a yes at the prompt), printing the artifact id that undoes it.

    python3 examples/python-harness/harness.py --repo ~/src/app --test 'make test'
    python3 examples/python-harness/harness.py --repo ~/src/app --test 'pytest -q' \\
        --fix 'sed -i s/old/new/ app.py' --apply
    python3 examples/python-harness/harness.py --undo art_0123456789abcdef

Reaches the daemon as ``tryboxi`` does (``TRYBOXI_HOME``'s socket, or ``TRYBOXI_URL`` +
``TRYBOXI_TOKEN``). Uses the installed ``tryboxi`` package (``pip install ./sdk/python``); run
from a checkout without installing, it takes the package from ``sdk/python/src``.

Exit status: 0 when the tests pass (whether or not the change was applied), 1 when they still
fail, 2 for bad arguments, 3 when the daemon cannot be reached, 4 for another API error.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, List, Optional, TextIO

try:
    import tryboxi
except ImportError:  # a checkout, not installed: use the SDK next door
    sys.path.insert(
        0,
        os.path.join(
            os.path.dirname(os.path.abspath(__file__)), "..", "..", "sdk", "python", "src"
        ),
    )
    import tryboxi


def _write(stream: TextIO) -> Callable[[str], None]:
    def out(text: str) -> None:
        stream.write(text)
        stream.flush()

    return out


def run_step(
    sbx: "tryboxi.Sandbox", title: str, cmd: str, timeout: Optional[float]
) -> "tryboxi.ExecResult":
    """Run one command in the VM, its output streamed to ours as it comes."""
    print(f"== {title}: {cmd}", flush=True)
    result = sbx.exec(
        cmd, timeout=timeout, on_stdout=_write(sys.stdout), on_stderr=_write(sys.stderr)
    )
    if result.timed_out:
        status = "timed out"
    elif result.exit_code is None:
        status = f"killed by signal {result.signal}"
    else:
        status = f"exit {result.exit_code}"
    print(f"-- {title}: {status} ({result.duration_ms} ms)", flush=True)
    return result


def show_diff(diff: "tryboxi.DiffReport") -> None:
    for f in diff.files:
        print(f"   {f.kind:<12} {f.path} (+{f.additions} -{f.deletions})")
    for r in diff.refused:
        print(f"   refused      {r}")
    for t in diff.too_big:
        print(f"   too big      {t.get('path')} ({t.get('size')} bytes)")
    if diff.patch:
        print(diff.patch, end="")


def want_apply(args: argparse.Namespace, repo: str) -> bool:
    if args.apply:
        return True
    if args.no_apply:
        return False
    if not sys.stdin.isatty():
        print("not applying (no terminal to ask; pass --apply)")
        return False
    answer = input(f"apply these changes to {repo}? [y/N] ")
    return answer.strip().lower() in ("y", "yes")


def loop(args: argparse.Namespace) -> int:
    client = tryboxi.Client()
    repo = os.path.abspath(args.repo)
    sbx = client.create(repo, template=args.template, network=args.network or None)
    print(f"sandbox: {sbx.id} (template {sbx.template}, {repo} at /workspace)", flush=True)
    try:
        passed = False
        for round_no in range(1, args.rounds + 1):
            result = run_step(sbx, f"tests, round {round_no}", args.test, args.timeout)
            if result.ok:
                passed = True
                break
            if not args.fix or round_no == args.rounds:
                break
            run_step(sbx, "fix", args.fix, args.timeout)
        print(f"tests: {'passed' if passed else 'failed'}", flush=True)

        diff = sbx.diff()
        if not diff:
            print("diff: no changes in the sandbox")
            return 0 if passed else 1
        print(f"diff: {len(diff.files)} file(s) changed in the sandbox")
        show_diff(diff)
        if not passed:
            print("not applying: the tests do not pass")
            return 1
        if not want_apply(args, repo):
            return 0
        report = sbx.apply()
        for p in report.applied:
            print(f"applied: {p}")
        for p in report.conflicts:
            print(f"conflict (merged with markers): {p}")
        for p in report.refused:
            print(f"refused: {p}")
        if report.artifact_id:
            print(f"artifact: {report.artifact_id}")
            art = report.artifact_id
            print(f"undo with: {sys.argv[0]} --undo {art}   (or: tryboxi undo {art})")
        else:
            print("artifact: none (nothing on the host changed)")
        return 0
    finally:
        if args.keep:
            print(f"kept: {sbx.id}")
        else:
            sbx.rm()


def undo(artifact: str) -> int:
    report = tryboxi.Client().undo(artifact)
    for p in report.restored:
        print(f"restored: {p}")
    for p in report.removed:
        print(f"removed: {p}")
    return 0


def parse(argv: Optional[List[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repo", help="the host folder to work on (synced into /workspace)")
    p.add_argument("--test", help="the test command, run by /bin/sh -c in /workspace")
    p.add_argument(
        "--fix", help="a command run when the tests fail (the agent's edit), then the tests again"
    )
    p.add_argument("--rounds", type=int, default=3, help="test runs at most (default 3)")
    p.add_argument("--timeout", type=float, default=600, help="seconds per command (default 600)")
    p.add_argument("--template", default=None, help="template (default: auto, by the repo's files)")
    p.add_argument("--network", action="append", help="egress rule or preset (repeatable)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--apply", action="store_true", help="apply the diff without asking")
    g.add_argument("--no-apply", action="store_true", help="never apply")
    p.add_argument(
        "--keep", action="store_true", help="leave the sandbox running (its id is printed)"
    )
    p.add_argument("--undo", metavar="ART", help="undo an earlier apply and exit")
    args = p.parse_args(argv)
    if args.undo is None and (not args.repo or not args.test):
        p.error("--repo and --test are required (or --undo ART)")
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    return args


def main(argv: Optional[List[str]] = None) -> int:
    args = parse(argv)
    try:
        return undo(args.undo) if args.undo else loop(args)
    except tryboxi.DaemonUnreachable as e:
        print(f"error: {e}", file=sys.stderr)
        return 3
    except tryboxi.TryboxiError as e:
        print(f"error: {e}", file=sys.stderr)
        return 4


if __name__ == "__main__":
    sys.exit(main())
