"""What structured output costs per decode step, at batch sizes B, on the configured model:

1. the work itself, replayed outside the engine: for each step of real constrained outputs, fill
   the bitmask for B matchers, apply it to [B, V] logits and accept the sampled tokens (what
   the sampler and Req.append_token add to a step): as the sampler does it (on CPU, numpy
   unpacks each row), and with the torch unpack + masked_fill path other devices take;
2. through the engine: B greedy requests held to JSON schemas against the same prompts
   unconstrained for the same number of tokens (ignore_eos), paired rounds, median time per
   output token after the first (TPOT).

`--workload` picks the constraint: `json` (a JSON schema per request), `tools` (a named tool call
in the Hermes format, the function's parameters being those schemas, prompts listing the tools
as the server's injected prompt does: graphexec/server/tool_grammar.py's forced grammar) or
`tools_auto` (tool_choice auto with strict functions: free text under the lazy grammar, which
holds a call only once the model opens one).

    graphexec-bench structured_cost --batch 1 8 --rounds 7
    graphexec-bench structured_cost --workload tools --batch 1 8 --rounds 7
    OMP_NUM_THREADS=1 graphexec-bench structured_cost --batch 1 8 --rounds 7 -- capture=eager
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.stats import median
from bench import tables
from graphexec import Engine, SamplingParams
from graphexec.structured.spec import StructuredSpec
from graphexec.structured.token_bitmask import TokenBitmask

_STR = {"type": "string", "maxLength": 24}
_SCHEMAS = [
    {"type": "object", "properties": {"name": _STR, "age": {"type": "integer", "minimum": 0, "maximum": 120}, "city": _STR}, "required": ["name", "age", "city"]},
    {"type": "object", "properties": {"title": _STR, "tags": {"type": "array", "items": _STR, "minItems": 2, "maxItems": 3}}, "required": ["title", "tags"]},
    {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "reason": _STR, "score": {"type": "number", "minimum": 0, "maximum": 10}}, "required": ["answer", "reason", "score"]},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {"id": {"type": "integer"}, "email": _STR}, "required": ["id", "email"]}, "active": {"type": "boolean"}}, "required": ["user", "active"]},
]
_TOPICS = ["a person", "a book", "a yes/no question", "a user account", "a city", "a film", "a recipe", "a car"]


def _tool_workload(engine: Engine, batch: int, max_new_tokens: int, auto: bool) -> tuple[list[list[int]], list[SamplingParams]]:
    """Each request offers the four schemas as strict functions, listed in the system prompt as
    the server lists them for a template that ignores tools, and, unless `auto`, names one."""
    from graphexec.server.tool_parsers import HERMES
    from graphexec.server.tool_prompt import tools_system_prompt
    from graphexec.server.tools import ToolChoice, ToolSpec, tool_constraint

    tools = [ToolSpec(f"record_{i}", f"Record {_TOPICS[i]}", schema, strict=True) for i, schema in enumerate(_SCHEMAS)]
    system = {"role": "system", "content": tools_system_prompt([t.definition() for t in tools], HERMES)}
    prompts, params = [], []
    for i in range(batch):
        tool = tools[i % len(tools)]
        ask = {"role": "user", "content": f"Record {_TOPICS[i % len(_TOPICS)]} with {tool.name}."}
        prompts.append(engine.encode_chat([system, ask]))
        choice = ToolChoice("auto") if auto else ToolChoice("function", tool.name)
        params.append(SamplingParams(max_new_tokens=max_new_tokens, structured=tool_constraint(tools, choice, False, HERMES)))
    return prompts, params


def _workload(batch: int, max_new_tokens: int) -> tuple[list[str], list[SamplingParams]]:
    prompts = [f"Reply with a JSON record about {_TOPICS[i % len(_TOPICS)]}." for i in range(batch)]
    params = [
        SamplingParams(max_new_tokens=max_new_tokens, structured=StructuredSpec.json_schema(_SCHEMAS[i % len(_SCHEMAS)]))
        for i in range(batch)
    ]
    return prompts, params


def replay_us(engine: Engine, params: list[SamplingParams], outputs: list[list[int]], mode: str) -> float:
    """µs per step of fill + apply + accept, averaged over the outputs' steps (a row leaves the
    batch when its output ends, as in the engine); the best of 5 passes, since on a shared
    machine the least disturbed pass is the closest to the work's own cost."""
    backend = engine.grammar_backend()
    vocab = engine.model_config.vocab_size
    sequences = outputs
    bitmask = TokenBitmask(vocab, len(params), unpack="auto" if mode == "default" else "torch")
    logits = torch.randn(len(params), vocab)
    passes = []
    for _ in range(5):
        times = []
        grammars = [backend.matcher(p.structured) for p in params]
        for step in range(max(map(len, sequences))):
            live = [g if step < len(s) else None for g, s in zip(grammars, sequences)]
            work = logits.clone()
            t0 = time.perf_counter()
            bitmask.apply(work, live)  # what the sampler runs (mode "default") or the device way
            for grammar, sequence in zip(live, sequences):
                if grammar is not None:
                    assert grammar.accept(sequence[step])
            times.append(time.perf_counter() - t0)
        passes.append(statistics.mean(times))
    return min(passes) * 1e6


