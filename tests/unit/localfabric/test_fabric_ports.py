"""The local fabric's ports stay its own: a process it restarts on its old port finds it free.

A drill SIGKILLs a node and the fabric restarts it on the same port. Ports from the
kernel's ephemeral range can be taken in between by any outbound connection's local end
(CI saw a restarted node fail with EADDRINUSE), so the fabric draws ports from below it.
"""

from __future__ import annotations

import socket

from localfabric.procs import fabric_port, port_or_free


def _ephemeral_start() -> int:
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        return int(f.read().split()[0])


def test_fabric_ports_are_below_the_ephemeral_range_and_never_handed_out_twice() -> None:
    ports = [fabric_port("127.0.0.1") for _ in range(100)]
    assert len(set(ports)) == len(ports)
    assert all(20000 <= p < _ephemeral_start() for p in ports)


def test_a_preferred_port_is_kept_when_free_and_replaced_when_taken() -> None:
    port = fabric_port("127.0.0.1")
    assert port_or_free(port, "127.0.0.1") == port
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen()
        other = port_or_free(port, "127.0.0.1")
    assert other != port and other < _ephemeral_start()
