"""An agent framework from PyPI (the OpenAI Agents SDK), unmodified, runs its tool loop against
graphexec's server on SmolLM2, through the Responses API and through Chat Completions: the model
calls the local function with schema-valid arguments, the framework sends the result back, and
the final answer carries it (bench/agent_check.py)."""

import pytest

pytest.importorskip("agents", reason="openai-agents is in the dev extra: bash scripts/setup.sh --dev")


@pytest.mark.slow
def test_the_openai_agents_sdk_runs_a_tool_loop_through_both_apis(smollm2_engine):
    from bench.agent_check import APIS, CITY, check
    from graphexec.server.app import create_app
    from tests.helpers import ServerThread, server_config
    from tests.invariants import assert_no_leak

    with ServerThread(create_app(smollm2_engine, server_config())) as server:
        results = check(server.url, smollm2_engine.config.model.name)
    assert set(results) == set(APIS)
    for api, run in results.items():
        assert run["tool_calls"] == [CITY], (api, run)  # one call, its argument the city asked about
        assert run["turns"] == 2, (api, run)  # the call, then the answer with the tool's result in context
        assert CITY in str(run["final_output"]), (api, run)
    assert_no_leak(smollm2_engine)
