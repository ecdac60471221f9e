"""The synchronous client: :class:`Client` (daemon-wide calls) and :class:`Sandbox` (one
sandbox's calls), each a thin, typed layer over one route of ``api/openapi.yaml``.

Every call opens its own connection, so a client may be shared between threads. Exec output is
read from the NDJSON stream as it arrives and handed to the callbacks chunk by chunk.
"""

from __future__ import annotations

import base64
import codecs
import json
import os
from typing import (
    Any,
    Callable,
    Dict,
    Generator,
    Iterator,
    List,
    Mapping,
    Optional,
    Sequence,
    Union,
    cast,
    overload,
)
from urllib.parse import quote

from ._transport import Endpoint, iter_lines
from .errors import ExecError, NotFound, ProtocolError
from .types import ApplyReport, DiffReport, ExecResult, Snapshot, UndoReport

__all__ = ["Client", "Sandbox", "ForkResult", "OutputCallback"]

Json = Dict[str, Any]
#: Receives each chunk of a command's output as text, as it arrives (a multi-byte character
#: split across chunks is passed whole with the later chunk).
OutputCallback = Callable[[str], None]
PathLike = Union[str, "os.PathLike[str]"]


def _seg(s: str) -> str:
    """One path segment (an id), so a hostile id cannot reach another route."""
    return quote(s, safe="")


def _qv(s: str) -> str:
    return quote(s, safe="/")


