"""The images and video clips a request names: base64 data URLs, local files (only under an allowed
directory), and http(s) URLs (fetched within a time limit, a byte limit and a redirect limit, and never from a
loopback, private or link-local address unless allowed). Anything refused is a one-line RequestError raised
before the refused bytes are read.

    image = open_image(url, 0, policy)
    clip = open_video(url, 0, policy)  # the frames policy.video samples (data/video.py)

As vLLM's `--allowed-local-media-path`. A fetch connects to the very address it checked (the URL's host is
resolved once, the connection goes to that address with the host name kept for the Host header and TLS), so a
name that resolves to a public address for the check and to a private one for the connection gets nowhere;
responses are asked for and read unencoded (httpcore, which decodes nothing), so no compression can inflate
them past the byte limit; and every socket read and write gets only the time left before the fetch's deadline,
so no server answering one byte at a time can hold a request longer.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import io
import ipaddress
import os
import socket
import ssl
import stat
import time
from pathlib import Path
from urllib.parse import unquote, urljoin, urlparse

import httpcore
import httpx
from PIL import Image

from data import ImageLoadError, load_image
from data.video import Clip, VideoError, read_video
from models.split_config import VideoConfig
from serving.requests import RequestError

GLOBAL_IPV6 = ipaddress.ip_network("2000::/3")  # global unicast; every other IPv6 range is refused


@dataclasses.dataclass(frozen=True)
class MediaPolicy:
    """Where images and clips may come from, how much of them is read and for how long a clip's frames
    decode, and how a clip's frames are sampled (the served model's `config.video`)."""

    allowed_local_path: Path | None = None  # local files only under this directory (None: no local files)
    allow_private_urls: bool = False  # fetch from loopback / private / link-local addresses too
    max_bytes: int = 10 * 2**20  # an image's encoded size
    max_video_bytes: int = 64 * 2**20  # a clip's encoded size
    max_pixels: int = 4096 * 4096  # an image's (a clip frame's) decoded size (RGB 4096 x 4096 is 48 MiB)
    decode_timeout: float = 20.0  # seconds to decode a clip's sampled frames
    timeout: float = 10.0  # seconds for a whole fetch, redirects included
    max_redirects: int = 3
    video: VideoConfig = dataclasses.field(default_factory=VideoConfig)


def open_image(url: str, index: int, policy: MediaPolicy) -> Image.Image:
    """The RGB image `url` names (a data URL, a path or file:// URL, an http(s) URL); RequestError
    otherwise."""
    source = _open(url, f"image {index}", policy)
    try:
        return load_image(source, policy.max_pixels)
    except ImageLoadError as e:
        raise RequestError(str(e)) from None


def open_video(url: str, index: int, policy: MediaPolicy) -> Clip:
    """The frames `policy.video` samples of the clip `url` names (as `open_image`: only they are decoded, each
    scaled down to its max_side); RequestError for a clip that is not there or not readable."""
    source = _open(url, f"video {index}", dataclasses.replace(policy, max_bytes=policy.max_video_bytes))
    try:
        return read_video(source, policy.video, policy.max_pixels, policy.decode_timeout)
    except VideoError as e:
        raise RequestError(str(e)) from None


def _open(url: str, name: str, policy: MediaPolicy) -> io.BytesIO:
    """The bytes `url` names, as a file object called `name`; RequestError where refused."""
    try:
        if url.startswith("data:"):
            data = _data_url(url, name, policy)
        elif url.startswith(("http://", "https://")):
            data = _fetch(url, name, policy)
        elif url.startswith("file:"):
            parsed = urlparse(url)
            if parsed.netloc not in ("", "localhost"):
                raise RequestError(f"{name}: a file URL names no other host (file:///path)")
            data = _read_local(Path(unquote(parsed.path)), name, policy)
        elif "://" not in url:
            data = _read_local(Path(url), name, policy)
        else:
            raise RequestError(f"{name}: unsupported URL scheme (send a data URL, an http(s) URL or a local "
                               "path)")
    # malformed URLs and host names, NUL bytes in paths
    except (httpx.InvalidURL, UnicodeError, ValueError) as e:
        if isinstance(e, RequestError):
            raise
        raise RequestError(f"{name}: invalid URL ({type(e).__name__})") from None
    source = io.BytesIO(data)
    source.name = name
    return source


def _data_url(url: str, name: str, policy: MediaPolicy) -> bytes:
    header, _, payload = url.partition(",")
    if not header.endswith(";base64"):
        raise RequestError(f"{name}: a data URL must be base64-encoded (data:image/png;base64,...)")
    if len(payload) * 3 // 4 > policy.max_bytes:
        raise RequestError(f"{name}: larger than {policy.max_bytes} bytes")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise RequestError(f"{name}: invalid base64 data") from None


def _read_local(path: Path, name: str, policy: MediaPolicy) -> bytes:
    """A regular file whose real path (every symlink followed) lies under the allowed directory, read with a
    limit. Missing and outside files get the same answer (no oracle of what exists elsewhere); devices, pipes
    and directories are refused before they are opened, and the opened file's own path is checked again."""
    if policy.allowed_local_path is None:
        raise RequestError(f"{name}: local paths are not served (the server takes them only under "
                           f"--allowed-local-media-path DIR)")
    root = policy.allowed_local_path.resolve()
    unavailable = f"{name}: no such file under the allowed media directory"
    real = path.resolve()
    if not real.is_relative_to(root):
        raise RequestError(unavailable)
    try:
        if not stat.S_ISREG(os.stat(real).st_mode):
            raise RequestError(f"{name}: not a regular file")
        descriptor = os.open(real, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    except OSError:
        raise RequestError(unavailable) from None
    with os.fdopen(descriptor, "rb") as file:
        opened = Path(os.readlink(f"/proc/self/fd/{descriptor}")) if os.path.exists("/proc/self/fd") else real
        info = os.fstat(descriptor)
        if not opened.is_relative_to(root) or not stat.S_ISREG(info.st_mode):  # swapped since the check
            raise RequestError(unavailable)
        if info.st_size > policy.max_bytes:
            raise RequestError(f"{name}: larger than {policy.max_bytes} bytes")
        return file.read(policy.max_bytes + 1)[: policy.max_bytes]


class DeadlineStream(httpcore.NetworkStream):
    """A connection whose every read and write gets at most the time left before `deadline`."""

    def __init__(self, stream: httpcore.NetworkStream, deadline: float) -> None:
        self.stream, self.deadline = stream, deadline

    def _left(self, timeout: float | None) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise httpcore.ReadTimeout("the fetch's deadline passed")
        return left if timeout is None else min(timeout, left)

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self.stream.read(max_bytes, self._left(timeout))

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self.stream.write(buffer, self._left(timeout))

    def close(self) -> None:
        self.stream.close()

    def start_tls(self, ssl_context: ssl.SSLContext, server_hostname: str | None = None,
                  timeout: float | None = None) -> httpcore.NetworkStream:
        return DeadlineStream(self.stream.start_tls(ssl_context, server_hostname, self._left(timeout)),
                              self.deadline)

    def get_extra_info(self, info: str):
        return self.stream.get_extra_info(info)


class DeadlineBackend(httpcore.SyncBackend):
    def __init__(self, deadline: float) -> None:
        self.deadline = deadline

    def connect_tcp(self, host: str, port: int, timeout: float | None = None,
                    local_address: str | None = None, socket_options=None) -> httpcore.NetworkStream:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise httpcore.ConnectTimeout("the fetch's deadline passed")
        stream = super().connect_tcp(host, port, left if timeout is None else min(timeout, left),
                                     local_address, socket_options)
        return DeadlineStream(stream, self.deadline)


def _fetch(url: str, name: str, policy: MediaPolicy) -> bytes:
    """GET `url` through at most max_redirects redirects, each hop's address checked and pinned, the whole of
    it within policy.timeout."""
    deadline = time.monotonic() + policy.timeout
    with httpcore.ConnectionPool(network_backend=DeadlineBackend(deadline), retries=0) as pool:
        for _ in range(policy.max_redirects + 1):
            target = httpx.URL(url)
            if target.scheme not in ("http", "https") or not target.host:
                raise RequestError(f"{name}: redirected to {url}, not an http(s) URL")
            host = target.raw_host.decode("ascii")  # the IDNA-encoded name, as the Host header has it
            address = _checked_address(host, target.port or (443 if target.scheme == "https" else 80), name,
                                       policy)
            headers = [(b"Host", target.netloc), (b"Accept-Encoding", b"identity"), (b"Connection", b"close")]
            try:
                with pool.stream("GET", str(target.copy_with(host=address)), headers=headers,
                                 extensions={"sni_hostname": host}) as response:
                    fields = {key.decode("latin-1").lower(): value.decode("latin-1") for key, value in
                              response.headers}
                    if response.status in (301, 302, 303, 307, 308) and "location" in fields:
                        url = urljoin(url, fields["location"])
                        continue
                    if response.status != 200:
                        raise RequestError(f"{name}: fetching from {host} gave HTTP {response.status}")
                    return _read_limited(response, fields, name, policy)
            except httpcore.TimeoutException:
                raise RequestError(f"{name}: the fetch took longer than {policy.timeout:g} s") from None
            except httpcore.NetworkError as e:
                raise RequestError(
                    f"{name}: cannot fetch it from {host} ({type(e).__name__})"
                ) from None
            except httpcore.ProtocolError as e:
                raise RequestError(
                    f"{name}: {host} answered with a broken response ({type(e).__name__})"
                ) from None
    raise RequestError(f"{name}: more than {policy.max_redirects} redirects")


def _checked_address(host: str, port: int, name: str, policy: MediaPolicy) -> str:
    """The address `host` resolves to, refused when any of its addresses is not public (unless allowed)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError:
        raise RequestError(f"{name}: cannot resolve {host}") from None
    addresses = [ipaddress.ip_address(info[4][0].split("%")[0]) for info in infos]
    if not policy.allow_private_urls and not all(map(_public, addresses)):
        raise RequestError(f"{name}: {host} resolves to a loopback, private or link-local address; the "
                           "server fetches only public addresses")
    return str(addresses[0])


def _public(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """A global unicast address; an IPv6 one also outside the ranges that embed an IPv4 address (6to4,
    Teredo), whose IPv4 part must then be public too."""
    if isinstance(address, ipaddress.IPv4Address):
        return address.is_global and not address.is_multicast
    if address not in GLOBAL_IPV6 or not address.is_global:
        return False
    embedded = [address.sixtofour, *(address.teredo or ())]
    return all(v4 is None or _public(v4) for v4 in embedded)


def _read_limited(response: httpcore.Response, fields: dict[str, str], name: str,
                  policy: MediaPolicy) -> bytes:
    encoding = fields.get("content-encoding", "identity").strip().lower()
    if encoding != "identity":
        raise RequestError(f"{name}: the server sent a {encoding}-encoded response (asked for none)")
    declared = fields.get("content-length", "")
    if declared.isdigit() and int(declared) > policy.max_bytes:
        raise RequestError(f"{name}: larger than {policy.max_bytes} bytes")
    data = bytearray()
    for chunk in response.iter_stream():
        data += chunk
        if len(data) > policy.max_bytes:
            raise RequestError(f"{name}: larger than {policy.max_bytes} bytes")
    return bytes(data)
