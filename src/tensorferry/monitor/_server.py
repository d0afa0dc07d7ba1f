"""The HTTP endpoint: ``/metrics`` for Prometheus, ``/healthz`` for probes.

``/metrics`` is :class:`MonitorCollector` through prometheus_client's WSGI
app, which negotiates the format (OpenMetrics and gzip where the scraper
asks); the text of the two formats scrapers ask for is written by
``_exposition`` (the same bytes, ~3x faster for 1,000 processes'
``--per-process`` series); ``/healthz``
is one line, 200 while the agent ticks and 503 once its last tick is older
than :data:`STALE_INTERVALS` intervals; ``/`` lists both; anything else is
404. Served by a threading WSGI server in a daemon thread.
"""

from __future__ import annotations

__all__ = ["DEFAULT_PORT", "STALE_INTERVALS", "PrometheusServer", "serve_prometheus"]

import gzip
import socket
import threading
import time
from collections.abc import Callable, Iterable
from socketserver import ThreadingMixIn
from typing import Any, Literal
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import choose_encoder, gzip_accepted

from ..errors import ConfigurationError
from ._agent import Agent
from ._checks import check_int
from ._config import DEFAULT_PORT
from ._exposition import Exposition, fast_format
from ._prometheus import MonitorCollector

STALE_INTERVALS = 3
"""``/healthz`` answers 503 once the last tick is older than this many intervals
(plus a second): the agent's thread is stuck or dead."""
# 65535: the largest TCP port; 0 lets the OS pick a free one.
_MAX_PORT = 65535
# zlib's fastest level; prometheus_client compresses at 9.
_GZIP_LEVEL = 1

StartResponse = Callable[[str, list[tuple[str, str]]], Any]


# How long the serving loop waits for a connection before it wakes to look
# for a stop request (socketserver's default, 0.5 s, wakes the process twice
# a second: ~0.1% of a core for nothing on a loaded node). close() wakes it.
POLL_SECONDS = 30.0


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        """Scrapes every few seconds would flood stderr."""


def health(agent: Agent | None, now: float | None = None) -> tuple[bool, str]:
    """``(healthy, one line)``: what ``/healthz`` answers."""
    if agent is None:
        return True, "ok: pools only (no agent)"
    snap = agent.latest
    if snap is None:
        return False, "starting: no tick yet"
    age = (time.time() if now is None else now) - snap.timestamp
    interval = agent.config.interval_seconds
    line = f"last tick {age:.1f}s ago, interval {interval:g}s, {len(snap.samples)} processes"
    if age > STALE_INTERVALS * interval + 1.0:
        return False, f"stale: {line}"
    return True, f"ok: {line}"