class Client:
    """A connection to the tryboxi daemon.

    With no arguments it finds the daemon as ``tryboxi`` does: ``TRYBOXI_URL`` (with
    ``TRYBOXI_TOKEN``, and ``TRYBOXI_FINGERPRINT`` for ``https://``) when set, else the unix
    socket ``tryboxi.sock`` in the data root (``$TRYBOXI_HOME``, else ``/var/lib/tryboxi`` as
    root, else ``~/.local/share/tryboxi``).

    Args:
        socket: a unix socket path (wins over the environment).
        url: ``http://127.0.0.1:PORT`` (loopback only) or ``https://HOST:PORT`` (wins over the
            environment); ``token`` and ``fingerprint`` go with it.
        timeout: seconds a single read or write on the connection may take (None: no limit,
            the default, since a create may wait in the host's queue). Exec streams never time
            out on the client side; use ``exec(timeout=...)``.
    """

    def __init__(
        self,
        socket: Optional[PathLike] = None,
        *,
        url: Optional[str] = None,
        token: Optional[str] = None,
        fingerprint: Optional[str] = None,
        timeout: Optional[float] = None,
    ) -> None:
        if socket is not None and url is not None:
            raise ValueError("give a socket or a url, not both")
        if socket is not None:
            self.endpoint = Endpoint.unix(socket)
        elif url is not None:
            self.endpoint = Endpoint.from_url(url, token=token, fingerprint=fingerprint)
        else:
            self.endpoint = Endpoint.from_env()
        self.timeout = timeout

    def __repr__(self) -> str:
        return f"tryboxi.Client({self.endpoint.describe()!r})"

    # -- plumbing -------------------------------------------------------------------------

    def request(self, method: str, path: str, body: Optional[Any] = None) -> Any:
        """One API call: ``body`` sent as JSON, the JSON answer returned (errors raised typed)."""
        data = None if body is None else json.dumps(body).encode()
        conn, resp = self.endpoint.request(method, path, data, timeout=self.timeout)
        try:
            raw = resp.read()
        except OSError as e:
            raise ProtocolError(f"{method} {path}: {e}") from e
        finally:
            conn.close()
        try:
            return json.loads(raw) if raw.strip() else None
        except ValueError as e:
            raise ProtocolError(f"{method} {path}: unexpected reply: {e}") from e

    def stream(
        self, method: str, path: str, body: Optional[Any] = None
    ) -> Generator[Json, None, None]:
        """One NDJSON-streaming call (exec, attach): each line's JSON as soon as it arrives.
        Leaving the iterator early closes the connection (the daemon then ends a command that
        was not started with ``detach``)."""
        data = None if body is None else json.dumps(body).encode()
        headers = {"Accept": "application/x-ndjson"}
        conn, resp = self.endpoint.request(method, path, data, headers=headers, timeout=None)
        try:
            for line in iter_lines(resp, path):
                try:
                    event = json.loads(line)
                except ValueError as e:
                    raise ProtocolError(f"{path}: a line that is not JSON: {e}") from e
                if not isinstance(event, dict):
                    raise ProtocolError(f"{path}: a line that is not a JSON object")
                yield event
        finally:
            conn.close()

    # -- daemon-wide calls ----------------------------------------------------------------

    def health(self) -> Json:
        """``GET /v1/health``: version, pid, data root, accel, sandbox count, capacity."""
        return cast(Json, self.request("GET", "/v1/health"))

    def create(
        self,
        workspace: Optional[PathLike] = None,
        *,
        template: Optional[str] = None,
        network: Union[None, str, Sequence[str], Mapping[str, Any]] = None,
        secrets: Optional[Sequence[str]] = None,
        vcpus: Optional[int] = None,
        memory_mib: Optional[int] = None,
        exclude: Optional[Sequence[str]] = None,
    ) -> "Sandbox":
        """Boot a sandbox; returns when its guest agent answers.

        Args:
            workspace: a host folder synced into ``/workspace`` (and where apply writes back);
                None for a sandbox without a host workspace.
            template: ``auto`` (the daemon's default: by the repo's files), ``base``, ``python``...
            network: the egress policy: preset names (``registries``, ``github``, ``none``) and
                ``HOST|*.SUFFIX|CIDR[:PORTS]`` allow rules, or the ``network`` object itself;
                None for the daemon's default policy.
            secrets: names of stored secrets the sandbox gets (as placeholders).
            vcpus, memory_mib: the VM's size (default: the daemon's).
            exclude: more ``sync.exclude`` patterns for this sandbox's whole life.
        """
        req: Json = {}
        if workspace is not None:
            ws: Json = {"host_path": os.path.abspath(os.fspath(workspace))}
            if exclude:
                ws["exclude"] = list(exclude)
            req["workspace"] = ws
        elif exclude:
            raise ValueError("exclude needs a workspace")
        if template is not None:
            req["template"] = template
        if network is not None:
            if isinstance(network, str):
                req["network"] = {"policy": [network]}
            elif isinstance(network, Mapping):
                req["network"] = dict(network)
            else:
                req["network"] = {"policy": list(network)}
        if secrets:
            req["secrets"] = list(secrets)
        if vcpus is not None:
            req["vcpus"] = vcpus
        if memory_mib is not None:
            req["memory_mib"] = memory_mib
        return Sandbox(self, self.request("POST", "/v1/sandboxes", req))

    def get(self, sandbox_id: str) -> "Sandbox":
        """``GET /v1/sandboxes/{id}`` (:class:`~tryboxi.NotFound` if there is none)."""
        return Sandbox(self, self.request("GET", f"/v1/sandboxes/{_seg(sandbox_id)}"))

    def sandbox(self, sandbox_id: str) -> "Sandbox":
        """A handle on a sandbox by id, without asking the daemon (see :meth:`get`)."""
        return Sandbox(self, {"id": sandbox_id})

    def list(self) -> List["Sandbox"]:
        """Every sandbox of the daemon."""
        return [Sandbox(self, s) for s in self.request("GET", "/v1/sandboxes")["sandboxes"]]

    def undo(
        self, artifact_id: str, *, force: bool = False, within: Optional[Sequence[str]] = None
    ) -> UndoReport:
        """Put back exactly what an apply or pull changed on the host.

        Refused (:class:`~tryboxi.Conflict`) when the host changed one of those files since,
        unless ``force`` (what it overwrites is backed up first). ``within``: host folders the
        undo may touch (:class:`~tryboxi.Forbidden` otherwise).
        """
        req: Json = {"force": force}
        if within:
            req["within"] = [os.path.abspath(p) for p in within]
        path = f"/v1/artifacts/{_seg(artifact_id)}/undo"
        return UndoReport.from_json(self.request("POST", path, req))

    def templates(self) -> List[Json]:
        """The root file systems a sandbox can boot (name, file, size, sha256)."""
        return cast(List[Json], self.request("GET", "/v1/templates")["templates"])


