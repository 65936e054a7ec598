"""`POST /v1/feedback`: a score for a stored turn of a run that keeps its traffic (art_ray/feedback.py).

The body is a `Feedback`: the turn by `completion_id` (or `session_id`, a capture session's latest turn),
`score`, optional `comment`, `source` (user, judge, system) and `feedback_id` (a retry with the same id
is answered the first record, stored once), and `model` (the run; else every run the caller sees that
stores traffic is asked). Authorized by a key that sees the run, as every route, or by the response's
signed `token` alone, which names the run and completion. The answer is the stored record (200; 202 when
it came with a token before its turn was stored, a stream still being sent: it waits for the turn); a turn
that is not stored for this caller (unknown, another key's run, `store: false`, past retention) is a
404, a malformed body a 400, a bad token a 401, all in OpenAI's error shape.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import pydantic

from art_ray.adapters.spec import InvalidModelNameError, parse_versioned_name
from art_ray.feedback import Feedback, new_feedback_id
from art_ray.serving.asgi import Receive, Scope, Send, caller_of, read_body, send_error, send_json
from art_ray.serving.endpoint_guard import FEEDBACK_PATH, request_path, routed_path
from art_ray.serving.feedback_token import FeedbackSigner
from art_ray.serving.traffic_logs import TrafficLogs


def validation_text(error: pydantic.ValidationError) -> tuple[str, str | None]:
    """The first problem of a body, and the field it is in."""
    first = error.errors()[0]
    field = ".".join(str(part) for part in first["loc"]) or None
    return (f"{field}: {first['msg']}" if field else first["msg"]), field


class FeedbackMiddleware:
    def __init__(
        self, app: Callable, signer: FeedbackSigner, traffic_logs: TrafficLogs | None = None
    ) -> None:
        self.app = app
        self._signer = signer
        self._traffic_logs = traffic_logs or TrafficLogs()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] == "http"
            and scope["method"] == "POST"
            and routed_path(request_path(scope)) == FEEDBACK_PATH
        ):
            await self._feedback(scope, receive, send)
        else:
            await self.app(scope, receive, send)

    async def _feedback(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            feedback = Feedback.model_validate(json.loads(await read_body(receive)))
        except ValueError as error:  # not JSON, or pydantic's ValidationError (a ValueError)
            message, field = (
                validation_text(error)
                if isinstance(error, pydantic.ValidationError)
                else ("invalid JSON", None)
            )
            await send_error(send, 400, f"bad feedback: {message}", "BadRequestError", field)
            return
        if feedback.feedback_id is None:  # drawn here, so the log's retry of this call stores it once
            feedback = feedback.model_copy(update={"feedback_id": new_feedback_id()})
        caller = caller_of(scope)
        completion_id = feedback.completion_id
        if feedback.token is not None:
            signed = self._signer.verify(feedback.token)
            if signed is None:
                await send_error(send, 401, "invalid feedback token", "AuthenticationError", "token")
                return
            runs, token_completion = [signed[0]], signed[1]
            if completion_id not in (None, token_completion):
                message = "the token is for another completion than `completion_id`"
                await send_error(send, 400, message, "BadRequestError", "completion_id")
                return
            completion_id = token_completion
        elif not caller.authenticated:
            message = (
                "Missing or incorrect API key: send `Authorization: Bearer <key>`, or the response's token"
            )
            await send_error(send, 401, message, "AuthenticationError")
            return
        else:
            runs = sorted(run for run in caller.access.traffic if caller.sees(run))
            if feedback.model is not None:
                try:
                    wanted = parse_versioned_name(feedback.model)[0]
                except InvalidModelNameError as error:
                    await send_error(send, 400, str(error), "BadRequestError", "model")
                    return
                runs = [run for run in runs if run == wanted]
        for run in runs:
            log = self._traffic_logs.get(run)
            if log is None:
                continue
            outcome = await log.add_feedback.remote(feedback, completion_id, feedback.token is not None)
            if outcome.record is not None:
                await send_json(send, outcome.status, outcome.record.model_dump())
                return
        target = (
            f"completion {completion_id!r}" if completion_id else f"capture session {feedback.session_id!r}"
        )
        message = (
            f"no stored turn for {target}: unknown, of a model this key does not see, not stored (its model "
            "does not store traffic, or the request said store: false), or past its retention"
        )
        await send_error(send, 404, message, "NotFoundError")
