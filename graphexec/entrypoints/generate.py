"""`graphexec-generate prompt="..." [overrides]`: generate on the configured model and print it."""

from __future__ import annotations

import sys
import time

from omegaconf import DictConfig

from graphexec.config import EngineConfig, config_dir
from graphexec.errors import GraphexecError


def _run(cfg: DictConfig) -> None:
    from graphexec.engine.engine import Engine
    from graphexec.engine.tp_worker import run_if_worker

    prompts = list(cfg.prompts) if cfg.prompts else [cfg.prompt]
    empty = [i for i, p in enumerate(prompts) if p == "" or p is None]
    if empty:
        # Checked here, before the model loads: under chat=true the engine would wrap "" in the chat
        # template and generate a reply to nothing, where a plain empty prompt is refused.
        which = "prompt" if not cfg.prompts else f"prompts[{empty[0]}]"
        print(f"error: {which} is empty: give some text to generate from", file=sys.stderr)
        sys.exit(2)
    try:
        t0 = time.perf_counter()
        config = EngineConfig.from_dictconfig(cfg)
        if run_if_worker(config):  # torchrun, rank != 0: this process serves rank 0's forwards
            return
        print(f"loading {config.model.name} (capture={config.capture.name}) ...", file=sys.stderr, flush=True)
        engine = Engine(config=config)
        t1 = time.perf_counter()
        outputs = engine.generate(prompts, chat=bool(cfg.chat))
        t2 = time.perf_counter()
        engine.shutdown()
    except GraphexecError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    for prompt, out in zip(prompts, outputs):
        print(f"> {prompt}\n{out.text}\n[{out.completion_tokens} tokens, finish_reason={out.finish_reason}]\n")
    new_tokens = sum(o.completion_tokens for o in outputs)
    print(
        f"model={engine.model_config.name} capture={engine.config.capture.name} "
        f"load {t1 - t0:.1f}s, generate {t2 - t1:.2f}s, {new_tokens / (t2 - t1):.1f} tokens/s",
        file=sys.stderr,
    )


def main() -> None:
    import hydra

    hydra.main(version_base=None, config_path=str(config_dir()), config_name="generate")(_run)()


if __name__ == "__main__":
    main()
