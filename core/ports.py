"""Local TCP ports for rendezvous and servers."""

import contextlib
import socket


def free_ports(count: int) -> list[int]:
    """``count`` distinct ports on 127.0.0.1 that were free a moment ago: the OS's picks, held open together
    while chosen so no two coincide (another process may still take one before it is used)."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]


def free_port() -> int:
    """One port of ``free_ports``."""
    return free_ports(1)[0]
