"""What the server may fetch an image from, and how much of it: `MediaPolicy` and its checks.

Address rule (checked on every resolved address of every hop, see `fetch.py`): a target is
refused when it is unspecified, link-local (169.254.0.0/16 with the cloud metadata address,
fe80::/10), multicast, reserved or documentation space, or one of the known cloud metadata
addresses; and, unless `allow_private` is set (intranet deployments, and tests on loopback), when
it is loopback, private (RFC 1918, fc00::/7, fec0::/10) or carrier-grade NAT (100.64.0.0/10).
IPv6 forms that embed an IPv4 address (IPv4-mapped, NAT64, 6to4) are judged by that address.

Domain rule: with `allowed_domains` set, a URL's host must be one of them or a subdomain of one
("example.com" allows "example.com" and "cdn.example.com", not "badexample.com").
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sluice.tokenizer.normalize import RequestError

if TYPE_CHECKING:
    from sluice.config import ServerArgs

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

_V4 = ipaddress.IPv4Network
_V6 = ipaddress.IPv6Network

# refused whatever the policy: (network, what it is)
_ALWAYS_REFUSED: tuple[tuple[_V4 | _V6, str], ...] = (
    (_V4("169.254.169.254/32"), "the cloud metadata address"),
    (_V4("100.100.100.200/32"), "a cloud metadata address"),  # Alibaba Cloud
    (_V6("fd00:ec2::254/128"), "a cloud metadata address"),  # AWS over IPv6
    (_V4("0.0.0.0/8"), "an unspecified address"),
    (_V4("169.254.0.0/16"), "a link-local address"),
    (_V4("192.0.0.0/24"), "a reserved address"),
    (_V4("192.0.2.0/24"), "a reserved address"),
    (_V4("192.88.99.0/24"), "a reserved address"),
    (_V4("198.51.100.0/24"), "a reserved address"),
    (_V4("203.0.113.0/24"), "a reserved address"),
    (_V4("224.0.0.0/4"), "a multicast address"),
    (_V4("240.0.0.0/4"), "a reserved address"),  # with 255.255.255.255
    (_V6("::/128"), "an unspecified address"),
    (_V6("fe80::/10"), "a link-local address"),
    (_V6("ff00::/8"), "a multicast address"),
    (_V6("2001::/32"), "a Teredo address"),
    (_V6("2001:db8::/32"), "a reserved address"),
    (_V6("100::/64"), "a reserved address"),
)
# refused unless `allow_private`
_PRIVATE: tuple[tuple[_V4 | _V6, str], ...] = (
    (_V4("127.0.0.0/8"), "a loopback address"),
    (_V4("10.0.0.0/8"), "a private address"),
    (_V4("172.16.0.0/12"), "a private address"),
    (_V4("192.168.0.0/16"), "a private address"),
    (_V4("198.18.0.0/15"), "a private address"),  # benchmarking networks
    (_V4("100.64.0.0/10"), "a carrier-grade NAT address"),
    (_V6("::1/128"), "a loopback address"),
    (_V6("fc00::/7"), "a private address"),
    (_V6("fec0::/10"), "a private address"),  # site-local, deprecated
    (_V6("64:ff9b:1::/48"), "a private address"),  # local-use NAT64
)
_GLOBAL_UNICAST_V6 = _V6("2000::/3")
_NAT64 = _V6("64:ff9b::/96")


def _embedded_ipv4(ip: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 form carries (IPv4-mapped, NAT64 well-known prefix, 6to4)."""
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip in _NAT64:
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return ip.sixtofour


def address_refusal(ip: IPAddress, allow_private: bool) -> str | None:
    """Why `ip` may not be fetched from ("a loopback address"), or None when it may."""
    if isinstance(ip, ipaddress.IPv6Address):
        ip = ipaddress.IPv6Address(int(ip))  # without a %scope
        inner = _embedded_ipv4(ip)
        if inner is not None:
            reason = address_refusal(inner, allow_private)
            return None if reason is None else f"{reason} ({inner} inside IPv6)"
    for net, reason in _ALWAYS_REFUSED:
        if ip.version == net.version and ip in net:
            return reason
    for net, reason in _PRIVATE:
        if ip.version == net.version and ip in net:
            return None if allow_private else reason
    if ip.version == 6 and ip not in _GLOBAL_UNICAST_V6:
        return "a reserved address"  # outside 2000::/3 and none of the ranges above
    return None


