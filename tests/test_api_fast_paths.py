"""The hot path's shortcuts against the library code they stand for (decision 0005).

- The dashboard's session of a request without cookies against Flask's.
"""

from __future__ import annotations

from flask import Flask
from flask.sessions import SecureCookieSessionInterface


def test_session_without_cookies_is_flasks(shared_app: Flask) -> None:
    """No Cookie header: the same empty session class as Flask's own would open."""
    interface = shared_app.session_interface
    assert isinstance(interface, SecureCookieSessionInterface)
    with shared_app.test_request_context("/companies") as ctx:
        ours = interface.open_session(shared_app, ctx.request)
        flasks = SecureCookieSessionInterface.open_session(interface, shared_app, ctx.request)
    assert type(ours) is type(flasks)
    assert ours is not None
    assert dict(ours) == dict(flasks or {}) == {}
    assert not ours.modified
    assert not ours.accessed
