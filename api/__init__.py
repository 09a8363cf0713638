"""The fairq HTTP API. `create_app` is this package's only public name."""

from __future__ import annotations

import functools

from flask import Flask

from api import auth, dashboard, database, errors, metrics, throttle
from api import logging as api_logging
from api import settings as api_settings
from api.settings import ApiSettings

__all__ = ["create_app"]


def create_app(settings: ApiSettings | None = None) -> Flask:
    """Build the WSGI app from `settings` (default: `ApiSettings.from_env()`).

    Raises `common.environment.SettingsError` naming the variable when the environment is invalid.
    """
    from api.companies.routes import blp as companies_blp  # noqa: PLC0415
    from api.stats.routes import blp as stats_blp  # noqa: PLC0415
    from api.system.routes import blp as system_blp  # noqa: PLC0415
    from api.tasks.routes import blp as tasks_blp  # noqa: PLC0415
    from api.workers.routes import blp as workers_blp  # noqa: PLC0415

    settings = settings or ApiSettings.from_env()
    app = Flask("fairq")
    api_settings.init_app(app, settings)
    app.config.update(
        MAX_CONTENT_LENGTH=settings.max_body_bytes,
        API_TITLE="fairq",
        API_VERSION="1.0",
        OPENAPI_VERSION="3.0.3",
        OPENAPI_URL_PREFIX="/",
        OPENAPI_JSON_PATH="openapi.json",
        OPENAPI_SWAGGER_UI_PATH="/docs",
        OPENAPI_SWAGGER_UI_URL="/docs/assets/",
        API_SPEC_OPTIONS={
            "info": {"description": "Multi-tenant task queue with fair, lock-safe claiming."},
            "components": {"securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
            "security": [{"bearer": []}],
            # Relative: the server that serves this document (make run: http://localhost:8000).
            "servers": [{"url": "/", "description": "This server"}],
        },
    )
    api_logging.init_app(app, level=settings.log_level, fmt=settings.log_format)
    database.init_app(
        app,
        settings.database_url,
        transaction_pooling=settings.database_pool_mode == "transaction",
        pool_size=settings.database_pool_size,
        ready_timeout_ms=settings.ready_timeout_ms,
    )
    auth.init_app(app)
    throttle.init_app(app, settings.auth_failure_limit)
    if settings.proxy_hops:
        # The client's address (the throttle's key, the logs) from the proxies' header.
        from werkzeug.middleware.proxy_fix import ProxyFix  # noqa: PLC0415

        app.wsgi_app = ProxyFix(app.wsgi_app, x_for=settings.proxy_hops)  # type: ignore[method-assign]
    api = errors.FairqApi(app)
    errors.register(app)
    for blp in (system_blp, companies_blp, tasks_blp, stats_blp, workers_blp):
        api.register_blueprint(blp)
    _serve_swagger_assets(app)
    # HTML pages under /dashboard, outside the OpenAPI document (api/dashboard).
    dashboard.init_app(app, settings)
    metrics.init_app(
        app,
        # The probe's connection: unpooled with a short connect timeout, so a hung database
        # delays a scrape by about two seconds, not the views' five plus a pool wait.
        functools.partial(database.probe_for, app.config["FAIRQ_PROBE"]),
        timeout_ms=settings.ready_timeout_ms,
        metrics_dir=settings.metrics_dir,
    )
    return app


def _serve_swagger_assets(app: Flask) -> None:
    # Swagger UI from a wheel that ships it: /docs renders with no internet access.
    import swagger_ui_bundle  # noqa: PLC0415
    from flask import send_from_directory  # noqa: PLC0415

    assets = swagger_ui_bundle.swagger_ui_path

    @app.get("/docs/assets/<path:filename>")
    def swagger_assets(filename: str):  # type: ignore[no-untyped-def]
        return send_from_directory(assets, filename, max_age=86400)