def engine_tpot_ms(engine: Engine, prompts: list[str] | list[list[int]], params: list[SamplingParams], rounds: int) -> tuple[tuple[float, float], tuple[float, float], list[list[int]]]:
    """TPOT (ms) constrained and unconstrained for the same token counts, in paired rounds: for
    each side the median over rounds of a round's median, and the best round (on a shared
    machine the best round is the least disturbed one)."""
    constrained = engine.generate(prompts, params, chat=True)  # warm: grammars compiled, caches hot
    # An output that ended by its grammar sampled EOS last; one cut at max_new_tokens did not.
    eos = engine.model_config.eos_token_ids[0]
    outputs = [o.token_ids + ([eos] if o.finish_reason == "stop" else []) for o in constrained]
    free = [SamplingParams(max_new_tokens=len(ids), ignore_eos=True) for ids in outputs]
    with_grammar, without = [], []
    for _ in range(rounds):
        with_grammar.append(median(o.tpot for o in engine.generate(prompts, params, chat=True) if o.tpot))
        without.append(median(o.tpot for o in engine.generate(prompts, free, chat=True) if o.tpot))

    def summary(values: list[float]) -> tuple[float, float]:
        return median(values) * 1e3, min(values) * 1e3

    return summary(with_grammar), summary(without), outputs


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workload", choices=["json", "tools", "tools_auto"], default="json")
    parser.add_argument("overrides", nargs="*", help="engine overrides (after --)")
    args = parser.parse_args(argv)
    with Engine(overrides=[*args.overrides, "++capture.background=false"]) as engine:  # graphs before timing
        print(tables.machine_line() + "\n")
        print(tables.header(["B", "fill + apply + accept µs/step: default (numpy on CPU) / torch unpack",
                      "TPOT constrained ms: median / best round", "TPOT unconstrained ms: median / best round",
                      "overhead (medians)"]))
        for batch in args.batch:
            if args.workload == "json":
                prompts, params = _workload(batch, args.max_new_tokens)
            else:
                prompts, params = _tool_workload(engine, batch, args.max_new_tokens, auto=args.workload == "tools_auto")
            constrained_ms, free_ms, outputs = engine_tpot_ms(engine, prompts, params, args.rounds)
            replays = [replay_us(engine, params, outputs, mode) for mode in ("default", "unpack")]
            overhead = (constrained_ms[0] / free_ms[0] - 1) * 100
            print(tables.row([batch, " / ".join(f"{us:.0f}" for us in replays), f"{constrained_ms[0]:.2f} / {constrained_ms[1]:.2f}",
                       f"{free_ms[0]:.2f} / {free_ms[1]:.2f}", f"{overhead:+.1f} %"]), flush=True)
