"""The web inbox in a real browser (Debian's Chromium, headless): every cell ends in the one story
the server recorded, and it gets there live, through the event stream, without a reload."""

from __future__ import annotations

import asyncio
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from playwright.async_api import Browser, Route, expect

from tests.browser import screenshot
from tests.browser.harness import PHONE, Inbox, Service, open_inbox

pytestmark = pytest.mark.asyncio(loop_scope="module")

JUST_NOW = r"(just now|\d+ s ago)"


@dataclass
class RoomQuestion:
    """A question deploybot asked in a room of alice and bob: the tokens and names involved."""

    agent_token: str
    alice: str
    alice_token: str
    bob: str
    bob_token: str
    room: str
    q: dict[str, Any]


async def room_question(service: Service, room_name: str, prompt: str, labels: list[str]) -> RoomQuestion:
    _, agent_token = await service.principal("deploybot", "agent")
    alice, alice_token = await service.principal("alice", "user")
    bob, bob_token = await service.principal("bob", "user")
    room = f"{room_name}-{alice}"
    await service.api.room(room, [alice, bob])
    q = await service.ask(agent_token, {"room": room}, prompt, labels)
    return RoomQuestion(agent_token, alice, alice_token, bob, bob_token, room, q)


async def test_a_new_question_appears_live(browser: Browser, service: Service) -> None:
    agent, agent_token = await service.principal("deploybot", "agent")
    alice, alice_token = await service.principal("alice", "user")
    async with open_inbox(browser, service.base_url, alice_token) as inbox:
        await expect(inbox.page.locator("#waiting-empty")).to_be_visible()

        q = await service.ask(agent_token, {"user": alice}, "Deploy build 1432?", ["Deploy", "Abort"])

        await expect(inbox.cell(q["id"]).locator(".prompt")).to_have_text("Deploy build 1432?")
        await expect(inbox.cell(q["id"]).locator(".asker")).to_have_text(agent)
        await expect(inbox.cell(q["id"]).locator(".countdown")).to_have_text(re.compile(r"· \d+:\d\d left"))
        await expect(inbox.option(q["id"], "Deploy")).to_be_visible()
        await expect(inbox.option(q["id"], "Abort")).to_be_visible()
        await expect(inbox.page.locator("#waiting-count")).to_have_text("(1)")
        await expect(inbox.page.locator("#waiting-empty")).to_be_hidden()


async def test_a_pending_question_behind_many_ended_ones_is_still_listed(
    browser: Browser, service: Service
) -> None:
    """A list page scans a bounded number of candidates, so it can come back empty with a
    cursor; the inbox read one page, and never showed a pending question asked before ~1,600
    newer ones that had ended."""
    _, agent_token = await service.principal("deploybot", "agent")
    alice, alice_token = await service.principal("alice", "user")
    older = await service.ask(agent_token, {"user": alice}, "Still waiting?", ["Yes", "No"])
    for _ in range(17):
        ended = await asyncio.gather(
            *(service.ask(agent_token, {"user": alice}, "Ended", ["Yes", "No"]) for _ in range(100))
        )
        await asyncio.gather(*(service.api.cancel(agent_token, q["id"]) for q in ended))
    query = "/v1/questions?role=responder&state=pending&limit=200"
    first = (await service.api.call("GET", query, alice_token)).body
    assert (first["items"], bool(first["next_cursor"])) == ([], True)  # what the inbox is up against

    async with open_inbox(browser, service.base_url, alice_token) as inbox:
        await expect(inbox.cell(older["id"]).locator(".prompt")).to_have_text("Still waiting?")
        await expect(inbox.page.locator("#waiting-count")).to_have_text("(1)")


