"""The one timestamp format (RFC 3339, UTC, microseconds, ``Z``) as a check the store and server
tests share."""

from __future__ import annotations

import re
from datetime import datetime, timedelta, timezone

FORMAT = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z")


def assert_utc_timestamp(text: str) -> None:
    """``text`` is in the one format and is a moment within a day of now (a real clock reading)."""
    assert FORMAT.fullmatch(text), text
    moment = datetime.fromisoformat(text.replace("Z", "+00:00"))
    assert moment.tzinfo == timezone.utc and abs(datetime.now(timezone.utc) - moment) < timedelta(days=1)
