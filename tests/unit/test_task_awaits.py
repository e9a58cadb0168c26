"""Awaiting a CacheTask that is already done (a small one-sided copy finishes inside the
call): it raises at once for a cancel already made, and is a schedule point only once per
slice of the endpoint's ``SchedulePoints`` (a loop turn costs about a tenth of such a pull),
so a loop of such awaits neither pays a loop turn each time nor starves the loop's other
tasks."""

from __future__ import annotations

import time

import anyio
import pytest

from llmdd_async._task import CacheTask, SchedulePoints

pytestmark = pytest.mark.anyio


def finished(points: SchedulePoints | None) -> CacheTask:
    task = CacheTask("pull", schedule_points=points)
    task.conclude(task.begin(None), None)
    return task


async def others_ran_during(awaits: int, points: SchedulePoints | None) -> int:
    """How many times a task started beside a loop of ``awaits`` awaits of a finished task got
    to run while that loop went on."""
    ran = 0
    done = False

    async def other() -> None:
        nonlocal ran
        while not done:
            ran += 1
            await anyio.lowlevel.checkpoint()

    async with anyio.create_task_group() as tg:
        tg.start_soon(other)
        task = finished(points)
        for _ in range(awaits):
            await task
        seen = ran
        done = True
    return seen


async def test_an_await_within_the_slice_takes_no_loop_turn() -> None:
    points = SchedulePoints(slice_s=3600)
    points.due()  # (a slice starts now)
    assert await others_ran_during(200, points) == 0


async def test_a_loop_of_awaits_lets_other_tasks_run_once_a_slice_is_over() -> None:
    points = SchedulePoints(slice_s=0)  # every await is past the slice
    assert await others_ran_during(200, points) >= 100


async def test_without_schedule_points_every_await_yields() -> None:
    assert await others_ran_during(200, None) >= 100


async def test_an_await_within_the_slice_is_still_a_cancellation_point() -> None:
    points = SchedulePoints(slice_s=3600)
    points.due()
    task = finished(points)
    reached = False
    with anyio.CancelScope() as scope:
        scope.cancel()
        await task
        reached = True
    assert scope.cancelled_caught
    assert not reached


async def test_a_failed_task_still_raises_within_the_slice() -> None:
    points = SchedulePoints(slice_s=3600)
    points.due()
    task = CacheTask("pull", schedule_points=points)
    task.conclude(task.begin(None), RuntimeError("boom"))
    with pytest.raises(Exception, match="boom"):
        await task


def test_a_slice_starts_again_at_each_schedule_point() -> None:
    points = SchedulePoints(slice_s=0.05)
    time.sleep(0.06)
    assert points.due()  # the first slice is over
    assert not points.due()  # a new one began with it
    time.sleep(0.06)
    assert points.due()
