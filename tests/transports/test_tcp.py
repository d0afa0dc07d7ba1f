"""The address a tcp (or nixl) Sender puts in its tickets.

A sender bound to a wildcard must not hand out ``0.0.0.0``: a peer on
another host cannot connect there. Every connection here stays on this
host: the advertised address is checked to be one of this host's own (a
socket can bind it) before a receiver connects to it, so the kernel delivers
it over loopback.
"""

from __future__ import annotations

import socket

import pytest
import torch
from _transfer_helpers import require

from tensorferry import Receiver, Sender
from tensorferry.errors import ConfigurationError
from tensorferry.transports._tcp import is_wildcard, parse_address

MiB = 1 << 20


def _is_local(host: str) -> bool:
    """Whether ``host`` is an address of this machine (only those can be bound)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        try:
            s.bind((host, 0))
        except OSError:
            return False
    return True


def _ipv6_works() -> bool:
    if not socket.has_ipv6:
        return False
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::", 0))
    except OSError:
        return False
    return True


@pytest.mark.parametrize("transport", ["tcp", "nixl"])
@pytest.mark.parametrize("bind", ["0.0.0.0", "::"])
def test_a_wildcard_bind_advertises_an_address_of_this_host(transport, bind):
    require(transport)
    if ":" in bind and not _ipv6_works():
        pytest.skip("this machine cannot bind IPv6")
    obj = {"w": torch.arange(1000, dtype=torch.float32), "b": torch.ones(7, dtype=torch.int64)}
    with Sender(transport, capacity_nbytes=MiB, host=bind, token="s3cret-token-of-24-bytes") as sender:
        ticket = sender.put(obj)
        host, port = parse_address(ticket.address)
        assert not is_wildcard(host), ticket.address
        assert sender.address == ticket.address
        assert _is_local(host), f"{host} is not an address of this host"
        with Receiver(transport, token="s3cret-token-of-24-bytes", timeout=20.0) as receiver:
            got = receiver.get(ticket.to_bytes())
        assert got.keys() == obj.keys() and all(torch.equal(got[k], obj[k]) for k in obj)


def test_advertise_host_is_what_tickets_carry():
    with Sender("tcp", capacity_nbytes=MiB, host="0.0.0.0", token="t-is-a-token-of-24-bytes", advertise_host="127.0.0.1") as sender:
        ticket = sender.put(torch.arange(10))
        port = parse_address(sender.address)[1]
        assert ticket.address == f"127.0.0.1:{port}"
        with Receiver("tcp", token="t-is-a-token-of-24-bytes", timeout=20.0) as receiver:
            assert torch.equal(receiver.get(ticket), torch.arange(10))


def test_a_specific_bind_is_advertised_as_bound():
    with Sender("tcp", capacity_nbytes=MiB) as sender:
        assert sender.put(torch.ones(2)).address.startswith("127.0.0.1:")


@pytest.mark.parametrize("advertise", ["0.0.0.0", "::", "", 17])
def test_advertise_host_must_be_an_address_peers_can_use(advertise):
    with pytest.raises(ConfigurationError, match=f"advertise_host={advertise!r}"):
        Sender("tcp", capacity_nbytes=MiB, host="0.0.0.0", token="t-is-a-token-of-24-bytes", advertise_host=advertise)
