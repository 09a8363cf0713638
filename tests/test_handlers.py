"""The send_email and webhook handlers against a real local SMTP server and HTTP server."""

from __future__ import annotations

import contextlib
import dataclasses
import email
import email.policy
import json
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from email.message import EmailMessage
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from aiosmtpd.controller import Controller

from worker import tasktypes
from worker.errors import PermanentTaskError
from worker.processing import task_result
from worker.tasktypes import send_email, sleep, webhook
from worker.tasktypes.base import HandlerConfig, TaskContext

pytestmark = pytest.mark.timeout(30)


def make_task(
    type_: str, payload: dict[str, Any], config: HandlerConfig, timeout: float | None = None
) -> TaskContext:
    """A first attempt at a task of `type_` with a fresh id; `timeout` seconds from now.

    `payload` as stored, loaded by the type's schema as the worker loads it.
    """
    return TaskContext(
        task_id=uuid.uuid4(),
        company_id=uuid.uuid4(),
        type=type_,
        payload=tasktypes.REGISTRY[type_].load_payload(payload),
        attempt=1,
        max_attempts=5,
        config=config,
        timeout=timeout,
        deadline=None if timeout is None else time.monotonic() + timeout,
    )


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (aiosmtpd cannot bind port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


# --- SMTP ---------------------------------------------------------------------------------------


class RecordingSmtpHandler:
    """aiosmtpd handler: keeps every accepted envelope; refuses recipients at `refused.invalid`."""

    def __init__(self) -> None:
        self.envelopes: list[Any] = []

    async def handle_RCPT(
        self, server: Any, session: Any, envelope: Any, address: str, rcpt_options: list[str]
    ) -> str:
        if address.endswith("@refused.invalid"):
            return "550 5.1.1 no such user here"
        envelope.rcpt_tos.append(address)
        return "250 OK"

    async def handle_DATA(self, server: Any, session: Any, envelope: Any) -> str:
        self.envelopes.append(envelope)
        return "250 Message accepted for delivery"


@dataclass
class SmtpServer:
    handler: RecordingSmtpHandler
    config: HandlerConfig


@pytest.fixture
def smtp_server() -> Iterator[SmtpServer]:
    """A real SMTP server on 127.0.0.1 that records what it accepts."""
    handler = RecordingSmtpHandler()
    port = free_port()
    controller = Controller(handler, hostname="127.0.0.1", port=port)
    controller.start()
    try:
        yield SmtpServer(
            handler,
            HandlerConfig(smtp_url=f"smtp://127.0.0.1:{port}", smtp_from="queue@fairq.test"),
        )
    finally:
        controller.stop()


def email_task(config: HandlerConfig, timeout: float | None = None, **payload: Any) -> TaskContext:
    return make_task(
        "send_email",
        {"to": "alice@example.com", "subject": "Hello", "body": "Hi Alice", **payload},
        config,
        timeout,
    )


def test_email_reaches_the_smtp_server_with_a_message_id_derived_from_the_task_id(
    smtp_server: SmtpServer,
) -> None:
    task = email_task(smtp_server.config, subject="Your report", body="It is ready.\n")

    send_email.handle(task)

    [envelope] = smtp_server.handler.envelopes
    assert envelope.mail_from == "queue@fairq.test"
    assert envelope.rcpt_tos == ["alice@example.com"]
    message = email.message_from_bytes(envelope.content, policy=email.policy.default)
    assert isinstance(message, EmailMessage)
    assert message["Message-ID"] == f"<{task.task_id}@fairq>"
    assert message["X-Fairq-Task-Id"] == str(task.task_id)
    assert message["To"] == "alice@example.com"
    assert message["Subject"] == "Your report"
    body = message.get_body()
    assert body is not None
    assert body.get_content().replace("\r\n", "\n") == "It is ready.\n"  # SMTP sends CRLF


def test_email_returns_its_message_id_and_the_servers_reply_to_the_message(
    smtp_server: SmtpServer,
) -> None:
    task = email_task(smtp_server.config)

    result = send_email.handle(task)

    assert result == {
        "message_id": f"<{task.task_id}@fairq>",
        "reply": "250 Message accepted for delivery",
    }
    task_result.encode(result)  # storable as the task's result


def test_a_resend_of_the_same_task_carries_the_same_message_id(smtp_server: SmtpServer) -> None:
    task = email_task(smtp_server.config)

    send_email.handle(task)
    send_email.handle(task)

    ids = {
        email.message_from_bytes(e.content, policy=email.policy.default)["Message-ID"]
        for e in smtp_server.handler.envelopes
    }
    assert ids == {f"<{task.task_id}@fairq>"}


def test_a_5xx_rejection_of_the_recipient_fails_the_email_permanently(
    smtp_server: SmtpServer,
) -> None:
    task = email_task(smtp_server.config, to="nobody@refused.invalid")

    with pytest.raises(PermanentTaskError, match="550"):
        send_email.handle(task)

    assert smtp_server.handler.envelopes == []


def test_an_unreachable_smtp_server_raises_a_retryable_error() -> None:
    config = HandlerConfig(smtp_url=f"smtp://127.0.0.1:{free_port()}")

    with pytest.raises(Exception) as caught:  # noqa: PT011 -- asserting "not permanent" below
        send_email.handle(email_task(config))

    assert not isinstance(caught.value, PermanentTaskError)


def test_an_unknown_smtp_url_scheme_is_a_retryable_config_error() -> None:
    config = HandlerConfig(smtp_url="http://127.0.0.1:25")

    with pytest.raises(send_email.SmtpRetryableError, match="SMTP_URL"):
        send_email.handle(email_task(config))


@contextlib.contextmanager
def trickling_smtp_server() -> Iterator[int]:
    """An SMTP server on 127.0.0.1 sending its greeting a byte per tenth of a second; its port.

    Every read is inside any timeout; the exchange (about 3 s) is far outside a short one.
    """
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def trickle() -> None:
        connection, _ = listener.accept()
        with connection:
            for byte in b"220 slow.example ESMTP\r\n":
                if stop.wait(0.1):
                    return
                try:
                    connection.sendall(bytes([byte]))
                except OSError:  # the client shut the connection down
                    return

    thread = threading.Thread(target=trickle)
    thread.start()
    try:
        yield listener.getsockname()[1]
    finally:
        stop.set()
        thread.join()
        listener.close()


def test_an_smtp_server_that_trickles_its_greeting_is_cut_off_at_the_total_timeout() -> None:
    with trickling_smtp_server() as port:
        config = HandlerConfig(smtp_url=f"smtp://127.0.0.1:{port}", smtp_timeout=0.5)
        with pytest.raises(send_email.SmtpRetryableError, match=r"longer than 0\.5 s"):
            send_email.handle(email_task(config))


def test_sending_stops_at_the_tasks_timeout_when_that_comes_before_smtp_timeout() -> None:
    with trickling_smtp_server() as port:
        config = HandlerConfig(smtp_url=f"smtp://127.0.0.1:{port}", smtp_timeout=30)
        started = time.monotonic()
        with pytest.raises(send_email.SmtpRetryableError, match=r"task's timeout \(0\.5 s\)"):
            send_email.handle(email_task(config, timeout=0.5))

    assert time.monotonic() - started < 5  # the task's 0.5 s, far from SMTP_TIMEOUT's 30 s


def test_a_line_break_in_the_subject_fails_the_email_permanently(smtp_server: SmtpServer) -> None:
    # Past the schema, which refuses it: the handler does not rely on its check alone.
    task = email_task(smtp_server.config)
    subject = "Hi\r\nBcc: victim@example.com"
    task = dataclasses.replace(task, payload=dataclasses.replace(task.payload, subject=subject))

    with pytest.raises(PermanentTaskError):
        send_email.handle(task)

    assert smtp_server.handler.envelopes == []


# --- HTTP ---------------------------------------------------------------------------------------


@dataclass
class Received:
    path: str
    headers: dict[str, str]
    body: bytes


@dataclass
class HttpServer:
    """A scripted HTTP server: `script[path]` is the queue of (status, headers, body) to answer."""

    port: int
    received: list[Received] = field(default_factory=list)
    script: dict[str, list[tuple[int, dict[str, str], bytes]]] = field(default_factory=dict)
    stalled: threading.Event = field(default_factory=threading.Event)
    # path -> (bytes written verbatim as the whole response, then the connection closes;
    # seconds to wait before each byte): a server that trickles, dies or cuts its answer short.
    raw: dict[str, tuple[bytes, float]] = field(default_factory=dict)
    # Paths whose raw answer the client hung up on before it was all written.
    cut_off: list[str] = field(default_factory=list)

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}{path}"

    def config(self, **overrides: Any) -> HandlerConfig:
        return HandlerConfig(**{"webhook_allow_private": True, "webhook_timeout": 0.5, **overrides})


