"""ETags of versioned resources: If-None-Match for polls, If-Match for optimistic concurrency."""

from __future__ import annotations

from fastapi import Response

from control_plane.errors import PreconditionFailed


def etag(version: int) -> str:
    """The strong ETag of a resource (or snapshot) version."""
    return f'"{version}"'


def _tags(header: str, *, weak: bool) -> list[str]:
    """The entity tags of a header. If-None-Match compares weakly (W/"3" names version 3);
    If-Match strongly, as RFC 9110 §13.1.1 requires: a weak tag matches nothing there."""
    tags = [t.strip() for t in header.split(",") if t.strip()]
    return [t.removeprefix("W/") for t in tags] if weak else [t for t in tags if not t.startswith("W/")]


def if_none_match_matches(if_none_match: str | None, version: int) -> bool:
    """Whether an If-None-Match header names this version (or `*`)."""
    if not if_none_match:
        return False
    tags = _tags(if_none_match, weak=True)
    return "*" in tags or etag(version) in tags


def check_if_match(if_match: str | None, version: int | None) -> None:
    """Raise 412 unless If-Match is absent or names the current version.

    `version` None means the resource does not exist: only an absent If-Match passes.
    """
    if if_match is None:
        return
    tags = _tags(if_match, weak=False)
    if version is None:
        raise PreconditionFailed("If-Match given but the resource does not exist")
    if "*" not in tags and etag(version) not in tags:
        raise PreconditionFailed(
            f"the resource changed (now at version {version}); re-read it and retry with its ETag"
        )


def check_put_preconditions(
    if_match: str | None, if_none_match: str | None, version: int | None, what: str
) -> None:
    """The preconditions of a create-or-replace PUT on `what`, at `version` (None: absent):
    If-Match must name the current version; If-None-Match: * (or the version) means create only."""
    check_if_match(if_match, version)
    if version is not None and if_none_match_matches(if_none_match, version):
        raise PreconditionFailed(f"{what} already exists (If-None-Match)")


def set_etag(response: Response, version: int) -> None:
    response.headers["ETag"] = etag(version)


def etag_version(if_none_match: str | None) -> int | None:
    """The version an If-None-Match header names when it names exactly one (a router's
    base for a delta); None otherwise."""
    if not if_none_match:
        return None
    tags = _tags(if_none_match, weak=True)
    if len(tags) != 1 or not (tag := tags[0]).startswith('"') or not tag.endswith('"'):
        return None
    inner = tag[1:-1]
    return int(inner) if inner.isascii() and inner.isdigit() else None
