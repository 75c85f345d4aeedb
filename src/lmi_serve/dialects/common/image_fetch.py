"""An http(s) image URL -> the file's bytes, where the model's option.image_fetch allows it.

Fetching what a client names is server-side request forgery waiting to happen, so each guard is here:
- off by default (`off`: data URIs only); `public` refuses any URL whose host resolves to a private,
  loopback, link-local, reserved or multicast address (the cloud metadata endpoint is link-local);
  `any` is for an image store inside the cluster;
- the connection goes to the address that was checked (the host is resolved once, then the request
  is sent to that IP with the original Host header, and TLS checks the certificate against the host
  name), so a second DNS answer cannot swap in a private address;
- redirects are followed by hand, at most MAX_REDIRECTS, each target checked as the first;
- option.image_fetch_timeout bounds connecting and each read, and the whole download;
- at most MAX_IMAGE_BYTES are read: a larger file (by Content-Length or by counting) is refused.
Every refusal is an InvalidRequest naming the content part, as the data-URI rules' are.
"""

from __future__ import annotations

import ipaddress
import socket
import time
from urllib.parse import urljoin, urlsplit

import urllib3

from lmi_serve.errors import InvalidRequest
from lmi_serve.serving.vision import FetchPolicy  # the model's options, which the handler loads with it

MAX_IMAGE_BYTES = 20 << 20  # one image file, as OpenAI's limit (and the data URIs')
MAX_REDIRECTS = 3
FETCH_MODES = ("off", "public", "any")


def fetch_image(url: str, where: str, policy: FetchPolicy) -> bytes:
    """The bytes at `url` (http or https) under `policy`; InvalidRequest naming `where` for a URL the
    policy refuses, an answer that is not a success, a file over MAX_IMAGE_BYTES or a timeout."""
    if not policy.enabled:
        raise InvalidRequest(f"{where}: image URLs are not fetched on this server (option.image_fetch=off); "
                             "send the image inline as a data URI (data:image/png;base64,...)", param=where)
    deadline = time.monotonic() + policy.timeout
    for _ in range(MAX_REDIRECTS + 1):
        response = _get(url, where, policy, deadline)
        try:
            if response.status in (301, 302, 303, 307, 308) and response.headers.get("Location"):
                url = urljoin(url, response.headers["Location"])
                continue
            if response.status != 200:
                raise InvalidRequest(f"{where}: fetching the image answered HTTP {response.status}", param=where)
            return _read_bounded(response, where, policy, deadline)
        finally:
            response.release_conn()
    raise InvalidRequest(f"{where}: the image URL redirects more than {MAX_REDIRECTS} times", param=where)


def _get(url: str, where: str, policy: FetchPolicy, deadline: float) -> urllib3.BaseHTTPResponse:
    """GET `url` from the address its host was checked at (no redirect followed, the body not read)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise InvalidRequest(f"{where}: an image URL must be http(s) or a data URI", param=where)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    address = _checked_address(parts.hostname, port, where, policy)
    left = _left(deadline, where, policy)
    timeout = urllib3.Timeout(connect=left, read=left)
    if parts.scheme == "https":  # the certificate is still checked against the URL's host name
        pool = urllib3.HTTPSConnectionPool(address, port, timeout=timeout, retries=False, cert_reqs="CERT_REQUIRED",
                                           server_hostname=parts.hostname, assert_hostname=parts.hostname)
    else:
        pool = urllib3.HTTPConnectionPool(address, port, timeout=timeout, retries=False)
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    host = parts.netloc.rsplit("@", 1)[-1]  # never send userinfo on
    try:
        return pool.urlopen("GET", target, headers={"Host": host, "Accept": "image/*"}, redirect=False,
                            preload_content=False, retries=False)
    except urllib3.exceptions.TimeoutError:
        raise InvalidRequest(f"{where}: fetching the image took over {policy.timeout:g} s "
                             "(option.image_fetch_timeout)", param=where) from None
    except urllib3.exceptions.HTTPError as exc:
        raise InvalidRequest(f"{where}: the image URL could not be fetched ({type(exc).__name__})", param=where) from None


def _checked_address(host: str, port: int, where: str, policy: FetchPolicy) -> str:
    """The first address `host` resolves to, once every address it resolves to passes the policy."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        raise InvalidRequest(f"{where}: the image URL's host {host!r} does not resolve", param=where) from None
    addresses = [info[4][0] for info in infos]
    if policy.mode == "public":
        for address in addresses:
            ip = ipaddress.ip_address(address.split("%", 1)[0])
            if not ip.is_global or ip.is_multicast:
                raise InvalidRequest(f"{where}: the image URL's host {host!r} is a private or local address, which "
                                     "option.image_fetch=public does not fetch", param=where)
    return addresses[0]


def _left(deadline: float, where: str, policy: FetchPolicy) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise InvalidRequest(f"{where}: fetching the image took over {policy.timeout:g} s "
                             "(option.image_fetch_timeout)", param=where)
    return left


def _read_bounded(response: urllib3.BaseHTTPResponse, where: str, policy: FetchPolicy, deadline: float) -> bytes:
    too_large = InvalidRequest(f"{where}: the image is over {MAX_IMAGE_BYTES >> 20} MiB", param=where)
    declared = response.headers.get("Content-Length", "")
    if declared.isdigit() and int(declared) > MAX_IMAGE_BYTES:
        raise too_large
    chunks, size = [], 0
    try:
        for chunk in response.stream(64 << 10):
            size += len(chunk)
            if size > MAX_IMAGE_BYTES:
                raise too_large
            chunks.append(chunk)
            _left(deadline, where, policy)  # a server that trickles bytes is cut at the timeout too
    except urllib3.exceptions.HTTPError:
        raise InvalidRequest(f"{where}: fetching the image timed out or broke off", param=where) from None
    return b"".join(chunks)
