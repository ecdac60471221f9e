"""The API's answers as small typed records (``api/openapi.yaml`` names each schema).

Every record keeps the daemon's JSON in ``raw``, so fields this SDK does not know yet are
still reachable.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

__all__ = [
    "ExecResult",
    "FileChange",
    "DiffReport",
    "ApplyReport",
    "UndoReport",
    "Snapshot",
]

Json = Dict[str, Any]


@dataclass
class ExecResult:
    """How a command ended, with all of its output.

    ``exit_code`` is None when a signal ended it (``signal`` says which) or it timed out.
    ``stdout``/``stderr`` are the output decoded as UTF-8 (undecodable bytes replaced);
    ``stdout_bytes``/``stderr_bytes`` are the exact bytes.
    """

    exit_code: Optional[int]
    signal: Optional[int]
    timed_out: bool
    stdout_bytes: bytes
    stderr_bytes: bytes
    exec_id: Optional[str] = None
    duration_ms: Optional[int] = None

    @property
    def stdout(self) -> str:
        return self.stdout_bytes.decode("utf-8", "replace")

    @property
    def stderr(self) -> str:
        return self.stderr_bytes.decode("utf-8", "replace")

    @property
    def ok(self) -> bool:
        """Exited with status 0."""
        return self.exit_code == 0


@dataclass
class FileChange:
    """One changed file of a diff (``FileChange``)."""

    path: str
    kind: str
    binary: bool
    additions: int
    deletions: int
    patch: Optional[str] = None
    old_path: Optional[str] = None
    raw: Json = field(default_factory=dict, repr=False)

    @classmethod
    def from_json(cls, j: Json) -> "FileChange":
        return cls(
            path=j["path"],
            kind=j["kind"],
            binary=bool(j.get("binary", False)),
            additions=int(j.get("additions", 0)),
            deletions=int(j.get("deletions", 0)),
            patch=j.get("patch"),
            old_path=j.get("old_path"),
            raw=j,
        )


@dataclass
class DiffReport:
    """What changed in the VM since the last sync (``DiffReport``)."""

    files: List[FileChange]
    too_big: List[Json] = field(default_factory=list)
    refused: List[str] = field(default_factory=list)
    raw: Json = field(default_factory=dict, repr=False)

    @classmethod
    def from_json(cls, j: Json) -> "DiffReport":
        return cls(
            files=[FileChange.from_json(f) for f in j.get("files", [])],
            too_big=list(j.get("too_big") or []),
            refused=list(j.get("refused") or []),
            raw=j,
        )

    @property
    def patch(self) -> str:
        """Every text file's unified diff, one after the other."""
        return "".join(
            (f.patch if f.patch.endswith("\n") else f.patch + "\n") for f in self.files if f.patch
        )

    def __bool__(self) -> bool:
        return bool(self.files)


@dataclass
class ApplyReport:
    """What an apply or pull did on the host (``ApplyReport``). ``artifact_id`` undoes it
    (:meth:`tryboxi.Client.undo`); None when nothing on the host changed."""

    artifact_id: Optional[str]
    applied: List[str]
    conflicts: List[str]
    refused: List[str]
    too_big: List[Json] = field(default_factory=list)
    raw: Json = field(default_factory=dict, repr=False)

    @classmethod
    def from_json(cls, j: Json) -> "ApplyReport":
        return cls(
            artifact_id=j.get("artifact_id"),
            applied=list(j.get("applied") or []),
            conflicts=list(j.get("conflicts") or []),
            refused=list(j.get("refused") or []),
            too_big=list(j.get("too_big") or []),
            raw=j,
        )


@dataclass
class UndoReport:
    """What an undo restored and removed (``UndoReport``)."""

    artifact_id: str
    restored: List[str]
    removed: List[str]
    overwritten: List[str] = field(default_factory=list)
    raw: Json = field(default_factory=dict, repr=False)

    @classmethod
    def from_json(cls, j: Json) -> "UndoReport":
        return cls(
            artifact_id=j["artifact_id"],
            restored=list(j.get("restored") or []),
            removed=list(j.get("removed") or []),
            overwritten=list(j.get("overwritten") or []),
            raw=j,
        )


@dataclass
class Snapshot:
    """A checkpoint of a sandbox (``Snapshot``)."""

    id: str
    sandbox_id: str
    name: Optional[str]
    created_at: str
    state_bytes: int
    duration_ms: int
    #: False for a disk-only snapshot (a restore or fork from it boots afresh).
    memory: bool = True
    raw: Json = field(default_factory=dict, repr=False)

    @classmethod
    def from_json(cls, j: Json) -> "Snapshot":
        return cls(
            id=j["id"],
            sandbox_id=j["sandbox_id"],
            name=j.get("name"),
            created_at=j.get("created_at", ""),
            state_bytes=int(j.get("state_bytes", 0)),
            duration_ms=int(j.get("duration_ms", 0)),
            memory=bool(j.get("memory", True)),
            raw=j,
        )
