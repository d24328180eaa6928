"""Domain errors shared by the core, the state tables and the service layer.

They carry no gRPC import: the service layer maps each class to its status code
(``fulcrum.service.errors``). Raise them *before* changing any state, so that a refused
call changes nothing.
"""

from __future__ import annotations


class FulcrumError(Exception):
    """Base class; ``message`` is what the caller sees."""

    code_name = "UNKNOWN"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidArgument(FulcrumError):
    """A field breaks a rule. The message names the field and the rule."""

    code_name = "INVALID_ARGUMENT"

    def __init__(self, field: str, rule: str) -> None:
        super().__init__(f"{field}: {rule}")
        self.field = field
        self.rule = rule


class NotFound(FulcrumError):
    """An id is unknown (or its holder has lapsed)."""

    code_name = "NOT_FOUND"


class AlreadyExists(FulcrumError):
    """An id is taken."""

    code_name = "ALREADY_EXISTS"


class ResourceExhausted(FulcrumError):
    """A configured bound is hit; ``retry_after_ms`` hints when to try again."""

    code_name = "RESOURCE_EXHAUSTED"

    def __init__(self, message: str, retry_after_ms: int = 0) -> None:
        super().__init__(message)
        self.retry_after_ms = retry_after_ms


class FailedPrecondition(FulcrumError):
    """The call does not fit the current state (for example a stale incarnation)."""

    code_name = "FAILED_PRECONDITION"


class Unavailable(FulcrumError):
    """The daemon is draining or the resource is temporarily out of service; retry
    (after ``retry_after_ms`` when set)."""

    code_name = "UNAVAILABLE"

    def __init__(self, message: str, retry_after_ms: int = 0) -> None:
        super().__init__(message)
        self.retry_after_ms = retry_after_ms


class DeadlineExceeded(FulcrumError):
    """The work did not happen in time."""

    code_name = "DEADLINE_EXCEEDED"


class PermissionDenied(FulcrumError):
    """The caller's identity may not do this."""

    code_name = "PERMISSION_DENIED"


class Unauthenticated(FulcrumError):
    """The caller has no valid identity."""

    code_name = "UNAUTHENTICATED"


class Unimplemented(FulcrumError):
    """The call is part of the API but not served by this build."""

    code_name = "UNIMPLEMENTED"
