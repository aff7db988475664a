"""Where the kit test project's tasks land their effects."""

from typing import Any


def effect(key: str) -> None:
    from tests.testapp.models import Effect

    Effect.objects.create(key=key)


def chunked(task: Any, job: str, count: int, every: int) -> dict[str, int]:
    """A resumable job through ``task.checkpoint``: one ChunkItem row per item of range(count); where the run
    started and how many items it ran."""
    from tests.testapp.models import ChunkItem

    start, ran = task.checkpoint.position, 0
    for item in task.checkpoint.iterate(range(count), every=every):
        ChunkItem.objects.create(job=job, item=item, run=1)
        ran += 1
    return {"start": start, "ran": ran}