class ForkResult:
    """The children of a fork (iterable like a list of :class:`Sandbox`); ``failed`` says why
    each child that could not be started failed."""

    def __init__(
        self, parent: str, sandboxes: List["Sandbox"], failed: List[str], duration_ms: int
    ) -> None:
        self.parent = parent
        self.sandboxes = sandboxes
        self.failed = failed
        self.duration_ms = duration_ms

    def __iter__(self) -> Iterator["Sandbox"]:
        return iter(self.sandboxes)

    def __len__(self) -> int:
        return len(self.sandboxes)

    @overload
    def __getitem__(self, i: int) -> "Sandbox": ...

    @overload
    def __getitem__(self, i: slice) -> List["Sandbox"]: ...

    def __getitem__(self, i: Union[int, slice]) -> Union["Sandbox", List["Sandbox"]]:
        return self.sandboxes[i]

    def __repr__(self) -> str:
        ids = [s.id for s in self.sandboxes]
        return f"ForkResult(parent={self.parent!r}, sandboxes={ids!r}, failed={self.failed!r})"


class Sandbox:
    """One sandbox: a microVM with the workspace synced into ``/workspace``.

    Use it as a context manager to remove it at the end::

        with client.create("/path/to/repo") as sbx:
            print(sbx.exec("make test").stdout)
    """

    def __init__(self, client: Client, info: Json) -> None:
        self.client = client
        self.info: Json = info
        self.id: str = info["id"]

    def __repr__(self) -> str:
        return f"tryboxi.Sandbox({self.id!r}, state={self.info.get('state')!r})"

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.rm()
        except NotFound:
            pass

    @property
    def _base(self) -> str:
        return f"/v1/sandboxes/{_seg(self.id)}"

    @property
    def state(self) -> Optional[str]:
        """``creating``, ``ready``, ``paused``, ``failed`` or ``removing`` (as last fetched)."""
        return self.info.get("state")

    @property
    def template(self) -> Optional[str]:
        return self.info.get("template")

    @property
    def workspace(self) -> Optional[str]:
        """The host folder, or None for a sandbox without a workspace."""
        ws = self.info.get("workspace")
        return ws.get("host_path") if isinstance(ws, dict) else None

    def refresh(self) -> "Sandbox":
        """Fetch the sandbox's record again."""
        self.info = self.client.request("GET", self._base)
        return self

    # -- commands -------------------------------------------------------------------------

    def exec_events(
        self,
        cmd: Union[str, Sequence[str]],
        *,
        env: Optional[Mapping[str, str]] = None,
        cwd: Optional[str] = None,
        timeout: Optional[float] = None,
        stdin: Union[None, str, bytes] = None,
        user: Optional[str] = None,
    ) -> Generator[Json, None, None]:
        """Run a command and yield its raw ``ExecEvent`` objects as they arrive (``started``,
        ``stdout``/``stderr`` chunks, then ``exit`` or ``error``). Output chunks get a
        ``bytes`` key with the decoded chunk. See :meth:`exec` for the arguments."""
        req: Json = {}
        if isinstance(cmd, str):
            req["cmd"] = cmd
        else:
            argv = list(cmd)
            if not argv or not all(isinstance(a, str) for a in argv):
                raise ValueError("argv must be a non-empty sequence of strings")
            req["argv"] = argv
        if env:
            req["env"] = dict(env)
        if cwd is not None:
            req["cwd"] = cwd
        if timeout is not None:
            req["timeout_s"] = float(timeout)
        if isinstance(stdin, bytes):
            req["stdin_b64"] = base64.b64encode(stdin).decode()
        elif stdin is not None:
            req["stdin"] = stdin
        if user is not None:
            req["user"] = user
        for event in self.client.stream("POST", f"{self._base}/exec", req):
            if event.get("type") in ("stdout", "stderr"):
                event["bytes"] = _chunk(event)
            yield event

    def exec(
        self,
        cmd: Union[str, Sequence[str]],
        *,
        env: Optional[Mapping[str, str]] = None,
        cwd: Optional[str] = None,
        timeout: Optional[float] = None,
        stdin: Union[None, str, bytes] = None,
        user: Optional[str] = None,
        on_stdout: Optional[OutputCallback] = None,
        on_stderr: Optional[OutputCallback] = None,
    ) -> ExecResult:
        """Run a command in the sandbox (after the daemon syncs the workspace into it).

        Args:
            cmd: a shell command line (run by ``/bin/sh -c``) or an argv list.
            env: more environment variables.
            cwd: the working directory (default ``/workspace``).
            timeout: seconds; the command's process group is killed after it
                (``ExecResult.timed_out``).
            stdin: standard input (text or bytes), then EOF.
            user: a user of the guest's ``/etc/passwd`` (default root).
            on_stdout, on_stderr: called with each chunk of output as text as it arrives.

        Returns:
            :class:`ExecResult` with the exit status and all of the output. A non-zero exit is
            not an error; an ``error`` event (the VM died...) raises :class:`~tryboxi.ExecError`.
        """
        out, err = bytearray(), bytearray()
        decoders = {
            "stdout": (codecs.getincrementaldecoder("utf-8")("replace"), on_stdout, out),
            "stderr": (codecs.getincrementaldecoder("utf-8")("replace"), on_stderr, err),
        }
        exec_id: Optional[str] = None
        events = self.exec_events(cmd, env=env, cwd=cwd, timeout=timeout, stdin=stdin, user=user)
        try:
            for event in events:
                kind = event.get("type")
                if kind == "started":
                    exec_id = event.get("exec_id")
                elif kind in decoders:
                    decoder, callback, buf = decoders[kind]
                    chunk: bytes = event["bytes"]
                    buf.extend(chunk)
                    if callback is not None:
                        text = decoder.decode(chunk)
                        if text:
                            callback(text)
                elif kind == "exit":
                    for decoder, callback, _ in decoders.values():
                        rest = decoder.decode(b"", final=True)
                        if rest and callback is not None:
                            callback(rest)
                    return ExecResult(
                        exit_code=event.get("exit_code"),
                        signal=event.get("signal"),
                        timed_out=bool(event.get("timed_out", False)),
                        stdout_bytes=bytes(out),
                        stderr_bytes=bytes(err),
                        exec_id=exec_id,
                        duration_ms=event.get("duration_ms"),
                    )
                elif kind == "error":
                    raise ExecError(
                        str(event.get("code", "error")),
                        str(event.get("message", "")),
                        bytes(out),
                        bytes(err),
                    )
        finally:
            events.close()
        raise ProtocolError("the exec stream ended without an exit or error event")

    # -- workspace ------------------------------------------------------------------------

    def sync(self, exclude: Optional[Sequence[str]] = None) -> Json:
        """Send what changed in the host folder into the VM (also done before every exec);
        the ``SyncReport``."""
        body: Json = {"exclude": list(exclude)} if exclude else {}
        return cast(Json, self.client.request("POST", f"{self._base}/sync", body))

    def diff(self, paths: Optional[Sequence[str]] = None, *, stat: bool = False) -> DiffReport:
        """What changed in the VM since the last sync, by file (unified diffs unless ``stat``);
        ``paths`` narrows it to these repo-relative files or folders."""
        query = ["stat=true"] if stat else []
        query += [f"path={_qv(p)}" for p in paths or []]
        route = f"{self._base}/diff" + ("?" + "&".join(query) if query else "")
        return DiffReport.from_json(self.client.request("GET", route))

    def apply(self, paths: Optional[Sequence[str]] = None) -> ApplyReport:
        """Bring the VM's changes into the host folder (3-way merge where both changed),
        backing up what it overwrites; ``paths`` limits it (default: everything). Undo it with
        ``client.undo(report.artifact_id)``."""
        body: Json = {"paths": list(paths)} if paths else {}
        return ApplyReport.from_json(self.client.request("POST", f"{self._base}/apply", body))

    def pull(self, paths: Sequence[str], *, force: bool = False) -> ApplyReport:
        """Copy these repo-relative paths from the VM to the host (a host file changed since
        the last sync is left alone and listed in ``refused`` unless ``force``)."""
        if isinstance(paths, str):
            paths = [paths]
        if not paths:
            raise ValueError("pull needs at least one path")
        body = {"paths": list(paths), "force": force}
        return ApplyReport.from_json(self.client.request("POST", f"{self._base}/pull", body))

    # -- files in the VM ------------------------------------------------------------------

    def read_file(self, path: str) -> bytes:
        """The content of an absolute path inside the VM (never the host)."""
        j = self.client.request("GET", f"{self._base}/files?path={_qv(path)}")
        if j.get("content_b64") is not None:
            return base64.b64decode(j["content_b64"])
        return str(j.get("content", "")).encode()

    def read_text(self, path: str, encoding: str = "utf-8") -> str:
        """:meth:`read_file`, decoded."""
        return self.read_file(path).decode(encoding)

    def write_file(self, path: str, content: Union[str, bytes], mode: Optional[int] = None) -> None:
        """Write a file inside the VM (atomically; parent folders made; default mode 0644)."""
        body: Json = {"path": path}
        if isinstance(content, bytes):
            body["content_b64"] = base64.b64encode(content).decode()
        else:
            body["content"] = content
        if mode is not None:
            body["mode"] = mode
        self.client.request("PUT", f"{self._base}/files?path={_qv(path)}", body)

    # -- lifecycle ------------------------------------------------------------------------

    def snapshot(self, name: Optional[str] = None, keep_memory: bool = True) -> Snapshot:
        """Checkpoint memory, devices and disk at one instant (the VM runs on).

        ``keep_memory=False`` keeps the disk alone: a restore or fork from it boots afresh."""
        body: Json = {"name": name} if name is not None else {}
        if not keep_memory:
            body["keep_memory"] = False
        return Snapshot.from_json(self.client.request("POST", f"{self._base}/snapshots", body))

    def snapshots(self) -> List[Snapshot]:
        """This sandbox's snapshots, oldest first."""
        j = self.client.request("GET", f"{self._base}/snapshots")
        return [Snapshot.from_json(s) for s in j["snapshots"]]

    def restore(self, snapshot: Union[str, Snapshot]) -> "Sandbox":
        """Replace the VM with one started from a snapshot (by id or name)."""
        ref = snapshot.id if isinstance(snapshot, Snapshot) else snapshot
        self.info = self.client.request("POST", f"{self._base}/restore", {"snapshot": ref})
        return self

    def fork(self, count: int = 1) -> ForkResult:
        """``count`` new sandboxes starting from this one's current state (it keeps running)."""
        j = self.client.request("POST", f"{self._base}/fork", {"count": count})
        return ForkResult(
            parent=j.get("parent", self.id),
            sandboxes=[Sandbox(self.client, s) for s in j.get("sandboxes", [])],
            failed=list(j.get("failed") or []),
            duration_ms=int(j.get("duration_ms", 0)),
        )

    def pause(self, keep_memory: bool = True) -> "Sandbox":
        """Pause to disk (no QEMU runs); any later call resumes it transparently.

        ``keep_memory=False`` keeps the disk alone: the guest writes back its files and powers
        off, and the next start boots afresh on that disk (processes are gone)."""
        body = None if keep_memory else {"keep_memory": False}
        self.info = self.client.request("POST", f"{self._base}/pause", body)
        return self

    def resume(self, reboot: bool = False) -> "Sandbox":
        """Resume a paused sandbox (files and processes as they were).

        ``reboot=True`` boots afresh on its disk instead, dropping its memory state."""
        body = {"reboot": True} if reboot else None
        self.info = self.client.request("POST", f"{self._base}/resume", body)
        return self

    def rm(self) -> None:
        """Stop the VM and delete all of its files (the host folder is untouched)."""
        self.info = self.client.request("DELETE", self._base)

    remove = rm


def _chunk(event: Json) -> bytes:
    if event.get("data") is not None:
        return str(event["data"]).encode()
    if event.get("data_b64") is not None:
        try:
            return base64.b64decode(event["data_b64"], validate=True)
        except ValueError as e:
            raise ProtocolError(f"an output chunk's data_b64 is not base64: {e}") from e
    return b""
