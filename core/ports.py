"""Local TCP ports for rendezvous and servers."""

import socket


def free_port() -> int:
    """A port on 127.0.0.1 that was free a moment ago (the OS's pick; another process may still take it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
