"""Typed exceptions for everything a call to the tryboxi daemon can fail with.

Every API error the daemon answers is ``{"error": {"code": ..., "message": ...}}`` with a 4xx/5xx
status (see ``api/openapi.yaml``). :func:`api_error` turns one into the subclass of
:class:`ApiError` named after its ``code`` (or, for a code this SDK does not know yet, after its
status), so callers can write ``except tryboxi.NotFound``.

Hierarchy::

    TryboxiError
    ├── DaemonUnreachable          nothing listens at the socket / URL
    ├── ConfigError                TRYBOXI_URL, token or fingerprint unusable
    ├── ProtocolError              the daemon answered something that is not the API
    │   └── FingerprintMismatch    https: the certificate is not the pinned one
    └── ApiError                   the daemon refused: .status, .code, .message
        ├── BadRequest             400 bad_request, method_not_allowed
        ├── Unauthorized           401 unauthorized (TCP: wrong or missing token)
        ├── Forbidden              403 forbidden (a home folder as workspace, a secret...)
        ├── NotFound               404 not_found
        ├── RequestTimeout         408 timeout
        ├── Conflict               409 conflict
        │   └── NoWorkspace        409 no_workspace
        ├── PayloadTooLarge        413 too_large
        ├── Unprocessable          422 unprocessable
        ├── HostFull (= Busy)      429 host_full
        ├── InternalError          500 internal
        ├── PortNotOpen            502 port_not_open
        ├── Unavailable            503 unavailable, too_many_connections
        ├── NoSpace                507 no_space
        └── ExecError              an exec's ``error`` event (vm_lost, exec_lost...)
"""

from __future__ import annotations

import json
from typing import Dict, Optional, Type

__all__ = [
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
    "api_error",
]


class TryboxiError(Exception):
    """Base of every error this SDK raises."""


class DaemonUnreachable(TryboxiError):
    """Nothing answers at the daemon's address (not started, wrong socket or URL)."""

    def __init__(self, address: str, reason: str) -> None:
        self.address = address
        self.reason = reason
        super().__init__(
            f"cannot reach the tryboxi daemon at {address}: {reason}. "
            "Start it with `tryboxi serve`"
        )


class ConfigError(TryboxiError):
    """The connection settings cannot be used (e.g. plain http off loopback, no token)."""


class ProtocolError(TryboxiError):
    """The daemon's answer is not what the API describes (or the connection broke mid-answer)."""


class FingerprintMismatch(ProtocolError):
    """Over https, the daemon's certificate is not the one ``TRYBOXI_FINGERPRINT`` pins.

    Nothing (in particular not the token) was sent on that connection.
    """

    def __init__(self, got: str) -> None:
        self.got = got
        super().__init__(f"the daemon's certificate is {got}, not the pinned TRYBOXI_FINGERPRINT")


class ApiError(TryboxiError):
    """The daemon answered with an error.

    Attributes:
        status: the HTTP status (0 for an ``error`` event inside an exec stream).
        code: the stable error code (``not_found``, ``conflict``, ``host_full``...).
        message: the daemon's explanation, for people.
    """

    def __init__(self, status: int, code: str, message: str) -> None:
        self.status = status
        self.code = code
        self.message = message
        super().__init__(f"{code}: {message}")


class BadRequest(ApiError):
    """400: the request is malformed or names something invalid."""


class Unauthorized(ApiError):
    """401: over TCP, the bearer token is missing or wrong."""


class Forbidden(ApiError):
    """403: refused on principle (a home folder as workspace, a stored secret's value...)."""


class NotFound(ApiError):
    """404: no such sandbox, exec, snapshot, artifact, secret..."""


class RequestTimeout(ApiError):
    """408: the request body did not arrive in time."""


class Conflict(ApiError):
    """409: the sandbox's state does not allow it now (not ready, has children...)."""


class NoWorkspace(Conflict):
    """409: sync, diff, apply or pull on a sandbox created without a host workspace."""


class PayloadTooLarge(ApiError):
    """413: the request body is over the daemon's limit."""


class Unprocessable(ApiError):
    """422: understood but cannot be done (e.g. a diff over ``sync.max_diff_mib``)."""


class HostFull(ApiError):
    """429: the host's vCPU/memory budget stayed full for the queue timeout."""


#: Another name for :class:`HostFull`.
Busy = HostFull


class InternalError(ApiError):
    """500: the daemon failed; its log says more."""


class PortNotOpen(ApiError):
    """502: nothing listens on that guest port."""


class Unavailable(ApiError):
    """503: no QEMU or no images, a request that can never fit, or too many connections."""


class NoSpace(ApiError):
    """507: the data root's file system is full; nothing was changed."""


class ExecError(ApiError):
    """An exec ended with an ``error`` event instead of ``exit`` (the VM died, the agent was
    lost, a restore replaced the VM...).

    ``stdout``/``stderr`` hold what arrived before it.
    """

    def __init__(self, code: str, message: str, stdout: bytes = b"", stderr: bytes = b"") -> None:
        super().__init__(0, code, message)
        self.stdout = stdout
        self.stderr = stderr


_BY_CODE: Dict[str, Type[ApiError]] = {
    "bad_request": BadRequest,
    "method_not_allowed": BadRequest,
    "unauthorized": Unauthorized,
    "forbidden": Forbidden,
    "not_found": NotFound,
    "timeout": RequestTimeout,
    "conflict": Conflict,
    "no_workspace": NoWorkspace,
    "too_large": PayloadTooLarge,
    "unprocessable": Unprocessable,
    "host_full": HostFull,
    "internal": InternalError,
    "port_not_open": PortNotOpen,
    "unavailable": Unavailable,
    "too_many_connections": Unavailable,
    "no_space": NoSpace,
}

_BY_STATUS: Dict[int, Type[ApiError]] = {
    400: BadRequest,
    401: Unauthorized,
    403: Forbidden,
    404: NotFound,
    405: BadRequest,
    408: RequestTimeout,
    409: Conflict,
    413: PayloadTooLarge,
    422: Unprocessable,
    429: HostFull,
    500: InternalError,
    502: PortNotOpen,
    503: Unavailable,
    507: NoSpace,
}


def api_error(status: int, body: bytes) -> ApiError:
    """The typed error for an error answer: by its ``code``, else by its status.

    A body that is not the error envelope still gives an :class:`ApiError` (code = the status
    as text, message = the body).
    """
    code: Optional[str] = None
    message = body.decode("utf-8", "replace").strip()
    try:
        detail = json.loads(body)["error"]
        if isinstance(detail.get("code"), str):
            code = detail["code"]
            message = str(detail.get("message", ""))
    except (ValueError, TypeError, KeyError, AttributeError):
        pass
    cls = _BY_CODE.get(code or "") or _BY_STATUS.get(status, ApiError)
    return cls(status, code or str(status), message)
