"""The harness's arguments, checked before anything is made (no root needed)."""

from __future__ import annotations

import pytest
from _hosts import Hosts, parse_rate


@pytest.mark.parametrize(("rate", "bits"), [("100mbit", 10**8), ("1gbit", 10**9), ("1.5Gbit", 15 * 10**8),
                                            ("512kibit", 512 << 10), (2000, 2000), ("7", 7)])
def test_rates_read_as_tc_reads_them(rate, bits):
    assert parse_rate(rate) == bits


@pytest.mark.parametrize("rate", ["100mbps", "fast", "0mbit", "", "-1gbit"])
def test_rates_tc_would_misread_are_refused(rate):
    with pytest.raises(ValueError, match="rate"):
        parse_rate(rate)


@pytest.mark.parametrize("count", [0, 255, 2.0])
def test_a_host_count_outside_one_subnet_is_refused(count):
    with pytest.raises(ValueError, match="1 to 254"):
        Hosts(count)
