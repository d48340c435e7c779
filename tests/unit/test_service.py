"""What every service shares: its background tasks are kept while they run, and only then."""

from __future__ import annotations

import asyncio

import structlog

from common.config import ServerArgs
from common.service import Service


async def test_finished_tasks_are_dropped_and_running_ones_cancelled_at_shutdown():
    service = Service(ServerArgs())
    await asyncio.gather(*(service.spawn(asyncio.sleep(0)) for _ in range(1000)))
    assert service._tasks == set()  # a long-lived tokenizer spawns one per KV snapshot
    waiting = service.spawn(asyncio.Event().wait())
    assert service._tasks == {waiting}
    await service.shutdown()
    await asyncio.wait([waiting])
    assert waiting.cancelled() and service._tasks == set()


async def test_a_failed_background_task_is_logged():
    service = Service(ServerArgs())

    async def boom() -> None:
        raise RuntimeError("lost the thread")

    with structlog.testing.capture_logs() as logs:
        await asyncio.wait([service.spawn(boom())])
        await asyncio.sleep(0)  # the done callback runs on the loop's next turn
    assert [(e["event"], e["error"]) for e in logs] == [
        ("background task failed", "RuntimeError('lost the thread')")]
    assert service._tasks == set()