def _app(registry: CollectorRegistry, agent: Agent | None) -> Callable[[dict[str, Any], StartResponse], Iterable[bytes]]:
    metrics = make_wsgi_app(registry)
    fast = Exposition()

    def scrape(environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        # prometheus_client negotiates; the two formats scrapers ask for are
        # written by _exposition (the same bytes, faster at 1,000 processes).
        if environ.get("REQUEST_METHOD", "GET") == "GET" and not environ.get("QUERY_STRING"):
            encoder, content_type = choose_encoder(environ.get("HTTP_ACCEPT", ""))
            fmt = fast_format(encoder)
            body = fast.render(registry, fmt) if fmt is not None else None
            if body is not None:
                headers = [("Content-Type", content_type)]
                if gzip_accepted(environ.get("HTTP_ACCEPT_ENCODING", "")):
                    # Level 1: 1,000 processes' --per-process series (~0.9 MB)
                    # compress in 10 ms instead of 66 ms, to 145 KB instead of 116 KB.
                    body = gzip.compress(body, compresslevel=_GZIP_LEVEL)
                    headers.append(("Content-Encoding", "gzip"))
                start_response("200 OK", headers)
                return [body]
        return metrics(environ, start_response)  # type: ignore[no-any-return]

    def app(environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "/")
        if path == "/metrics":
            return scrape(environ, start_response)
        if path == "/healthz":
            ok, line = health(agent)
            status = "200 OK" if ok else "503 Service Unavailable"
        elif path == "/":
            status, line = "200 OK", "tensorferry monitor: /metrics (Prometheus), /healthz (health)"
        else:
            status, line = "404 Not Found", f"{path}: not here; /metrics or /healthz"
        body = (line + "\n").encode()
        start_response(status, [("Content-Type", "text/plain; charset=utf-8"), ("Content-Length", str(len(body)))])
        return [body]

    return app


class PrometheusServer:
    """A running endpoint (``/metrics``, ``/healthz``);
    [``close``][tensorferry.monitor.PrometheusServer.close] stops it."""

    def __init__(self, httpd: WSGIServer, thread: threading.Thread, registry: CollectorRegistry) -> None:
        self._httpd = httpd
        self._thread = thread
        self.registry = registry
        self.host: str = httpd.server_address[0]  # type: ignore[assignment]
        self.port: int = httpd.server_address[1]

    @property
    def url(self) -> str:
        """Where to scrape."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    @property
    def health_url(self) -> str:
        """Where a probe asks whether the agent ticks."""
        return self.url.rsplit("/", 1)[0] + "/healthz"

    def close(self) -> None:
        """Stop serving and release the port."""
        # The serving loop waits POLL_SECONDS for a connection before it looks
        # at the stop request: wake it with one (it reads nothing and ends).
        stopping = threading.Thread(target=self._httpd.shutdown, name="tensorferry-metrics-stop", daemon=True)
        stopping.start()
        host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(self.host, self.host)
        deadline = time.monotonic() + 10.0
        while stopping.is_alive() and time.monotonic() < deadline:
            try:
                socket.create_connection((host, self.port), timeout=1.0).close()
            except OSError:
                pass
            stopping.join(0.05)
        self._httpd.server_close()
        self._thread.join(5.0)

    def __enter__(self) -> PrometheusServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def serve_prometheus(
    agent: Agent | None = None,
    *,
    host: str = "127.0.0.1",
    port: int = DEFAULT_PORT,
    labels: Literal["group", "process"] = "group",
) -> PrometheusServer:
    """Serve the agent's figures (and registered pools) on ``http://host:port/metrics``.

    Args:
        agent: the agent to expose (it must be ticking, e.g. ``agent.start()``).
        host: the address to bind; loopback by default, so nothing is exposed
            beyond the machine unless asked.
        port: the port (``DEFAULT_PORT``, 21464); 0 picks a free one (see the
            returned ``.port``).
        labels: ``group`` or ``process`` (see
            [``MonitorCollector``][tensorferry.monitor.MonitorCollector]).

    Returns:
        The running server.

    Raises:
        ConfigurationError: ``labels`` is neither choice, ``port`` is not in
            0..65535, or ``host:port`` cannot be bound (in use, not an
            address of this machine); the OS's error is the cause.
    """
    if check_int("serve_prometheus(port)", port, 0, "must be an int in 0..65535 (0: a free one)") > _MAX_PORT:
        raise ConfigurationError(f"serve_prometheus(port={port!r}): must be an int in 0..65535 (0: a free one)")
    registry = CollectorRegistry(auto_describe=False)
    registry.register(MonitorCollector(agent, labels=labels))

    class Server(_Server):
        pass

    try:
        Server.address_family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        httpd = make_server(host, port, _app(registry, agent), Server, handler_class=_Quiet)
    except OSError as exc:
        raise ConfigurationError(
            f"serve_prometheus(host={host!r}, port={port}): cannot bind ({exc.strerror or exc}); "
            "pick another port (0: a free one) or an address of this machine"
        ) from exc
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": POLL_SECONDS}, name="tensorferry-metrics",
                              daemon=True)
    thread.start()
    return PrometheusServer(httpd, thread, registry)
