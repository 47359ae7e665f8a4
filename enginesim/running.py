"""A request's prompts running together: started together, then followed as tokens come.

A request may hold several prompts (a batch, `n` samples): they start together, the first
failure fails the request, and a stream interleaves their tokens as each gains some.
`start_all` runs every prompt to its first token (the first failure cancels
the others); `progress` then yields each prompt's element as it gains tokens, whatever
prompt they come from; `complete` waits for them all.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Sequence

from enginesim.engine import Engine, Prompt
from enginesim.responses import Element

log = logging.getLogger(__name__)


async def start_all(engine: Engine, prompts: Sequence[Prompt]) -> list[Element]:
    """Run every prompt to its first token; the first failure cancels the others."""
    started = time.monotonic()
    tasks = [asyncio.create_task(engine.generate(p)) for p in prompts]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in tasks:
            error = task.exception() if task.done() and not task.cancelled() else None
            if error is not None:
                raise error
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return [
        Element(index=i, prompt=p, generation=t.result(), started=started)
        for i, (p, t) in enumerate(zip(prompts, tasks, strict=True))
    ]


async def _pump(element: Element, queue: asyncio.Queue[tuple[Element, bool]]) -> None:
    try:
        async for token in element.generation.tokens:
            element.output_ids.append(token)
            queue.put_nowait((element, False))
    finally:
        queue.put_nowait((element, True))


async def complete(elements: Sequence[Element]) -> None:
    """Every element run to its end (a whole answer)."""
    async for _ in progress(elements):
        continue


async def progress(elements: Sequence[Element]) -> AsyncIterator[Element]:
    """Each element every time it gains tokens, and once more (finished) at its end."""
    queue: asyncio.Queue[tuple[Element, bool]] = asyncio.Queue()
    pumps = [asyncio.create_task(_pump(e, queue)) for e in elements]
    try:
        remaining = len(elements)
        while remaining:
            element, final = await queue.get()
            if final:
                element.finished = True
                remaining -= 1
            yield element
    finally:
        for pump in pumps:
            pump.cancel()
        for outcome in await asyncio.gather(*pumps, return_exceptions=True):
            if isinstance(outcome, Exception):
                log.error("token stream failed: %r", outcome)
