"""Every path's moments come from service.model.timestamp: RFC 3339 UTC to the millisecond."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from hypothesis import given
from hypothesis import strategies as st

from service.model import timestamp

EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
LAST_MS_OF_9999 = 253_402_300_799_999


def rfc3339(ms: int) -> str:
    return (EPOCH + timedelta(milliseconds=ms)).isoformat(timespec="milliseconds").replace("+00:00", "Z")


@given(st.integers(min_value=0, max_value=LAST_MS_OF_9999))
def test_a_timestamp_is_the_rfc3339_utc_text_of_its_milliseconds(ms: int) -> None:
    assert timestamp(ms) == rfc3339(ms)
    assert timestamp(str(ms)) == rfc3339(ms)  # Redis hands fields over as text


def test_moments_within_one_second_keep_their_own_milliseconds() -> None:
    second = 1_764_806_400_000  # 2025-12-04T00:00:00Z
    assert [timestamp(second + ms) for ms in (0, 7, 456, 999, 1000)] == [
        "2025-12-04T00:00:00.000Z",
        "2025-12-04T00:00:00.007Z",
        "2025-12-04T00:00:00.456Z",
        "2025-12-04T00:00:00.999Z",
        "2025-12-04T00:00:01.000Z",
    ]
