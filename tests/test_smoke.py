"""The walk-through of the README, on a real Redis and on the in-memory backend."""

from tests.api import Api


async def test_agent_asks_user_answers_and_waiter_gets_the_same_envelope(any_api: Api) -> None:
    agent = await any_api.principal("deploybot", "agent")
    alice = await any_api.principal("alice", "user")
    question = await any_api.ask(agent, {"user": "alice"}, options=("deploy", "abort"))
    assert question["state"] == "pending"

    answered = await any_api.answer(alice, question["id"], "deploy")
    assert answered.status == 200
    assert answered.body["applied"] is True
    envelope = answered.body["question"]
    assert envelope["answer"]["option"] == "deploy"
    assert envelope["answer"]["responder"] == "alice"

    waited = await any_api.wait(agent, question["id"], 1)
    fetched = await any_api.get(agent, question["id"])
    assert waited.body == fetched.body == envelope