async def test_two_members_tapping_at_once_one_wins_and_the_other_sees_who(
    browser: Browser, service: Service
) -> None:
    asked = await room_question(service, "oncall", "Ship it?", ["Deploy", "Abort"])
    agent_token, alice, alice_token, bob_token, q = (
        asked.agent_token,
        asked.alice,
        asked.alice_token,
        asked.bob_token,
        asked.q,
    )
    async with (
        open_inbox(browser, service.base_url, alice_token) as alice_inbox,
        open_inbox(browser, service.base_url, bob_token) as bob_inbox,
    ):
        alice_deploy = alice_inbox.option(q["id"], "Deploy")
        bob_abort = bob_inbox.option(q["id"], "Abort")
        await expect(alice_deploy).to_be_visible()
        await expect(bob_abort).to_be_visible()

        # Both taps are in flight at once: each page's answer request is held until both have
        # been sent, then both go to the server together and race there.
        held: list[Route] = []
        both_sent = asyncio.Event()

        async def hold(route: Route) -> None:
            held.append(route)
            if len(held) == 2:
                both_sent.set()

        for inbox in (alice_inbox, bob_inbox):
            await inbox.page.route("**/v1/questions/*/answer", hold)
        await asyncio.gather(alice_deploy.click(), bob_abort.click())
        async with asyncio.timeout(10):
            await both_sent.wait()
        await asyncio.gather(*(route.continue_() for route in held))

        final = (await service.api.wait(agent_token, q["id"], timeout=10)).body
        assert final["state"] == "answered"
        winner = final["answer"]["responder"]
        won_with = {"deploy": "Deploy", "abort": "Abort"}[final["answer"]["option"]]
        winner_inbox, loser_inbox = (alice_inbox, bob_inbox) if winner == alice else (bob_inbox, alice_inbox)
        await expect(winner_inbox.story(q["id"])).to_have_text(f"You answered {won_with}")
        await expect(loser_inbox.story(q["id"])).to_have_text(
            re.compile(rf"^Already answered by {winner} \({won_with}\) {JUST_NOW}$")
        )
        for inbox in (alice_inbox, bob_inbox):
            await expect(inbox.cell(q["id"]).get_by_role("button")).to_have_count(0)
            await expect(inbox.page.locator(".error:visible, [role=alert]:visible")).to_have_count(0)


async def test_the_askers_cancel_turns_an_open_cell_cancelled_live(
    browser: Browser, service: Service
) -> None:
    agent, agent_token = await service.principal("deploybot", "agent")
    alice, alice_token = await service.principal("alice", "user")
    q = await service.ask(agent_token, {"user": alice}, "Rotate the keys?", ["Yes", "Later"])
    async with open_inbox(browser, service.base_url, alice_token) as inbox:
        await expect(inbox.option(q["id"], "Yes")).to_be_visible()

        cancelled = await service.api.cancel(agent_token, q["id"], "rotated by another job")
        assert cancelled.body["applied"] is True

        await expect(inbox.story(q["id"])).to_have_text(f"Cancelled by {agent}: rotated by another job")
        await expect(inbox.cell(q["id"])).to_have_attribute("data-state", "cancelled")
        await expect(inbox.cell(q["id"]).get_by_role("button")).to_have_count(0)
        await expect(inbox.page.locator("#waiting-count")).to_have_text("(0)")


async def test_an_expiring_question_flips_to_expired_live(browser: Browser, service: Service) -> None:
    _, agent_token = await service.principal("deploybot", "agent")
    alice, alice_token = await service.principal("alice", "user")
    q = await service.ask(agent_token, {"user": alice}, "Quick: retry?", ["Retry", "Skip"], expires_in=3)
    async with open_inbox(browser, service.base_url, alice_token) as inbox:
        await expect(inbox.cell(q["id"]).locator(".countdown")).to_have_text(re.compile(r"0:0[0-3] left"))

        await expect(inbox.story(q["id"])).to_have_text("Expired", timeout=15_000)

        await expect(inbox.cell(q["id"])).to_have_attribute("data-state", "expired")
        await expect(inbox.cell(q["id"]).get_by_role("button")).to_have_count(0)
        assert (await service.api.get(agent_token, q["id"])).body["state"] == "expired"


async def test_answers_given_elsewhere_update_the_cells_live(browser: Browser, service: Service) -> None:
    asked = await room_question(service, "ops", "Restart ingest?", ["Yes", "No"])
    agent_token, alice, alice_token, bob, bob_token, by_bob = (
        asked.agent_token,
        asked.alice,
        asked.alice_token,
        asked.bob,
        asked.bob_token,
        asked.q,
    )
    by_me_elsewhere = await service.ask(agent_token, {"user": alice}, "Merge hotfix?", ["Merge", "Wait"])
    async with open_inbox(browser, service.base_url, alice_token) as inbox:
        await expect(inbox.option(by_bob["id"], "No")).to_be_visible()
        await expect(inbox.option(by_me_elsewhere["id"], "Wait")).to_be_visible()

        assert (await service.api.answer(bob_token, by_bob["id"], "no")).body["applied"] is True
        assert (await service.api.answer(alice_token, by_me_elsewhere["id"], "merge")).body["applied"]

        await expect(inbox.story(by_bob["id"])).to_have_text(
            re.compile(rf"^Answered by {bob} \(No\) {JUST_NOW}$")
        )
        await expect(inbox.story(by_me_elsewhere["id"])).to_have_text("You answered Merge")
        await expect(inbox.page.locator("#waiting-count")).to_have_text("(0)")


