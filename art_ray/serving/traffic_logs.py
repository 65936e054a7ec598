"""A replica's handles on the runs' traffic logs (art_ray/traffic/log.py), looked up by name on first use."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)


def _lookup(run: str) -> Any:
    from art_ray.traffic.log import get_traffic_log

    return get_traffic_log(run)


class TrafficLogs:
    def __init__(self, lookup: Callable[[str], Any] = _lookup) -> None:
        self._lookup = lookup
        self._handles: dict[str, Any] = {}

    def get(self, run: str) -> Any | None:
        """The run's log, or None when none runs (a run registered elsewhere that has not started it yet,
        or one deleted since): the turn is then served without being stored, and the log says so."""
        if run not in self._handles:
            try:
                self._handles[run] = self._lookup(run)
            except ValueError:
                logger.warning("model %r stores its traffic, but its traffic log is not running", run)
                return None
        return self._handles[run]
