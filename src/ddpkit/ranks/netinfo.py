"""Which local address and network interface face the other nodes (multi-node launch only).

    addr = route_addr("10.0.0.1")       # the local IP the kernel would use to reach it
    interface_of(addr)                   # e.g. "eth1"; None if not found

torch's defaults name this node by ``socket.getfqdn()``, which on many Debian/Ubuntu
images resolves to 127.0.1.1 and on multi-homed nodes to the wrong network. Asking the
routing table how to reach the rendezvous host gives the address the other nodes can
actually connect back to.
"""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct

from ..errors import ConfigError

_SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address


def split_endpoint(endpoint: str) -> tuple[str, int]:
    host, _, port = endpoint.rpartition(":")
    return host.strip("[]"), int(port)


def route_addr(host: str) -> str:
    """The local IP address of the route to ``host``. A UDP connect sends no packet."""
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
    except socket.gaierror as exc:
        raise ConfigError(
            f"--rdzv-endpoint host {host!r} does not resolve ({exc.strerror}); "
            f"use an IP address or a name every node can resolve"
        ) from None
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        try:
            s.connect(sockaddr)
        except OSError as exc:
            raise ConfigError(f"no route from this node to --rdzv-endpoint host {host!r} ({exc.strerror})") from None
        return s.getsockname()[0]


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def is_local(addr: str) -> bool:
    """True when ``addr`` is one of this machine's addresses (so it could host the store)."""
    try:
        family = socket.getaddrinfo(addr, None)[0][0]
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((addr, 0))
        return True
    except OSError:
        return False


def interface_of(addr: str) -> str | None:
    """The name of the interface that holds IPv4 ``addr``, or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address on it
                continue
            if socket.inet_ntoa(packed[20:24]) == addr:
                return name
    return None
