"""`webhook` {url, body?, headers?}: one HTTP POST keyed by the task id (design §6)."""

from __future__ import annotations

import codecs
import ipaddress
import json
import socket
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import requests
import urllib3.exceptions
from marshmallow import RAISE, Schema, fields, post_load, validate
from requests.adapters import HTTPAdapter
from urllib3.connection import HTTPConnection, HTTPSConnection
from urllib3.connectionpool import HTTPConnectionPool, HTTPSConnectionPool

from common.fields import HTTP_FIELD_NAME, HTTP_FIELD_VALUE
from worker.errors import PermanentTaskError
from worker.tasktypes.base import TaskContext, TaskType
from worker.tasktypes.deadline import SocketDeadline

# How much of a response body or header value an error message may quote: enough to diagnose,
# never a whole page in `last_error`.
_QUOTE_LIMIT = 200

_DEFAULT_PORTS = {"http": 80, "https": 443}

# The most of a 2xx body read to check it arrived whole; a longer one is not read further.
_ACKNOWLEDGEMENT_LIMIT = 1 << 20
# How much of a 2xx body the task's result keeps (`body`), in bytes: an id or a short JSON
# answer fits; a longer body is cut there, the cut marked by "...".
_RESULT_BODY_LIMIT = 4096

# Statuses whose response has no body (RFC 9110 sections 15.3.5 and 15.4.5).
_BODYLESS = frozenset({204, 304})

# Addresses of one name tried before giving up for this attempt: bounds one attempt to a few
# connect timeouts however many records the name has.
_MAX_ADDRESSES = 3

# Headers the user may not set (compared lower-case). Hop-by-hop headers (RFC 9110 §7.6.1) belong
# to one connection, not to the message; Host and Content-Length are derived from the URL and the
# body, and a forged pair would misroute or desynchronise the request; Idempotency-Key and
# Content-Type are ours and must win (design §1.1).
_RESERVED_HEADERS = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
        "idempotency-key",
        "content-type",
    }
)


@dataclass(frozen=True)
class Webhook:
    """A webhook task's payload: the `url` to POST `body` (any JSON value) to, with `headers`."""

    url: str
    body: Any = None
    headers: Mapping[str, str] = field(default_factory=dict)


class WebhookPayload(Schema):
    """`url`: http(s) URL; `body`: any JSON sent as the request body; `headers`: str -> str.

    Loads a `Webhook`.
    """

    class Meta:
        unknown = RAISE

    url = fields.Url(
        required=True,
        schemes={"http", "https"},
        require_tld=False,
        validate=validate.Length(max=2048),
    )
    body = fields.Raw(load_default=None, allow_none=True)
    headers = fields.Dict(
        # Checked here, not first in the handler: a bad header is the client's 422 at
        # creation, not a task that fails for good later.
        keys=fields.String(validate=[validate.Length(min=1, max=256), HTTP_FIELD_NAME]),
        values=fields.String(validate=[validate.Length(max=8192), HTTP_FIELD_VALUE]),
        load_default=dict,
    )

    @post_load
    def _typed(self, data: dict[str, Any], **_kwargs: Any) -> Webhook:
        return Webhook(**data)


class WebhookRetryableError(Exception):
    """The call failed in a way that may pass later (5xx, 408, 429, timeout, no connection)."""


class _PinnedAdapter(HTTPAdapter):
    """Send to an IP-literal URL while TLS still uses and verifies the original host name.

    `server_hostname` sets SNI and the name the certificate must match (urllib3 drops it for
    plain-http pools), so pinning the address does not weaken HTTPS verification. Every
    socket it opens is registered with `deadline`, which shuts it down when the call's time
    is up.
    """

    def __init__(self, server_hostname: str, deadline: SocketDeadline) -> None:
        self._server_hostname = server_hostname
        self._deadline = deadline
        super().__init__(max_retries=0)

    def init_poolmanager(
        self, connections: int, maxsize: int, block: bool = False, **pool_kwargs: Any
    ) -> None:
        """Create the pool manager with `server_hostname` fixed for every pool it makes."""
        pool_kwargs["server_hostname"] = self._server_hostname
        super().init_poolmanager(connections, maxsize, block=block, **pool_kwargs)
        deadline = self._deadline

        class DeadlineHTTPConnection(HTTPConnection):
            def _new_conn(self) -> socket.socket:
                sock = super()._new_conn()
                deadline.register(sock)
                return sock

        class DeadlineHTTPSConnection(HTTPSConnection):
            def _new_conn(self) -> socket.socket:
                sock = super()._new_conn()
                deadline.register(sock)
                return sock

        class DeadlineHTTPPool(HTTPConnectionPool):
            ConnectionCls = DeadlineHTTPConnection

        class DeadlineHTTPSPool(HTTPSConnectionPool):
            ConnectionCls = DeadlineHTTPSConnection

        self.poolmanager.pool_classes_by_scheme = {
            "http": DeadlineHTTPPool,
            "https": DeadlineHTTPSPool,
        }


