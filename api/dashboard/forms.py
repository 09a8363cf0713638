"""What the dashboard's pages accept: WTForms forms for its POSTs, marshmallow schemas for
its query strings.

Every form carries Flask-WTF's CSRF token (`csrf_token`); the blueprint checks it on every
POST before any view runs (`api.dashboard.views`), so an action that is only a button (pause,
resume, retry, cancel, log out) needs no form class: its template sends the token. The
limits' bounds are the columns' (`db.models`), as in the JSON API's schemas.
"""

from __future__ import annotations

import re
from typing import Any

from flask_wtf import FlaskForm
from marshmallow import Schema, fields, validate
from wtforms import HiddenField, IntegerField, PasswordField
from wtforms.validators import InputRequired, NumberRange, Optional, StopValidation

from api import validators
from api.companies.schemas import (
    DEFAULT_OVERLAP_SECONDS,
    MAX_KEY_LIFETIME_SECONDS,
    MAX_OVERLAP_SECONDS,
)
from db.dashboard import CompanySort
from db.models import (
    MAX_IN_FLIGHT,
    MAX_PENDING,
    MAX_WEIGHT,
    MIN_IN_FLIGHT,
    MIN_PENDING,
    MIN_WEIGHT,
    TaskStatus,
)

# Offsets beyond this are refused, as by GET /companies/{id}/tasks: a deep OFFSET reads every
# row before it. Filters narrow a search better than paging.
MAX_OFFSET = 100_000

_DIGITS = re.compile(r"-?[0-9]+")


class StrictIntegerField(IntegerField):  # type: ignore[misc]  # WTForms ships no type hints
    """An integer written in ASCII decimal digits with an optional minus, like the API's.

    WTForms' own field takes whatever `int()` does: `1_000`, `+5` or other scripts' digits.
    Blank stays blank (None), for `Optional()`.
    """

    data: int | None

    def process_formdata(self, valuelist: list[Any]) -> None:
        """Parse the submitted text; a ValueError becomes the field's error."""
        if valuelist and str(valuelist[0]).strip():
            text = str(valuelist[0]).strip()
            if not _DIGITS.fullmatch(text) or len(text) > 20:
                self.data = None
                raise ValueError(self.gettext("Not a valid integer value."))
            valuelist = [text]
        super().process_formdata(valuelist)

    def pre_validate(self, form: Any) -> None:
        """Stop at a value that is no integer: its range cannot be checked, and saying it is
        out of range as well would be a second message for one mistake. A blank one is left
        to `InputRequired()` or `Optional()`."""
        if self.process_errors and self.raw_data and str(self.raw_data[0]).strip():
            raise StopValidation()


class LoginForm(FlaskForm):  # type: ignore[misc]  # Flask-WTF ships no type hints
    """The login: the admin token, once; `next` is the dashboard page to go back to."""

    token = PasswordField("Admin token", validators=[InputRequired()])
    next = HiddenField()


class LimitsForm(FlaskForm):  # type: ignore[misc]
    """A company's weight and limits; a blank limit is unlimited."""

    weight = StrictIntegerField(
        "Weight",
        validators=[InputRequired(), NumberRange(min=MIN_WEIGHT, max=MAX_WEIGHT)],
        description=f"Share of the workers while several companies have work "
        f"({MIN_WEIGHT}..{MAX_WEIGHT}).",
    )
    max_in_flight = StrictIntegerField(
        "Max in flight",
        validators=[Optional(), NumberRange(min=MIN_IN_FLIGHT, max=MAX_IN_FLIGHT)],
        description=f"Most tasks processing at once ({MIN_IN_FLIGHT}..{MAX_IN_FLIGHT}); "
        "blank: unlimited.",
    )
    max_pending = StrictIntegerField(
        "Max pending",
        validators=[Optional(), NumberRange(min=MIN_PENDING, max=MAX_PENDING)],
        description=f"Most unfinished tasks ({MIN_PENDING}..{MAX_PENDING:,}); blank: unlimited.",
    )


class KeyIssueForm(FlaskForm):  # type: ignore[misc]
    """A new API key: when it expires, in days; blank: never."""

    expires_in_days = StrictIntegerField(
        "Expires in (days)",
        validators=[Optional(), NumberRange(min=1, max=MAX_KEY_LIFETIME_SECONDS // 86400)],
        description="Blank: never.",
    )


class KeyRotateForm(FlaskForm):  # type: ignore[misc]
    """A rotation: how long the old key keeps working beside the new one, in hours."""

    overlap_hours = StrictIntegerField(
        "Old key works for (hours)",
        default=DEFAULT_OVERLAP_SECONDS // 3600,
        validators=[InputRequired(), NumberRange(min=0, max=MAX_OVERLAP_SECONDS // 3600)],
    )


class CompanyListQuery(Schema):
    """Query string of the companies listing."""

    sort = fields.String(
        load_default=CompanySort.OLDEST_WAIT.value,
        validate=validate.OneOf([sort.value for sort in CompanySort]),
    )
    order = fields.String(load_default="desc", validate=validate.OneOf(["asc", "desc"]))
    q = fields.String(load_default=None, validate=[validate.Length(max=200), validators.NO_NUL])
    page = validators.QueryInteger(load_default=1, validate=validate.Range(min=1, max=100_000))


class CompanyTasksQuery(Schema):
    """Query string of a company's page: its tasks' filters and page."""

    status = fields.String(
        load_default=None, validate=validate.OneOf([status.value for status in TaskStatus])
    )
    type = fields.String(
        load_default=None, validate=[validate.Length(min=1, max=100), validators.NO_NUL]
    )
    page = validators.QueryInteger(load_default=1, validate=validate.Range(min=1, max=100_000))
