"""Where one decode step goes, two ways.  Any engine override works (after --).

Profile (the default): torch.profiler over the decode backend's forward plus the LM head and
sampler, for a batch of B requests with `--context` tokens of KV each.  Prints the ops by self CPU
time and the step's wall time (profiled steps run slower than unprofiled ones; read the shares).

    graphexec-bench step_profile --batch 1 8 -- capture=eager
    graphexec-bench step_profile --batch 1 8 -- capture.decode.buckets=[1,8]
    graphexec-bench step_profile --batch 1 -- model.weights=dequantize capture=eager

`--split`: a B=1 step split at the scheduler / runner boundaries: plan (slots and the
ScheduleBatch), ForwardBatch.init_new, ModelRunner.forward (pad, forward scope, graph, slice) and
logits + sampling; medians of 350 steps, default plan, SmolLM2.  Run it in each checkout to
compare two commits side by side (fresh process each, alternated):

    graphexec-bench step_profile --split
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from bench.capture import config_without_progress_bars
from bench.stats import upper_median
from bench.tables import machine_line, table
from bench.timing import paired_ms
from graphexec.batch.forward_mode import ForwardMode
from graphexec.engine.threads import call_in_thread

SPLIT_STEPS, SPLIT_SKIP = 400, 50


def _profile(engine, batch: int, context: int, steps: int, rows: int) -> str:
    from bench.decode import decode_batch

    runner = engine.runner
    fb, release = decode_batch(engine, batch, context)
    with torch.inference_mode():
        wall_ms = paired_ms({"step": lambda: runner.forward_and_sample(fb)}, 1, steps)["step"]["median_ms"]
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                runner.forward_and_sample(fb)
    release()
    ops = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)
    backend = runner.backends[ForwardMode.DECODE].name
    return f"B={batch}, backend {backend}: {wall_ms:.2f} ms per step unprofiled (mean of {steps})\n{ops}"


def _split(engine) -> str:
    from graphexec import SamplingParams
    from graphexec.batch.request import Req
    from graphexec.scheduler.hand_batches import HandBatches

    runner, hand = engine.runner, HandBatches(engine.kv_cache)
    params = SamplingParams(max_new_tokens=2 * SPLIT_STEPS, ignore_eos=True)
    req = Req("r", list(range(100, 164)), params, (), engine.max_context)
    times: dict[str, list[float]] = {"plan": [], "init_forward_batch": [], "forward": [], "logits_and_sample": []}
    with torch.inference_mode():
        prefill = hand.extend([req])
        out = runner.forward_and_sample(runner.init_forward_batch(prefill))
        hand.ran(prefill, out.sampler.next_token_ids[:1].tolist())
        for step in range(SPLIT_STEPS):
            t0 = time.perf_counter()
            batch = hand.decode([req])
            t1 = time.perf_counter()
            fb = runner.init_forward_batch(batch)
            t2 = time.perf_counter()
            hidden = runner.forward(fb)
            t3 = time.perf_counter()
            token = int(runner.sampler(runner.logits_processor(hidden, fb), fb.sampling_info).next_token_ids[0])
            t4 = time.perf_counter()
            hand.ran(batch, [token])
            if step >= SPLIT_SKIP:
                for key, seconds in zip(times, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
                    times[key].append(seconds)
    hand.release(req)
    return (f"medians of {SPLIT_STEPS - SPLIT_SKIP} B=1 steps, ms\n\n"
            + table(list(times), [[f"{upper_median(v) * 1e3:.3f}" for v in times.values()]]))


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--split", action="store_true", help="time a B=1 step's four parts instead of profiling")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rows", type=int, default=18)
    parser.add_argument("overrides", nargs="*", help="engine overrides, after --")
    args = parser.parse_args(argv)
    from graphexec import Engine

    overrides = list(args.overrides)
    if "capture=eager" not in overrides and not args.split:  # capture only the profiled buckets
        overrides.append(f"capture.decode.buckets=[{','.join(str(b) for b in sorted(set(args.batch)))}]")
    engine = Engine(config=config_without_progress_bars(overrides))
    print(machine_line(), flush=True)
    # On a thread that ends, as the engine loop runs the model: the main thread loaded and
    # captured on another one, and two live OpenMP teams in one process slow both.
    jobs = [lambda: _split(engine)] if args.split else [
        lambda batch=batch: _profile(engine, batch, args.context, args.steps, args.rows) for batch in args.batch]
    for job in jobs:
        print(call_in_thread(job), flush=True)
    engine.shutdown()
