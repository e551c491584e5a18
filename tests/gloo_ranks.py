"""Run one test function per rank in processes of their own and collect what each puts on the result queue."""

from redline.ports import free_port


def run_ranks(ctx, target, world: int, args_of, timeout: float) -> dict:
    """Start ``world`` processes of ``ctx`` (a multiprocessing context) running ``target(*args_of(rank, port),
    results)`` — ``port`` one free port for the group's rendezvous — and return ``{rank: value}`` from the
    ``(rank, value)`` pairs they put on ``results`` (a rank that failed puts its traceback as a string)."""
    results, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=target, args=(*args_of(rank, port), results), daemon=True) for rank in range(world)]
    for p in procs:
        p.start()
    outcome = dict(results.get(timeout=timeout) for _ in procs)
    for p in procs:
        p.join(timeout)
    return outcome
