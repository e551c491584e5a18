"""Run one test function per rank in processes of their own and collect what each puts on the result queue."""

from redline.ports import free_port


def run_ranks(ctx, target, world: int, args_of, timeout: float, *, daemon: bool = True) -> dict:
    """Start ``world`` processes of ``ctx`` (a multiprocessing context) running ``target(*args_of(rank, port),
    results)`` — ``port`` one free port for the group's rendezvous — and return ``{rank: value}`` from the
    ``(rank, value)`` pairs they put on ``results`` (a rank that failed puts its traceback as a string).
    ``daemon=False`` for ranks that start processes of their own (an engine process): a daemon may have none. A
    rank still running past ``timeout`` is killed."""
    results, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=target, args=(*args_of(rank, port), results), daemon=daemon)
             for rank in range(world)]
    for p in procs:
        p.start()
    try:
        outcome = dict(results.get(timeout=timeout) for _ in procs)
        for p in procs:
            p.join(timeout)
        return outcome
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()  # stuck: a non-daemon rank would otherwise hold up the test process's exit