async def test_tab_reaches_the_option_buttons_and_enter_answers(browser: Browser, service: Service) -> None:
    _, agent_token = await service.principal("deploybot", "agent")
    alice, alice_token = await service.principal("alice", "user")
    q = await service.ask(agent_token, {"user": alice}, "Scale up?", ["Scale", "Hold"])
    async with open_inbox(browser, service.base_url, alice_token) as inbox:
        await expect(inbox.option(q["id"], "Scale")).to_be_visible()
        page = inbox.page

        focused = ""
        for _ in range(10):  # sign out, then the first option: a handful of stops at most
            await page.keyboard.press("Tab")
            focused = await page.evaluate("document.activeElement.textContent")
            if focused == "Scale":
                break
        assert focused == "Scale", "Tab never reached the first option button"
        await page.keyboard.press("Tab")
        assert await page.evaluate("document.activeElement.textContent") == "Hold"

        await page.keyboard.press("Enter")

        await expect(inbox.story(q["id"])).to_have_text("You answered Hold")
        await expect(inbox.story(q["id"])).to_be_focused()
        assert (await service.api.get(alice_token, q["id"])).body["answer"]["option"] == "hold"


async def test_a_question_link_scrolls_to_that_question_and_focuses_its_first_button(
    browser: Browser, service: Service
) -> None:
    _, agent_token = await service.principal("deploybot", "agent")
    alice, alice_token = await service.principal("alice", "user")
    asked = [
        await service.ask(agent_token, {"user": alice}, f"Question {n}?", ["Go", "Stop"], 600 + n)
        for n in range(8)
    ]
    first, last = asked[0]["id"], asked[-1]["id"]
    async with open_inbox(
        browser, service.base_url, alice_token, PHONE, fragment=f"question={last}"
    ) as inbox:
        await expect(inbox.option(last, "Go")).to_be_focused()
        await expect(inbox.option(last, "Go")).to_be_in_viewport()
        await expect(inbox.cell(last)).to_have_class(re.compile(r"\bwanted\b"))
        assert inbox.page.url == f"{service.base_url}/#question={last}", "the token left the URL"

        await inbox.page.goto(f"{service.base_url}/#question={first}")

        await expect(inbox.option(first, "Go")).to_be_focused()
        await expect(inbox.option(first, "Go")).to_be_in_viewport()


async def test_every_control_is_a_named_button_and_stories_are_announced(
    browser: Browser, service: Service
) -> None:
    _, agent_token = await service.principal("deploybot", "agent")
    alice, alice_token = await service.principal("alice", "user")
    q = await service.ask(agent_token, {"user": alice}, "Page the DBA?", ["Page", "Skip"])
    async with open_inbox(browser, service.base_url, alice_token) as inbox:
        group = inbox.page.get_by_role("group", name="Page the DBA?")
        await expect(group.get_by_role("button")).to_have_count(2)
        await expect(group.get_by_role("button", name="Page", exact=True)).to_be_visible()
        await expect(inbox.story(q["id"])).to_have_attribute("aria-live", "polite")
        await expect(inbox.page.get_by_role("button", name="Sign out")).to_be_visible()


async def test_at_360_px_the_inbox_needs_no_horizontal_scroll(browser: Browser, service: Service) -> None:
    _, agent_token = await service.principal("deploybot", "agent")
    alice, alice_token = await service.principal("alice", "user")
    long_word = "x" * 120
    labels = [f"Option number {n} with a long label" for n in range(1, 11)]
    pending = await service.ask(agent_token, {"user": alice}, f"A long prompt {long_word}?", labels)
    answered = await service.ask(agent_token, {"user": alice}, "Short?", ["Yes", "No"])
    await service.api.answer(alice_token, answered["id"], "yes")
    async with open_inbox(browser, service.base_url, alice_token, viewport=PHONE) as inbox:
        await expect(inbox.option(pending["id"], labels[-1])).to_be_visible()
        await expect(inbox.story(answered["id"])).to_have_text("You answered Yes")

        widths = await inbox.page.evaluate(
            "[document.documentElement.scrollWidth, document.documentElement.clientWidth]"
        )

        assert widths[1] == PHONE["width"]
        assert widths[0] <= widths[1], f"the page is {widths[0]} px wide in a {widths[1]} px viewport"


