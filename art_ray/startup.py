"""Start a model's parts side by side and say what is still starting."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any


async def side_by_side(parts: dict[str, Awaitable[Any]], say: Callable[[str], None]) -> dict[str, Any]:
    """Await every part at once; returns each part's result, or the exception it raised. Every part runs
    to its end even when another fails, so the caller knows what did start and can stop it."""
    if not parts:
        return {}
    started = time.monotonic()
    names = {asyncio.ensure_future(part): name for name, part in parts.items()}
    if len(names) > 1:
        say(f"starting {', '.join(parts)} side by side")
    results: dict[str, Any] = {}
    pending = set(names)
    while pending:
        done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            name = names[task]
            error = task.exception()
            results[name] = error if error is not None else task.result()
            state = f"failed ({type(error).__name__})" if error is not None else "ready"
            waiting = sorted(names[other] for other in pending)
            still = f"; still starting: {', '.join(waiting)}" if waiting else ""
            say(f"{name} {state} after {time.monotonic() - started:.0f} s{still}")
    return results
