"""Keyset pagination for admin listings: `?limit=&cursor=`, next page in a Link header.

Bodies stay plain JSON arrays; the next page's URL goes in `Link: <…>; rel="next"`
(RFC 8288, as GitHub's API does), so clients that read one page keep working.
A cursor is the last row's sort key, so rows inserted meanwhile never shift a page.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Annotated, Any, TypeVar

from fastapi import Query, Request, Response
from sqlalchemy import Select, and_, or_
from sqlalchemy.orm import InstrumentedAttribute, Session

from control_plane.context import AppContext
from control_plane.errors import BadRequest

DEFAULT_LIMIT = 100
MAX_LIMIT = 1000

T = TypeVar("T")
V = TypeVar("V")
_BAD_CURSOR = "invalid cursor; use the one from the previous page's Link header"


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
                at = datetime.fromisoformat(value)
                if at.tzinfo is None:
                    raise ValueError("naive datetime")
                out.append(at)
            elif python_type in (int, float, str) and isinstance(value, python_type) and not isinstance(value, bool):
                out.append(_bindable(value))
            else:
                raise ValueError(f"bad value for {column.key}")
        return out
    except (ValueError, TypeError, binascii.Error, UnicodeDecodeError, NotImplementedError) as e:
        raise BadRequest(_BAD_CURSOR) from e


def _bindable(value: str | int | float) -> str | int | float:
    """`value` if every database accepts it as a parameter (64-bit ints, strings without NUL)."""
    if isinstance(value, int) and not -(2**63) <= value < 2**63:
        raise ValueError("integer out of range")
    if isinstance(value, str) and "\x00" in value:
        raise ValueError("NUL in string")
    return value


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


def list_page(
    ctx: AppContext,
    request: Request,
    response: Response,
    page: PageParams,
    query: Select[tuple[T]],
    order: Sequence[InstrumentedAttribute[Any]],
    view: Callable[[T], V],
    *,
    descending: bool = False,
) -> list[V]:
    """A listing endpoint's whole answer: one page of `query` (see `paginate`) read in one
    session, each row turned into its view, and the next page's Link header set."""
    with ctx.read() as session:
        rows, next_cursor = paginate(session, query, order, page, descending=descending)
        views = [view(r) for r in rows]
    set_next_link(request, response, next_cursor)
    return views


def paginate_items(
    items: Sequence[T], key: Callable[[T], tuple[str | int | float, ...]], page: PageParams
) -> tuple[list[T], str | None]:
    """One page of an in-memory listing, ordered by `key` (unique per item), with the same cursors
    and Link headers as `paginate`."""
    ordered = sorted(items, key=key)
    if page.cursor is not None:
        after = tuple(_decode_plain(page.cursor))
        if ordered and len(key(ordered[0])) != len(after):
            raise BadRequest(_BAD_CURSOR)
        try:
            ordered = [item for item in ordered if key(item) > after]
        except TypeError as e:
            # The cursor's values are not of the key's types: it came from another listing.
            raise BadRequest(_BAD_CURSOR) from e
    if len(ordered) <= page.limit:
        return list(ordered), None
    rows = list(ordered[: page.limit])
    return rows, _encode(key(rows[-1]))


def _decode_plain(cursor: str) -> list[str | int | float]:
    """A cursor's values, each a string or a number (no nulls, no nesting)."""
    try:
        values = json.loads(base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)))
    except (ValueError, TypeError, binascii.Error, UnicodeDecodeError) as e:
        raise BadRequest(_BAD_CURSOR) from e
    if not isinstance(values, list) or not values or not all(
        isinstance(v, str | int | float) and not isinstance(v, bool) for v in values
    ):
        raise BadRequest(_BAD_CURSOR)
    return values


def set_next_link(request: Request, response: Response, next_cursor: str | None) -> None:
    """Point the Link header at the next page, keeping the request's other parameters."""
    if next_cursor is None:
        return
    url = request.url.include_query_params(cursor=next_cursor)
    response.headers["Link"] = f'<{url}>; rel="next"'