def handle(task: TaskContext[Webhook]) -> dict[str, Any]:
    """POST `payload.body` as JSON to `payload.url` with `Idempotency-Key: <task id>`.

    The body is always JSON: an absent or null `body` is sent as the four bytes `null` with
    `Content-Type: application/json`, so a receiver's JSON parser never sees an empty body.
    Redirects are not followed (a redirect could lead past the SSRF guard). The whole call,
    from the name lookup's answer to the last byte of the response, takes at most
    `config.webhook_timeout` seconds (`SocketDeadline`), however slowly the server answers,
    or what is left of the task's timeout if less.
    The checked addresses are tried in resolver order, moving on only when a connection
    cannot be opened (nothing was sent), at most `_MAX_ADDRESSES` of them.

    Raises `PermanentTaskError` for a refused target (see `_resolve`), a 3xx, a 4xx other than
    408/429, or a payload that cannot be sent; `WebhookRetryableError` for 408, 429, 5xx,
    timeouts, connection errors and a response that may be cut short (see
    `_check_acknowledgement`). A whole 2xx completes the task, with the result
    `{"status": <code>, "body": <the body's first _RESULT_BODY_LIMIT bytes, as text>}`.
    """
    config = task.config
    url = urllib.parse.urlsplit(task.payload.url)
    target = _resolve(url, allow_private=config.webhook_allow_private)
    try:
        data = json.dumps(task.payload.body, allow_nan=False).encode("utf-8")
    except (TypeError, ValueError) as exc:
        raise PermanentTaskError(f"webhook body is not JSON-serialisable: {exc}") from exc
    headers = _request_headers(task.payload.headers)
    headers["Host"] = target.host_header
    headers["Content-Type"] = "application/json"
    headers["Idempotency-Key"] = str(task.task_id)

    limit = task.within_timeout(config.webhook_timeout)
    with SocketDeadline(limit) as deadline, requests.Session() as session:
        # No proxies or ~/.netrc from the environment: a proxy would make its own DNS and routing
        # decisions behind the guard, and netrc could attach our credentials to a user's URL.
        session.trust_env = False
        session.mount(f"{url.scheme}://", _PinnedAdapter(target.host, deadline))
        addresses = target.addresses[:_MAX_ADDRESSES]
        for index, address in enumerate(addresses):
            try:
                response = session.post(
                    _pinned_url(url, address, target.port),
                    data=data,
                    headers=headers,
                    timeout=(deadline.remaining(), deadline.remaining()),
                    allow_redirects=False,
                    stream=True,  # bodies are read by `_check_status`, and only so far
                )
                with response:
                    body = _check_status(response)
            except (requests.exceptions.InvalidHeader, requests.exceptions.InvalidURL) as exc:
                raise PermanentTaskError(f"webhook request is invalid: {exc}") from exc
            except requests.RequestException as exc:
                if deadline.expired:
                    raise WebhookRetryableError(_took_too_long(task, limit)) from exc
                if _failed_to_connect(exc) and index + 1 < len(addresses):
                    continue
                raise WebhookRetryableError(f"webhook call failed: {_quote(str(exc))}") from exc
            return {"status": response.status_code, "body": body}
    # Unreachable: every address either answered (returned) or raised; the loop ran once at
    # least (`_resolve` found an address).
    raise WebhookRetryableError("webhook host has no address to try")


