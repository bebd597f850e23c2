"""Image URLs fetched where the operator allows them (--image-urls): against a real HTTP server on this host, the
picture is fetched, redirects are followed a bounded number of times and checked again, a body past the size
limit and a server slower than the time limit are refused, and private, loopback and link-local addresses are
refused unless --image-urls-private allows them (server-side request forgery)."""

from __future__ import annotations

import base64
from collections.abc import Iterator

import pytest

from neuron import images
from neuron.config.settings import ImageLimits
from neuron.server.common import fetch
from testkit.origin import origin as serving_images
from testkit.vision import png

PICTURE = png(16, 16, seed=4)
WHERE = "messages[0].content[0].image_url.url"


@pytest.fixture(scope="module")
def origin() -> Iterator[str]:
    with serving_images({"/a.png": PICTURE}) as url:
        yield url


@pytest.fixture
def allowed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fetching on, from this host's own addresses too, with small limits."""
    limits = ImageLimits(image_urls=True, image_urls_private=True, image_fetch_timeout=1.0, max_image_bytes=4000)
    monkeypatch.setattr(images, "LIMITS", limits)


async def refused(url: str, says: str) -> None:
    with pytest.raises(images.ImageError, match=says) as caught:
        await fetch.image(url, WHERE)
    assert caught.value.param == WHERE


@pytest.mark.anyio
async def test_an_image_url_and_its_redirect_are_fetched(origin: str, allowed: None) -> None:
    assert await fetch.image(f"{origin}/a.png", WHERE) == PICTURE
    assert await fetch.image(f"{origin}/redirect", WHERE) == PICTURE
    picture = images.read(images.checked(f"{origin}/a.png", WHERE), PICTURE)
    inline = "data:image/png;base64," + base64.b64encode(PICTURE).decode()
    assert picture.digest == images.from_url(inline, WHERE).digest


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("path", "says"),
    [
        ("/loop", "redirects more than 3 times"),
        ("/to-file", "not an http\\(s\\) URL"),  # each redirect's target is checked again
        ("/missing", "answered HTTP 404"),
        ("/big", "at most 4,000 bytes \\(--max-image-bytes\\)"),  # its Content-Length says so
        ("/unsized", "at most 4,000 bytes"),  # cut off as it arrives
        ("/slow", "took over 1 s \\(--image-fetch-timeout\\)"),
    ],
)
async def test_bad_image_urls_are_refused_naming_the_part(origin: str, allowed: None, path: str, says: str) -> None:
    await refused(f"{origin}{path}", says)


@pytest.mark.anyio
async def test_a_closed_port_and_an_unknown_host_are_refused(allowed: None) -> None:
    await refused("http://127.0.0.1:9/a.png", "could not be fetched")
    await refused("http://no-such-host.invalid/a.png", "could not be resolved")


@pytest.mark.anyio
@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1/a.png",
        "http://localhost/a.png",
        "http://10.1.2.3/a.png",
        "http://192.168.0.1/a.png",
        "http://169.254.169.254/latest/meta-data/",  # a cloud's metadata service
        "http://[::1]/a.png",
        "http://[::ffff:127.0.0.1]/a.png",  # loopback, written as IPv6
        "http://0.0.0.0/a.png",
    ],
)
async def test_private_loopback_and_link_local_addresses_are_refused_unless_allowed(
    monkeypatch: pytest.MonkeyPatch, url: str
) -> None:
    monkeypatch.setattr(images, "LIMITS", ImageLimits(image_urls=True, image_fetch_timeout=2.0))
    await refused(url, "--image-urls-private")


def test_image_urls_are_refused_unless_the_operator_allows_them(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(images.ImageError, match="--image-urls"):
        images.checked("https://example.com/a.png", WHERE)
    monkeypatch.setattr(images, "LIMITS", ImageLimits(image_urls=True))
    assert images.checked("https://example.com/a.png", WHERE).remote
