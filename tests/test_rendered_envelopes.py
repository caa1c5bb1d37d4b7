"""The envelope's JSON is made once per (id, version, transition call) and reused; these pin that
reuse never serves an envelope the stored fields no longer say."""

from __future__ import annotations

import msgpack
import msgspec

from service.model import Question, RenderedEnvelopes, as_envelope, envelope, to_json

PENDING = {
    "id": "0123456789abcdef012345678",
    "state": "pending",
    "prompt": "Ship it?",
    "options": '[{"id":"no","label":"No"},{"id":"yes","label":"Yes"}]',
    "opt_ids": "|no|yes|",
    "to_kind": "user",
    "to_id": "alice",
    "asker": "deploybot",
    "created_ms": "1764950000123",
    "expires_ms": "1764953600123",
    "meta": "{}",
    "version": "1",
    "ccall": "c1",
    "hook_secret": "whsec_not-for-the-envelope",
}
ANSWERED = PENDING | {
    "state": "answered",
    "version": "2",
    "resolved_ms": "1764950001000",
    "tcall": "t1",
    "ans_option": "yes",
    "ans_by": "alice",
    "ans_ms": "1764950001000",
}


def test_a_question_encodes_as_its_envelope_never_its_fields() -> None:
    body = to_json({"applied": True, "question": Question(PENDING)})
    assert msgspec.json.decode(body) == {"applied": True, "question": envelope(PENDING)}
    assert b"whsec_" not in body
    packed = msgpack.packb({"items": [Question(ANSWERED)]}, use_bin_type=True, default=as_envelope)
    assert msgpack.unpackb(packed) == {"items": [envelope(ANSWERED)]}


def test_the_rendered_json_is_the_envelope_and_is_made_once() -> None:
    rendered = RenderedEnvelopes(8)
    first = rendered.json(Question(PENDING))
    assert first == to_json(envelope(PENDING))
    assert rendered.json(Question(dict(PENDING))) is first


def test_a_transition_is_rendered_anew_and_an_older_copy_still_reads_as_itself() -> None:
    rendered = RenderedEnvelopes(8)
    rendered.json(Question(PENDING))
    assert msgspec.json.decode(rendered.json(Question(ANSWERED)))["state"] == "answered"
    assert msgspec.json.decode(rendered.json(Question(PENDING)))["state"] == "pending"


def test_another_transition_at_the_same_version_is_not_served_from_the_first() -> None:
    """A failover that lost an answer can let another call end the question at version 2 too;
    its transition call id tells the two apart."""
    rendered = RenderedEnvelopes(8)
    rendered.json(Question(ANSWERED))
    other = ANSWERED | {"tcall": "t2", "ans_option": "no", "ans_by": "bob"}
    assert msgspec.json.decode(rendered.json(Question(other)))["answer"]["option"] == "no"


def test_the_cache_keeps_at_most_its_size() -> None:
    rendered = RenderedEnvelopes(2)
    for n in range(5):
        rendered.json(Question(PENDING | {"id": f"{n:025d}"}))
    assert len(rendered) == 2