def make_request_handler(state: HttpServer) -> type[BaseHTTPRequestHandler]:
    class ScriptedHandler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            state.received.append(Received(self.path, dict(self.headers.items()), body))
            if self.path == "/slow":
                state.stalled.wait(5)  # the teardown sets it, so the thread ends promptly
                return
            if self.path in state.raw:
                self._answer_raw(*state.raw[self.path])
                return
            steps = state.script.get(self.path)
            status, headers, reply = steps.pop(0) if steps else (200, {}, b"ok")
            self.send_response(status)
            for name, value in headers.items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def _answer_raw(self, answer: bytes, delay: float) -> None:
            self.close_connection = True
            try:
                for index in range(len(answer)):
                    if delay and state.stalled.wait(delay):
                        return
                    self.wfile.write(answer[index : index + 1])
                    self.wfile.flush()
            except OSError:  # the client shut the connection down
                state.cut_off.append(self.path)

        def log_message(self, format: str, *args: Any) -> None:
            """Keep the test output quiet."""

    return ScriptedHandler


@pytest.fixture
def http_server() -> Iterator[HttpServer]:
    """A real HTTP server on 127.0.0.1 answering POSTs as its `script` says (default 200)."""
    state = HttpServer(port=0)
    server = ThreadingHTTPServer(("127.0.0.1", 0), make_request_handler(state))
    server.daemon_threads = False  # so server_close() joins the request threads
    state.port = server.server_address[1]
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    try:
        yield state
    finally:
        state.stalled.set()
        server.shutdown()
        server.server_close()
        thread.join()


