"""A worker rank that dies on another node, named by rank 0 (issue 57).

A rank of rank 0's own node that dies is found in ``/proc`` when ``mpirun`` ends the job (``launch._ending_note``).
One on another node gives rank 0 no such moment: Open MPI's TCP transport sees the connection to it break and ends
rank 0 at once, in C ("An error occurred in Socket closed ... MPI_ERRORS_ARE_FATAL", then "prterun has exited due
to process rank 0 ... calling abort", which blames a survivor), before any of mpifl's Python runs. So each worker on
another node keeps a TCP connection of its own open to rank 0 for the whole run (its lifeline): the worker's kernel
closes it the moment the process ends, however it ends (``kill -9``, the out-of-memory killer). What watches these
connections is a small process of rank 0's (this file run as a script, standard library only), not a thread: a
thread of rank 0 lost the race with Open MPI's abort on a busy machine (it waits for the interpreter's lock while
Open MPI's C code does not), a process of its own writes the line while rank 0 is being ended. It holds the lines
to write, one per worker, and rank 0's pipe: a byte on it silences the watcher (the run is stopping or ending on
purpose), its end (rank 0 gone) ends it. A worker that ends on purpose (the run's end, a stop, a failure it reports
itself) says goodbye first, which silences it too. A node that is lost whole (its cable, its power) closes nothing:
Open MPI names it. Where no connection can be made (a firewall), the run goes on without one.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import platform
import selectors
import socket
import struct
import subprocess
import sys
from collections.abc import Callable

CONNECT_S = 1.0
"""How long a worker tries each of rank 0's addresses at the start."""
GOODBYE = b"."
QUIET = b"q"
"""What rank 0 writes to its watcher when it stops or ends on purpose."""


def _addresses() -> list[str]:
    """This machine's IPv4 addresses, its hostname's first, loopback last (Linux's ``SIOCGIFADDR``)."""
    found: list[str] = []
    with contextlib.suppress(OSError):
        found += [str(info[4][0]) for info in socket.getaddrinfo(platform.node(), None, socket.AF_INET)]
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            with contextlib.suppress(OSError):
                request = struct.pack("256s", name[:15].encode())
                found.append(socket.inet_ntoa(fcntl.ioctl(probe.fileno(), 0x8915, request)[20:24]))
    unique = list(dict.fromkeys(found))
    return [a for a in unique if not a.startswith("127.")] + [a for a in unique if a.startswith("127.")]


class Lifeline:
    """Start with :meth:`open` (a collective); :meth:`close` on every rank when it ends on purpose."""

    def __init__(self, sock: socket.socket | None = None, watcher: subprocess.Popen | None = None):
        self.sock, self.watcher = sock, watcher  # a worker's connection; rank 0's watcher

    @classmethod
    def open(cls, comm, peers: list[tuple[str, int]], report: Callable[[int], str]) -> Lifeline:  # noqa: ANN001
        """Rank 0 listens and starts its watcher; each worker on another host than rank 0's connects and says its
        rank. ``comm``: a Comm; ``report(rank)``: the line written when that rank's connection breaks."""
        rank = comm.Get_rank()
        remote = [r for r, (host, _) in enumerate(peers) if host != peers[0][0]]
        if not remote:
            return cls()
        listener = None
        if rank == 0:
            with contextlib.suppress(OSError):
                listener = socket.create_server(("", 0), backlog=len(remote))
        where = comm.bcast((listener.getsockname()[1], _addresses()) if listener else None, root=0)
        if listener is not None:
            with listener:
                return cls(watcher=_start_watcher(listener, {r: report(r) for r in remote}))
        if rank in remote and where is not None:
            port, addresses = where
            for address in addresses:
                with contextlib.suppress(OSError):
                    sock = socket.create_connection((address, port), timeout=CONNECT_S)
                    sock.sendall(struct.pack("!I", rank))
                    return cls(sock=sock)
        return cls()

    def quiet(self) -> None:
        """Rank 0 is stopping: no line from here on (safe in a signal handler)."""
        if self.watcher is not None and self.watcher.stdin is not None:
            with contextlib.suppress(OSError, ValueError):
                os.write(self.watcher.stdin.fileno(), QUIET)

    def close(self) -> None:
        """This rank ends on purpose: a worker says goodbye; rank 0 silences its watcher and lets it end."""
        if self.sock is not None:
            with contextlib.suppress(OSError):
                self.sock.sendall(GOODBYE)
                self.sock.close()
        if self.watcher is not None:
            self.quiet()
            with contextlib.suppress(OSError, ValueError, subprocess.TimeoutExpired):
                self.watcher.stdin.close()  # type: ignore[union-attr]
                self.watcher.wait(timeout=CONNECT_S * 5)


def _start_watcher(listener: socket.socket, lines: dict[int, str]) -> subprocess.Popen | None:
    """This file as rank 0's watcher process, handed the listening socket and the line for each worker (as JSON,
    its length first, on the pipe that then carries :data:`QUIET`); None where it cannot start."""
    try:
        watcher = subprocess.Popen([sys.executable, "-I", __file__, str(listener.fileno())], stdin=subprocess.PIPE,
                                   pass_fds=(listener.fileno(),), stdout=subprocess.DEVNULL)
    except OSError:
        return None
    payload = json.dumps(lines).encode()
    with contextlib.suppress(OSError):
        watcher.stdin.write(struct.pack("!Q", len(payload)) + payload)  # type: ignore[union-attr]
        watcher.stdin.flush()  # type: ignore[union-attr]
    return watcher


def _read_exactly(fd: int, size: int) -> bytes:
    data = b""
    while len(data) < size and (chunk := os.read(fd, size - len(data))):
        data += chunk
    return data


def _watch(listener: socket.socket) -> None:
    """The watcher: accept the workers' connections, and write one line when one breaks without goodbye, unless
    rank 0 said :data:`QUIET` first; a goodbye silences it too (a worker that fails says goodbye before it aborts
    the job, which kills the others); rank 0's end (its pipe's end) ends it. A break is looked at before the end
    seen at the same moment: Open MPI ends rank 0 because the worker died."""
    size = struct.unpack("!Q", _read_exactly(0, 8))[0]
    lines = {int(rank): line for rank, line in json.loads(_read_exactly(0, size)).items()}
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    selector.register(0, selectors.EVENT_READ)
    while True:
        broken, quiet, ended = [], False, False
        for key, _ in selector.select():
            if key.fileobj is listener:
                with contextlib.suppress(OSError, struct.error):
                    conn, _ = listener.accept()
                    conn.settimeout(CONNECT_S * 5)
                    worker = struct.unpack("!I", conn.recv(4, socket.MSG_WAITALL))[0]
                    conn.setblocking(False)
                    selector.register(conn, selectors.EVENT_READ, worker)
                continue
            try:
                data = os.read(0, 64) if key.fileobj == 0 else key.fileobj.recv(64)  # type: ignore[union-attr]
            except BlockingIOError:
                continue
            except OSError:
                data = b""
            quiet = quiet or bool(data)  # rank 0's QUIET or a worker's goodbye
            if not data:
                ended = ended or key.fileobj == 0
                if key.fileobj != 0:
                    broken.append(key.data)
        if broken and not quiet:
            with contextlib.suppress(OSError):
                os.write(2, f"{lines[broken[0]]}\n".encode())
        if broken or quiet or ended:
            return


if __name__ == "__main__":
    _watch(socket.socket(fileno=int(sys.argv[1])))
