"""A recording TCP proxy for the tests that check what crosses a link
(tests/transports/test_auth.py, test_relay_tls.py): a real proxy on
loopback, between a real peer and the process under test, that forwards
every connection and keeps every byte it saw, each way."""

from __future__ import annotations

import socket
import threading
import time

__all__ = ["RecordingProxy"]


class RecordingProxy:
    """A TCP proxy on loopback that forwards each connection to ``upstream``
    and records every byte, each way; it listens on 127.0.0.1 at ``port``
    (0: any free one; a relay bound to 127.0.0.2 at the same port, which
    advertises 127.0.0.1, is reached through it). ``rate_nbytes``: the most
    bytes a second it passes upstream to downstream on each connection
    (None: as fast as it can), a slow link to a sender."""

    def __init__(self, upstream: str, port: int = 0, rate_nbytes: int | None = None) -> None:
        host, up_port = upstream.rsplit(":", 1)
        self.upstream = (host, int(up_port))
        self.rate_nbytes = rate_nbytes
        self.listener = socket.create_server(("127.0.0.1", port))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.sessions: list[tuple[bytearray, bytearray]] = []  # (receiver -> sender, sender -> receiver)
        self._threads: list[threading.Thread] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                down, _ = self.listener.accept()
            except OSError:
                return
            up = socket.create_connection(self.upstream)
            rec = (bytearray(), bytearray())
            self.sessions.append(rec)
            for src, dst, buf, rate in ((down, up, rec[0], None), (up, down, rec[1], self.rate_nbytes)):
                t = threading.Thread(target=self._pump, args=(src, dst, buf, rate), daemon=True)
                t.start()
                self._threads.append(t)

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket, buf: bytearray, rate: int | None) -> None:
        started = time.monotonic()
        try:
            # 64 KiB at a time when slowed: the sleeps stay short and even.
            while data := src.recv(1 << 20 if rate is None else 1 << 16):
                buf += data
                dst.sendall(data)
                if rate is not None:
                    time.sleep(max(0.0, started + len(buf) / rate - time.monotonic()))
        except OSError:
            pass
        for s in (dst, src):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def captured(self) -> bytes:
        return b"".join(bytes(up) + bytes(down) for up, down in self.sessions)

    def close(self) -> None:
        self.listener.close()

    def __enter__(self) -> "RecordingProxy":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