def webhook_task(
    config: HandlerConfig, url: str, timeout: float | None = None, **payload: Any
) -> TaskContext:
    return make_task("webhook", {"url": url, **payload}, config, timeout)


@pytest.fixture
def connections(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Record and block every outgoing socket connect, so no packet can leave the test."""
    attempts: list[Any] = []

    def refuse(self: socket.socket, address: Any) -> None:
        attempts.append(address)
        raise ConnectionRefusedError("blocked by the test")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    return attempts


def test_webhook_sends_the_task_id_as_idempotency_key_and_the_body_as_json(
    http_server: HttpServer,
) -> None:
    body = {"event": "invoice.paid", "amount": 12.5, "tags": ["a", "é"]}
    task = webhook_task(http_server.config(), http_server.url("/hook"), body=body)

    webhook.handle(task)

    [request] = http_server.received
    assert request.path == "/hook"
    assert request.headers["Idempotency-Key"] == str(task.task_id)
    assert request.headers["Content-Type"] == "application/json"
    assert json.loads(request.body) == body


def test_webhook_without_a_body_sends_json_null(http_server: HttpServer) -> None:
    webhook.handle(webhook_task(http_server.config(), http_server.url("/hook"), body=None))

    [request] = http_server.received
    assert request.body == b"null"
    assert request.headers["Content-Type"] == "application/json"


def test_user_headers_are_sent_but_cannot_override_idempotency_key_or_framing(
    http_server: HttpServer,
) -> None:
    task = webhook_task(
        http_server.config(),
        http_server.url("/hook"),
        body={"x": 1},
        headers={
            "X-Signature": "sig-123",
            "idempotency-key": "attacker-chosen",
            "Content-Type": "text/plain",
            "Host": "evil.example",
            "Content-Length": "999",
            "Transfer-Encoding": "chunked",
        },
    )

    webhook.handle(task)

    [request] = http_server.received
    assert request.headers["X-Signature"] == "sig-123"
    assert request.headers["Idempotency-Key"] == str(task.task_id)
    assert request.headers["Content-Type"] == "application/json"
    assert request.headers["Host"] == f"127.0.0.1:{http_server.port}"
    assert request.headers["Content-Length"] == str(len(request.body))
    assert "Transfer-Encoding" not in request.headers
    assert json.loads(request.body) == {"x": 1}


def test_a_503_is_retried_and_the_next_attempt_completes_on_200(http_server: HttpServer) -> None:
    http_server.script["/flaky"] = [(503, {}, b"busy"), (200, {}, b"ok")]
    task = webhook_task(http_server.config(), http_server.url("/flaky"))

    with pytest.raises(webhook.WebhookRetryableError, match="503"):
        webhook.handle(task)
    webhook.handle(task)  # the retry: same task, same idempotency key

    keys = [r.headers["Idempotency-Key"] for r in http_server.received]
    assert keys == [str(task.task_id)] * 2


def test_a_400_fails_the_webhook_permanently_with_the_status_and_a_short_excerpt(
    http_server: HttpServer,
) -> None:
    http_server.script["/bad"] = [(400, {}, b"E" * 5000)]

    with pytest.raises(PermanentTaskError, match="400") as caught:
        webhook.handle(webhook_task(http_server.config(), http_server.url("/bad")))

    assert len(str(caught.value)) < 300


@pytest.mark.parametrize("status", [408, 429, 500, 502])
def test_408_429_and_5xx_are_retryable(http_server: HttpServer, status: int) -> None:
    http_server.script["/hook"] = [(status, {}, b"later")]

    with pytest.raises(webhook.WebhookRetryableError, match=str(status)) as caught:
        webhook.handle(webhook_task(http_server.config(), http_server.url("/hook")))

    assert not isinstance(caught.value, PermanentTaskError)


@pytest.mark.parametrize("status", [301, 302, 307, 308])
def test_a_redirect_is_not_followed_and_fails_permanently(
    http_server: HttpServer, status: int
) -> None:
    http_server.script["/moved"] = [(status, {"Location": http_server.url("/elsewhere")}, b"")]

    with pytest.raises(PermanentTaskError, match="redirect"):
        webhook.handle(webhook_task(http_server.config(), http_server.url("/moved")))

    assert [r.path for r in http_server.received] == ["/moved"]


def test_a_server_slower_than_the_timeout_is_retryable(http_server: HttpServer) -> None:
    task = webhook_task(http_server.config(webhook_timeout=0.5), http_server.url("/slow"))

    with pytest.raises(webhook.WebhookRetryableError):
        webhook.handle(task)


def test_a_webhook_stops_at_the_tasks_timeout_when_that_comes_before_its_own(
    http_server: HttpServer,
) -> None:
    config = http_server.config(webhook_timeout=30)
    task = webhook_task(config, http_server.url("/slow"), timeout=0.5)
    started = time.monotonic()

    with pytest.raises(webhook.WebhookRetryableError, match=r"task's timeout \(0\.5 s\)"):
        webhook.handle(task)

    assert time.monotonic() - started < 5  # the task's 0.5 s, far from the call's own 30 s


def test_a_server_that_trickles_its_answer_is_cut_off_at_the_total_timeout(
    http_server: HttpServer,
) -> None:
    # 20 bytes of headers a tenth of a second apart: each read is far inside the timeout,
    # the whole answer (about 6 s) far outside it.
    answer = b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nX-Padding: " + b"x" * 20 + b"\r\n\r\n"
    http_server.raw["/trickle"] = (answer, 0.1)
    task = webhook_task(http_server.config(webhook_timeout=0.5), http_server.url("/trickle"))

    with pytest.raises(webhook.WebhookRetryableError, match=r"longer than 0\.5 s"):
        webhook.handle(task)

    assert http_server.received[0].path == "/trickle"


@pytest.mark.parametrize(
    "answer",
    [
        pytest.param(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc", id="body-cut-short"),
        pytest.param(b"HTTP/1.1 200 OK\r\nContent-Ty", id="died-mid-headers"),
        pytest.param(b"HTTP/1.1 200 OK\r\n", id="died-after-status-line"),
        pytest.param(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nab", id="chunk-cut-short"
        ),
    ],
)
def test_a_success_cut_short_is_retryable_not_completed(
    http_server: HttpServer, answer: bytes
) -> None:
    http_server.raw["/cut"] = (answer, 0.0)
    task = webhook_task(http_server.config(), http_server.url("/cut"))

    with pytest.raises(webhook.WebhookRetryableError):
        webhook.handle(task)


@pytest.mark.parametrize(
    "answer",
    [
        pytest.param(b"HTTP/1.1 204 No Content\r\n\r\n", id="no-content"),
        pytest.param(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n",
            id="chunked",
        ),
        pytest.param(b"HTTP/1.1 202 Accepted\r\nContent-Length: 2\r\n\r\nok", id="length"),
    ],
)
def test_a_whole_success_completes(http_server: HttpServer, answer: bytes) -> None:
    http_server.raw["/whole"] = (answer, 0.0)

    result = webhook.handle(webhook_task(http_server.config(), http_server.url("/whole")))

    assert result["body"] == ("" if b" 204 " in answer else "ok")


def test_a_webhook_returns_the_status_and_the_body_it_got(http_server: HttpServer) -> None:
    http_server.script["/created"] = [(201, {}, b'{"id": 42}')]

    result = webhook.handle(webhook_task(http_server.config(), http_server.url("/created")))

    assert result == {"status": 201, "body": '{"id": 42}'}


def test_a_webhook_result_keeps_the_first_4096_bytes_of_the_body_as_storable_text(
    http_server: HttpServer,
) -> None:
    # The cut falls inside a two-byte character, which is dropped, not mangled; U+0000, which
    # jsonb cannot hold, becomes U+FFFD.
    body = ("\x00" + "é" * 3000).encode()
    http_server.script["/long"] = [(200, {}, body)]

    result = webhook.handle(webhook_task(http_server.config(), http_server.url("/long")))

    assert result == {"status": 200, "body": "\ufffd" + "é" * 2047 + "..."}
    task_result.encode(result)  # storable as the task's result


def test_sleep_sleeps_no_longer_than_the_time_left_and_then_fails_retryably() -> None:
    task = make_task("sleep", {"seconds": 30}, HandlerConfig(), timeout=0.3)
    started = time.monotonic()

    with pytest.raises(TimeoutError, match="timeout came first"):
        sleep.handle(task)

    assert time.monotonic() - started < 5  # the task's 0.3 s, not the 30 s asked for


def test_sleep_within_its_timeout_sleeps_as_asked() -> None:
    task = make_task("sleep", {"seconds": 0.05}, HandlerConfig(), timeout=5)
    started = time.monotonic()

    sleep.handle(task)

    assert time.monotonic() - started >= 0.05


def test_an_unreachable_webhook_host_is_retryable() -> None:
    task = webhook_task(
        HandlerConfig(webhook_allow_private=True), f"http://127.0.0.1:{free_port()}/"
    )

    with pytest.raises(webhook.WebhookRetryableError):
        webhook.handle(task)


@pytest.mark.parametrize(
    "host",
    [
        "127.0.0.1",
        "localhost",
        "10.0.0.1",
        "169.254.169.254",
        "[::1]",
        "[::ffff:127.0.0.1]",
        "0.0.0.0",
    ],
)
def test_private_targets_are_refused_before_any_connection(
    connections: list[Any], host: str
) -> None:
    task = webhook_task(HandlerConfig(webhook_allow_private=False), "http://example.com/")
    # The payload as the handler gets it: the schema already refuses some of these hosts.
    task = dataclasses.replace(task, payload=webhook.Webhook(url=f"http://{host}:8080/hook"))

    with pytest.raises(PermanentTaskError, match="non-public address"):
        webhook.handle(task)

    assert connections == []


def test_a_name_with_any_private_address_is_refused(
    monkeypatch: pytest.MonkeyPatch, connections: list[Any]
) -> None:
    # Name resolution is the one thing faked here: no public test name can resolve to a chosen
    # mix of public and private addresses.
    def resolve(host: str, port: int, *args: Any, **kwargs: Any) -> list[Any]:
        assert host == "mixed.test"
        return [
            (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("93.184.216.34", port)),
            (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.1.2.3", port)),
        ]

    monkeypatch.setattr(socket, "getaddrinfo", resolve)
    task = webhook_task(HandlerConfig(), "https://mixed.test/hook")

    with pytest.raises(PermanentTaskError, match=r"10\.1\.2\.3"):
        webhook.handle(task)

    assert connections == []


def test_the_request_goes_to_the_address_that_was_checked(
    http_server: HttpServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A name resolved a second time could answer differently (DNS rebinding); the handler must
    # resolve once and connect to that address, sending the original name as Host.
    real_getaddrinfo: Callable[..., list[Any]] = socket.getaddrinfo
    lookups: list[str] = []

    def resolve(host: str, *args: Any, **kwargs: Any) -> list[Any]:
        lookups.append(host)
        return real_getaddrinfo("127.0.0.1" if host == "hook.test" else host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", resolve)
    task = webhook_task(http_server.config(), f"http://hook.test:{http_server.port}/hook")

    webhook.handle(task)

    assert lookups.count("hook.test") == 1
    [request] = http_server.received
    assert request.headers["Host"] == f"hook.test:{http_server.port}"


def test_an_address_that_refuses_the_connection_falls_over_to_the_next_checked_one(
    http_server: HttpServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 127.0.0.2 is loopback too, but nothing listens there: the connect is refused, nothing is
    # sent, so trying the next address cannot double-send.
    def resolve(host: str, port: int, *args: Any, **kwargs: Any) -> list[Any]:
        if host != "dual.test":
            return real_getaddrinfo(host, port, *args, **kwargs)
        return [
            (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.2", port)),
            (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", port)),
        ]

    real_getaddrinfo: Callable[..., list[Any]] = socket.getaddrinfo
    monkeypatch.setattr(socket, "getaddrinfo", resolve)

    webhook.handle(webhook_task(http_server.config(), f"http://dual.test:{http_server.port}/hook"))

    assert [r.headers["Host"] for r in http_server.received] == [f"dual.test:{http_server.port}"]


def test_loopback_is_refused_without_the_allow_flag_and_works_with_it(
    http_server: HttpServer,
) -> None:
    url = http_server.url("/hook")

    with pytest.raises(PermanentTaskError):
        webhook.handle(webhook_task(HandlerConfig(webhook_allow_private=False), url))
    assert http_server.received == []

    webhook.handle(webhook_task(http_server.config(webhook_allow_private=True), url))
    assert [r.path for r in http_server.received] == ["/hook"]


def test_localhost_by_name_works_with_the_allow_flag(http_server: HttpServer) -> None:
    webhook.handle(webhook_task(http_server.config(), http_server.url("/hook", host="localhost")))

    [request] = http_server.received
    assert request.headers["Host"] == f"localhost:{http_server.port}"
