"""The `openai-agents` SDK, unmodified, runs a tool loop against Baton: an agent with one
function tool, `tool_choice: "required"`, greedy, over both of the SDK's models (chat
completions and the Responses API). The model calls the tool with arguments that validate (the
call is constrained to its schema), the SDK runs the tool and ends on its output
(`tool_use_behavior="stop_on_first_tool"`: a random-weight model would otherwise never stop
calling). Run in the SDK's own venv (tests/clients/venvs.py)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

SCRIPT = r'''
import json, sys
from typing import Literal
from agents import (Agent, ModelSettings, OpenAIChatCompletionsModel, OpenAIResponsesModel,
                    Runner, function_tool, set_tracing_disabled)
from openai import AsyncOpenAI

set_tracing_disabled(True)
client = AsyncOpenAI(base_url=sys.argv[1] + "/v1", api_key="unused")
calls = []

@function_tool
def forecast(city: Literal["oslo", "rome", "lima"], days: Literal[1, 2, 3]) -> str:
    """The weather forecast of a city."""
    calls.append({"city": city, "days": days})
    return f"sunny in {city} for {days} days"

out = []
for name, model in (("chat", OpenAIChatCompletionsModel("tiny", client)),
                    ("responses", OpenAIResponsesModel("tiny", client))):
    agent = Agent(name="forecaster", instructions="Answer with the forecast tool.",
                  tools=[forecast], model=model, tool_use_behavior="stop_on_first_tool",
                  model_settings=ModelSettings(tool_choice="required", temperature=0,
                                               parallel_tool_calls=False, max_tokens=300))
    before = len(calls)
    result = Runner.run_sync(agent, "What is the weather in Rome?")
    out.append({"model": name, "final_output": result.final_output,
                "calls": calls[before:]})
print(json.dumps(out))
'''


def check(bin_dir: Path, work: Path, http_address: str) -> list[str]:
    """Failures, one line each (none: the SDK ran its tool loop over both APIs)."""
    script = work / "agents_sdk_check.py"
    script.write_text(SCRIPT)
    proc = subprocess.run([str(bin_dir / "python"), str(script), http_address],
                          capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        tail = " | ".join(proc.stderr.strip().splitlines()[-3:])
        return [f"openai-agents: the tool loop failed ({proc.returncode}): {tail}"]
    failures = []
    for run in json.loads(proc.stdout.strip().splitlines()[-1]):
        calls = run["calls"]
        if len(calls) != 1 or calls[0]["city"] not in ("oslo", "rome", "lima") or \
                calls[0]["days"] not in (1, 2, 3):
            failures.append(f"openai-agents ({run['model']}): the tool was called {calls}")
        elif run["final_output"] != f"sunny in {calls[0]['city']} for {calls[0]['days']} days":
            failures.append(f"openai-agents ({run['model']}): final output "
                            f"{run['final_output']!r} is not the tool's")
    return failures
