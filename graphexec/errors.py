"""Errors graphexec raises.  Bad input gets a ValueError subclass, so callers can catch one type;
failures of the engine itself (a step that raised, a closed engine) are RuntimeErrors.
"""

from __future__ import annotations


class GraphexecError(ValueError):
    """Base class for every error graphexec raises on bad input."""


class InvalidRequestError(GraphexecError):
    """A prompt or a request's sampling parameters are out of range.

    `param` names the offending request field when the raiser knows it (the HTTP server reports
    it as the OpenAI error's `param`); otherwise the message starts with the field name.
    """

    def __init__(self, message: str, *, param: str | None = None):
        super().__init__(message)
        self.param = param


class ConfigError(GraphexecError):
    """A configuration option names something unknown or is out of range."""


class CheckpointError(GraphexecError):
    """A model file or directory is missing or cannot be read."""


class RequestFailedError(RuntimeError):
    """The engine failed while running a request (the request ended; the engine keeps serving)."""


class EngineClosedError(RuntimeError):
    """The engine was shut down and takes no more requests."""


class WorkerFailedError(RequestFailedError):
    """A tensor-parallel rank died or stopped answering (parallel.timeout_s): the engine fails its
    requests with this error and stops; a new engine must be started."""
