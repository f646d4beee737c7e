"""The one error capture/ raises for bad options; the message names the option by its config path.

capture/ is a library: its callers (graphexec's ModelRunner) turn this into their own error type.
"""


class CaptureConfigError(ValueError):
    """A capture option is invalid, or asks for something this device cannot do."""