PARSE_CHUNKS = """async (chunks) => {
  const { parseEventStream } = await import("/web/api.js");
  const bytes = new TextEncoder();
  const body = new ReadableStream({
    start(controller) {
      for (const chunk of chunks) controller.enqueue(bytes.encode(chunk));
      controller.close();
    },
  });
  const events = [];
  for await (const event of parseEventStream(body)) events.push(event);
  return events;
}"""


async def test_the_event_stream_parser_reassembles_events_split_across_chunks(
    browser: Browser, service: Service
) -> None:
    chunks = [
        "retry: 2000\n\n: keep-alive\n\nid: 1-0\nev",
        'ent: question.created\ndata: {"a"',
        ":1}\n\nid: 2-0\r\nevent: question.resolved\r\ndata: x\r\ndata:y\r\n\r\nid: 3-0\ndata: cut",
    ]
    async with open_inbox(browser, service.base_url, None) as inbox:
        events = await inbox.page.evaluate(PARSE_CHUNKS, chunks)

    assert events == [
        {"id": None, "type": "message", "data": "", "retry": 2000},
        {"id": "1-0", "type": "question.created", "data": '{"a":1}', "retry": None},
        {"id": "2-0", "type": "question.resolved", "data": "x\ny", "retry": None},
    ]  # the unfinished last event is not delivered


STORIES = """async (cases) => {
  const { story } = await import("/web/stories.js");
  return cases.map(([q, me, tapped, now]) => story(q, me, tapped, Date.parse(now)));
}"""


async def test_each_final_state_has_its_sentence(browser: Browser, service: Service) -> None:
    options = [{"id": "deploy", "label": "Deploy"}, {"id": "abort", "label": "Abort"}]
    answered = {
        "state": "answered",
        "options": options,
        "answer": {"option": "abort", "responder": "bob", "answered_at": "2026-01-01T10:00:00.000Z"},
    }
    expired = {"state": "expired", "options": options}
    cancelled = {"state": "cancelled", "options": options, "cancellation": {"by": "bot", "reason": "moot"}}
    silent = {**cancelled, "cancellation": {"by": "bot", "reason": None}}
    cases = [
        [answered, "bob", True, "2026-01-01T10:00:12.400Z"],
        [answered, "alice", True, "2026-01-01T10:00:12.400Z"],
        [answered, "alice", False, "2026-01-01T10:03:00.000Z"],
        [answered, "alice", False, "2026-01-01T10:00:00.300Z"],
        [expired, "alice", True, "2026-01-01T10:00:00.000Z"],
        [cancelled, "alice", False, "2026-01-01T10:00:00.000Z"],
        [silent, "alice", True, "2026-01-01T10:00:00.000Z"],
    ]
    async with open_inbox(browser, service.base_url, None) as inbox:
        sentences = await inbox.page.evaluate(STORIES, cases)

    assert sentences == [
        "You answered Abort",
        "Already answered by bob (Abort) 12 s ago",
        "Answered by bob (Abort) 3 min ago",
        "Answered by bob (Abort) just now",
        "Expired",
        "Cancelled by bot: moot",
        "Cancelled by bot",
    ]


async def sign_in_link(service: Service, principal: str) -> str:
    """The link `python -m service admin sign-in-link` prints for `principal`."""
    env = {
        **os.environ,
        "QS_REDIS_URL": service.settings.redis_url,
        "QS_KEY_PREFIX": service.settings.key_prefix,
    }
    cli = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "service", "admin", "sign-in-link", principal,
        "--base-url", service.base_url + "/",
        env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await cli.communicate()
    assert cli.returncode == 0, err.decode()
    return out.decode().strip()


