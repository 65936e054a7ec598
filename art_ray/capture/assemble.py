"""Recorded turns of a capture session -> one Trajectory (its conversations, each choice as sampled).

Rules (ART's `art.langgraph` / `auto_trajectory` and AReaL's `InteractionCache`, simplified):

1. A conversation is a list of message dicts and served `Choice`s, with the tools of its first turn. Its
   *view* is each item's key (below); a Choice's key is that of the assistant message it carries.
2. A turn *extends* a conversation when the conversation's view is a prefix of the turn's request messages
   (compared key by key) and both have the same tools. It joins the longest such conversation (ties: the
   one started first): the request's messages past that prefix are appended as dicts, then the turn's
   choice as a `Choice`. A turn that extends none starts a new conversation from its request messages.
3. A message's key is its role, its content (None counts as "", a list of text parts as their joined
   text) and its tool calls as (function name, JSON arguments parsed and re-dumped with sorted keys).
   Ids (`tool_call_id`, tool-call `id`) and every other key (`name`, reasoning, refusal) are ignored:
   frameworks regenerate ids and re-serialize arguments (LangChain) or drop reasoning, and the agent still
   continued the same conversation. So when a later request carries a rewritten copy of a recorded choice
   whose key matches, the recorded Choice stays in the conversation (the sampled tokens are the truth) and
   the copy is dropped; when the key differs, the turn starts a new conversation, in which the rewritten
   copy is context only (never trained twice).
4. The conversation holding the first turn given becomes the Trajectory's `messages_and_choices`/`tools`;
   the others become `additional_histories`, in the order of their first turn. They share the reward.

Why message-level matching is enough: the trainer feeds each choice its own `prompt_token_ids` and cuts
a sequence where a turn's prompt does not extend the tokens before it, so a loose match can cost packing
efficiency, never correctness. A regeneration (a prompt that is a prefix of a recorded conversation), an
`n > 1` sibling and a sub-agent all start their own conversation.

Turns are matched shortest request first: a turn's request always holds its parent's request plus the
parent's choice, so parents come first however the replicas' records were interleaved or their clocks
skewed (`created_at` is not used for ordering).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import pydantic

from art_ray.capture.turns import CapturedTurn
from art_ray.errors import CaptureError
from art_ray.trajectories import History, Trajectory, _choice_type

# (role, content, ((function name, canonical arguments), ...))
MessageKey = tuple[Any, str, tuple[tuple[Any, str], ...]]


def _canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":"))


def _content_key(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(part, dict) and part.get("type") == "text" for part in content
    ):
        return "".join(str(part.get("text", "")) for part in content)
    return _canonical_json(content)


def _arguments_key(arguments: Any) -> str:
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return arguments  # the model wrote invalid JSON: compare it verbatim
    return _canonical_json(arguments)


def message_key(message: dict[str, Any]) -> MessageKey:
    """What two copies of a message must share to count as the same message (rule 3)."""
    calls = []
    for call in message.get("tool_calls") or ():
        function = (call.get("function") if isinstance(call, dict) else None) or {}
        calls.append((function.get("name"), _arguments_key(function.get("arguments"))))
    return (message.get("role"), _content_key(message.get("content")), tuple(calls))


def _tools_key(tools: list[dict[str, Any]] | None) -> str:
    return _canonical_json(tools or [])


@dataclass
class _Conversation:
    first_turn: int
    tools: list[dict[str, Any]] | None
    tools_key: str
    items: list[Any] = field(default_factory=list)
    keys: list[MessageKey] = field(default_factory=list)


def _parent(
    conversations: list[_Conversation], keys: list[MessageKey], tools_key: str
) -> _Conversation | None:
    candidates = [
        conversation
        for conversation in conversations
        if conversation.tools_key == tools_key
        and len(conversation.keys) <= len(keys)
        and keys[: len(conversation.keys)] == conversation.keys
    ]
    if not candidates:
        return None
    return max(candidates, key=lambda conversation: (len(conversation.keys), -conversation.first_turn))


def _served_choice(turn: CapturedTurn, index: int) -> Any:
    try:
        return _choice_type().model_validate(turn.choice)
    except pydantic.ValidationError as error:
        raise CaptureError(f"turn {index}: the recorded choice is not a chat choice: {error}") from None


def build_trajectory(
    turns: list[CapturedTurn], reward: float, metrics: dict[str, float | int | bool] | None = None
) -> Trajectory:
    """The Trajectory of a capture session's turns (rules in the module docstring). Choices keep the
    recorded token data as is: call `check_trainable()` to require it (a streamed turn may lack some)."""
    if not turns:
        raise CaptureError(
            "the capture session recorded no completion: the agent must send its requests to the "
            "session's base_url (or with its header)"
        )
    conversations: list[_Conversation] = []
    for index in sorted(range(len(turns)), key=lambda i: len(turns[i].request_messages)):
        turn = turns[index]
        choice = _served_choice(turn, index)
        keys = [message_key(message) for message in turn.request_messages]
        tools_key = _tools_key(turn.tools)
        conversation = _parent(conversations, keys, tools_key)
        if conversation is None:
            conversation = _Conversation(first_turn=index, tools=turn.tools, tools_key=tools_key)
            conversations.append(conversation)
        known = len(conversation.keys)
        conversation.items.extend(dict(message) for message in turn.request_messages[known:])
        conversation.keys.extend(keys[known:])
        conversation.items.append(choice)
        conversation.keys.append(message_key(turn.choice.get("message") or {}))
    conversations.sort(key=lambda conversation: conversation.first_turn)
    histories = []
    for conversation in conversations:
        try:
            histories.append(History(messages_and_choices=conversation.items, tools=conversation.tools))
        except pydantic.ValidationError as error:
            raise CaptureError(f"a recorded request is not a valid conversation: {error}") from None
    main, *others = histories
    trajectory = Trajectory(
        messages_and_choices=main.messages_and_choices,
        tools=main.tools,
        additional_histories=others,
        reward=reward,
        metrics=dict(metrics or {}),
    )
    trajectory.stamp_policy_versions()
    return trajectory
