"""lm-evaluation-harness against graphexec-serve, beside lm-eval's own `hf` model on the same weights.

Three local tasks (bench/lm_eval_data/*.jsonl; nothing from the hub): multiple choice
(loglikelihood of each choice), generate_until (greedy, exact match) and a rolling loglikelihood
(perplexity).  The server side is lm-eval's `local-completions` model with default model_args:
lm-eval finds the server's tokenizer through GET /tokenizer_info and uses /tokenize and
/detokenize, sends token-id prompts, and scores choices from `echo` + `logprobs`.  The reference
side is lm-eval's `hf` model on transformers' SmolLM2 loaded from the same GGUF.

Accuracy and exact match must be equal; perplexities agree to `PPL_RTOL` (graphexec runs the
packed Q4_1/Q8_0 weights, transformers their fp32 dequantization: logits agree to ~2e-3).

    graphexec-bench lm_eval_check                      # starts graphexec-serve (default plan)
    graphexec-bench lm_eval_check --url http://127.0.0.1:8000 --model smollm2-135m
    graphexec-bench lm_eval_check --serve-args capture=eager --out results.json
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from bench.serve import against_server, check_parser
from bench.tables import machine_line, table

DATA = Path(__file__).resolve().parent / "lm_eval_data"
PPL_RTOL = 2e-3
# Task name -> (data file, the metrics compared, whether they must be equal or close).
METRICS = {
    "graphexec_mc": ("multiple_choice.jsonl", ("acc", "acc_norm"), "equal"),
    "graphexec_gen": ("generate_until.jsonl", ("exact_match",), "equal"),
    "graphexec_ppl": ("perplexity.jsonl", ("word_perplexity", "byte_perplexity", "bits_per_byte"), "close"),
}
# Each task's own fields of its lm-eval config (the data and the metrics are METRICS').
TASK_FIELDS = {
    "graphexec_mc": {"output_type": "multiple_choice", "doc_to_text": "{{question}}", "doc_to_choice": "{{choices}}",
                     "doc_to_target": "{{answer}}"},
    "graphexec_gen": {"output_type": "generate_until", "doc_to_text": "{{question}}", "doc_to_target": "{{answer}}",
                      "generation_kwargs": {"until": ["\n"], "max_gen_toks": 16, "do_sample": False, "temperature": 0.0}},
    "graphexec_ppl": {"output_type": "loglikelihood_rolling", "doc_to_text": "", "doc_to_target": "{{text}}"},
}
AGGREGATION = {"word_perplexity": "weighted_perplexity", "byte_perplexity": "weighted_perplexity",
               "bits_per_byte": "bits_per_byte"}  # the others: "mean", higher is better
EXACT_MATCH_OPTIONS = {"ignore_case": True, "ignore_punctuation": True, "regexes_to_ignore": [r"^\s+", r"\s+$"]}


def task_configs() -> list[dict[str, Any]]:
    """The three tasks as lm-eval task configs (dicts, so their data paths are absolute)."""
    return [{"task": name, "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(DATA / file)}},
             "test_split": "test", "metric_list": [_metric(m) for m in metrics]} | TASK_FIELDS[name]
            for name, (file, metrics, _) in METRICS.items()]


def _metric(name: str) -> dict[str, Any]:
    aggregation = AGGREGATION.get(name, "mean")
    return ({"metric": name, "aggregation": aggregation, "higher_is_better": aggregation == "mean"}
            | (EXACT_MATCH_OPTIONS if name == "exact_match" else {}))


def _evaluate(model: Any, limit: int | None, **kwargs: Any) -> dict[str, Any]:
    """lm-eval on the three tasks, at most `limit` documents each (None: all).  Its task manager
    leaves out lm-eval's thousands of built-in task files: indexing them took 10-25 s a call here,
    and the tasks are configs, not names."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(model=model, tasks=task_configs(), log_samples=True, limit=limit,
                                   task_manager=TaskManager(include_defaults=False), **kwargs)


def evaluate_server(base_url: str, model: str, limit: int | None = None) -> dict[str, Any]:
    return _evaluate("local-completions", limit,
                     model_args={"model": model, "base_url": f"{base_url.rstrip('/')}/v1/completions"})


def evaluate_hf(model: Any = None, tokenizer: Any = None, limit: int | None = None) -> dict[str, Any]:
    """lm-eval's `hf` model on transformers' SmolLM2 from the default GGUF (or `model` and its
    `tokenizer`: reading them from the GGUF costs seconds each)."""
    import torch
    import transformers
    from lm_eval.models.huggingface import HFLM

    from graphexec.loader import default_smollm2_gguf

    path = default_smollm2_gguf()
    if tokenizer is None:
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    if model is None:
        model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                                  dtype=torch.float32)
    hf = HFLM(pretrained=model.eval(), tokenizer=tokenizer, batch_size=1)
    return _evaluate(hf, limit)


def compare(server: dict[str, Any], hf: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per task and metric: both scores and whether they agree."""
    rows = []
    for task, (_, metrics, rule) in METRICS.items():
        for metric in metrics:
            ours, theirs = _score(server, task, metric), _score(hf, task, metric)
            agree = ours == theirs if rule == "equal" else math.isclose(ours, theirs, rel_tol=PPL_RTOL)
            rows.append({"task": task, "metric": metric, "graphexec": ours, "hf": theirs, "rule": rule, "agree": agree})
    return rows


def per_doc(results: dict[str, Any], task: str) -> list[list[Any]]:
    """Each document's responses as lm-eval scored them: loglikelihoods (one per choice, or the
    rolling total) or the generated strings."""
    samples = sorted(results["samples"][task], key=lambda s: s["doc_id"])
    return [[r[0] if isinstance(r, (list, tuple)) else r for r in s["filtered_resps"]] for s in samples]


def _score(results: dict[str, Any], task: str, metric: str) -> float:
    return float(results["results"][task][f"{metric},none"])


def main(argv: list[str]) -> int:
    parser = check_parser(__doc__, serve_args=[])
    parser.add_argument("--out", type=Path, help="write both sides' scores and the comparison here (JSON)")
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    server = against_server(args, 600, evaluate_server)
    server_s, t0 = time.perf_counter() - t0, time.perf_counter()
    hf = evaluate_hf()
    hf_s = time.perf_counter() - t0
    rows = compare(server, hf)
    print(machine_line() + "\n")
    print(table(["task", "metric", f"graphexec-serve ({server_s:.0f} s)", f"lm-eval hf ({hf_s:.0f} s)", "agree"],
                [[r["task"], r["metric"], f"{r['graphexec']:.6g}", f"{r['hf']:.6g}", "yes" if r["agree"] else "NO"]
                 for r in rows]))
    if args.out:
        args.out.write_text(json.dumps({"rows": rows, "server_seconds": server_s, "hf_seconds": hf_s}, indent=2))
    return 0 if all(r["agree"] for r in rows) else 1
