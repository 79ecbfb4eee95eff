"""Whether the server could listen on an address, asked before the model loads, so that a
port already in use is one line at start-up rather than a failure after it."""

from __future__ import annotations

import errno
import socket


def cannot_listen(host: str, port: int, port_hint: str = "") -> str | None:
    """Why a server cannot listen on `host:port` now, or None when it can (port 0 always can).
    The probe binds the way uvicorn does (SO_REUSEADDR), so a port in TIME_WAIT is free.
    `port_hint` follows the advice to choose another --port where the port is taken (`serve`
    names `make run PORT=...`, which starts it; the gateway has no such target)."""
    if port == 0:
        return None
    where = f"{host}:{port}"
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except socket.gaierror as e:
        return f"cannot listen on {where}: {e.strerror} (--host takes an address of this machine)"
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as e:
            hint = {
                errno.EADDRINUSE: "another server is listening there; choose another --port"
                + (f" ({port_hint})" if port_hint else ""),
                errno.EACCES: "ports below 1024 need privileges; choose a --port of 1024 or more",
                errno.EADDRNOTAVAIL: "that is not an address of this machine; try 127.0.0.1 or 0.0.0.0",
            }.get(e.errno or 0, "")
            return f"cannot listen on {where}: {e.strerror}" + (f" ({hint})" if hint else "")
    return None
