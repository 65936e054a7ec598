"""Anthropic Messages (`/v1/messages`) to chat completions and back, with vLLM's own converters.

vLLM's `AnthropicServingMessages` already maps a Messages request to a chat completion request (system
prompt, text, tool_use and tool_result blocks, tools, tool_choice, stop sequences) and a chat completion,
whole or streamed, to a Messages response; this bridge lets those run around art-ray's chat route
(art_ray/serving/protocol_bridge.py). Requests are validated by vLLM's `AnthropicMessagesRequest`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pydantic

from art_ray.serving.asgi import anthropic_error
from art_ray.serving.protocol_bridge import BridgeRequestError, sampling_extras, validation_message


class MessagesBridge:
    """`serving`: the replica's vLLM `AnthropicServingMessages` (app.state.anthropic_serving_messages),
    whose converters know the model's chat template (whether inline system prompts must merge)."""

    def __init__(self, serving: Any) -> None:
        self._serving = serving

    async def chat_request(self, payload: dict[str, Any], caller: str) -> dict[str, Any]:
        from vllm.entrypoints.anthropic.protocol import AnthropicMessagesRequest

        try:
            request = AnthropicMessagesRequest.model_validate(payload)
        except pydantic.ValidationError as error:
            raise BridgeRequestError(400, validation_message(error)) from None
        chat = self._serving.to_chat_completion_request(
            request, merge_inline_system=getattr(self._serving, "_merge_inline_system", True)
        )
        # unset and None fields stay out: the chat route's defaults (token ids, logprobs) then apply
        body = {key: value for key, value in chat.model_dump(exclude_unset=True).items() if value is not None}
        body.pop("metadata", None)
        user = (payload.get("metadata") or {}).get("user_id")
        if isinstance(user, str) and user:  # a release's arm follows the user (art_ray/releases.py)
            body["user"] = user
        return {**body, **sampling_extras(payload)}

    async def response(self, chat: dict[str, Any], payload: dict[str, Any], caller: str) -> dict[str, Any]:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionResponse

        message = self._serving.messages_full_converter(ChatCompletionResponse.model_validate(chat))
        return message.model_dump(exclude_none=True)

    def stream(self, chunks: AsyncIterator[str], payload: dict[str, Any], caller: str) -> AsyncIterator[str]:
        return self._serving.message_stream_converter(chunks)

    def error(self, status: int, message: str, error_type: str, param: str | None) -> dict[str, Any]:
        return anthropic_error(status, message)
