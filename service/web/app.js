// The inbox: sign in with a token, list what waits for me, answer with one tap, follow the
// event stream so every cell shows the one final story the server recorded.

import { Api, ApiError } from "./api.js";
import { audience, goneStory, optionLabel, story, timeLeft } from "./stories.js";

const TOKEN_KEY = "question-service.token";
const RECONNECT_MS = 2000;
const EXPIRY_CHECK_MS = 500;
const EXPIRY_CHECKS = 20;

const $ = (id) => document.getElementById(id);
const view = {
  signIn: $("sign-in"),
  form: $("sign-in-form"),
  tokenInput: $("token"),
  signInError: $("sign-in-error"),
  inbox: $("inbox"),
  who: $("who"),
  live: $("live"),
  signOut: $("sign-out"),
  waiting: $("waiting"),
  waitingCount: $("waiting-count"),
  waitingEmpty: $("waiting-empty"),
  history: $("history"),
  historyEmpty: $("history-empty"),
};

let session = null; // {api, me, entries: Map(id -> entry), lastEventId, stop: AbortController}
let wanted = null; // the question a `#question=<id>` link (a notification) points at

// -- signing in ----------------------------------------------------------------------------------

/**
 * Reads the fragment: `token=` from a sign-in link (fragments are never sent to a server), taken
 * out of the address bar at once; `question=` from a notification, shown once the list is loaded.
 */
function readFragment() {
  const params = new URLSearchParams(location.hash.slice(1));
  const token = params.get("token");
  if (params.get("question")) wanted = params.get("question");
  if (token !== null) {
    params.delete("token");
    const rest = params.toString();
    history.replaceState(null, "", location.pathname + location.search + (rest ? `#${rest}` : ""));
  }
  return token;
}

async function signIn(token) {
  localStorage.setItem(TOKEN_KEY, token); // kept through a failed attempt: a reload retries it
  const api = new Api(token);
  let reply;
  try {
    reply = await api.me();
  } catch (err) {
    if (err instanceof ApiError && err.status === 401) {
      localStorage.removeItem(TOKEN_KEY);
      showSignIn("That token is not accepted: it is unknown, revoked or expired.");
    } else {
      showSignIn(`Cannot reach the service (${err.message}). Try again.`);
    }
    return;
  }
  const { id, kind } = reply.principal;
  if (kind !== "user") {
    localStorage.removeItem(TOKEN_KEY);
    showSignIn(`That token belongs to the ${kind} ${id}; the inbox is for users.`);
    return;
  }
  session = { api, me: id, entries: new Map(), lastEventId: null, stop: new AbortController() };
  showInbox(id);
  follow(session);
}

function signOut(message) {
  endSession();
  localStorage.removeItem(TOKEN_KEY);
  showSignIn(message);
}

function endSession() {
  if (session) session.stop.abort();
  session = null;
  view.waiting.replaceChildren();
  view.history.replaceChildren();
}

function showSignIn(message) {
  view.inbox.hidden = true;
  view.who.hidden = view.live.hidden = view.signOut.hidden = true;
  view.signIn.hidden = false;
  view.signInError.textContent = message || "";
  view.tokenInput.value = "";
}

function showInbox(me) {
  view.signIn.hidden = true;
  view.inbox.hidden = false;
  view.who.textContent = `Signed in as ${me}`;
  view.who.hidden = view.live.hidden = view.signOut.hidden = false;
  setLive(false);
  updateCounts();
}

// -- the event stream ----------------------------------------------------------------------------

/** Follow GET /v1/events until signed out; after a drop, resume after the last event seen. */
async function follow(s) {
  while (session === s) {
    const connection = new AbortController(); // ends this connection whatever way it fails
    const signOutAborts = () => connection.abort();
    s.stop.signal.addEventListener("abort", signOutAborts);
    try {
      const events = await s.api.openEvents(s.lastEventId, connection.signal);
      setLive(true);
      await refresh(s); // the stream is subscribed: a change from now on arrives as an event
      await revealWanted(s);
      for await (const event of events) {
        if (event.id) s.lastEventId = event.id;
        if (event.type === "question.created" || event.type === "question.resolved") {
          upsert(s, JSON.parse(event.data));
        }
      }
    } catch (err) {
      if (s.stop.signal.aborted) return;
      if (err instanceof ApiError && err.status === 401) {
        signOut("Your token is no longer accepted. Sign in again.");
        return;
      }
      console.warn("event stream dropped; reconnecting", err);
    } finally {
      connection.abort();
      s.stop.signal.removeEventListener("abort", signOutAborts);
    }
    setLive(false);
    await new Promise((resolve) => setTimeout(resolve, RECONNECT_MS));
  }
}

function setLive(live) {
  view.live.textContent = live ? "Live" : "Reconnecting…";
  view.live.dataset.live = String(live);
}

