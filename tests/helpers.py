"""Small tools shared by the engine-loop and server tests."""

import contextlib
import socket
import threading
import time


def wait_until(condition, timeout: float = 15.0, what: str = "condition") -> None:
    """Poll `condition` (the engine loop works on its own thread) until true or fail."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.01)


@contextlib.contextmanager
def before_each_step(engine, hook):
    """Call `hook(fb)` on the engine's thread before every forward while inside the block."""
    real = engine.runner.forward_and_sample

    def hooked(fb):
        hook(fb)
        return real(fb)

    engine.runner.forward_and_sample = hooked
    try:
        yield
    finally:
        del engine.runner.forward_and_sample


@contextlib.contextmanager
def slowed(engine, seconds: float = 0.005):
    """Every step takes at least `seconds`, so a long request is still running when a test
    acts on it, however fast or loaded the machine is."""
    with before_each_step(engine, lambda fb: time.sleep(seconds)):
        yield


@contextlib.contextmanager
def paused(engine):
    """Steps wait until the block exits: requests pile up in a known state."""
    gate = threading.Event()
    try:
        with before_each_step(engine, lambda fb: gate.wait()):
            yield
    finally:
        gate.set()


def server_defaults() -> dict:
    """configs/server/default.yaml as a plain dict: the options graphexec-serve starts with."""
    from omegaconf import OmegaConf

    from graphexec.config import config_dir

    return OmegaConf.to_container(OmegaConf.load(config_dir() / "server" / "default.yaml"))


def server_config(**changes):
    """Test servers: the shipped defaults on loopback, a free port, quiet logs."""
    from graphexec.server.config import ServerConfig

    test = {"host": "127.0.0.1", "port": 0, "max_queued_requests": 64, "log_level": "warning"}
    return ServerConfig.from_mapping(server_defaults() | test | changes)


class ServerThread:
    """uvicorn serving `app` on 127.0.0.1 at a free port, in a background thread of the test,
    with graphexec-serve's protocol and options (the app's `server_config`; `overrides` win)."""

    def __init__(self, app, **overrides):
        import uvicorn

        from graphexec.server.uvicorn_setup import uvicorn_options

        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.bind(("127.0.0.1", 0))
        self.port = self._socket.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, **uvicorn_options(app.state.server_config, **overrides)))
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self._socket]}, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "ServerThread":
        self._thread.start()
        wait_until(lambda: self.server.started, what="uvicorn to start")
        return self

    def __exit__(self, *exc_info) -> None:
        self.server.should_exit = True
        self._thread.join(10)
        self._socket.close()


@contextlib.contextmanager
def recorded_batches(engine):
    """Yields a list that receives every ForwardBatch the runner runs while inside the block."""
    batches = []
    with before_each_step(engine, batches.append):
        yield batches
