"""A worker rank that dies on another node, named by rank 0 (issue 57).

A rank of rank 0's own node that dies is found in ``/proc`` when ``mpirun`` ends the job (``launch._ending_note``).
One on another node gives rank 0 no such moment: Open MPI's TCP transport sees the connection to it break and ends
the rank at once, in C ("An MPI communication peer process has unexpectedly disconnected", then "prterun has
exited due to process rank 0 ... calling abort", which blames a survivor), before any of mpifl's Python runs. So
each worker on another node keeps a TCP connection of its own open to rank 0 for the whole run (its lifeline): the
worker's kernel closes it the moment the process ends, however it ends (``kill -9``, the out-of-memory killer),
and a thread of rank 0, asleep on these connections, writes at once which rank died, where and the command that
continues. A worker that ends on purpose (the run's end, a stop, a failure it reports itself) says goodbye first,
and rank 0 falls silent once it is stopping or ending itself. A node that is lost whole (its cable, its power)
closes nothing: Open MPI names it. Where no connection can be made (a firewall), the run goes on without one.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import platform
import selectors
import socket
import struct
import sys
import threading
from collections.abc import Callable

CONNECT_S = 1.0
"""How long a worker tries each of rank 0's addresses at the start."""
GOODBYE = b"."


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

    def __init__(self, rank: int, sock: socket.socket | None, quiet: threading.Event):
        self.rank, self.sock, self.quiet = rank, sock, quiet

    @classmethod
    def open(cls, comm, peers: list[tuple[str, int]], report: Callable[[int], str],  # noqa: ANN001 - a Comm
             silent: Callable[[], bool]) -> Lifeline:
        """Rank 0 listens and watches; each worker on another host than rank 0's connects and says its rank.
        ``report(rank)``: the line rank 0 writes when that rank's connection breaks, unless ``silent()``."""
        rank, quiet = comm.Get_rank(), threading.Event()
        remote = [r for r, (host, _) in enumerate(peers) if host != peers[0][0]]
        if not remote:
            return cls(rank, None, quiet)
        listener = None
        if rank == 0:
            with contextlib.suppress(OSError):
                listener = socket.create_server(("", 0), backlog=len(remote))
        where = comm.bcast((listener.getsockname()[1], _addresses()) if listener else None, root=0)
        sock = None
        if rank in remote and where is not None:
            port, addresses = where
            for address in addresses:
                with contextlib.suppress(OSError):
                    sock = socket.create_connection((address, port), timeout=CONNECT_S)
                    sock.sendall(struct.pack("!I", rank))
                    break
        if listener is not None:
            threading.Thread(target=_watch, args=(listener, report, silent, quiet), daemon=True,
                             name="mpifl-lifeline").start()
        return cls(rank, sock if rank else listener, quiet)

    def close(self) -> None:
        """This rank ends on purpose: a worker says goodbye; rank 0 reports nothing more."""
        self.quiet.set()
        if self.sock is not None and self.rank != 0:
            with contextlib.suppress(OSError):
                self.sock.sendall(GOODBYE)
                self.sock.close()


def _watch(listener: socket.socket, report: Callable[[int], str], silent: Callable[[], bool],
           quiet: threading.Event) -> None:
    """Rank 0's thread: accept the workers' connections, and write one line when one breaks without goodbye. Any
    goodbye silences it: the job is ending on purpose (a worker that fails says goodbye before it aborts the job,
    which kills the others)."""
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    while not quiet.is_set():
        broken = []
        for key, _ in selector.select(timeout=1.0):
            if key.fileobj is listener:
                with contextlib.suppress(OSError, struct.error):
                    conn, _ = listener.accept()
                    conn.settimeout(CONNECT_S * 5)
                    worker = struct.unpack("!I", conn.recv(4, socket.MSG_WAITALL))[0]
                    conn.setblocking(False)
                    selector.register(conn, selectors.EVENT_READ, worker)
                continue
            try:
                data = key.fileobj.recv(64)  # type: ignore[union-attr]
            except BlockingIOError:
                continue
            except OSError:
                data = b""
            if data:  # a goodbye
                quiet.set()
            else:
                broken.append(key.data)
        if broken and not (quiet.is_set() or silent()):
            with contextlib.suppress(OSError):
                os.write(sys.stderr.fileno(), f"{report(broken[0])}\n".encode())
        if broken:
            quiet.set()
