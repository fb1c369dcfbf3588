"""Who may reach the page and the API, by what name, and from where.

The Host header must name this service: a loopback name, the address it listens on (any of
this machine's addresses when it listens on all), or a name the owner lists in `api.hosts`,
with its port. Anything else is a DNS-rebinding attempt (a foreign name made to resolve to
this machine) and refused. An Origin, when sent, must be one of those too, under the
service's own scheme: a page from anywhere else may send requests but not act through them.

A request from this machine (a loopback address, or the connection's own address at both
ends) is answered as the loopback-only service always was: the page freely, the API with the
token. Any other device must have signed in; the token is not accepted from it.
"""

from __future__ import annotations

import ipaddress
import socket
from urllib.parse import urlsplit

WILDCARDS = ("0.0.0.0", "::")
_PROBE = ("192.0.2.1", 9)  # TEST-NET-1: a route lookup only, a UDP connect sends nothing


def ip_of(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        address = ipaddress.ip_address(text.strip("[]").split("%")[0])
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped:
        return address.ipv4_mapped
    return address


def is_loopback(host: str) -> bool:
    address = ip_of(host)
    return address is not None and address.is_loopback


def is_local(peer: str, own: str) -> bool:
    """A connection from this machine: from loopback, or from the address it reached."""
    peer_ip = ip_of(peer)
    return peer_ip is not None and (peer_ip.is_loopback or peer_ip == ip_of(own))


class Gate:
    """The names and origins this service answers to, and where it can be reached from."""

    def __init__(self, host: str, port: int, names: tuple[str, ...], https: bool):
        self.host, self.port, self.names = host, port, names
        self.scheme = "https" if https else "http"
        self.wildcard = host in WILDCARDS
        self.remote = not is_loopback(host)  # other devices can connect
        self._bound = ip_of(host)

    def host_allowed(self, header: str) -> bool:
        split = urlsplit(f"//{header.strip().lower()}")
        try:
            port = split.port or (443 if self.scheme == "https" else 80)
        except ValueError:
            return False
        name = split.hostname or ""
        if port != self.port or not name or split.username is not None or split.path:
            return False
        address = ip_of(name)
        if address is None:
            return name == "localhost" or (self.remote and name in self.names)
        if address.is_loopback:
            return True
        return self.remote and (self.wildcard or address == self._bound or name in self.names)

    def origin_allowed(self, origin: str) -> bool:
        split = urlsplit(origin.strip().lower())
        return (
            split.scheme == self.scheme
            and not split.path
            and not split.query
            and self.host_allowed(split.netloc)
        )

    def local_url(self) -> str:
        """Where this machine opens the page (and the CLI calls the API)."""
        return self._url(self.cli_host())

    def cli_host(self) -> str:
        if self.host == "0.0.0.0":
            return "127.0.0.1"
        return "::1" if self.host == "::" else self.host

    def remote_urls(self) -> list[str]:
        """Where other devices open the page: the address it listens on (this machine's
        address on its network, where it listens on all) and the names in `api.hosts`."""
        if not self.remote:
            return []
        first = primary_address(self.host) if self.wildcard else self.host
        hosts = [h for h in (first, *self.names) if h]
        return list(dict.fromkeys(self._url(h) for h in hosts))

    def _url(self, host: str) -> str:
        shown = f"[{host}]" if ":" in host else host
        return f"{self.scheme}://{shown}:{self.port}/"


def primary_address(wildcard: str) -> str | None:
    """This machine's address on the network its default route leaves by, if it has one."""
    family = socket.AF_INET6 if wildcard == "::" else socket.AF_INET
    probe = ("2001:db8::1", 9) if family == socket.AF_INET6 else _PROBE
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as udp:
            udp.connect(probe)
            address = str(udp.getsockname()[0])
    except OSError:
        return None
    return None if is_loopback(address) else address
