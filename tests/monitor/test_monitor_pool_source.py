"""A real Sender's stats as a pool source, scraped over HTTP from 127.0.0.1."""

from __future__ import annotations

import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

torch = pytest.importorskip("torch")

import tensorferry  # noqa: E402
import tensorferry.monitor  # noqa: E402


def scrape(url: str) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    with urllib.request.urlopen(url, timeout=10) as resp:
        assert resp.status == 200
        text = resp.read().decode()
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def test_sender_stats_as_a_pool_source_scraped_over_http() -> None:
    sender = tensorferry.Sender("tcp", capacity_nbytes=1 << 20)
    try:
        stats = sender.stats()
        # The Sender's dict has more than the monitor's keys (live_tickets): they are ignored.
        assert set(tensorferry.monitor._pools.POOL_KEYS) < set(stats) and "live_tickets" in stats
        # The recipe of docs/monitor.md: a Sender's stats as they are.
        tensorferry.monitor.register_pool_source("weights", sender.stats, role="sender")
        try:
            tensor = torch.arange(4096, dtype=torch.float32)  # 16 KiB
            ticket = sender.put(tensor)
            with tensorferry.Receiver("tcp", timeout=20.0) as receiver:
                got = receiver.get(ticket)
            assert torch.equal(got, tensor)
            sender.wait_released(ticket, timeout=20.0)
            want = sender.stats()
            assert want["transfers"] >= 1 and want["bytes_moved"] >= tensor.numel() * 4
            with tensorferry.monitor.serve_prometheus(None, host="127.0.0.1", port=0) as server:
                assert server.host == "127.0.0.1" and server.port > 0
                m = scrape(server.url)
            # The figures do not move while nothing is put or read.
            assert sender.stats() == want
            # A live ticket holds its group's bytes until released; put one for the used figure.
            held = sender.put(torch.ones(1024, dtype=torch.float64), readers=None)
            try:
                held_stats = sender.stats()
                with tensorferry.monitor.serve_prometheus(None, host="127.0.0.1", port=0) as server:
                    m_held = scrape(server.url)
            finally:
                sender.discard(held)
        finally:
            tensorferry.monitor.unregister_pool_source("weights")
    finally:
        sender.close()

    label = (("pool", "weights"), ("role", "sender"))
    for metrics, figures in ((m, want), (m_held, held_stats)):
        assert metrics["tensorferry_pool_capacity_bytes"][label] == figures["capacity_nbytes"] == 1 << 20
        assert metrics["tensorferry_pool_used_bytes"][label] == figures["used_nbytes"]
        assert metrics["tensorferry_pool_largest_free_bytes"][label] == figures["largest_free_nbytes"]
        assert metrics["tensorferry_pool_transfers_total"][label] == figures["transfers"]
        assert metrics["tensorferry_pool_moved_bytes_total"][label] == figures["bytes_moved"]
        assert metrics["tensorferry_pool_sources_failing"][()] == 0
        # Unknown keys never become metrics.
        assert not any("live_tickets" in name for name in metrics)
    assert held_stats["used_nbytes"] >= 1024 * 8 > want["used_nbytes"] - 1
    assert m_held["tensorferry_pool_largest_free_bytes"][label] <= (1 << 20) - 1024 * 8

    # Unregistered: the next scrape has no pool figures at all.
    with tensorferry.monitor.serve_prometheus(None, host="127.0.0.1", port=0) as server:
        after = scrape(server.url)
    assert "tensorferry_pool_capacity_bytes" not in after
