"""Paging of the listing reads (ListMembers, GetDecodeLoad).

A page token is the id of the previous page's last member: listings are sorted by id, so a
page starts after it whatever joined or left in between (no server-side cursor to keep).
"""

from __future__ import annotations

from fulcrum.errors import InvalidArgument
from fulcrum.state.fleet import validate_member_id


def page_size_of(requested: int, default: int, maximum: int) -> int:
    """The page size of a listing request (0 = ``default``); INVALID_ARGUMENT naming
    ``page_size`` above ``maximum``."""
    if requested > maximum:
        raise InvalidArgument("page_size", f"must be in [0, {maximum}] (0 = {default})")
    return requested or default


def page_token_of(token: str) -> str:
    """The last id of the previous page (a member id), or "" for the first page
    (INVALID_ARGUMENT naming ``page_token`` otherwise)."""
    if token:
        validate_member_id(token, "page_token")
    return token
