"""`send_email` {to, subject, body?}: one SMTP message, identified by the task id (design §6)."""

from __future__ import annotations

import datetime
import email.utils
import smtplib
import socket
import ssl
import urllib.parse
from dataclasses import dataclass
from email.message import EmailMessage
from typing import TYPE_CHECKING, Any

from marshmallow import RAISE, Schema, fields, post_load, validate

from common.fields import SINGLE_LINE
from worker.errors import PermanentTaskError
from worker.tasktypes.base import HandlerConfig, TaskContext, TaskType
from worker.tasktypes.deadline import SocketDeadline

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer

_DEFAULT_PORTS = {"smtp": 25, "smtps": 465}

# 5xx replies that mean "authenticate first / your credentials are wrong" (RFC 4954 §6): a config
# problem of ours, not of the message, so they are retried rather than failing the task for good.
_AUTH_REPLY_CODES = frozenset({530, 534, 535, 538})

# How much of a server reply an error message may quote.
_QUOTE_LIMIT = 200
# How much of the server's reply to the message the task's result keeps: a reply line's
# limit (RFC 5321 §4.5.3.1.5), which holds the queue id servers put there.
_RESULT_REPLY_LIMIT = 512


@dataclass(frozen=True)
class SendEmail:
    """A send_email task's payload: the recipient `to`, `subject` and `body` (text)."""

    to: str
    subject: str
    body: str


class SendEmailPayload(Schema):
    """`to`: one address; `subject`: 1..998 chars (RFC 5322 line limit); `body`: text.

    Loads a `SendEmail`.
    """

    class Meta:
        unknown = RAISE

    to = fields.Email(required=True, metadata={"description": "Recipient address."})
    subject = fields.String(required=True, validate=[validate.Length(min=1, max=998), SINGLE_LINE])
    body = fields.String(load_default="", validate=validate.Length(max=60_000))

    @post_load
    def _typed(self, data: dict[str, Any], **_kwargs: Any) -> SendEmail:
        return SendEmail(**data)


class SmtpRetryableError(Exception):
    """Sending failed in a way that may pass later (4xx reply, connection or config problem)."""


def handle(task: TaskContext[SendEmail]) -> dict[str, str]:
    """Send `payload.subject`/`payload.body` to `payload.to` through `config.smtp_url`.

    `Message-ID` is `<{task id}@fairq>` and `X-Fairq-Task-Id` carries the task id, so a resend
    after a crash (at-least-once, design §1.1) is recognisable downstream. Returns the task's
    result: `{"message_id": "<{task id}@fairq>", "reply": "<code> <text>"}`, the server's
    reply to the message (its queue id, often), at most `_RESULT_REPLY_LIMIT` characters.
    The whole exchange, connect to QUIT, takes at most `config.smtp_timeout` seconds, or
    what is left of the task's timeout if less.

    Raises `PermanentTaskError` when the server rejects the message or recipient with a 5xx
    reply (RFC 5321 §4.2.1), or when the payload cannot form a message (e.g. a line break in the
    subject); `SmtpRetryableError` for 4xx replies, connection errors, timeouts, and for
    configuration problems (bad `smtp_url`, rejected credentials) that operators must fix.
    """
    message = _build_message(task)
    limit = task.within_timeout(task.config.smtp_timeout)
    with SocketDeadline(limit) as deadline:
        try:
            code, reply = _send(task.config, message, deadline)
        except (smtplib.SMTPException, OSError) as exc:
            if deadline.expired:
                raise SmtpRetryableError(f"{_took_too_long(task, limit)}: {exc}") from exc
            if isinstance(exc, smtplib.SMTPException):
                raise _classify(exc) from exc
            # refused, unreachable, timeout, TLS failure
            raise SmtpRetryableError(f"SMTP connection failed: {exc}") from exc
    return {
        "message_id": str(message["Message-ID"]),
        "reply": f"{code} {_reply_text(reply, _RESULT_REPLY_LIMIT)}",
    }


def _took_too_long(task: TaskContext[SendEmail], limit: float) -> str:
    """Why a deadline cut the exchange short: SMTP_TIMEOUT's, or the task's own timeout."""
    if limit < task.config.smtp_timeout and task.timeout is not None:
        return f"sending stopped after {limit:.3g} s: the task's timeout ({task.timeout:g} s)"
    return f"sending took longer than {task.config.smtp_timeout:g} s"


def _build_message(task: TaskContext[SendEmail]) -> EmailMessage:
    """Build the message; a payload that cannot form a valid message is a `PermanentTaskError`."""
    message = EmailMessage()
    try:
        message["Message-ID"] = f"<{task.task_id}@fairq>"
        message["X-Fairq-Task-Id"] = str(task.task_id)
        message["Date"] = email.utils.format_datetime(datetime.datetime.now(datetime.UTC))
        message["From"] = task.config.smtp_from
        message["To"] = task.payload.to
        message["Subject"] = task.payload.subject
        message.set_content(task.payload.body)
    except ValueError as exc:  # the email package refuses CR/LF in headers and bad addresses
        raise PermanentTaskError(f"cannot build email: {exc}") from exc
    return message


