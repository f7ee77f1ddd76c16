"""One timestamp format for everything preheat writes for people and programs: RFC 3339, UTC,
microseconds, ``Z`` (``preheat.timings.now_iso``). Store refs (tests/store) and the server's
predictions use it."""

from __future__ import annotations

from datetime import datetime, timezone

from preheat.server.core import Prediction
from preheat.timings import now_iso
from tests._support.timestamps import assert_utc_timestamp


def test_now_iso_is_rfc3339_utc_with_microseconds():
    before = datetime.now(timezone.utc)
    text = now_iso()
    assert_utc_timestamp(text)
    assert before <= datetime.fromisoformat(text.replace("Z", "+00:00")) <= datetime.now(timezone.utc)


def test_predictions_are_stamped_in_the_same_format():
    assert_utc_timestamp(Prediction(id="p", job=None, input={}).created_at)  # type: ignore[arg-type]
