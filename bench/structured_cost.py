"""What structured output costs per decode step, at batch sizes B, on the configured model:

1. the work itself, replayed outside the engine over real constrained outputs: per step, fill the
   bitmask for B matchers, apply it to [B, V] logits and accept the sampled tokens (what the
   sampler and Req.append_token add), as the sampler does it (on CPU, numpy unpacks each row) and
   with the torch unpack + masked_fill path other devices take;
2. through the engine: the median time per output token after the first (TPOT) of B greedy
   requests held to JSON schemas against the same prompts unconstrained for as many tokens
   (ignore_eos), in paired rounds.

`--workload` picks the constraint: `json` (a JSON schema per request), `tools` (a named tool call
in the Hermes format over those schemas, the tools listed in the prompt as the server injects
them: graphexec/server/tool_grammar.py's forced grammar) or `tools_auto` (tool_choice auto with
strict functions: free text under the lazy grammar, which holds a call only once the model opens
one).

    graphexec-bench structured_cost --batch 1 8 --rounds 7
    graphexec-bench structured_cost --workload tools --batch 1 8 --rounds 7
    OMP_NUM_THREADS=1 graphexec-bench structured_cost --batch 1 8 --rounds 7 -- capture=eager
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.stats import median, spread
from bench.tables import header, machine_line, row
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


def workload(engine: Engine, batch: int, max_new_tokens: int, kind: str) -> tuple[list, list[SamplingParams]]:
    """Prompts and params per request.  `tools*`: each request offers the four schemas as strict
    functions, listed in the system prompt as the server lists them for a template that ignores
    tools, and, for `tools`, names one."""
    from graphexec.server.tool_parsers import HERMES
    from graphexec.server.tool_prompt import tools_system_prompt
    from graphexec.server.tools import ToolChoice, ToolSpec, tool_constraint

    topics = [_TOPICS[i % len(_TOPICS)] for i in range(batch)]
    if kind == "json":
        prompts = [f"Reply with a JSON record about {topic}." for topic in topics]
        specs = [StructuredSpec.json_schema(_SCHEMAS[i % len(_SCHEMAS)]) for i in range(batch)]
    else:
        tools = [ToolSpec(f"record_{i}", f"Record {_TOPICS[i]}", schema, strict=True) for i, schema in enumerate(_SCHEMAS)]
        system = {"role": "system", "content": tools_system_prompt([t.definition() for t in tools], HERMES)}
        picks = [tools[i % len(tools)] for i in range(batch)]
        prompts = [engine.encode_chat([system, {"role": "user", "content": f"Record {topic} with {tool.name}."}])
                   for topic, tool in zip(topics, picks)]
        specs = [tool_constraint(tools, ToolChoice("auto") if kind == "tools_auto" else ToolChoice("function", tool.name),
                                 False, HERMES) for tool in picks]
    return prompts, [SamplingParams(max_new_tokens=max_new_tokens, structured=spec) for spec in specs]


def replay_us(engine: Engine, params: list[SamplingParams], outputs: list[list[int]], mode: str) -> float:
    """µs per step of fill + apply + accept, averaged over the outputs' steps (a row leaves the
    batch when its output ends, as in the engine); the best of 5 passes, since on a shared
    machine the least disturbed pass is the closest to the work's own cost."""
    backend, vocab = engine.grammar_backend(), engine.model_config.vocab_size
    bitmask = TokenBitmask(vocab, len(params), unpack="auto" if mode == "default" else "torch")
    logits = torch.randn(len(params), vocab)

    def one_pass() -> float:
        grammars, times = [backend.matcher(p.structured) for p in params], []
        for step in range(max(map(len, outputs))):
            live = [g if step < len(s) else None for g, s in zip(grammars, outputs)]
            work = logits.clone()
            t0 = time.perf_counter()
            bitmask.apply(work, live)  # what the sampler runs (mode "default") or the device way
            accepted = [g.accept(s[step]) for g, s in zip(live, outputs) if g is not None]
            times.append(time.perf_counter() - t0)
            assert all(accepted)
        return statistics.mean(times)

    return min(one_pass() for _ in range(5)) * 1e6


def engine_tpot_ms(engine: Engine, prompts: list, params: list[SamplingParams], rounds: int):
    """TPOT ms constrained and unconstrained for the same token counts, in paired rounds: a spread
    per side over rounds of a round's median (its min is the best round: on a shared machine the
    least disturbed one); and the constrained outputs, each with the EOS its grammar sampled."""
    constrained = engine.generate(prompts, params, chat=True)  # warm: grammars compiled, caches hot
    # An output that ended by its grammar sampled EOS last; one cut at max_new_tokens did not.
    eos = engine.model_config.eos_token_ids[0]
    outputs = [o.token_ids + ([eos] if o.finish_reason == "stop" else []) for o in constrained]
    sides = {"constrained": params, "free": [SamplingParams(max_new_tokens=len(ids), ignore_eos=True) for ids in outputs]}
    ms: dict[str, list[float]] = {side: [] for side in sides}
    for _ in range(rounds):
        for side, side_params in sides.items():
            ms[side].append(median(o.tpot for o in engine.generate(prompts, side_params, chat=True) if o.tpot) * 1e3)
    return spread(ms["constrained"]), spread(ms["free"]), outputs


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workload", choices=["json", "tools", "tools_auto"], default="json")
    parser.add_argument("overrides", nargs="*", help="engine overrides (after --)")
    args = parser.parse_args(argv)
    with Engine(overrides=[*args.overrides, "++capture.background=false"]) as engine:  # graphs before timing
        print(machine_line() + "\n")
        print(header(["B", "fill + apply + accept µs/step: default (numpy on CPU) / torch unpack",
                      "TPOT constrained ms: median / best round", "TPOT unconstrained ms: median / best round",
                      "overhead (medians)"]))
        for batch in args.batch:
            prompts, params = workload(engine, batch, args.max_new_tokens, args.workload)
            constrained, free, outputs = engine_tpot_ms(engine, prompts, params, args.rounds)
            replays = [replay_us(engine, params, outputs, mode) for mode in ("default", "unpack")]
            print(row([batch, " / ".join(f"{us:.0f}" for us in replays),
                       *(f"{s['median']:.2f} / {s['min']:.2f}" for s in (constrained, free)),
                       f"{(constrained['median'] / free['median'] - 1) * 100:+.1f} %"]), flush=True)
