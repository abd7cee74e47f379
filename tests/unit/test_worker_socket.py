"""The workers' request-plane socket sends small writes at once (TCP_NODELAY).

asyncio sets TCP_NODELAY only on sockets whose ``proto`` is IPPROTO_TCP; without it, a
response's second small write waited for the peer's delayed ACK (40 ms on Linux): measured with
``pdserve bench router``, a scripted worker's stream took 44 ms instead of about 1.4 ms.
"""

from __future__ import annotations

import socket

from pdserve.workers.roles.worker_app import bind_socket


def test_accepted_connections_have_nodelay() -> None:
    listener = bind_socket("127.0.0.1", 0)
    try:
        listener.listen(1)
        client = socket.create_connection(listener.getsockname(), timeout=5)
        conn, _ = listener.accept()
        try:
            assert conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
            assert listener.proto == socket.IPPROTO_TCP  # asyncio's own check passes too
        finally:
            conn.close()
            client.close()
    finally:
        listener.close()
