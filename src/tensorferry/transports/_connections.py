"""Receiver-side plumbing shared by every transport: pooled channels,
the releaser of zero-copy holds, and the resources a receiver lends its
channels.

* :class:`ChannelPool` keeps idle channels per sender (one per concurrent
  get), drops the ones whose sender hung up, and closes a channel that
  zero-copy views still use only after the last of them is gone.
* :class:`Releaser` sends the Release of a zero-copy hold when its views
  are collected: finalizers only enqueue, one thread does the socket work.
* :class:`ReceiveContext` is what a channel may use of its receiver (the
  receive pool, made on demand; per-transport state such as nixl's
  endpoint), through methods, never by changing the receiver's fields.
"""

from __future__ import annotations

import queue
import select
import threading
from typing import Any, Callable

from ..errors import ConfigurationError, TicketError
from ..memory import DEFAULT_CAPACITY_NBYTES, MemoryPool

__all__ = ["ChannelPool", "Releaser", "ReceiveContext"]


class ReceiveContext:
    """The resources a Receiver lends its channels; closed with it.

    Args:
        pool: the receiver's receive pool, if it was given one.
        capacity_nbytes: size of the pool :meth:`ensure_pool` makes.
    """

    def __init__(self, pool: MemoryPool | None, *, capacity_nbytes: int = DEFAULT_CAPACITY_NBYTES) -> None:
        self._pool = pool
        self._own_pool = False
        self._capacity_nbytes = capacity_nbytes
        # Reentrant: a resource's maker may ask for the pool.
        self._lock = threading.RLock()
        self._resources: dict[str, Any] = {}

    @property
    def pool(self) -> MemoryPool | None:
        return self._pool

    def ensure_pool(self) -> MemoryPool:
        """The receive pool, made now if there is none (nixl reads into
        registered memory)."""
        with self._lock:
            if self._pool is None:
                self._pool = MemoryPool(self._capacity_nbytes)
                self._own_pool = True
            return self._pool

    def resource(self, key: str, make: Callable[[], Any]) -> Any:
        """The receiver's one ``key`` resource (made once by ``make``; a
        closed one is made again); closed with the context."""
        with self._lock:
            res = self._resources.get(key)
            if res is None or getattr(res, "closed", False):
                res = self._resources[key] = make()
            return res

    def close(self) -> None:
        with self._lock:
            resources, self._resources = list(self._resources.values()), {}
            pool = self._pool if self._own_pool else None
        for res in resources:
            res.close()
        if pool is not None:
            pool.close()


class Releaser:
    """Sends the Release of zero-copy holds when their views are collected.

    Finalizers run wherever the GC runs; they only enqueue here, and one
    thread does the (blocking) socket work.
    """

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="tensorferry-releaser", daemon=True)
        self._thread.start()

    def submit(self, channel: Any, ticket_id: int, piece: int) -> None:
        self._queue.put((channel, ticket_id, piece))

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            channel, ticket_id, piece = item
            with channel.lock:
                try:
                    channel.release(ticket_id, piece, timeout=10.0)
                except Exception:
                    pass  # the sender is gone; its pool went with it
                channel.holds -= 1
                if channel.holds == 0 and channel.retired:
                    channel.close()

    def stop(self) -> None:
        self._queue.put(None)


class ChannelPool:
    """Idle channels per sender, reused by later gets. Thread-safe.

    Args:
        channel_class: ``name -> Channel subclass``.
        token: the shared secret the channels prove they hold.
        context: lent to every channel.
        tls: a client ``ssl.SSLContext`` for the channels that cross a link.
    """

    def __init__(self, channel_class: Callable[[str], type], *, token: bytes, context: ReceiveContext, tls: Any = None) -> None:
        self._channel_class = channel_class
        self._token = token
        self.tls = tls
        self._context = context
        self._lock = threading.Lock()
        self._idle: dict[tuple[str, str], list[Any]] = {}
        self._all: list[Any] = []
        self._closed = False

    def checkout(self, transport: str, address: str, pool_generation: int, ticket_id: int, timeout: float) -> Any:
        """A connected channel to the sender at ``address`` (idle or new).

        Raises:
            TicketError: the sender restarted since the ticket was made.
            ConfigurationError: the pool (its receiver) is closed.
        """
        key = (transport, address)
        with self._lock:
            if self._closed:
                raise ConfigurationError("this Receiver is closed; make a new one")
            idle = self._idle.get(key)
            hung: list[Any] = []
            ch = None
            while idle:
                cand = idle.pop()
                if not cand.closed and not _hung_up(cand.sock):
                    ch = cand
                    break
                hung.append(cand)
        for dead in hung:
            self.discard(dead)
        if ch is None:
            self.prune()
            ch = self._channel_class(transport)(address, token=self._token, timeout=timeout, context=self._context, tls=self.tls)
            with self._lock:
                self._all.append(ch)
        if ch.welcome.pool_generation != pool_generation:
            self.give_back(ch)
            raise TicketError(
                f"ticket {ticket_id} is from an earlier pool of the sender at {address} "
                "(the sender restarted); ask for a new ticket"
            )
        return ch

    def give_back(self, ch: Any) -> None:
        """Return a channel after a get that left its stream clean."""
        with self._lock:
            if self._closed or ch.closed:
                return
            self._idle.setdefault((ch.transport, ch.address), []).append(ch)

    def discard(self, ch: Any) -> None:
        """Close a channel (now, or after the zero-copy views that need it)."""
        with ch.lock:
            if ch.holds:
                ch.retired = True
            else:
                ch.close()

    def prune(self) -> None:
        """Close idle channels whose sender hung up (it exited or closed).

        Each holds a socket and, for shm, a mapping of that sender's whole
        pool (which keeps the pool's memory alive); a long-lived receiver
        must not keep one per sender it ever talked to.
        """
        with self._lock:
            dead = []
            for key, chans in list(self._idle.items()):
                alive = [c for c in chans if not c.closed and not _hung_up(c.sock)]
                dead += [c for c in chans if not any(c is a for a in alive)]
                if alive:
                    self._idle[key] = alive
                else:
                    del self._idle[key]
        for ch in dead:
            self.discard(ch)
        with self._lock:
            self._all = [c for c in self._all if not c.closed]

    def idle_keys(self) -> list[tuple[str, str]]:
        """``(transport, address)`` of the senders with an idle channel."""
        with self._lock:
            return [k for k, chans in self._idle.items() if chans]

    def close(self) -> None:
        with self._lock:
            self._closed = True
            chans = list(self._all)
            self._idle.clear()
        for ch in chans:
            self.discard(ch)


def _hung_up(sock: Any) -> bool:
    """Whether an idle connection was closed by its sender.

    Between requests a sender sends nothing, so anything to read (the end of
    the stream, an error) means the connection is unusable.
    """
    try:
        poller = select.poll()
        poller.register(sock, select.POLLIN | select.POLLERR | select.POLLHUP)
        return bool(poller.poll(0))
    except (OSError, ValueError):
        return True
