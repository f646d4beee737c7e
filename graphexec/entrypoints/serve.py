"""`graphexec-serve [overrides]`: the configured model behind an OpenAI-compatible HTTP API.

uvicorn runs with graphexec's protocol and connection options (graphexec/server/uvicorn_setup.py):
a read deadline for request headers and refused bodies (`server.request_read_timeout_s`),
`server.keep_alive_timeout_s`, `server.limit_concurrency`, and a log config that also shows
graphexec's INFO lines.
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
        if run_if_worker(config):  # torchrun, rank != 0: no HTTP front, only rank 0's forwards
            return
        engine = Engine(config=config)
    except GraphexecError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    print(
        f"graphexec-serve: model={engine.config.model.name} capture={engine.config.capture.name} "
        f"on http://{server.host}:{server.port}",
        file=sys.stderr,
    )
    try:
        options = uvicorn_options(server, log_config=log_config(server.log_level))
        uvicorn.run(create_app(engine, server), **options)
    finally:
        engine.shutdown()


def main() -> None:
    import hydra

    hydra.main(version_base=None, config_path=str(config_dir()), config_name="serve")(_run)()


if __name__ == "__main__":
    main()
