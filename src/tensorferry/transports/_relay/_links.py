"""A child's kept connections to relays: authenticated once (with the
session that signs their Pulls), reused by later pulls of the same relay.
See :mod:`tensorferry.transports._relay`.

A new connection to a relay costs a connect, the token's handshake (two
round trips) and a Pull before the first byte. Between hosts whose links
are busy (every other hop of the chains is moving bytes then) each round
trip waits behind the links' queues and the relay's busy threads: measured
on 1 Gbit/s namespace hosts, a sharded sync of 4 replicas, a relay's
handshake took 0.1 to 0.66 s, while the hop above it was already
streaming. A kept connection costs only the Pull's round trip.
"""

from __future__ import annotations

import select
import socket
import threading
from collections import OrderedDict

from .._auth import Session

__all__ = ["RelayLinks"]

# Idle connections kept to one relay: a sharded get pulls one stream a
# source at once, several of them from the same relay at times (4 source
# ranks: up to 4).
IDLE_PER_RELAY = 4
# Idle connections kept in all (the oldest closed first): each is also a
# thread of the relay's server, waiting for the next Pull.
IDLE_TOTAL = 32


class RelayLinks:
    """Idle, authenticated stream connections to relays, by relay address.
    Thread-safe: a get's streams pull on threads of their own.

    Only a connection whose last Pull ended with every byte of its stream
    received is kept, so a kept one is at a frame boundary, with nothing
    unread. A relay that closed one meanwhile (it closed, or restarted at
    the same address) shows up as readable (end of file) here, and such a
    connection is dropped, not handed out.
    """

    def __init__(self, idle_per_relay: int = IDLE_PER_RELAY, idle_total: int = IDLE_TOTAL) -> None:
        # Oldest first: each connection's relay address and session (its
        # count of signed Pulls goes on from one pull to the next).
        self._idle: OrderedDict[socket.socket, tuple[str, Session]] = OrderedDict()
        self._per_relay, self._total = idle_per_relay, idle_total
        self._lock = threading.Lock()
        self._closed = False

    def take(self, address: str) -> tuple[socket.socket, Session] | None:
        """An idle connection to the relay at ``address`` and its session
        (the caller owns it: it keeps it or closes it), or None."""
        while True:
            with self._lock:
                sock = next((s for s, (a, _) in self._idle.items() if a == address), None)
                if sock is None:
                    return None
                _, session = self._idle.pop(sock)
            if _still_open(sock):
                return sock, session
            sock.close()

    def keep(self, address: str, sock: socket.socket, session: Session) -> None:
        """Keep ``sock`` (a connection to the relay at ``address`` at a
        frame boundary, ``session`` its signer) for the next pull of that
        relay; closes it if the links are closed or full for that relay."""
        drop: list[socket.socket] = []
        with self._lock:
            if self._closed or sum(a == address for a, _ in self._idle.values()) >= self._per_relay:
                drop.append(sock)
            else:
                self._idle[sock] = (address, session)
                while len(self._idle) > self._total:
                    drop.append(self._idle.popitem(last=False)[0])
        for s in drop:
            s.close()

    def close(self) -> None:
        """Close every idle connection; later ones are closed, not kept."""
        with self._lock:
            self._closed = True
            idle, self._idle = list(self._idle), OrderedDict()
        for s in idle:
            s.close()


def _still_open(sock: socket.socket) -> bool:
    """An idle connection has nothing to read: readable means the relay
    closed it (or sent what it should not have)."""
    try:
        return not select.select([sock], [], [], 0)[0]
    except (OSError, ValueError):
        return False
