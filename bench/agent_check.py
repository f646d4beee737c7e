"""An agent framework from PyPI, unmodified, driving a tool loop against graphexec-serve.

The OpenAI Agents SDK (`openai-agents`) runs an agent with one local Python function tool,
`get_weather(city)`, twice: through the Responses API (the SDK's default model) and through Chat
Completions.  Each run is the loop agent frameworks make: the model calls the tool (tool_choice
"required", so even a 135M model calls it, its arguments held to the function's schema), the SDK
runs the function here and sends its result back, and the model answers with that result in its
context (the SDK resets tool_choice to auto after a call, so the loop ends).  Reported per API:
the tool's calls, the final output, the turns and the seconds.

    graphexec-bench agent_check                          # starts graphexec-serve (capture=eager)
    graphexec-bench agent_check --url http://127.0.0.1:8000 --model smollm2-135m
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from bench.serve import against_server, check_parser

CITY = "Paris"
QUESTION = f"What is the weather in {CITY}?"
APIS = ("responses", "chat_completions")


async def run_agents(base_url: str, model: str) -> dict[str, dict[str, Any]]:
    """One agent run per API against the server at base_url; what each did."""
    import openai
    from agents import set_tracing_disabled

    set_tracing_disabled(True)  # traces would go to OpenAI's servers
    client = openai.AsyncOpenAI(base_url=f"{base_url.rstrip('/')}/v1", api_key="unused")
    results = {api: await run_agent(api, client, model) for api in APIS}
    await client.close()
    return results


async def run_agent(api: str, client, model: str) -> dict[str, Any]:
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, OpenAIResponsesModel, Runner, function_tool

    calls: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        calls.append(city)
        return f"It is sunny and 21 degrees in {city}."

    model_class = OpenAIResponsesModel if api == "responses" else OpenAIChatCompletionsModel
    settings = ModelSettings(tool_choice="required", parallel_tool_calls=False, temperature=0.0, max_tokens=64)
    agent = Agent(name="weather", instructions="Use the get_weather tool, then answer with what it says.",
                  tools=[get_weather], model=model_class(model, client), model_settings=settings)
    start = time.perf_counter()
    result = await Runner.run(agent, QUESTION, max_turns=4)
    return {"tool_calls": calls, "final_output": result.final_output, "turns": len(result.raw_responses),
            "seconds": round(time.perf_counter() - start, 2)}


def check(base_url: str, model: str) -> dict[str, dict[str, Any]]:
    return asyncio.run(run_agents(base_url, model))


def main(argv: list[str]) -> int:
    args = check_parser(__doc__, serve_args=["capture=eager"]).parse_args(argv)
    results = against_server(args, 300, check)
    print(json.dumps(results, indent=2))
    ok = all(r["tool_calls"] == [CITY] and CITY in str(r["final_output"]) for r in results.values())
    return 0 if ok else 1
