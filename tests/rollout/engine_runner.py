"""Driving an async engine from a synchronous test."""

import asyncio


def run(engine, coro_fn):
    """Run ``coro_fn(engine)`` on a fresh event loop, then shut the engine down."""
    async def main():
        try:
            return await coro_fn(engine)
        finally:
            await engine.shutdown()
    return asyncio.run(main())
