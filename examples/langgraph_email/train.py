"""The ART-E style email agent of examples/email_agent, written with LangGraph and trained unchanged: the
agent is a plain LangGraph graph over LangChain's ChatOpenAI, with no token ids, Choices or art-ray calls
in it. It gets a base URL; the endpoint records what it sampled (a capture session, README "Capture
sessions") and the recorded turns become the trajectory.

    python examples/langgraph_email/train.py --steps 3

Same inbox, tools, turn limit and reward as examples/email_agent (inbox.answer_reward).
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Any

sys.path[:0] = [
    str(Path(__file__).parent),
    str(Path(__file__).parents[1]),
    str(Path(__file__).parents[1] / "email_agent"),
]

import inbox  # noqa: E402
from inbox import EMAILS, LAST_TURN, MAX_TOKENS, MAX_TURNS, RESULTS, SYSTEM  # noqa: E402
from langchain_core.messages import SystemMessage, ToolMessage  # noqa: E402
from langchain_openai import ChatOpenAI  # noqa: E402
from langgraph.graph import END, START, MessagesState, StateGraph  # noqa: E402
from loop import AgentTask, main  # noqa: E402

import art_ray  # noqa: E402
from art_ray import CaptureSession  # noqa: E402


async def email_agent(
    base_url: str, api_key: str | None, model: str, scenario: inbox.Scenario, temperature: float
) -> dict[str, Any]:
    """A LangGraph agent: `agent` (the chat model, tools bound) and `tools` (the inbox) nodes in a loop
    until it answers or MAX_TURNS. Returns what the reward needs."""
    conn = inbox.build_index(list(scenario.emails))
    seen: dict[str, Any] = {
        "answer": None,
        "sources": [],
        "found": False,
        "read": False,
        "turns": 0,
        "errors": 0,
    }
    llm = ChatOpenAI(
        model=model,
        base_url=base_url,
        api_key=api_key or "unused",
        temperature=temperature,
        max_tokens=MAX_TOKENS,
    )

    async def agent(state: MessagesState) -> dict:
        seen["turns"] += 1
        choice = LAST_TURN if seen["turns"] == MAX_TURNS else "required"
        # one call a turn (examples/email_agent/train.py says why)
        bound = llm.bind_tools(inbox.TOOLS, tool_choice=choice, parallel_tool_calls=False)
        return {"messages": [await bound.ainvoke(state["messages"])]}

    def tools(state: MessagesState) -> dict:
        results = []
        for call in state["messages"][-1].tool_calls:
            arguments, name = call["args"], call["name"]
            try:
                if name == "search_inbox":
                    result: Any = inbox.search_inbox(conn, arguments["keywords"], RESULTS)
                    seen["found"] |= any(hit["message_id"] in scenario.sources for hit in result)
                elif name == "read_email":
                    message_id = str(arguments["message_id"])
                    result = inbox.read_email(conn, message_id) or {
                        "error": f"no email with id {message_id!r}"
                    }
                    seen["read"] |= message_id.strip() in scenario.sources
                elif name == "return_final_answer":
                    cited = arguments.get("sources", [])
                    seen["sources"] = [str(s) for s in (cited if isinstance(cited, list) else [cited])]
                    seen["answer"] = str(arguments["answer"])
                    result = "ok"
                else:
                    raise ValueError(f"unknown tool {name!r}")
            except (ValueError, KeyError, TypeError) as error:
                seen["errors"] += 1
                result = {"error": f"{type(error).__name__}: {error}"}
            results.append(ToolMessage(content=json.dumps(result), tool_call_id=call["id"]))
        return {"messages": results}

    def next_node(state: MessagesState) -> str:
        if not state["messages"][-1].tool_calls:  # cut off, or no readable call: the episode ends
            seen["errors"] += 1
            return END
        return "tools"

    def after_tools(state: MessagesState) -> str:
        return END if seen["answer"] is not None or seen["turns"] >= MAX_TURNS else "agent"

    graph = StateGraph(MessagesState)
    graph.add_node("agent", agent)
    graph.add_node("tools", tools)
    graph.add_edge(START, "agent")
    graph.add_conditional_edges("agent", next_node, ["tools", END])
    graph.add_conditional_edges("tools", after_tools, ["agent", END])
    try:
        await graph.compile().ainvoke({"messages": [SystemMessage(SYSTEM), ("user", scenario.question)]})
    except Exception as error:  # noqa: BLE001 - e.g. the conversation outgrew max_model_len: it ends there
        seen["errors"] += 1
        print(f"episode ended: {type(error).__name__}: {str(error)[:120]}", file=sys.stderr)
    return seen


@art_ray.captured_rollout
async def rollout(session: CaptureSession, scenario: inbox.Scenario, temperature: float) -> tuple:
    seen = await email_agent(session.base_url, session.api_key, session.model, scenario, temperature)
    return inbox.answer_reward(
        seen["answer"],
        seen["sources"],
        scenario,
        found_source=seen["found"],
        read_source=seen["read"],
        turns=seen["turns"],
        tool_errors=seen["errors"],
    )


TASK = AgentTask(
    name="langgraph_email",
    rollout=rollout,
    train_scenarios=lambda rng: inbox.make_scenario(rng, EMAILS),
    val_scenarios=[inbox.make_scenario(random.Random(40_000 + i), EMAILS) for i in range(16)],
    metrics=["correct", "found_source", "read_source", "cited_source", "answered", "turns", "tool_errors"],
    train_temperature=0.7,
    max_model_len=1280,
)

if __name__ == "__main__":
    main(TASK, __doc__)
