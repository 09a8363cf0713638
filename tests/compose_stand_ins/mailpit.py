"""The mailpit stand-in: accepts mail over SMTP and lists it as Mailpit's API does.

Listens on `MP_SMTP_BIND_ADDR` (default 0.0.0.0:1025) for SMTP and on `MP_UI_BIND_ADDR`
(default 0.0.0.0:8025) for HTTP, Mailpit's variables. `GET /api/v1/messages` answers
`{"total": n, "messages": [...]}`, newest first, each message with Mailpit's `MessageID`,
`From`, `To` and `Subject` fields; `GET /livez` answers 200. Messages are kept in memory.
Standard library only: it runs on the stand-in base's Python, not the project's.
"""

from __future__ import annotations

import asyncio
import email
import email.policy
import email.utils
import json
import os
import signal
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

_messages: list[dict[str, Any]] = []
_lock = threading.Lock()


def _address(value: str) -> tuple[str, int]:
    host, _, port = value.rpartition(":")
    return host or "0.0.0.0", int(port)


def _summary(raw: bytes) -> dict[str, Any]:
    message = email.message_from_bytes(raw, policy=email.policy.default)
    name, address = email.utils.parseaddr(str(message.get("From", "")))
    return {
        "ID": str(len(_messages) + 1),
        "MessageID": str(message.get("Message-ID", "")).strip("<>"),
        "From": {"Name": name, "Address": address},
        "To": [
            {"Name": to_name, "Address": to_address}
            for to_name, to_address in email.utils.getaddresses(message.get_all("To", []))
        ],
        "Subject": str(message.get("Subject", "")),
        "Size": len(raw),
    }


async def _session(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """One SMTP session: EHLO/HELO, MAIL, RCPT, DATA, RSET, NOOP, QUIT."""

    async def reply(line: str) -> None:
        writer.write(line.encode() + b"\r\n")
        await writer.drain()

    await reply("220 mailpit stand-in ESMTP")
    try:
        while line := await reader.readline():
            verb = line.decode(errors="replace").strip().split(" ", 1)[0].upper()
            if verb == "EHLO":
                await reply("250-mailpit stand-in\r\n250-8BITMIME\r\n250 SMTPUTF8")
            elif verb in {"HELO", "MAIL", "RCPT", "RSET", "NOOP"}:
                await reply("250 OK")
            elif verb == "DATA":
                await reply("354 End data with <CR><LF>.<CR><LF>")
                lines = []
                while (data := await reader.readline()) not in {b".\r\n", b".\n", b""}:
                    lines.append(data[1:] if data.startswith(b".") else data)
                with _lock:
                    _messages.insert(0, _summary(b"".join(lines)))
                await reply("250 OK: queued")
            elif verb == "QUIT":
                await reply("221 Bye")
                break
            else:
                await reply("502 Command not implemented")
    finally:
        writer.close()


class _Api(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        """The message list, or liveness."""
        if self.path.split("?")[0] == "/api/v1/messages":
            with _lock:
                body = json.dumps({"total": len(_messages), "messages": _messages}).encode()
            self._answer(200, body)
        elif self.path == "/livez":
            self._answer(200, b"ok")
        else:
            self._answer(404, b"not found")

    def _answer(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet."""


async def _main() -> None:
    http = ThreadingHTTPServer(_address(os.environ.get("MP_UI_BIND_ADDR", ":8025")), _Api)
    threading.Thread(target=http.serve_forever, daemon=True).start()
    host, port = _address(os.environ.get("MP_SMTP_BIND_ADDR", ":1025"))
    smtp = await asyncio.start_server(_session, host, port)
    print(f"mailpit stand-in: SMTP on {host}:{port}, API on {http.server_address}", flush=True)
    # PID 1 in its container: without handlers, SIGTERM and SIGINT would be ignored.
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    async with smtp:
        await stop.wait()
    http.shutdown()


if __name__ == "__main__":
    asyncio.run(_main())