def normalize_domain(domain: str) -> str:
    """Lower case, IDNA-encoded, without a trailing dot or a leading "*." / "."."""
    name = domain.strip().lower().rstrip(".")
    for prefix in ("*.", "."):
        name = name.removeprefix(prefix)
    try:
        return name.encode("idna").decode("ascii")
    except UnicodeError:
        return name


def is_domain_allowed(host: str, allowed_domains: tuple[str, ...]) -> bool:
    """Whether `host` is one of `allowed_domains` (normalized) or a subdomain of one; any host
    when the list is empty."""
    if not allowed_domains:
        return True
    name = normalize_domain(host)
    return any(name == d or name.endswith("." + d) for d in allowed_domains)


class MediaError(RequestError):
    """An image the server will not take: a 400 whose message says why, with the numbers."""

    def __init__(self, message: str, code: str = "invalid_image", param: str = "image_url"):
        super().__init__(message, 400, code, param)


@dataclass(frozen=True)
class MediaPolicy:
    """Where images may come from and how large they may be; one per HTTP process.

    `allowed_local_path` is a real path (symlinks resolved) or None (local files refused)."""

    allowed_domains: tuple[str, ...] = ()
    allowed_local_path: str | None = None
    allow_private: bool = False
    fetch_timeout: float = 10.0  # seconds for one fetch, all redirects and the body included
    max_redirects: int = 5
    max_image_bytes: int = 20 * 1024 * 1024
    max_image_pixels: int = 25_000_000
    max_images: int = 16  # per request
    max_tiles: int = 128  # per request, of the processed images

    def __post_init__(self) -> None:
        domains = tuple(normalize_domain(d) for d in self.allowed_domains if d.strip())
        object.__setattr__(self, "allowed_domains", domains)
        if self.allowed_local_path is not None:
            real = os.path.realpath(self.allowed_local_path)
            if not os.path.isdir(real):
                raise ValueError(
                    f"--allowed-local-media-path {self.allowed_local_path!r} is not a directory"
                )
            object.__setattr__(self, "allowed_local_path", real)

    @classmethod
    def from_args(cls, args: ServerArgs) -> MediaPolicy:
        return cls(
            allowed_domains=args.allowed_media_domains,
            allowed_local_path=args.allowed_local_media_path,
            allow_private=args.allow_private_media_urls,
            fetch_timeout=args.media_fetch_timeout,
            max_redirects=args.max_media_redirects,
            max_image_bytes=args.max_image_bytes,
            max_image_pixels=args.max_image_pixels,
            max_images=args.max_images_per_request,
            max_tiles=args.max_image_tiles_per_request,
        )

    def check_num_images(self, num_images: int) -> None:
        if num_images > self.max_images:
            raise MediaError(
                f"the request has {num_images} images, over the limit of {self.max_images} "
                "per request (--max-images-per-request)",
                code="too_many_images",
            )

    def check_num_tiles(self, num_tiles: int, num_images: int, pixel_len: int) -> None:
        """The processed images of one request: at most `max_tiles` tiles in all."""
        if num_tiles > self.max_tiles:
            raise MediaError(
                f"the request's {num_images} images make {num_tiles} tiles "
                f"({format_bytes(pixel_len)} of pixels), over the limit of {self.max_tiles} "
                "tiles per request (--max-image-tiles-per-request)",
                code="too_many_image_tiles",
            )

    def too_many_bytes(self, source: str, byte_len: int | None = None) -> MediaError:
        """The refusal of an image of `byte_len` bytes (None: more than the limit, as read)."""
        limit = format_bytes(self.max_image_bytes)
        size = f"more than {limit}" if byte_len is None else format_bytes(byte_len)
        return MediaError(
            f"image_url: {source} is {size}, over the limit of {limit} per image "
            "(--max-image-bytes)",
            code="image_too_large",
        )


def format_bytes(num_bytes: int) -> str:
    if num_bytes < 1024 * 1024:
        return f"{num_bytes} bytes"
    return f"{num_bytes / (1024 * 1024):.1f} MiB"
