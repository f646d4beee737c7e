"""`graphexec-serve [overrides]`: the configured model behind an OpenAI-compatible HTTP API.

uvicorn runs with graphexec's protocol and connection options (graphexec/server/uvicorn_setup.py):
a read deadline for request headers and refused bodies (`server.request_read_timeout_s`),
`server.keep_alive_timeout_s`, `server.limit_concurrency`, TLS (`server.ssl_*`), and a log config
that also shows graphexec's INFO lines.  API keys are gathered before the model loads, so a bad key
file, or a non-loopback host without a key, fails at once (graphexec/server/api_keys.py).

`parallel.dp_size > 1`: this process is only the front (graphexec/server/front.py); it starts
dp_size replicas, each a graphexec-serve of its own on a loopback port (graphexec/parallel/
replicas.py), routes requests among them and stops them when it exits.  The front checks the keys;
the replicas take only the run's own token.
"""

from __future__ import annotations

import sys

from omegaconf import DictConfig, OmegaConf

from graphexec.config import EngineConfig, config_dir
from graphexec.errors import GraphexecError


def _run(cfg: DictConfig) -> None:
    import uvicorn

    from graphexec.engine.engine import Engine
    from graphexec.engine.tp_worker import run_if_worker
    from graphexec.server.app import create_app
    from graphexec.server.config import ServerConfig
    from graphexec.server.uvicorn_setup import log_config, uvicorn_options

    try:
        server = ServerConfig.from_mapping(OmegaConf.to_container(cfg.server, resolve=True))
        config = EngineConfig.from_dictconfig(cfg)
        if config.parallel.dp_size > 1:
            _check_dp_outside_torchrun()
        if run_if_worker(config):  # torchrun, rank != 0: no HTTP front, only rank 0's forwards
            return
        _check_access(server)
        if config.parallel.dp_size > 1:
            return _run_front(server, config)
        engine = Engine(config=config)
    except GraphexecError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    print(
        f"graphexec-serve: model={engine.config.model.name} capture={engine.config.capture.name} "
        f"on {_scheme(server)}://{server.host}:{server.port}",
        file=sys.stderr,
    )
    try:
        options = uvicorn_options(server, log_config=log_config(server.log_level))
        uvicorn.run(create_app(engine, server), **options)
    finally:
        engine.shutdown()


def _check_access(server) -> None:
    """Gather the keys now (a ConfigError before minutes of loading) and say who can reach us."""
    from graphexec.server.api_keys import exposure_warning, load_keys

    warning = exposure_warning(server, load_keys(server))
    if warning is not None:
        print(f"graphexec-serve: warning: {warning}", file=sys.stderr)


def _scheme(server) -> str:
    return "https" if server.ssl_certfile is not None else "http"


def _check_dp_outside_torchrun() -> None:
    from graphexec.errors import ConfigError
    from graphexec.parallel.launch import from_torchrun

    if from_torchrun() is not None:
        raise ConfigError(
            "parallel.dp_size > 1 starts its replicas itself and cannot run under torchrun; "
            "run graphexec-serve directly (each replica starts its own parallel.tp_size ranks)"
        )


def _run_front(server, config: EngineConfig) -> None:
    """Start the replicas, serve the front until it is stopped, then stop them."""
    import uvicorn
    from hydra.core.hydra_config import HydraConfig

    from graphexec.parallel.replicas import ReplicaSet, ReplicaStartError, threads_per_replica_rank
    from graphexec.parallel.router import Router
    from graphexec.server.api_keys import replica_key_env, replica_token
    from graphexec.server.front import create_front_app
    from graphexec.server.uvicorn_setup import log_config, uvicorn_options

    parallel = config.parallel
    threads = threads_per_replica_rank(parallel.dp_size, parallel.tp_size, parallel.threads_per_rank)
    print(f"graphexec-serve: starting {parallel.dp_size} replicas ({threads} threads per rank)", file=sys.stderr)
    token = replica_token()  # the front checks the clients' keys; the replicas take only this
    try:
        replicas = ReplicaSet.start(
            list(HydraConfig.get().overrides.task), parallel.dp_size, threads, env=replica_key_env(token)
        )
    except ReplicaStartError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(1)
    try:
        router = Router(parallel.dp_size, parallel.dp_affinity_slack)
        app = create_front_app(replicas.urls, router, server, on_shutdown=replicas.stop, replica_token=token)
        print(
            f"graphexec-serve: model={config.model.name} dp_size={parallel.dp_size} (replicas at "
            f"{', '.join(replicas.urls)}) on {_scheme(server)}://{server.host}:{server.port}",
            file=sys.stderr,
        )
        uvicorn.run(app, **uvicorn_options(server, log_config=log_config(server.log_level)))
    finally:
        replicas.stop()  # start-up failed, or already done by the app's shutdown (then a no-op)


def main() -> None:
    import hydra

    from graphexec.parallel.replicas import die_with_front

    die_with_front()  # a data-parallel replica goes when its front goes

    hydra.main(version_base=None, config_path=str(config_dir()), config_name="serve")(_run)()


if __name__ == "__main__":
    main()