/** Load what waits for me and the recent history; catch up on anything missed while away. */
async function refresh(s) {
  const [pending, recent] = await Promise.all([
    listPages(s.api, { role: "responder", state: "pending", limit: "200" }, PENDING_PAGES),
    s.api.list({ role: "responder", limit: "50" }),
  ]);
  if (session !== s) return;
  const stillPending = new Set(pending.items.map((q) => q.id));
  for (const q of [...pending.items, ...recent.items]) upsert(s, q);
  for (const entry of s.entries.values()) {
    if (isOpen(entry) && !stillPending.has(entry.q.id)) refetch(s, entry);
  }
}

/** At most this many pages of what waits for me (200 each) are loaded. */
const PENDING_PAGES = 10;

/** A listing's items, following next_cursor for up to `pages` pages: a page can come back short,
 * even empty, while more match further on (the server scans a bounded number of candidates per
 * page), so one page could hide an older pending question behind many ended ones. */
async function listPages(api, query, pages) {
  const items = [];
  let cursor = null;
  for (let n = 0; n < pages; n++) {
    const page = await api.list(cursor ? { ...query, cursor } : query);
    items.push(...page.items);
    cursor = page.next_cursor;
    if (!cursor) break;
  }
  return { items };
}

/** Fetch one question again; a failure leaves the cell as it is until the next event or load. */
async function refetch(s, entry) {
  try {
    upsert(s, await s.api.get(entry.q.id));
  } catch (err) {
    if (err instanceof ApiError && err.status === 404) markGone(s, entry);
    else console.warn(`could not fetch question ${entry.q.id}`, err);
  }
}

/** A pending question the server no longer shows me (a 404: I left its room since it was asked):
 * it cannot be answered from here, so it leaves the waiting list with a sentence saying why. */
function markGone(s, entry) {
  if (session !== s || entry.gone) return;
  entry.gone = true;
  closeCell(entry.cell, "gone", goneStory(entry.q));
  place(entry, view.history);
  updateCounts();
}

/** Scroll to the question a notification pointed at, and focus its first control. */
async function revealWanted(s) {
  const id = wanted;
  if (!id) return;
  wanted = null;
  if (!s.entries.has(id)) {
    try {
      upsert(s, await s.api.get(id));
    } catch (err) {
      if (!(err instanceof ApiError && err.status === 404)) console.warn(`cannot show ${id}`, err);
      return; // a 404: not (or no longer) visible to me, so there is nothing to show
    }
  }
  if (session !== s) return;
  const { cell } = s.entries.get(id);
  cell.li.classList.add("wanted");
  cell.li.scrollIntoView({ block: "center" });
  const firstOption = cell.options.isConnected ? cell.options.querySelector("button") : null;
  (firstOption || cell.story).focus();
}

// -- cells ---------------------------------------------------------------------------------------

/** Merge an envelope: a newer version replaces the cell's story; an older or equal one is ignored. */
function upsert(s, q, { mine = false } = {}) {
  if (session !== s) return;
  let entry = s.entries.get(q.id);
  if (entry && entry.gone) {
    // Shown to me again (back in the room, or my own tap's reply): a fresh cell replaces it.
    entry.cell.li.remove();
    s.entries.delete(q.id);
    entry = undefined;
  }
  if (!entry) {
    const fresh = { q, tapped: false, busy: false, checking: false, cell: buildCell(q) };
    s.entries.set(q.id, fresh);
    place(fresh, q.state === "pending" ? view.waiting : view.history);
    render(s, fresh);
    updateCounts();
    return;
  }
  if (q.version < entry.q.version || (q.version === entry.q.version && !mine)) return;
  entry.q = q;
  render(s, entry);
  updateCounts();
}

/** Waiting cells by deadline, soonest first; history by resolution, newest first. */
function place(entry, list) {
  const key = list === view.waiting ? sortKeyWaiting(entry.q) : sortKeyHistory(entry.q);
  const before = [...list.children].find((li) => Number(li.dataset.sort) > key);
  entry.cell.li.dataset.sort = String(key);
  list.insertBefore(entry.cell.li, before || null);
}

const sortKeyWaiting = (q) => Date.parse(q.expires_at);
const sortKeyHistory = (q) => -Date.parse(q.resolved_at || q.created_at);

