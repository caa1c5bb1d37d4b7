// What a cell says: pure functions of a question envelope, who I am, and the time.

/** The label of option `id` in question `q` (the id itself if the option is unknown). */
export function optionLabel(q, id) {
  const option = q.options.find((o) => o.id === id);
  return option ? option.label : id;
}

/** "just now", "12 s ago", "3 min ago", "2 h ago", "4 d ago". */
export function ago(ms) {
  const seconds = Math.floor(Math.max(0, ms) / 1000);
  if (seconds < 1) return "just now";
  if (seconds < 60) return `${seconds} s ago`;
  if (seconds < 3600) return `${Math.floor(seconds / 60)} min ago`;
  if (seconds < 86400) return `${Math.floor(seconds / 3600)} h ago`;
  return `${Math.floor(seconds / 86400)} d ago`;
}

/** "4:05 left", "1:02:03 left", "2 d left"; "0:00 left" once the deadline passed. */
export function timeLeft(ms) {
  const total = Math.ceil(Math.max(0, ms) / 1000);
  const days = Math.floor(total / 86400);
  if (days >= 2) return `${days} d left`;
  const hours = Math.floor(total / 3600);
  const minutes = Math.floor((total % 3600) / 60);
  const seconds = String(total % 60).padStart(2, "0");
  if (hours > 0) return `${hours}:${String(minutes).padStart(2, "0")}:${seconds} left`;
  return `${minutes}:${seconds} left`;
}

/**
 * The final story of a terminal question, as one sentence.
 * `tapped`: I tapped an option of this question, so an answer by someone else is news to me.
 */
export function story(q, me, tapped, now) {
  if (q.state === "answered") {
    const label = optionLabel(q, q.answer.option);
    if (q.answer.responder === me) return `You answered ${label}`;
    const when = ago(now - Date.parse(q.answer.answered_at));
    const prefix = tapped ? "Already answered" : "Answered";
    return `${prefix} by ${q.answer.responder} (${label}) ${when}`;
  }
  if (q.state === "expired") return "Expired";
  if (q.state === "cancelled") {
    const { by, reason } = q.cancellation;
    return reason ? `Cancelled by ${by}: ${reason}` : `Cancelled by ${by}`;
  }
  return "";
}

/** Who a question went to, from my side: "you" or "room oncall". */
/** The sentence of a cell whose question I can no longer see (a 404 on tap or re-fetch). */
export function goneStory(q) {
  return q.to.room !== undefined
    ? `You are no longer in room ${q.to.room}, so this is not yours to answer.`
    : "This question is no longer yours to answer.";
}

export function audience(q) {
  return q.to.room !== undefined ? `room ${q.to.room}` : "you";
}
