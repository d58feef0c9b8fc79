"""The images a request names: base64 data URLs, local files (only under an allowed directory), and http(s) URLs
(fetched with a timeout, a byte limit and a redirect limit, and never from a loopback, private or link-local address
unless allowed). Anything refused is a one-line RequestError raised before the refused bytes are read.

As vLLM's `--allowed-local-media-path`. A fetch connects to the very address it checked (the URL's host is resolved
once, the connection goes to that address with the host name kept for the Host header and TLS), so a name that
resolves to a public address for the check and to a private one for the connection gets nowhere.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import io
import ipaddress
import os
import socket
import stat
import time
from pathlib import Path
from urllib.parse import unquote, urljoin

import httpx
from PIL import Image

from data import ImageLoadError, load_image
from serving.engine import RequestError


@dataclasses.dataclass(frozen=True)
class MediaPolicy:
    """Where images may come from, and how much of them is read."""

    allowed_local_path: Path | None = None  # local files only under this directory (None: no local files)
    allow_private_urls: bool = False  # fetch from loopback / private / link-local addresses too
    max_bytes: int = 20 * 2**20  # an image's encoded size
    timeout: float = 10.0  # seconds for a whole fetch, redirects included
    max_redirects: int = 3


def open_image(url: str, index: int, policy: MediaPolicy) -> Image.Image:
    """The RGB image `url` names (a data URL, a path or file:// URL, an http(s) URL); RequestError otherwise."""
    name = f"image {index}"
    if url.startswith("data:"):
        data = _data_url(url, name, policy)
    elif url.startswith(("http://", "https://")):
        data = _fetch(url, name, policy)
    elif url.startswith("file://") or "://" not in url:
        data = _read_local(Path(unquote(url.removeprefix("file://"))), name, policy)
    else:
        raise RequestError(f"{name}: unsupported URL scheme (send a data URL, an http(s) URL or a local path)")
    source = io.BytesIO(data)
    source.name = name
    try:
        return load_image(source)
    except ImageLoadError as e:
        raise RequestError(str(e)) from None


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
    """A regular file whose real path (every symlink followed) lies under the allowed directory, read with a limit;
    devices, pipes and directories are refused before they are opened."""
    if policy.allowed_local_path is None:
        raise RequestError(f"{name}: local image paths are not served (the server takes them only under "
                           f"--allowed-local-media-path DIR)")
    try:
        real = path.resolve(strict=True)
    except (OSError, RuntimeError):
        raise RequestError(f"{name}: no such file under the allowed media directory") from None
    if not real.is_relative_to(policy.allowed_local_path.resolve()):
        raise RequestError(f"{name}: {path} is outside the allowed media directory")
    try:
        descriptor = os.open(real, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)  # a FIFO must not block the open
    except OSError as e:
        raise RequestError(f"{name}: cannot read {path} ({e.strerror})") from None
    with os.fdopen(descriptor, "rb") as file:
        info = os.fstat(file.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise RequestError(f"{name}: {path} is not a regular file")
        if info.st_size > policy.max_bytes:
            raise RequestError(f"{name}: larger than {policy.max_bytes} bytes")
        return file.read(policy.max_bytes + 1)[: policy.max_bytes]


def _fetch(url: str, name: str, policy: MediaPolicy) -> bytes:
    """GET `url` through at most max_redirects redirects, each hop's address checked and pinned."""
    deadline = time.monotonic() + policy.timeout
    with httpx.Client(timeout=policy.timeout, trust_env=False, follow_redirects=False) as client:
        for _ in range(policy.max_redirects + 1):
            target = httpx.URL(url)
            if target.scheme not in ("http", "https") or not target.host:
                raise RequestError(f"{name}: redirected to {url}, not an http(s) URL")
            address = _checked_address(target, name, policy)
            try:
                with client.stream("GET", target.copy_with(host=address),
                                   headers={"Host": target.netloc.decode("ascii")},
                                   extensions={"sni_hostname": target.host}) as response:
                    if response.is_redirect:
                        url = urljoin(url, response.headers.get("location", ""))
                        continue
                    if response.status_code != 200:
                        raise RequestError(f"{name}: fetching {target.host} gave HTTP {response.status_code}")
                    return _read_limited(response, name, policy, deadline)
            except httpx.HTTPError as e:
                raise RequestError(f"{name}: cannot fetch from {target.host} ({type(e).__name__})") from None
    raise RequestError(f"{name}: more than {policy.max_redirects} redirects")


def _checked_address(target: httpx.URL, name: str, policy: MediaPolicy) -> str:
    """The address the URL's host resolves to, refused when any of its addresses is not public (unless allowed)."""
    try:
        infos = socket.getaddrinfo(target.host, target.port or (443 if target.scheme == "https" else 80),
                                   type=socket.SOCK_STREAM)
    except OSError:
        raise RequestError(f"{name}: cannot resolve {target.host}") from None
    addresses = [ipaddress.ip_address(info[4][0].split("%")[0]) for info in infos]
    if not policy.allow_private_urls:
        for address in addresses:
            plain = getattr(address, "ipv4_mapped", None) or address
            if not plain.is_global or plain.is_multicast:
                raise RequestError(f"{name}: {target.host} resolves to a loopback, private or link-local address "
                                   f"({address}); the server fetches only public addresses")
    return str(addresses[0])


def _read_limited(response: httpx.Response, name: str, policy: MediaPolicy, deadline: float) -> bytes:
    declared = response.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > policy.max_bytes:
        raise RequestError(f"{name}: larger than {policy.max_bytes} bytes")
    data = bytearray()
    for chunk in response.iter_bytes():
        data += chunk
        if len(data) > policy.max_bytes:
            raise RequestError(f"{name}: larger than {policy.max_bytes} bytes")
        if time.monotonic() > deadline:
            raise RequestError(f"{name}: the fetch took longer than {policy.timeout:g} s")
    return bytes(data)
