"""Webhook targets: which URLs the server will POST to, and how it reaches them. The same
address policy guards the LoRA URLs a request names (``preheat.server.inputs``).

A webhook URL comes from the client, so without a policy the server would POST wherever it is
told (server-side request forgery: cloud metadata, databases on localhost, the private
network). The policy:

- ``http`` and ``https`` only;
- the host is resolved, and every address it resolves to must be public: loopback, private,
  link-local, multicast, reserved, unspecified, shared (CGNAT) and the cloud metadata addresses
  are refused, unless ``allow_private`` is set or the host / an address / a CIDR is on the
  allow-list (metadata addresses only by the allow-list);
- the delivery connects to the address that was checked (the URL's host becomes the ``Host``
  header and the TLS server name), so a second DNS answer cannot redirect it;
- redirects are never followed (the client is built with ``follow_redirects=False``).

The URL is checked when the prediction is submitted (422 naming ``webhook``) and again before
every delivery (DNS may have changed since).
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from dataclasses import dataclass
from typing import Any, Optional, Union
from urllib.parse import urlsplit, urlunsplit

__all__ = ["WebhookPolicy", "WebhookRefused", "Target", "METADATA_ADDRESSES", "delivery_client"]

IPAddress = Union[ipaddress.IPv4Address, ipaddress.IPv6Address]

# Instance-metadata endpoints of the big clouds (AWS/GCP/Azure/OpenStack, AWS IPv6, ECS task
# metadata, Alibaba, Oracle): refused even with allow_private; only an allow-list entry admits one.
METADATA_ADDRESSES = frozenset(ipaddress.ip_address(a) for a in (
    "169.254.169.254", "fd00:ec2::254", "169.254.170.2", "100.100.100.200", "192.0.0.192"))


def delivery_client() -> Any:
    """The HTTP client deliveries go through: 10 s timeout, redirects never followed (a redirect
    would lead to an address nobody checked)."""
    import httpx

    return httpx.AsyncClient(timeout=httpx.Timeout(10.0), follow_redirects=False)


class WebhookRefused(ValueError):
    """A webhook URL the policy does not allow; ``str()`` is one line for the 422."""


@dataclass(frozen=True)
class Target:
    """Where one delivery goes: ``url`` names the checked address; ``host`` is the original
    ``Host`` header and ``sni`` the TLS server name (None for http)."""

    url: str
    host: str
    sni: Optional[str]


def _unmapped(ip: IPAddress) -> IPAddress:
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def _kind(ip: IPAddress) -> Optional[str]:
    """Why ``ip`` is not a public address (None when it is)."""
    ip = _unmapped(ip)
    if ip in METADATA_ADDRESSES:
        return "a cloud metadata address"
    for name, flag in (("loopback", ip.is_loopback), ("link-local", ip.is_link_local),
                       ("multicast", ip.is_multicast), ("unspecified", ip.is_unspecified),
                       ("private", ip.is_private), ("reserved", ip.is_reserved)):
        if flag:
            return name
    if not ip.is_global:
        return "not a public address"
    return None


@dataclass(frozen=True)
class WebhookPolicy:
    """``allow_private``: admit non-public addresses (not metadata ones). ``allow``: host names,
    addresses or CIDRs admitted whatever they are (e.g. ``127.0.0.1``, ``10.1.0.0/16``)."""

    allow_private: bool = False
    allow: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for entry in self.allow:
            self._network(entry)  # host names pass; a malformed CIDR raises here

    @staticmethod
    def _network(entry: str) -> Optional[Union[ipaddress.IPv4Network, ipaddress.IPv6Network]]:
        text = entry.strip().strip("[]")
        try:
            return ipaddress.ip_network(text, strict=False)
        except ValueError:
            if "/" in text:
                raise WebhookRefused(f"webhook allow-list entry {entry!r} is not a valid CIDR") from None
            return None  # a host name

    def _allowed(self, host: str, ip: IPAddress) -> bool:
        for entry in self.allow:
            net = self._network(entry)
            if net is None:
                if entry.strip().lower().rstrip(".") == host.lower().rstrip("."):
                    return True
            elif _unmapped(ip) in net or ip in net:
                return True
        return False

    def refusal(self, host: str, ip: IPAddress) -> Optional[str]:
        """Why the policy refuses ``ip`` (resolved from ``host``), e.g. "10.0.0.1 is private"; None
        when it admits it."""
        if self._allowed(host, ip):
            return None
        kind = _kind(ip)
        if kind is None or (self.allow_private and kind != "a cloud metadata address"):
            return None
        shown = host if host == str(ip) else f"{host} ({ip})"
        return f"{shown} is {kind}"

    def check_address(self, host: str, ip: IPAddress) -> None:
        """Raise :class:`WebhookRefused` unless the policy admits ``ip`` (resolved from ``host``)."""
        why = self.refusal(host, ip)
        if why is not None:
            raise WebhookRefused(f"{why}; webhooks go to public addresses only "
                                 "(see --webhook-allow-private and --webhook-allow)")

    async def resolve(self, url: str) -> Target:
        """Check ``url`` and pick the address to connect to; raises :class:`WebhookRefused`."""
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https"):
            raise WebhookRefused(f"scheme {parts.scheme!r} is not allowed; use http or https")
        host = parts.hostname
        if not host:
            raise WebhookRefused("the URL has no host")
        try:
            port = parts.port or (443 if parts.scheme == "https" else 80)
        except ValueError:
            raise WebhookRefused("the URL has an invalid port") from None
        try:
            literal: Optional[IPAddress] = ipaddress.ip_address(host.split("%")[0])
        except ValueError:
            literal = None
        if literal is not None:
            addresses = [literal]
        else:
            try:
                infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
            except (socket.gaierror, UnicodeError) as err:
                raise WebhookRefused(f"cannot resolve {host}: {err}") from None
            addresses = list(dict.fromkeys(ipaddress.ip_address(info[4][0].split("%")[0]) for info in infos))
            if not addresses:
                raise WebhookRefused(f"cannot resolve {host}")
        for ip in addresses:  # every answer must pass: the connection could use any of them
            self.check_address(host, ip)
        ip = addresses[0]
        netloc = f"[{ip}]:{port}" if ip.version == 6 else f"{ip}:{port}"
        pinned = urlunsplit((parts.scheme, netloc, parts.path or "/", parts.query, ""))
        host_header = parts.netloc.rpartition("@")[2]  # no userinfo in Host
        return Target(url=pinned, host=host_header, sni=host if parts.scheme == "https" else None)

    async def post(self, client: Any, url: str, body: Any) -> Any:
        """POST ``body`` as JSON to ``url`` through ``client`` (an ``httpx.AsyncClient`` that does
        not follow redirects), connecting to the address that was just checked."""
        target = await self.resolve(url)
        extensions = {"sni_hostname": target.sni} if target.sni else {}
        return await client.post(target.url, json=body, headers={"Host": target.host}, extensions=extensions)
