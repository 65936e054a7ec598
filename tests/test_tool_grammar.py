"""The tool parser art-ray registers beside the configured one bounds the whitespace of a call's JSON and
changes nothing else of vLLM's grammar or parsing."""

from __future__ import annotations

import json

from art_ray.models import TINY, prepare
from art_ray.serving.tool_grammar import bounded_whitespace_parser

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}},
        },
    }
]


def json_contents(node: object) -> list[dict]:
    if isinstance(node, dict):
        found = [node] if node.get("type") == "json_schema" else []
        return found + [c for value in node.values() for c in json_contents(value)]
    if isinstance(node, list):
        return [c for value in node for c in json_contents(value)]
    return []


def test_every_json_content_of_a_call_gets_the_whitespace_bound() -> None:
    from transformers import AutoTokenizer
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.tool_parsers.abstract_tool_parser import ToolParserManager
    from vllm.tool_parsers.hermes_tool_parser import Hermes2ProToolParser
    from vllm.tool_parsers.tool_strict_level import ToolStrictLevel

    name = bounded_whitespace_parser("hermes", 3)
    assert name == "hermes+max_whitespace=3"
    bounded_cls = ToolParserManager.get_tool_parser(name)
    assert issubclass(bounded_cls, Hermes2ProToolParser)
    tokenizer = AutoTokenizer.from_pretrained(str(prepare(TINY)))
    request = ChatCompletionRequest(
        model="m", messages=[{"role": "user", "content": "x"}], tools=TOOLS, tool_choice="required"
    )
    stock = Hermes2ProToolParser(tokenizer).get_structural_tag(
        request, strict_level=ToolStrictLevel.PARAMETER
    )
    bounded = bounded_cls(tokenizer).get_structural_tag(request, strict_level=ToolStrictLevel.PARAMETER)
    stock_json, bounded_json = stock.model_dump(), bounded.model_dump()
    assert json_contents(bounded_json) and all(
        c["max_whitespace_cnt"] == 3 for c in json_contents(bounded_json)
    )
    assert all(c["max_whitespace_cnt"] is None for c in json_contents(stock_json))
    for content in json_contents(stock_json):
        content["max_whitespace_cnt"] = 3
    assert json.dumps(stock_json) == json.dumps(bounded_json)  # nothing else changed
    # parsing is the parser's own
    text = '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
    parsed = bounded_cls(tokenizer).extract_tool_calls(text, request=request)
    assert [(c.function.name, json.loads(c.function.arguments)) for c in parsed.tool_calls] == [
        ("add", {"a": 1})
    ]
