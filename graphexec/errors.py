"""Errors raised for bad input.  All are ValueError subclasses so callers can catch one type."""


class GraphexecError(ValueError):
    """Base class for every error graphexec raises on bad input."""


class InvalidRequestError(GraphexecError):
    """A prompt or a request's sampling parameters are out of range."""


class ConfigError(GraphexecError):
    """A configuration option names something unknown or is out of range."""


class CheckpointError(GraphexecError):
    """A model file or directory is missing or cannot be read."""