def _took_too_long(task: TaskContext[Webhook], limit: float) -> str:
    """Why a deadline cut the call short: WEBHOOK_TIMEOUT_SECONDS, or the task's timeout."""
    if limit < task.config.webhook_timeout and task.timeout is not None:
        return f"webhook call stopped after {limit:.3g} s: the task's timeout ({task.timeout:g} s)"
    seconds = task.config.webhook_timeout
    return f"webhook call took longer than {seconds:g} s (WEBHOOK_TIMEOUT_SECONDS)"


@dataclass(frozen=True)
class _Target:
    """Where a webhook goes: checked `addresses`, `port`, ASCII `host` and the Host header."""

    host: str
    port: int
    host_header: str
    addresses: list[ipaddress.IPv4Address | ipaddress.IPv6Address]


def _resolve(url: urllib.parse.SplitResult, *, allow_private: bool) -> _Target:
    """Resolve the URL's host once and apply the SSRF guard to every address it resolves to.

    SSRF guard (design §6): unless `allow_private`, raise `PermanentTaskError` if ANY address
    is not a public unicast address (loopback, private, link-local, multicast, reserved,
    unspecified, shared, including their IPv4-mapped IPv6 forms). Refusing on any rather than
    filtering keeps a name that mixes public and internal records from being a coin toss. The
    caller connects only to these checked addresses (the URL is rewritten to the IP), so a DNS
    answer that changes between check and connect (rebinding) cannot redirect the request.
    A resolution failure is transient (`WebhookRetryableError`).
    """
    if url.scheme not in _DEFAULT_PORTS or not url.hostname:
        raise PermanentTaskError(
            f"webhook url must be http(s) with a host, got {_quote(url.geturl())}"
        )
    try:
        explicit_port = url.port
        host = url.hostname.encode("idna").decode("ascii")
    except (ValueError, UnicodeError) as exc:
        raise PermanentTaskError(f"webhook url is invalid: {exc}") from exc
    port = explicit_port if explicit_port is not None else _DEFAULT_PORTS[url.scheme]

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:
        raise WebhookRetryableError(f"cannot resolve webhook host {host!r}: {exc}") from exc
    addresses = list(dict.fromkeys(ipaddress.ip_address(info[4][0]) for info in infos))
    if not addresses:
        raise WebhookRetryableError(f"webhook host {host!r} resolved to no address")
    if not allow_private:
        refused = [a for a in addresses if _is_forbidden(a)]
        if refused:
            raise PermanentTaskError(
                f"webhook host {host!r} resolves to non-public address {refused[0]} "
                "(set WEBHOOK_ALLOW_PRIVATE=true to allow)"
            )

    host_header = f"[{host}]" if ":" in host else host
    if explicit_port is not None and explicit_port != _DEFAULT_PORTS[url.scheme]:
        host_header = f"{host_header}:{explicit_port}"
    return _Target(host=host, port=port, host_header=host_header, addresses=addresses)


def _pinned_url(
    url: urllib.parse.SplitResult, address: ipaddress.IPv4Address | ipaddress.IPv6Address, port: int
) -> str:
    """Rewrite `url` to point at `address` (keeping credentials, path and query; no fragment)."""
    if address.version == 6:
        netloc = f"[{str(address).replace('%', '%25')}]:{port}"  # a zone id is %-encoded in URLs
    else:
        netloc = f"{address}:{port}"
    if "@" in url.netloc:  # keep URL credentials: requests turns them into Basic auth
        netloc = f"{url.netloc.rpartition('@')[0]}@{netloc}"
    return urllib.parse.urlunsplit((url.scheme, netloc, url.path or "/", url.query, ""))


def _failed_to_connect(exc: requests.RequestException) -> bool:
    """Tell whether `exc` means no connection was opened, so no byte of the request was sent."""
    reason = exc.args[0] if exc.args else None
    return isinstance(exc, requests.ConnectionError) and (
        isinstance(reason, urllib3.exceptions.MaxRetryError)
        and isinstance(reason.reason, urllib3.exceptions.ConnectTimeoutError)
    )


