"""The operator's dashboard: server-rendered pages under `/dashboard` (issue 14).

Overview, companies, a company, a task; pause and resume a company, set its weight and
limits, retry or cancel a task. Served by the API itself from Jinja templates and static
files in this package (uPlot for the chart, vendored with its licence): no build step, and
nothing is loaded from another origin, so it works offline like `/docs`.

Security (issue 14, item 3):
- The admin token is entered once in the login form and exchanged for Flask's signed
  session cookie (`SESSION_COOKIE_NAME`): `HttpOnly`, `SameSite=Strict`, `Secure` when the
  request came over HTTPS (`request.is_secure`: gunicorn's `forwarded_allow_ips` and
  `secure_scheme_headers` say when to trust a proxy's `X-Forwarded-Proto`), path
  `/dashboard` only, and an absolute expiry of `DASHBOARD_SESSION_HOURS` from the login. The
  token is never put in the cookie, a URL or a page.
- The signing key is derived from `ADMIN_TOKEN` (`session_key`): every API process and host
  already shares it, so there is no second secret to distribute, and rotating the token
  ends every dashboard session. Without `ADMIN_TOKEN` the dashboard answers 503, like the
  admin endpoints.
- Every POST carries Flask-WTF's CSRF token, checked before any view runs. The JSON API is
  left alone (`WTF_CSRF_CHECK_DEFAULT = False`): it authenticates by bearer token, which a
  browser never sends by itself.
- Every page is sent with a Content-Security-Policy allowing scripts, styles and images from
  this origin only (no inline script or style), `X-Frame-Options: DENY`, `no-store`, and
  Jinja's autoescaping of everything a tenant or a handler wrote.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import hmac
from typing import Any

from flask import Flask, Request, Response, request
from flask.sessions import SecureCookieSession, SecureCookieSessionInterface, SessionMixin
from flask_wtf.csrf import CSRFProtect
from itsdangerous import URLSafeTimedSerializer

from api.settings import ApiSettings

__all__ = ["URL_PREFIX", "csrf", "init_app", "session_key"]

URL_PREFIX = "/dashboard"
SESSION_COOKIE_NAME = "fairq_dashboard"

# Checks the CSRF token of the dashboard's POSTs only (`views._guard` calls `protect`).
csrf = CSRFProtect()


class _SessionInterface(SecureCookieSessionInterface):
    """Flask's signed cookie session, `Secure` whenever the request itself was HTTPS.

    `SESSION_COOKIE_SECURE` is one value for every request: a deployment reached both over
    HTTPS and over plain HTTP on localhost (`make run`) needs the flag per request.
    """

    def __init__(self) -> None:
        self._serializer: tuple[tuple[Any, ...], URLSafeTimedSerializer | None] | None = None

    def get_cookie_secure(self, app: Flask) -> bool:
        """`Secure` when configured, and whenever this request came over HTTPS."""
        return bool(super().get_cookie_secure(app) or request.is_secure)

    def open_session(self, app: Flask, request: Request) -> SecureCookieSession | None:
        """Flask's, without parsing the cookies of a request that sent none: an empty session.

        Flask opens the session of every request, and the API's requests send no cookie.
        """
        if "HTTP_COOKIE" not in request.environ:
            if self.get_signing_serializer(app) is None:
                return None  # no secret key: Flask's null session, as its own would give
            return self.session_class()
        return super().open_session(app, request)

    def save_session(self, app: Flask, session: SessionMixin, response: Response) -> None:
        """Flask's, returning at once for a session nobody read, changed or filled.

        Flask's own reads every cookie attribute first, then does nothing for such a
        session: the API's requests, which never touch it.
        """
        if session.accessed or session.modified or session:
            super().save_session(app, session, response)

    def get_signing_serializer(self, app: Flask) -> URLSafeTimedSerializer | None:
        """Flask's serializer, built once per set of keys instead of on every request.

        Flask opens the session of every request, the API's too: building the serializer
        each time was about 2% of a task create's time. It keeps no state between calls.
        """
        keys = (app.secret_key, *(app.config["SECRET_KEY_FALLBACKS"] or ()))
        cached = self._serializer
        if cached is None or cached[0] != keys:
            cached = self._serializer = (keys, super().get_signing_serializer(app))
        return cached[1]


def session_key(admin_token: str) -> bytes:
    """The session cookie's signing key: an HMAC of a fixed label under the admin token.

    The cookie, signed with it, reveals nothing of the token (HMAC is one-way), and the
    same token gives the same key in every process, so any API process accepts the cookie.
    """
    return hmac.new(
        admin_token.encode("utf-8"), b"fairq dashboard session v1", hashlib.sha256
    ).digest()


def init_app(app: Flask, settings: ApiSettings) -> None:
    """Serve the dashboard from `app`: its blueprint, session cookie and CSRF protection."""
    # Importing `keys` adds the company keys views to `views.blp`: before it is registered.
    from api.dashboard import (  # noqa: PLC0415  (imports flask-wtf forms and templates)
        keys,  # noqa: F401  (imported for the routes it adds)
        views,
    )

    app.config.update(
        SESSION_COOKIE_NAME=SESSION_COOKIE_NAME,
        SESSION_COOKIE_PATH=URL_PREFIX,
        SESSION_COOKIE_HTTPONLY=True,
        SESSION_COOKIE_SAMESITE="Strict",
        PERMANENT_SESSION_LIFETIME=dt.timedelta(hours=settings.dashboard_session_hours),
        # The login's expiry is absolute (`views.LOGIN_EXPIRES`): an open tab refreshing
        # itself must not extend it.
        SESSION_REFRESH_EACH_REQUEST=False,
        WTF_CSRF_CHECK_DEFAULT=False,
        # A token is bound to its session (a random value kept in it), so it lives as long
        # as the login: a page left open for an hour still acts.
        WTF_CSRF_TIME_LIMIT=None,
    )
    if settings.admin_token is not None:
        app.secret_key = session_key(settings.admin_token)
    app.session_interface = _SessionInterface()
    csrf.init_app(app)
    app.register_blueprint(views.blp, url_prefix=URL_PREFIX)
    app.after_request(views.after_dashboard_request)
