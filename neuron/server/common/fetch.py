"""Image URLs fetched for a request, where the operator allows it (--image-urls). No MLX.

Fetching a URL a client names is a server-side request forgery risk: the server
reaches what the client may not (its loopback, its private network, a cloud's
metadata service at 169.254.169.254). So each host is resolved here and every
address it resolves to must be public (unless --image-urls-private); the request
then goes to the address that was checked, not to a second lookup a rebinding
DNS server could answer otherwise. Redirects are followed by hand, at most
``REDIRECTS``, each one checked the same way. The whole fetch, redirects
included, has --image-fetch-timeout; the body is read raw (no decompression) and
cut off past --max-image-bytes. Proxies from the environment are not used: they
would reach the address instead of the check.
"""

from __future__ import annotations

import ipaddress
import socket
from urllib.parse import urljoin, urlsplit

import anyio
import httpx

from neuron import images
from neuron.images import ImageError

REDIRECTS = 3
INLINE = "send the image inline as a data: URL (data:image/png;base64,...)"


async def image(url: str, where: str) -> bytes:
    """The bytes at ``url``, an http(s) URL a request's part ``where`` names; refusals are ``ImageError``s that
    name the part and say what to send instead."""
    timeout = images.LIMITS.image_fetch_timeout
    try:
        with anyio.fail_after(timeout):
            return await _follow(url, where)
    except TimeoutError:
        raise ImageError(
            f"`{where}`: fetching {_shown(url)} took over {timeout:g} s (--image-fetch-timeout); {INLINE}", where
        ) from None


async def _follow(url: str, where: str) -> bytes:
    async with httpx.AsyncClient(trust_env=False, follow_redirects=False, timeout=None) as client:
        for _ in range(REDIRECTS + 1):
            target, host, sni = await _checked(url, where)
            request = client.build_request(
                "GET",
                target,
                headers={"host": host, "accept": "image/*", "accept-encoding": "identity"},
                extensions={"sni_hostname": sni},
            )
            try:
                reply = await client.send(request, stream=True)
                try:
                    if reply.is_redirect and "location" in reply.headers:
                        url = urljoin(url, reply.headers["location"])
                        continue
                    if reply.status_code != 200:
                        raise ImageError(
                            f"`{where}`: {_shown(url)} answered HTTP {reply.status_code}; {INLINE}, or a URL that "
                            "serves it",
                            where,
                        )
                    return await _body(reply, where)
                finally:
                    await reply.aclose()
            except httpx.HTTPError as e:
                raise ImageError(
                    f"`{where}`: {_shown(url)} could not be fetched ({type(e).__name__}: {e}); {INLINE}", where
                ) from e
    raise ImageError(f"`{where}`: {_shown(url)} redirects more than {REDIRECTS} times; {INLINE}", where)


async def _checked(url: str, where: str) -> tuple[str, str, str]:
    """Where to send the request for ``url``: the URL with its host replaced by a checked address, the Host
    header, and the name TLS verifies the certificate against."""
    parts = urlsplit(url)
    if parts.scheme.lower() not in ("http", "https") or not parts.hostname:
        raise ImageError(f"`{where}`: {_shown(url)} is not an http(s) URL with a host; {INLINE}", where)
    if parts.username is not None or parts.password is not None:
        raise ImageError(f"`{where}`: an image URL may not carry a user or password; {INLINE}", where)
    host = parts.hostname
    try:
        port = parts.port or (443 if parts.scheme.lower() == "https" else 80)
        found = await anyio.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, ValueError) as e:
        raise ImageError(f"`{where}`: the host {host!r} could not be resolved ({e}); {INLINE}", where) from e
    addresses = [ipaddress.ip_address(str(sockaddr[0]).split("%", 1)[0]) for *_, sockaddr in found]
    if not addresses:
        raise ImageError(f"`{where}`: the host {host!r} resolves to no address; {INLINE}", where)
    if not images.LIMITS.image_urls_private:
        for address in addresses:
            if not _public(address):
                raise ImageError(
                    f"`{where}`: {host} is {address}, a private, loopback or link-local address, which this "
                    f"server does not fetch from (its operator may allow it with --image-urls-private); {INLINE}",
                    where,
                )
    target = httpx.URL(url).copy_with(host=str(addresses[0]), port=port)
    return str(target), parts.netloc.rpartition("@")[2], host


def _public(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_global and not address.is_multicast


async def _body(reply: httpx.Response, where: str) -> bytes:
    most = images.LIMITS.max_image_bytes
    length = reply.headers.get("content-length", "")
    if length.isdigit() and int(length) > most:
        raise images.too_large(where)
    body = bytearray()
    async for chunk in reply.aiter_raw():
        body += chunk
        if len(body) > most:
            raise images.too_large(where)
    return bytes(body)


def _shown(url: str) -> str:
    return repr(url if len(url) <= 120 else url[:117] + "...")