async def test_a_sign_in_link_signs_in_and_leaves_no_token_in_the_url(
    browser: Browser, service: Service
) -> None:
    alice, _ = await service.principal("alice", "user")
    link = await sign_in_link(service, alice)
    assert link.startswith(f"{service.base_url}/#token=qs_")
    async with open_inbox(browser, service.base_url, None) as inbox:
        page = inbox.page

        await page.goto(link)

        await expect(page.locator("#live")).to_have_attribute("data-live", "true")
        await expect(page.locator("#who")).to_have_text(f"Signed in as {alice}")
        assert page.url == f"{service.base_url}/"
        stored = await page.evaluate("localStorage.getItem('question-service.token')")
        assert link.endswith(f"#token={stored}")

        await page.reload()
        await expect(page.locator("#who")).to_have_text(f"Signed in as {alice}")

        await page.get_by_role("button", name="Sign out").click()
        await expect(page.get_by_role("heading", name="Sign in")).to_be_visible()
        assert await page.evaluate("localStorage.getItem('question-service.token')") is None


async def test_a_pasted_token_signs_in_and_a_refused_one_says_why(browser: Browser, service: Service) -> None:
    agent, agent_token = await service.principal("deploybot", "agent")
    alice, alice_token = await service.principal("alice", "user")
    async with open_inbox(browser, service.base_url, None) as inbox:
        page = inbox.page
        token_field = page.get_by_label("Token")

        await token_field.fill("qs_000000000000_not-a-real-token")
        await token_field.press("Enter")
        await expect(page.get_by_role("alert")).to_have_text(
            "That token is not accepted: it is unknown, revoked or expired."
        )
        await token_field.fill(agent_token)
        await page.get_by_role("button", name="Sign in").click()
        await expect(page.get_by_role("alert")).to_have_text(
            f"That token belongs to the agent {agent}; the inbox is for users."
        )
        await token_field.fill(alice_token)
        await page.get_by_role("button", name="Sign in").click()

        await expect(page.locator("#live")).to_have_attribute("data-live", "true")
        await expect(page.locator("#who")).to_have_text(f"Signed in as {alice}")
        # Chromium logs every refused request; the refusal itself is what this test expects.
        inbox.problems[:] = [p for p in inbox.problems if "status of 401" not in p]


async def test_the_screenshot_script_renders_the_seeded_inbox(
    browser: Browser, service: Service, tmp_path: Path
) -> None:
    token = await screenshot.seed(service)
    out = tmp_path / "inbox.png"

    await screenshot.render(browser, service, token, out)

    assert out.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


async def test_a_member_who_left_the_room_taps_sees_it_is_no_longer_theirs_and_gets_it_back_on_rejoining(
    browser: Browser, service: Service
) -> None:
    asked = await room_question(service, "rota", "Page the DBA?", ["Page", "Wait"])
    q, room = asked.q, asked.room
    async with open_inbox(browser, service.base_url, asked.alice_token) as inbox:
        await expect(inbox.option(q["id"], "Page")).to_be_visible()
        await expect(inbox.page.locator("#waiting-count")).to_have_text("(1)")
        await tap_after_leaving(service, inbox, asked, "Page")

        await expect(inbox.option(q["id"], "Page")).to_have_count(0)
        await expect(inbox.page.locator("#waiting-count")).to_have_text("(0)")
        await expect(inbox.page.locator(f"#history [data-id='{q['id']}']")).to_be_visible()
        assert (await service.api.get(asked.agent_token, q["id"])).body["state"] == "pending"

        await service.api.room(room, [asked.alice, asked.bob])  # back in the room
        inbox.expected += ["event stream dropped", "ERR_INCOMPLETE_CHUNKED_ENCODING"]
        drop_every_connection(service)  # the event stream drops; the page reconnects and reloads

        await expect(inbox.option(q["id"], "Wait")).to_be_visible()
        await expect(inbox.page.locator("#waiting-count")).to_have_text("(1)")
        await inbox.option(q["id"], "Wait").click()
        await expect(inbox.story(q["id"])).to_have_text("You answered Wait")


async def tap_after_leaving(service: Service, inbox: Inbox, asked: RoomQuestion, label: str) -> None:
    """Alice leaves the room while her cell still offers its buttons, then taps one: a 404."""
    await service.api.room(asked.room, [asked.bob])
    inbox.expected.append("the server responded with a status of 404")
    await inbox.option(asked.q["id"], label).click()
    await expect(inbox.story(asked.q["id"])).to_have_text(
        f"You are no longer in room {asked.room}, so this is not yours to answer."
    )


def drop_every_connection(service: Service) -> None:
    runner = service.client.server.runner
    assert runner is not None
    assert runner.server is not None
    for connection in runner.server.connections:
        assert connection.transport is not None
        connection.transport.close()
