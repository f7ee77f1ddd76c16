"""One timestamp format for everything preheat writes for people and programs: RFC 3339, UTC,
microseconds, ``Z`` (``preheat.timings.now_iso``). Store refs (tests/store) and the server's
predictions use it."""

from __future__ import annotations

import re
from datetime import datetime, timedelta, timezone

from preheat.server.core import Prediction
from preheat.timings import now_iso

FORMAT = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z")


def assert_utc_timestamp(text: str) -> None:
    """``text`` is in the one format and is a moment within a day of now (a real clock reading)."""
    assert FORMAT.fullmatch(text), text
    moment = datetime.fromisoformat(text.replace("Z", "+00:00"))
    assert moment.tzinfo == timezone.utc and abs(datetime.now(timezone.utc) - moment) < timedelta(days=1)


def test_now_iso_is_rfc3339_utc_with_microseconds():
    before = datetime.now(timezone.utc)
    text = now_iso()
    assert_utc_timestamp(text)
    assert before <= datetime.fromisoformat(text.replace("Z", "+00:00")) <= datetime.now(timezone.utc)


def test_predictions_are_stamped_in_the_same_format():
    assert_utc_timestamp(Prediction(id="p", job=None, input={}).created_at)  # type: ignore[arg-type]
