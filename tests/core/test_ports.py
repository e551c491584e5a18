"""Local port picks."""

from redline.ports import free_port, free_ports


def test_ports_picked_together_are_distinct():
    ports = free_ports(64)
    assert len(set(ports)) == 64 and all(0 < p < 65536 for p in ports)
    assert isinstance(free_port(), int)
