"""Which local address and interface face the rendezvous host."""

import pytest

from ddpkit.errors import ConfigError
from ddpkit.ranks import netinfo


def test_loopback_routes_from_loopback():
    assert netinfo.route_addr("127.0.0.1") == "127.0.0.1"
    assert netinfo.interface_of("127.0.0.1") == "lo"
    assert netinfo.is_loopback("localhost") and netinfo.is_loopback("127.0.0.5") and not netinfo.is_loopback("10.0.0.1")


def test_local_and_foreign_addresses():
    assert netinfo.is_local("127.0.0.1")
    assert not netinfo.is_local("192.0.2.123")  # TEST-NET-1: never assigned to this machine
    assert netinfo.interface_of("192.0.2.123") is None


def test_unresolvable_endpoint_host_is_a_clear_error():
    with pytest.raises(ConfigError, match="does not resolve"):
        netinfo.route_addr("no-such-host.invalid")


def test_split_endpoint():
    assert netinfo.split_endpoint("node0:29500") == ("node0", 29500)
    assert netinfo.split_endpoint("[::1]:29500") == ("::1", 29500)
