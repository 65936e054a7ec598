"""vLLM's log lines in a Serve replica and in the engine processes below it, without vLLM's dictConfig.

vLLM applies a logging dictConfig as it builds the engine config, and a dictConfig closes every handler of
the process: Serve's replica logger then kept a MemoryHandler with no target, which held every request's
access-log record for the replica's life (~2 KB a request, ~3 MB a minute under the soak's load) and wrote
none. So a replica's engine is built with vLLM's logging setup off (`LoggingConfig(configure_logging=False)`,
which its engine core and worker processes are handed too) and vLLM's lines get a handler of their own,
in the replica (`log_vllm_lines`) and in each engine process: a forked one inherits it, a spawned one (a GPU
engine's, or any with ART_RAY_CPU_FORK=0) adds it as it loads vLLM's plugins (`register`).
"""

from __future__ import annotations

import logging
import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.config.logging import LoggingConfig

# set in the replica before its engine starts; its engine processes inherit it
LINES_OF_A_REPLICA = "ART_RAY_VLLM_LINES"


def log_vllm_lines() -> None:
    """vLLM's lines in this process to stdout, as vLLM's own setup sends them, without its dictConfig;
    the engine processes this one starts do the same."""
    import vllm.envs

    os.environ[LINES_OF_A_REPLICA] = "1"
    logger = logging.getLogger("vllm")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(
            logging.Formatter(
                "%(levelname)s %(asctime)s [%(filename)s:%(lineno)d] %(message)s", "%m-%d %H:%M:%S"
            )
        )
        logger.addHandler(handler)
        logger.setLevel(vllm.envs.VLLM_LOGGING_LEVEL)
        logger.propagate = False


def register() -> None:
    """The `vllm.general_plugins` entry point `art_ray_vllm_lines`: runs in every process that builds or
    runs an engine; in one a replica started, vLLM's lines get their handler."""
    if os.environ.get(LINES_OF_A_REPLICA) == "1":
        log_vllm_lines()


def logging_config_of_a_replica() -> LoggingConfig:
    """What a replica hands vLLM: no dictConfig, in the replica or in its engine processes."""
    from vllm.config.logging import LoggingConfig

    return LoggingConfig(configure_logging=False)
