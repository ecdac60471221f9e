"""tryboxi: a Python client for the tryboxi daemon (disposable QEMU microVM sandboxes).

Standard library only. Talks HTTP/JSON to the daemon over its unix socket, or over TCP with
``TRYBOXI_URL`` + ``TRYBOXI_TOKEN`` (and ``TRYBOXI_FINGERPRINT`` for https)::

    import tryboxi

    client = tryboxi.Client()
    with client.create("/path/to/repo") as sbx:
        result = sbx.exec("make test", on_stdout=print)
        print(sbx.diff().patch)
        report = sbx.apply()
        print("undo with", report.artifact_id)

The contract is the daemon's ``api/openapi.yaml``; errors are raised as the subclasses of
:class:`ApiError` in :mod:`tryboxi.errors`.
"""

from ._transport import Endpoint, data_root
from .client import Client, ForkResult, OutputCallback, Sandbox
from .errors import (
    ApiError,
    BadRequest,
    Busy,
    ConfigError,
    Conflict,
    DaemonUnreachable,
    ExecError,
    FingerprintMismatch,
    Forbidden,
    HostFull,
    InternalError,
    NoSpace,
    NotFound,
    NoWorkspace,
    PayloadTooLarge,
    PortNotOpen,
    ProtocolError,
    RequestTimeout,
    TryboxiError,
    Unauthorized,
    Unavailable,
    Unprocessable,
)
from .types import ApplyReport, DiffReport, ExecResult, FileChange, Snapshot, UndoReport

__version__ = "0.1.0"

__all__ = [
    "Client",
    "Sandbox",
    "ForkResult",
    "OutputCallback",
    "Endpoint",
    "data_root",
    "ExecResult",
    "FileChange",
    "DiffReport",
    "ApplyReport",
    "UndoReport",
    "Snapshot",
    "TryboxiError",
    "DaemonUnreachable",
    "ConfigError",
    "ProtocolError",
    "FingerprintMismatch",
    "ApiError",
    "BadRequest",
    "Unauthorized",
    "Forbidden",
    "NotFound",
    "RequestTimeout",
    "Conflict",
    "NoWorkspace",
    "PayloadTooLarge",
    "Unprocessable",
    "HostFull",
    "Busy",
    "InternalError",
    "PortNotOpen",
    "Unavailable",
    "NoSpace",
    "ExecError",
]
