"""Keyset pagination for admin listings: `?limit=&cursor=`, next page in a Link header.

Bodies stay plain JSON arrays; the next page's URL goes in `Link: <…>; rel="next"`
(RFC 8288, as GitHub's API does), so clients that read one page keep working.
A cursor is the last row's sort key, so rows inserted meanwhile never shift a page.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Annotated, Any, TypeVar

from fastapi import Query, Request, Response
from sqlalchemy import Select, and_, or_
from sqlalchemy.orm import InstrumentedAttribute, Session

from control_plane.errors import BadRequest

DEFAULT_LIMIT = 100
MAX_LIMIT = 1000

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class PageParams:
    limit: int
    cursor: str | None


def page_params(
    limit: Annotated[int, Query(ge=1, le=MAX_LIMIT, description="rows per page")] = DEFAULT_LIMIT,
    cursor: Annotated[str | None, Query(max_length=1024, description="from the previous page's Link")] = None,
) -> PageParams:
    """FastAPI dependency: the page a listing asks for."""
    return PageParams(limit=limit, cursor=cursor)


def _encode(values: Sequence[Any]) -> str:
    plain = [v.isoformat() if isinstance(v, datetime) else v for v in values]
    return base64.urlsafe_b64encode(json.dumps(plain, separators=(",", ":")).encode()).decode().rstrip("=")


def _decode(cursor: str, columns: Sequence[InstrumentedAttribute[Any]]) -> list[Any]:
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        values = json.loads(raw)
        if not isinstance(values, list) or len(values) != len(columns):
            raise ValueError("wrong shape")
        out: list[Any] = []
        for column, value in zip(columns, values, strict=True):
            python_type = column.type.python_type
            if python_type is datetime:
                out.append(datetime.fromisoformat(value))
            elif python_type in (int, float, str) and isinstance(value, python_type) and not isinstance(value, bool):
                out.append(value)
            else:
                raise ValueError(f"bad value for {column.key}")
        return out
    except (ValueError, TypeError, binascii.Error, UnicodeDecodeError, NotImplementedError) as e:
        raise BadRequest("invalid cursor; use the one from the previous page's Link header") from e


def paginate(
    session: Session,
    query: Select[tuple[T]],
    order: Sequence[InstrumentedAttribute[Any]],
    page: PageParams,
    *,
    descending: bool = False,
) -> tuple[list[T], str | None]:
    """One page of `query` in the order of the (unique together) `order` columns, and the
    cursor of the next page (None on the last one)."""
    if page.cursor is not None:
        after = _decode(page.cursor, order)
        # (a, b) > (x, y) spelled out: row-value comparison is not portable everywhere.
        clauses = []
        for i, column in enumerate(order):
            equal = [order[j] == after[j] for j in range(i)]
            beyond = column < after[i] if descending else column > after[i]
            clauses.append(and_(*equal, beyond))
        query = query.where(or_(*clauses))
    query = query.order_by(*[c.desc() if descending else c.asc() for c in order]).limit(page.limit + 1)
    rows = list(session.scalars(query).all())
    if len(rows) <= page.limit:
        return rows, None
    rows = rows[: page.limit]
    last = rows[-1]
    return rows, _encode([getattr(last, c.key) for c in order])


def set_next_link(request: Request, response: Response, next_cursor: str | None) -> None:
    """Point the Link header at the next page, keeping the request's other parameters."""
    if next_cursor is None:
        return
    url = request.url.include_query_params(cursor=next_cursor)
    response.headers["Link"] = f'<{url}>; rel="next"'