function buildCell(q) {
  const li = document.createElement("li");
  li.className = "cell";
  li.dataset.id = q.id;
  const promptId = `prompt-${q.id}`;
  const meta = element("p", "meta");
  const asker = element("span", "asker", q.asker);
  const countdown = element("span", "countdown");
  meta.append(asker, ` asked ${audience(q)}`, countdown);
  const prompt = element("h3", "prompt", q.prompt);
  prompt.id = promptId;
  const options = element("div", "options");
  options.setAttribute("role", "group");
  options.setAttribute("aria-labelledby", promptId);
  for (const option of q.options) {
    const button = element("button", "option", option.label);
    button.type = "button";
    button.dataset.option = option.id;
    options.append(button);
  }
  const storyLine = element("p", "story");
  storyLine.setAttribute("aria-live", "polite");
  storyLine.tabIndex = -1; // focus moves here once my tap settles, so the keyboard is not lost
  li.append(meta, prompt, options, storyLine);
  return { li, countdown, options, story: storyLine };
}

function element(tag, className, text) {
  const node = document.createElement(tag);
  node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

function render(s, entry) {
  const { q, cell } = entry;
  if (q.state === "pending") {
    cell.li.dataset.state = q.state;
    updateCountdown(s, entry);
    return;
  }
  closeCell(cell, q.state, story(q, s.me, entry.tapped, s.api.now()));
}

/** A cell that offers nothing any more: its buttons and countdown give way to its sentence. */
function closeCell(cell, state, sentence) {
  const hadFocus = cell.li.contains(document.activeElement);
  cell.li.dataset.state = state;
  cell.options.remove();
  cell.countdown.textContent = "";
  cell.story.textContent = sentence;
  if (hadFocus) cell.story.focus();
}

/** Still waiting for my answer: pending, and shown to me. */
function isOpen(entry) {
  return entry.q.state === "pending" && !entry.gone;
}

function updateCountdown(s, entry) {
  const left = Date.parse(entry.q.expires_at) - s.api.now();
  entry.cell.countdown.textContent = left > 0 ? ` · ${timeLeft(left)}` : " · expiring…";
  if (left <= 0 && !entry.checking) checkExpiry(s, entry);
}

/** At zero the server expires the question; fetch until it says so (the event may come first). */
async function checkExpiry(s, entry) {
  entry.checking = true;
  for (let i = 0; i < EXPIRY_CHECKS && session === s && isOpen(entry); i++) {
    await refetch(s, entry);
    if (entry.q.state !== "pending") return;
    await new Promise((resolve) => setTimeout(resolve, EXPIRY_CHECK_MS));
  }
}

function updateCounts() {
  const entries = session ? [...session.entries.values()] : [];
  const waiting = entries.filter(isOpen).length;
  view.waitingCount.textContent = `(${waiting})`;
  view.waitingEmpty.hidden = view.waiting.children.length > 0;
  view.historyEmpty.hidden = view.history.children.length > 0;
}

// -- answering -----------------------------------------------------------------------------------

async function tap(button) {
  const s = session;
  const entry = s && s.entries.get(button.closest(".cell").dataset.id);
  if (!entry || !isOpen(entry) || entry.busy) return;
  entry.tapped = entry.busy = true;
  const label = optionLabel(entry.q, button.dataset.option);
  setButtonsDisabled(entry, true);
  entry.cell.story.textContent = `Sending ${label}…`;
  try {
    const reply = await s.api.answer(entry.q.id, button.dataset.option);
    upsert(s, reply.question, { mine: true });
  } catch (err) {
    if (err instanceof ApiError && err.status === 401) {
      signOut("Your token is no longer accepted. Sign in again.");
      return;
    }
    if (err instanceof ApiError && err.status === 404) {
      markGone(s, entry);
      return;
    }
    if (entry.gone) return; // a re-fetch found it gone meanwhile; the cell says so already
    entry.cell.story.textContent = `Not sent: ${err.message}. Try again.`;
    setButtonsDisabled(entry, false);
  } finally {
    entry.busy = false;
  }
}

function setButtonsDisabled(entry, disabled) {
  for (const button of entry.cell.options.querySelectorAll("button")) {
    button.setAttribute("aria-disabled", String(disabled)); // stays focusable while it sends
  }
}

// -- wiring --------------------------------------------------------------------------------------

view.form.addEventListener("submit", (event) => {
  event.preventDefault();
  const token = view.tokenInput.value.trim();
  if (token) signIn(token);
});
view.signOut.addEventListener("click", () => signOut("Signed out."));
view.waiting.addEventListener("click", (event) => {
  const button = event.target.closest("button.option");
  if (button) tap(button);
});
// A sign-in link opened while the page is already open changes only the fragment: no reload.
window.addEventListener("hashchange", () => {
  const token = readFragment();
  if (token !== null) {
    endSession();
    signIn(token);
  } else if (session) {
    revealWanted(session);
  }
});
setInterval(() => {
  if (!session) return;
  for (const entry of session.entries.values()) {
    if (isOpen(entry)) updateCountdown(session, entry);
  }
}, 1000);

const token = readFragment() || localStorage.getItem(TOKEN_KEY);
if (token) signIn(token);
else showSignIn();
