"""What create stores and hashes is canonical_json's text (json.dumps, sorted keys, compact). The
options and the request digest are written by msgspec now: they must stay byte for byte what
json.dumps wrote, or an Idempotency-Key retried across an upgrade would read as another request."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import msgspec
from hypothesis import given
from hypothesis import strategies as st

from service.bodies import Ask
from service.model import MAX_LABEL, canonical_json, canonical_json_without_floats
from service.questions import metadata_json, request_digest

text = st.text()  # no lone surrogates (hypothesis leaves them out): no decoder lets one through
no_floats = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**63), max_value=2**64 - 1) | text,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(text, inner, max_size=4),
    max_leaves=20,
)
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)  # what metadata takes (msgpack's range)
    | st.floats(allow_nan=False, allow_infinity=False)
    | text,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(text, inner, max_size=4),
    max_leaves=20,
)
asks: st.SearchStrategy[dict[str, Any]] = st.builds(
    dict,
    prompt=text.filter(bool),
    options=st.lists(
        st.fixed_dictionaries(
            {"id": st.from_regex(r"\A[a-z]{1,8}\Z"), "label": st.text(min_size=1, max_size=MAX_LABEL)}
        ),
        min_size=2,
        max_size=10,
    ),
    to=st.sampled_from([{"user": "alice"}, {"room": "ops"}]),
    expires_in=st.none() | st.integers(min_value=1, max_value=86_400),
    expires_at=st.none() | st.just("2030-01-01T00:00:00.000Z"),
    metadata=st.none() | st.dictionaries(text, json_values, max_size=4),
    webhook_url=st.none() | st.just("https://example.com/hook"),
)


def digest_as_json_dumps_wrote_it(body: Ask) -> str:
    canonical = canonical_json(
        {
            "prompt": body.prompt,
            "options": [[o.id, o.label] for o in body.options],
            "to": [body.to.user, body.to.room],
            "expires_in": body.expires_in,
            "expires_at": body.expires_at,
            "metadata": body.metadata,
            **({"webhook_url": body.webhook_url} if body.webhook_url is not None else {}),
        }
    )
    return hashlib.sha256(canonical.encode()).hexdigest()


@given(no_floats)
def test_values_without_floats_are_written_as_json_dumps_writes_them(value: Any) -> None:
    assert canonical_json_without_floats(value).decode() == canonical_json(value)


@given(asks)
def test_the_request_digest_is_what_json_dumps_made_of_the_request(raw: dict[str, Any]) -> None:
    body = msgspec.convert({k: v for k, v in raw.items() if v is not None}, Ask)
    assert request_digest(body, metadata_json(body)) == digest_as_json_dumps_wrote_it(body)


def test_metadata_floats_keep_json_dumps_text_in_the_digest() -> None:
    body = msgspec.convert(
        {"prompt": "p", "options": [{"id": "a", "label": "A"}, {"id": "b", "label": "B"}],
         "to": {"user": "alice"}, "expires_in": 60, "metadata": {"big": 1e16, "small": 1e-7}},
        Ask,
    )  # fmt: skip
    assert metadata_json(body) == '{"big":1e+16,"small":1e-07}'
    assert request_digest(body, metadata_json(body)) == digest_as_json_dumps_wrote_it(body)


def test_absent_and_empty_metadata_keep_their_own_digests() -> None:
    base = {
        "prompt": "p",
        "options": [{"id": "a", "label": "A"}, {"id": "b", "label": "B"}],
        "to": {"user": "alice"},
        "expires_in": 60,
    }
    absent, empty = msgspec.convert(base, Ask), msgspec.convert({**base, "metadata": {}}, Ask)
    assert metadata_json(absent) == metadata_json(empty) == "{}"
    assert request_digest(absent, "{}") == digest_as_json_dumps_wrote_it(absent)
    assert request_digest(empty, "{}") == digest_as_json_dumps_wrote_it(empty)
    assert request_digest(absent, "{}") != request_digest(empty, "{}")
    assert json.loads(canonical_json_without_floats({"m": msgspec.Raw(b'{"x":1e+16}')})) == {"m": {"x": 1e16}}
