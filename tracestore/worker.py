"""Child worker processes and their one protocol: pickled messages over a unix socketpair.

:func:`start` runs ``python -c`` with a small bootstrap, not ``multiprocessing``: spawn would run
the caller's ``__main__`` again (a trainer's script without a main guard would re-run itself). The
bootstrap reads the parent's ``sys.path`` from the socket, imports ``module`` and calls its
``function(sock)``; the child's loop ends when the socket closes, which also happens when the
parent dies. Messages, both ways: an 8-byte little-endian length, then a pickle. A child only
unpickles what its parent sends it. Used by the reader's read processes and by ``inspect``'s
parallel shard verification.

Example::

    proc, sock = start("tracestore.cli.verify", "worker_main")
    send(sock, unit)
    problems = recv(sock)
    stop(proc, sock)
"""

from __future__ import annotations

import contextlib
import pickle
import socket
import struct
import subprocess
import sys
from typing import Any

_LEN = struct.Struct("<Q")

_BOOT = (
    "import importlib, pickle, socket, struct, sys\n"
    "s = socket.socket(fileno=int(sys.argv[1]))\n"
    "(n,) = struct.unpack('<Q', s.recv(8, socket.MSG_WAITALL))\n"
    "sys.path[:0] = pickle.loads(s.recv(n, socket.MSG_WAITALL))\n"
    "getattr(importlib.import_module(sys.argv[2]), sys.argv[3])(s)\n"
)


def start(module: str, function: str) -> tuple[subprocess.Popen[bytes], socket.socket]:
    """A child running ``module.function(sock)`` and the parent's end of its socket. OSError when
    the interpreter cannot be started."""
    parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        proc = subprocess.Popen(
            [sys.executable, "-c", _BOOT, str(child.fileno()), module, function],
            pass_fds=[child.fileno()],
            stdin=subprocess.DEVNULL,
        )
    except OSError:
        parent.close()
        raise
    finally:
        child.close()
    try:
        send(parent, list(sys.path))  # read by the bootstrap, before it can import ``module``
    except OSError:
        stop(proc, parent)
        raise
    return proc, parent


def stop(proc: subprocess.Popen[bytes], sock: socket.socket, timeout: float = 10.0) -> None:
    """Close the parent's end (the child's loop then ends) and wait for the child; kill it after
    ``timeout`` seconds."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def send(sock: socket.socket, obj: Any) -> None:
    """One message: ``obj`` pickled, after its length."""
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    sock.sendall(_LEN.pack(len(data)) + data)


def recv(sock: socket.socket) -> Any:
    """The next message; EOFError when the other end closed."""
    (n,) = _LEN.unpack(recv_exact(sock, _LEN.size))
    return pickle.loads(recv_exact(sock, n))


def recv_exact(sock: socket.socket, n: int) -> bytearray:
    """Exactly ``n`` bytes; EOFError when the other end closes first."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise EOFError("the other end closed")
        got += k
    return buf
