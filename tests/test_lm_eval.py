"""lm-evaluation-harness, unmodified, against graphexec's server.

A multiple-choice task (loglikelihoods from echo + logprobs), a generate_until task and a
perplexity task (rolling loglikelihood), all local (bench/lm_eval_data, no hub), run through
lm-eval's `local-completions` model with default model_args (it finds the server's tokenizer
through /tokenizer_info), score what lm-eval's `hf` model scores on the same weights.
"""

import pytest

pytest.importorskip("lm_eval", reason="lm-eval is in the dev extra: bash scripts/setup.sh --dev")

# Documents per task: all 8 generate_until and all 3 perplexity documents, the first 8 of the 16
# multiple-choice questions (each is 4 echo requests, one at a time: most of the server's time).
LIMIT = 8


@pytest.mark.slow
def test_local_completions_scores_equal_lm_evals_hf_model(smollm2_engine, hf_smollm2, hf_smollm2_tokenizer):
    from bench.lm_eval_check import compare, evaluate_hf, evaluate_server, per_doc
    from graphexec.server.app import create_app
    from tests.helpers import ServerThread, server_config

    smollm2_engine.flush_cache()
    with ServerThread(create_app(smollm2_engine, server_config())) as server:
        ours = evaluate_server(server.url, smollm2_engine.config.model.name, LIMIT)
    theirs = evaluate_hf(hf_smollm2, hf_smollm2_tokenizer, LIMIT)
    rows = compare(ours, theirs)
    assert all(row["agree"] for row in rows), rows
    # Per document, not only the aggregates: the same greedy answers, and each choice's
    # loglikelihood within the packed weights' distance from their fp32 dequantization.
    assert [len(per_doc(ours, task)) for task in ("graphexec_mc", "graphexec_gen", "graphexec_ppl")] == [LIMIT, 8, 3]
    assert per_doc(ours, "graphexec_gen") == per_doc(theirs, "graphexec_gen")
    for task in ("graphexec_mc", "graphexec_ppl"):
        for got, expected in zip(per_doc(ours, task), per_doc(theirs, task), strict=True):
            assert got == pytest.approx(expected, abs=0.05, rel=1e-3), task
