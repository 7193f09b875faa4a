"""Carries TCP connections between the local sandbox's own network namespace and the proxy.

Under bubblewrap the local sandbox's network namespace has only a loopback
device, so nothing on the host (the engine, the gRPC port, the proxy) is
reachable. This module bridges just the proxy, over a unix socket bound into the
sandbox: run as a script inside the sandbox, it listens on 127.0.0.1:PORT,
sends each connection to that socket, runs the command and exits with its
status; on the host, `serve` sends each connection on the socket to the
proxy's TCP port. Standard library only: inside the sandbox it runs under the
host's system Python.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
from collections.abc import Callable


def _pipe(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        try:
            dst.shutdown(socket.SHUT_WR)  # the peer sees the end of this direction only
        except OSError:
            pass


def _splice(conn: socket.socket, connect: Callable[[], socket.socket]) -> None:
    try:
        upstream = connect()
    except OSError:
        conn.close()
        return
    back = threading.Thread(target=_pipe, args=(upstream, conn), daemon=True)
    back.start()
    _pipe(conn, upstream)
    back.join()
    conn.close()
    upstream.close()


def serve(listener: socket.socket, connect: Callable[[], socket.socket]) -> None:
    """Accepts until the listener is shut down; each connection is spliced to a fresh `connect()`."""
    while True:
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        threading.Thread(target=_splice, args=(conn, connect), daemon=True).start()


def _unix(path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
    except OSError:
        sock.close()
        raise
    return sock


def main(argv: list[str]) -> int:
    """`PORT SOCKET -- CMD...`: forward 127.0.0.1:PORT to SOCKET while CMD runs."""
    port, path, separator, *cmd = argv
    if separator != "--" or not cmd:
        raise SystemExit("usage: proxy_forward.py PORT SOCKET -- CMD...")
    listener = socket.create_server(("127.0.0.1", int(port)), backlog=64)
    threading.Thread(target=serve, args=(listener, lambda: _unix(path)), daemon=True).start()
    try:
        code = subprocess.call(cmd)
    except OSError as exc:
        print(f"{cmd[0]}: {exc.strerror}", file=sys.stderr)
        return 127
    # A command killed by a signal reports as a shell would (128 + signal).
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