def _is_forbidden(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """Tell whether `address` is anything but a public unicast address (the SSRF guard's rule)."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped  # ::ffff:127.0.0.1 reaches 127.0.0.1
    return (
        address.is_loopback
        or address.is_private
        or address.is_link_local
        or address.is_multicast
        or address.is_reserved
        or address.is_unspecified
        or not address.is_global  # also shared address space 100.64/10 (RFC 6598)
    )


def _request_headers(user_headers: Mapping[str, str]) -> dict[str, str]:
    """Copy the user's headers, dropping every name in `_RESERVED_HEADERS` (any case)."""
    return {
        name: value
        for name, value in user_headers.items()
        if name.strip().lower() not in _RESERVED_HEADERS
    }


def _check_status(response: requests.Response) -> str:
    """For a whole 2xx, return its body's excerpt (`_RESULT_BODY_LIMIT`); else raise the
    error the status code calls for (see `handle`).

    Raises `requests.RequestException` when reading the body fails.
    """
    status = response.status_code
    if 200 <= status < 300:
        return _check_acknowledgement(response)
    if 300 <= status < 400:
        location = _quote(response.headers.get("Location", ""))
        raise PermanentTaskError(
            f"webhook answered redirect {status} to {location!r}; redirects are not followed"
        )
    detail = f"webhook answered {status} {response.reason}: {_body_excerpt(response)}"
    if status in (408, 429) or status >= 500:
        raise WebhookRetryableError(detail)
    if 400 <= status < 500:
        raise PermanentTaskError(detail)
    raise WebhookRetryableError(detail)  # 1xx as final or a non-standard code: try again later


def _check_acknowledgement(response: requests.Response) -> str:
    """Raise `WebhookRetryableError` unless this 2xx provably arrived whole; return its excerpt.

    A response cut short in its headers parses as a complete one without a body, so a success
    must be framed: a `Content-Length` or chunked body, read to its end here (urllib3 raises on
    a body shorter than its length or an unterminated chunk), or a status that has no body.
    A body longer than `_ACKNOWLEDGEMENT_LIMIT` is not read further. The excerpt is the
    body's first `_RESULT_BODY_LIMIT` bytes as text (`_result_excerpt`).
    """
    if response.status_code in _BODYLESS:
        return ""
    chunked = "chunked" in response.headers.get("Transfer-Encoding", "").lower()
    if "Content-Length" not in response.headers and not chunked:
        raise WebhookRetryableError(
            f"webhook answered {response.status_code} without a Content-Length or a chunked "
            "body, so it cannot be told from a response cut short; treated as not delivered"
        )
    read = 0
    head = b""
    for chunk in response.iter_content(chunk_size=64 * 1024):
        if len(head) <= _RESULT_BODY_LIMIT:
            head += chunk[: _RESULT_BODY_LIMIT + 1 - len(head)]
        read += len(chunk)
        if read >= _ACKNOWLEDGEMENT_LIMIT:
            break
    return _result_excerpt(head)


def _result_excerpt(head: bytes) -> str:
    """The first `_RESULT_BODY_LIMIT` bytes of `head` as text, "..." marking a cut.

    Decoded as UTF-8 (what JSON and most text bodies are), bad bytes replaced, a character
    cut in two at the limit dropped; U+0000, which no JSON result can hold (`jsonb`),
    becomes U+FFFD.
    """
    cut = len(head) > _RESULT_BODY_LIMIT
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    text = decoder.decode(head[:_RESULT_BODY_LIMIT], final=not cut)
    return text.replace("\x00", "\ufffd") + ("..." if cut else "")


def _body_excerpt(response: requests.Response) -> str:
    """Read at most `_QUOTE_LIMIT` characters of the body; an unreadable body is quoted as ''."""
    try:
        chunk = next(response.iter_content(chunk_size=_QUOTE_LIMIT), b"")
    except requests.RequestException:
        return ""
    return _quote(chunk.decode("utf-8", errors="replace"))


def _quote(text: str) -> str:
    """Cut `text` to `_QUOTE_LIMIT` characters, marking the cut."""
    return text if len(text) <= _QUOTE_LIMIT else text[:_QUOTE_LIMIT] + "..."


TASK_TYPE = TaskType(
    name="webhook",
    description=(
        "POSTs `body` as JSON to `url` with `Idempotency-Key: <task id>`. 2xx completes; "
        "4xx other than 408/429 fails permanently; 5xx and timeouts are retried."
    ),
    payload_schema=WebhookPayload,
    handler=handle,
    # The call's own total time limit, WEBHOOK_TIMEOUT (default 10 s) and a margin.
    default_timeout=lambda _payload: 60,
)
