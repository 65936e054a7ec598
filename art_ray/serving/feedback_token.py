"""Signed feedback tokens: what lets a browser post feedback for one completion without the API key.

Each stored completion's response carries `X-Art-Ray-Feedback-Token`: the run and the completion id,
signed with HMAC-SHA256 under a secret every replica derives from the deployment's admin key (or, on a
keyless endpoint, from the deployment's identity). The token authorizes feedback for that completion
only, for as long as the turn is kept (its retention), like LangSmith's pre-signed feedback URLs.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json

FEEDBACK_TOKEN_HEADER = "X-Art-Ray-Feedback-Token"


class FeedbackSigner:
    def __init__(self, secret_source: str) -> None:
        self._secret = hashlib.sha256(b"art-ray feedback token\n" + secret_source.encode()).digest()

    def sign(self, model: str, completion_id: str) -> str:
        payload = base64.urlsafe_b64encode(json.dumps([model, completion_id]).encode()).decode().rstrip("=")
        return f"{payload}.{self._mac(payload)}"

    def verify(self, token: str) -> tuple[str, str] | None:
        """(run, completion id) of a token this deployment signed, else None."""
        payload, _, mac = token.partition(".")
        if not payload or not hmac.compare_digest(mac, self._mac(payload)):
            return None
        try:
            model, completion_id = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
        except (ValueError, TypeError):
            return None
        if not isinstance(model, str) or not isinstance(completion_id, str):
            return None
        return model, completion_id

    def _mac(self, payload: str) -> str:
        return hmac.new(self._secret, payload.encode(), hashlib.sha256).hexdigest()
