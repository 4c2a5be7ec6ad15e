"""Refuse to start on a port that another process already listens on.

gRPC Python sets SO_REUSEPORT on its listening sockets by default, so a second server started on a busy
port would start and silently share it: the kernel spreads new connections over both, and a stale
instance (another model, an old build) answers part of the traffic. Each service therefore checks all
of its ports before it imports or loads anything (so the refusal is immediate), and its gRPC server binds
with ``grpc.so_reuseport`` off (so that two services starting at the same moment cannot both win).
"""

from __future__ import annotations

import errno
import socket


class PortInUse(SystemExit):
    """Raised before start-up; its one-line message goes to stderr and the process exits with code 1."""


def format_address(host: str, port: int) -> str:
    host = host.strip("[]")
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def port_in_use(host: str, port: int) -> bool:
    """True when binding ``host:port`` fails because some socket already holds it (port 0 is never in use).

    The probe binds as a server does (SO_REUSEADDR, so connections of a just-stopped server in TIME_WAIT do not
    count) but without SO_REUSEPORT, so any listener on that address, including a gRPC one, makes it fail.
    Other bind errors (an address this host does not have) are left for the real bind to report.
    """
    if port == 0:
        return False
    try:
        candidates = socket.getaddrinfo(host.strip("[]") or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror:
        return False
    for family, kind, proto, _, address in candidates:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(address)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    return True
    return False


def refuse_busy_ports(label: str, host: str, *ports: int) -> None:
    """Raises :class:`PortInUse` naming the first of ``ports`` (0s skipped) that is taken on ``host``."""
    for port in ports:
        if port and port_in_use(host, port):
            raise PortInUse(
                f"{label}: {format_address(host, port)} is already in use (is another instance running?); not starting"
            )
