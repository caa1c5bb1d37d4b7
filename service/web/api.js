// The service's HTTP API as the inbox uses it: bearer-token requests and the event stream.
// The token goes in the Authorization header only, never in a URL, so no log or Referer sees it.

export class ApiError extends Error {
  constructor(status, detail) {
    super(detail);
    this.status = status;
  }
}

export class Api {
  constructor(token) {
    this.token = token;
    this.skewMs = 0; // server clock minus ours, from the Date header of each reply
  }

  /** Now on the server's clock (to the second), so countdowns agree with the deadline. */
  now() {
    return Date.now() + this.skewMs;
  }

  async request(method, path, body) {
    const headers = { Authorization: `Bearer ${this.token}`, Accept: "application/json" };
    const init = { method, headers, cache: "no-store" };
    if (body !== undefined) {
      headers["Content-Type"] = "application/json";
      init.body = JSON.stringify(body);
    }
    const sent = Date.now();
    const response = await fetch(path, init);
    this.learnSkew(response, sent);
    const payload = await response.json().catch(() => null);
    if (!response.ok) {
      const detail = payload && payload.detail ? payload.detail : `HTTP ${response.status}`;
      throw new ApiError(response.status, detail);
    }
    return payload;
  }

  learnSkew(response, sent) {
    const date = Date.parse(response.headers.get("Date") || "");
    if (Number.isNaN(date)) return;
    const skew = date + 500 - (sent + Date.now()) / 2; // Date is whole seconds: take the middle
    // Within a second and a half the clocks agree as far as a whole-second header can tell.
    this.skewMs = Math.abs(skew) > 1500 ? skew : 0;
  }

  me() {
    return this.request("GET", "/v1/me");
  }

  list(query) {
    return this.request("GET", `/v1/questions?${new URLSearchParams(query)}`);
  }

  get(id) {
    return this.request("GET", `/v1/questions/${encodeURIComponent(id)}`);
  }

  answer(id, option) {
    return this.request("POST", `/v1/questions/${encodeURIComponent(id)}/answer`, { option });
  }

  /**
   * Opens GET /v1/events with fetch() (EventSource cannot send Authorization) and yields each
   * event as {id, type, data, retry}. Resolves once the stream is open: the server subscribes
   * before it answers, so nothing that happens after this resolves is missed.
   */
  async openEvents(lastEventId, signal) {
    const headers = { Authorization: `Bearer ${this.token}`, Accept: "text/event-stream" };
    if (lastEventId) headers["Last-Event-ID"] = lastEventId;
    const response = await fetch("/v1/events", { headers, signal, cache: "no-store" });
    if (!response.ok) {
      const payload = await response.json().catch(() => null);
      throw new ApiError(response.status, payload && payload.detail ? payload.detail : `HTTP ${response.status}`);
    }
    return parseEventStream(response.body);
  }
}

/** The text/event-stream format (WHATWG HTML, "server-sent events"), event by event. */
export async function* parseEventStream(body) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  let event = { id: null, type: "message", data: [], retry: null };
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += value;
      const lines = buffer.split(/\r\n|\r|\n/);
      buffer = lines.pop(); // an unfinished line waits for the next chunk
      for (const line of lines) {
        if (line === "") {
          if (event.data.length > 0 || event.retry !== null) {
            yield { ...event, data: event.data.join("\n") };
          }
          event = { id: null, type: "message", data: [], retry: null };
          continue;
        }
        if (line.startsWith(":")) continue; // a comment: the keep-alive
        const colon = line.indexOf(":");
        const field = colon < 0 ? line : line.slice(0, colon);
        let value = colon < 0 ? "" : line.slice(colon + 1);
        if (value.startsWith(" ")) value = value.slice(1);
        if (field === "data") event.data.push(value);
        else if (field === "event") event.type = value;
        else if (field === "id") event.id = value;
        else if (field === "retry" && /^\d+$/.test(value)) event.retry = Number(value);
      }
    }
  } finally {
    reader.releaseLock();
  }
}