def _send(
    config: HandlerConfig, message: EmailMessage, deadline: SocketDeadline
) -> tuple[int, bytes]:
    """Connect to `config.smtp_url`, log in if it carries credentials, send, and quit.

    Returns the server's reply to the message (the end of DATA): code and text.

    `smtp://` is plain SMTP (no STARTTLS); `smtps://` is implicit TLS with certificate
    verification. Once the server has accepted the message, a failing QUIT is ignored: the mail
    is sent, and retrying would only send it twice. The connection is registered with
    `deadline` as soon as it exists, before the TLS handshake and the greeting.
    """
    url = urllib.parse.urlsplit(config.smtp_url)
    try:
        port = url.port
    except ValueError as exc:
        raise SmtpRetryableError(f"SMTP_URL has an invalid port: {exc}") from exc
    if url.scheme not in _DEFAULT_PORTS or not url.hostname:
        raise SmtpRetryableError(
            "SMTP_URL must look like smtp://[user:password@]host[:port] or smtps://...; "
            f"got scheme {url.scheme!r} and host {url.hostname!r}"
        )
    host, port = url.hostname, port or _DEFAULT_PORTS[url.scheme]

    class DeadlineSMTP(smtplib.SMTP):
        # The reply to DATA, which `sendmail` checks and drops.
        data_reply: tuple[int, bytes] = (0, b"")

        # The hook smtplib.SMTP_SSL itself overrides (typeshed does not declare it): the plain
        # socket, before the TLS handshake and the greeting.
        def _get_socket(self, host: str, port: int, timeout: float) -> socket.socket:
            sock: socket.socket = super()._get_socket(host, port, timeout)  # type: ignore[misc]
            deadline.register(sock)
            return sock

        def data(self, msg: ReadableBuffer | str) -> tuple[int, bytes]:
            self.data_reply = super().data(msg)
            return self.data_reply

    class DeadlineSMTPSSL(smtplib.SMTP_SSL, DeadlineSMTP):
        pass

    smtp: DeadlineSMTP
    if url.scheme == "smtps":
        smtp = DeadlineSMTPSSL(
            host, port, timeout=deadline.remaining(), context=ssl.create_default_context()
        )
    else:
        smtp = DeadlineSMTP(host, port, timeout=deadline.remaining())
    try:
        if url.username is not None:
            smtp.login(urllib.parse.unquote(url.username), urllib.parse.unquote(url.password or ""))
        smtp.send_message(message)
    except BaseException:
        smtp.close()
        raise
    try:
        smtp.quit()
    except (smtplib.SMTPException, OSError):
        smtp.close()
    return smtp.data_reply


def _classify(exc: smtplib.SMTPException) -> Exception:
    """Map an smtplib error to `PermanentTaskError` (5xx about the message) or a retryable one."""
    if isinstance(exc, smtplib.SMTPRecipientsRefused):
        replies = list(exc.recipients.values())
        detail = "; ".join(f"{code} {_reply_text(text)}" for code, text in replies)
        if replies and all(500 <= code < 600 for code, _ in replies):
            raise_as: type[Exception] = PermanentTaskError
        else:
            raise_as = SmtpRetryableError
        return raise_as(f"SMTP server refused the recipient: {detail}")
    if isinstance(
        exc,
        smtplib.SMTPAuthenticationError | smtplib.SMTPConnectError | smtplib.SMTPHeloError,
    ):
        # About our connection or credentials, not this message: every task would fail alike.
        return SmtpRetryableError(f"SMTP session failed ({type(exc).__name__}): {exc}")
    if isinstance(exc, smtplib.SMTPResponseException):
        detail = f"SMTP server answered {exc.smtp_code} {_reply_text(exc.smtp_error)}"
        if 500 <= exc.smtp_code < 600 and exc.smtp_code not in _AUTH_REPLY_CODES:
            return PermanentTaskError(detail)
        return SmtpRetryableError(detail)
    return SmtpRetryableError(f"SMTP failed ({type(exc).__name__}): {exc}")


def _reply_text(text: bytes | str, limit: int = _QUOTE_LIMIT) -> str:
    """Decode an SMTP reply text and cut it to `limit` characters, marking the cut.

    U+0000, which no JSON result can hold (`jsonb`), becomes U+FFFD.
    """
    decoded = text.decode("utf-8", errors="replace") if isinstance(text, bytes) else text
    decoded = decoded.replace("\x00", "\ufffd")
    return decoded if len(decoded) <= limit else decoded[:limit] + "..."


TASK_TYPE = TaskType(
    name="send_email",
    description="Sends one email over SMTP; the Message-ID is derived from the task id.",
    payload_schema=SendEmailPayload,
    handler=handle,
    # The call's own total time limit, SMTP_TIMEOUT (default 30 s) and a margin.
    default_timeout=lambda _payload: 90,
)
