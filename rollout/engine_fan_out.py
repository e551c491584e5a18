"""The calls every engine of a group must receive, sent to all of them at once.

``EngineFanOut`` implements the broadcast half of ``redline.rollout.engine.Engine`` for a class that holds
several engines and defines ``_engines()``; ``generate`` and ``health`` stay with that class, since each group
picks its engine per request and judges health its own way.
"""

import asyncio


class EngineFanOut:
    def _engines(self) -> list:
        """The engines a broadcast call reaches, in order."""
        raise NotImplementedError

    async def _all(self, method: str, *args) -> None:
        await asyncio.gather(*(getattr(engine, method)(*args) for engine in self._engines()))

    async def update_weights(self, buckets, version):
        buckets = [list(b) for b in buckets]  # each engine reads every bucket
        await self._all("update_weights", buckets, version)

    async def release_memory(self, tags):
        await self._all("release_memory", tags)

    async def resume_memory(self, tags):
        await self._all("resume_memory", tags)

    async def flush_cache(self):
        await self._all("flush_cache")

    async def pause(self):
        await self._all("pause")

    async def resume(self):
        await self._all("resume")

    async def shutdown(self):
        await self._all("shutdown")
