"""Swagger UI at /docs renders in a real browser with no internet (design §3, stack notes).

A real HTTP server runs the app; headless Chromium loads /docs through a proxy that does not
exist, so every non-local request fails, and records its network log. The page must render
every operation of the OpenAPI document, and nothing it loads may come from another origin.

Chromium is reached under a non-loopback name mapped to 127.0.0.1 inside the browser only:
Swagger UI hides some remote features (the online validator badge) on localhost, and the test
must see the page as a deployment does.

Without Chromium the browser test skips, except in CI (`CI=true`), where it fails: `.ci/run`
installs the Debian package `chromium`.
"""

from __future__ import annotations

import html
import json
import os
import re
import signal
import subprocess
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import pytest

from tests import system_tools

DOCS_HOST: Final = "fairq.test"
# Nothing listens on the discard port: a request sent through this proxy fails at once.
DEAD_PROXY: Final = "http://127.0.0.1:9"
CHROMIUM_TIMEOUT_SECONDS: Final = 60
# Paths design §3 promises, as OpenAPI templates (flask-smorest names them after the view args).
REQUIRED_PATHS: Final = {
    "/companies",
    "/companies/{company_id}",
    "/companies/{company_id}/tasks",
    "/companies/{company_id}/tasks/{task_id}",
    "/companies/{company_id}/tasks/{task_id}/cancel",
    "/companies/{company_id}/tasks/{task_id}/retry",
}
_HTTP_METHODS: Final = {"get", "put", "post", "delete", "patch", "head", "options"}

# One collapsed operation as Swagger UI renders it: method, path template, summary.
_OPERATION = re.compile(
    r'class="opblock-summary-method">(?P<method>[A-Z]+)</span>'
    r'<span class="opblock-summary-path"[^>]*?data-path="(?P<path>[^"]*)"'
    r"(?:(?!opblock-summary-method).)*?"
    r'class="opblock-summary-description">(?P<summary>[^<]*)</div>',
    re.DOTALL,
)


def fetch(url: str) -> tuple[int, str]:
    """GET `url` directly (no proxy); return the status and body."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(url, timeout=10) as response:
        status: int = response.status
        return status, response.read().decode("utf-8")


@dataclass(frozen=True)
class Rendered:
    """What Chromium made of a page: the final DOM and the network log."""

    dom: str
    netlog: dict[str, Any]


def chromium_command(chromium: str, url: str, profile: Path, netlog: Path) -> list[str]:
    """The headless Chromium command line that dumps `url`'s DOM after its scripts ran."""
    return [
        chromium,
        "--headless",
        "--no-sandbox",  # CI runs as root, where the sandbox cannot start
        "--disable-gpu",
        "--disable-dev-shm-usage",  # containers have a tiny /dev/shm
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={profile}",
        # Everything goes to a dead proxy, except our host, which resolves to loopback.
        f"--proxy-server={DEAD_PROXY}",
        f"--proxy-bypass-list={DOCS_HOST}",
        f"--host-resolver-rules=MAP {DOCS_HOST} 127.0.0.1",
        f"--log-net-log={netlog}",
        "--dump-dom",
        # Virtual time waits for the page's fetches (openapi.json) and then its rendering.
        "--virtual-time-budget=10000",
        url,
    ]


def render(chromium: str, url: str, workdir: Path) -> Rendered:
    """Load `url` in headless Chromium; return the DOM and the parsed network log."""
    netlog = workdir / "netlog.json"
    command = chromium_command(chromium, url, workdir / "profile", netlog)
    # Own session: on timeout the whole browser (zygote, renderer, GPU process) is killed.
    with subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env={**os.environ, "HOME": str(workdir)},
    ) as proc:
        try:
            dom, errors = proc.communicate(timeout=CHROMIUM_TIMEOUT_SECONDS)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            pytest.fail(f"Chromium did not finish in {CHROMIUM_TIMEOUT_SECONDS}s: {command}")
    assert proc.returncode == 0, f"Chromium exited {proc.returncode}: {errors[-3000:]}"
    text = netlog.read_text(encoding="utf-8")
    try:
        log: dict[str, Any] = json.loads(text)
    except json.JSONDecodeError:
        # A log cut short at exit lacks its closing brackets; the events are still usable.
        log = json.loads(text.rstrip().rstrip(",") + "]}")
    return Rendered(dom=dom, netlog=log)


def requests_made_by(origin: str, netlog: dict[str, Any]) -> list[str]:
    """URLs of the requests the page at `origin` made: its navigation and what it initiated.

    The browser's own background requests (update checks and the like) have no initiator
    and are left out; they go to the dead proxy anyway.
    """
    event_types = {code: name for name, code in netlog["constants"]["logEventTypes"].items()}
    urls = []
    for event in netlog["events"]:
        if event_types.get(event["type"]) != "URL_REQUEST_START_JOB":
            continue
        params = event.get("params", {})
        url = params.get("url", "")
        if params.get("initiator") == origin or url.startswith(origin + "/"):
            urls.append(url)
    return urls


def spec_operations(spec: dict[str, Any]) -> set[tuple[str, str, str]]:
    """(METHOD, path, summary) of every operation in the OpenAPI document."""
    return {
        (method.upper(), path, operation.get("summary", ""))
        for path, item in spec["paths"].items()
        for method, operation in item.items()
        if method in _HTTP_METHODS
    }


def test_docs_page_references_only_same_origin_urls(live_api_port: int) -> None:
    base = f"http://127.0.0.1:{live_api_port}"
    status, page = fetch(f"{base}/docs")
    references = re.findall(r"""(?:src|href)\s*=\s*["']([^"']+)["']""", page)
    spec_url = re.search(r"""url:\s*["']([^"']+)["']""", page)

    assert status == 200
    assert references, "the page loads Swagger UI's script and stylesheet"
    assert spec_url is not None
    assert spec_url.group(1) == "/openapi.json"
    assert not re.search(r"https?://|//[a-z0-9]", page, re.IGNORECASE), "no absolute URL at all"
    for reference in references:
        assert reference.startswith("/"), reference
        assert not reference.startswith("//"), reference
        assert fetch(base + reference)[0] == 200, reference


def test_swagger_ui_renders_every_operation_without_internet(
    live_api_port: int, tmp_path: Path
) -> None:
    chromium = system_tools.require("chromium", package="chromium")
    _, spec_text = fetch(f"http://127.0.0.1:{live_api_port}/openapi.json")
    expected = spec_operations(json.loads(spec_text))
    origin = f"http://{DOCS_HOST}:{live_api_port}"

    rendered = render(chromium, f"{origin}/docs", tmp_path)

    shown = {
        (m["method"], html.unescape(m["path"]), html.unescape(m["summary"]))
        for m in _OPERATION.finditer(rendered.dom)
    }
    assert {path for _, path, _ in expected} >= REQUIRED_PATHS
    assert all(summary for _, _, summary in expected), "every operation has a summary"
    assert shown == expected, f"missing: {expected - shown}; unexpected: {shown - expected}"
    requests = requests_made_by(origin, rendered.netlog)
    assert f"{origin}/openapi.json" in requests, "the network log recorded the page's fetches"
    assert f"{origin}/docs/assets/swagger-ui-bundle.js" in requests
    foreign = [url for url in requests if not url.startswith(origin + "/")]
    assert not foreign, f"/docs loaded from other origins: {foreign}"
