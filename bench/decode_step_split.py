"""Where a B=1 decode step goes, split at the scheduler / runner boundaries: plan (slots and the
ScheduleBatch), ForwardBatch.init_new, ModelRunner.forward (pad, forward scope, graph, slice) and
logits + sampling.  Medians of 350 steps on one thread, default plan, SmolLM2.

Run it in each checkout to compare two commits side by side (fresh process each, alternated):

    graphexec-bench decode_step_split
"""

from __future__ import annotations

import threading
import time

import torch

from bench.stats import upper_median
from bench.tables import machine_line, table
from graphexec import Engine, SamplingParams
from graphexec.batch.request import Req

STEPS, SKIP = 400, 50


def measure(engine: Engine) -> dict[str, float]:
    runner, scheduler = engine.runner, engine.scheduler
    req = Req("r", list(range(100, 164)), SamplingParams(max_new_tokens=2 * STEPS, ignore_eos=True), (), engine.max_context)
    times: dict[str, list[float]] = {"plan": [], "init_forward_batch": [], "forward": [], "logits_and_sample": []}
    with torch.inference_mode():
        out = runner.forward_and_sample(runner.init_forward_batch(scheduler.plan_extend([req])))
        req.num_computed_tokens = req.seq_len
        req.output_ids.append(int(out.sampler.next_token_ids[0]))
        for step in range(STEPS):
            t0 = time.perf_counter()
            batch = scheduler.plan_decode([req])
            t1 = time.perf_counter()
            fb = runner.init_forward_batch(batch)
            t2 = time.perf_counter()
            hidden = runner.forward(fb)
            t3 = time.perf_counter()
            token = int(runner.sampler(runner.logits_processor(hidden, fb), fb.sampling_info).next_token_ids[0])
            t4 = time.perf_counter()
            req.num_computed_tokens = req.seq_len
            req.output_ids.append(token)
            if step >= SKIP:
                for key, seconds in zip(times, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
                    times[key].append(seconds)
    scheduler.release(req)
    return {key: upper_median(v) * 1e3 for key, v in times.items()}


def main(argv: list[str]) -> None:
    engine = Engine(overrides=["capture.extend.progress=false", "capture.decode.progress=false", "capture.background=false"])
    result: dict[str, float] = {}
    # A thread of its own, as the engine loop runs the model: the main thread loaded and captured
    # on another one, and two live OpenMP teams in one process slow both.
    thread = threading.Thread(target=lambda: result.update(measure(engine)))
    thread.start()
    thread.join()
    print(f"{machine_line()}; medians of {STEPS - SKIP} B=1 steps, ms\n")
    print(table(list(result), [[f"{ms:.3f}" for ms in result.values()]]))
    engine.shutdown()
