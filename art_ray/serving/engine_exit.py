"""A replica whose vLLM engine died ends its process, as vLLM's own server does, and Serve starts another.

vLLM answers a request that met a dead engine with an OpenAI error (500), then sets `should_exit` on the
uvicorn server it expects in `app.state.server` (launchers/launcher.py `terminate_if_errored`): its server
stops and whatever supervises it starts a new one. Under Serve there is no such server: the handler raised
AttributeError, so each request got a bare 500 without the error JSON, and Serve replaced the replica
only once its health check had failed three times, 10 s apart (issue 49's 20-minute soak: 76 s of 500s
from one replica).

`EngineExit` stands in for that server: the error goes out, and a moment later the replica's process exits;
Ray reports the actor dead and Serve starts a replacement at once, routing to the others meanwhile. Its
forked engine processes end with it (art_ray/serving/cpu_fork.py; a GPU engine's by vLLM's death pipe).
A dead engine that no request meets is found by the replica's health check, as before.
"""

from __future__ import annotations

import asyncio
import logging
import os

logger = logging.getLogger(__name__)

# long enough for the error being answered to leave
EXIT_DELAY_S = 1.0


class EngineExit:
    """What vLLM's error handler finds in `app.state.server`; setting `should_exit` ends this process."""

    def __init__(self) -> None:
        self._exiting = False

    @property
    def should_exit(self) -> bool:
        return self._exiting

    @should_exit.setter
    def should_exit(self, value: bool) -> None:
        if value and not self._exiting:
            self._exiting = True
            logger.error("the vLLM engine died: the replica exits in %.0f s, Serve replaces it", EXIT_DELAY_S)
            asyncio.get_running_loop().call_later(EXIT_DELAY_S, os._exit, 1)
