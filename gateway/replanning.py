"""Solves the routers' plans of the traffic they have seen (`Router.replan`), off the request path: in a
worker thread, every `REPLAN_INTERVAL_S` seconds (`cost`: where new conversations decode,
`scoring.conversations`). `serve` and `epp` alike run it."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping

from scoring.conversations import REPLAN_INTERVAL_S
from scoring.types import Router

log = logging.getLogger("hetgate.replanning")


async def replan_forever(
    routers: Callable[[], Mapping[str, Router]], interval_s: float = REPLAN_INTERVAL_S
) -> None:
    """`routers()` is read each round, so a reloaded configuration's routers are the ones replanned."""
    while True:
        await asyncio.sleep(interval_s)
        await replan_once(routers())


async def replan_once(routers: Mapping[str, Router]) -> None:
    for model, router in routers.items():
        if not router.replans:
            continue
        try:
            await asyncio.to_thread(router.replan)
        except Exception as error:  # a plan is a hint: routing goes on with the last one
            log.warning("replanning %s failed (%s): keeping the last plan", model, type(error).__name__)


def start_replanning(routers: Callable[[], Mapping[str, Router]]) -> asyncio.Task[None] | None:
    """The task, or None when no router replans."""
    if not any(router.replans for router in routers().values()):
        return None
    return asyncio.create_task(replan_forever(routers), name="replanning")
