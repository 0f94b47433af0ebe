// Small DOM and formatting pieces shared by the views. Server strings only ever reach the
// page through textContent or attributes, never through innerHTML.

import { serverNow } from "./api.js";

export const STATUSES = [
  "PENDING",
  "WAITING_FOR_RESOURCE",
  "GENERATING",
  "UPLOADING",
  "NEEDS_REVIEW",
  "RETRYING",
  "SUCCESS",
  "FAILED",
  "TIMEOUT",
  "CANCELLED",
];

export const STATUS_LABELS = {
  PENDING: "Pending",
  WAITING_FOR_RESOURCE: "Waiting for resource",
  GENERATING: "Generating",
  UPLOADING: "Uploading",
  NEEDS_REVIEW: "Needs review",
  RETRYING: "Retrying",
  SUCCESS: "Success",
  FAILED: "Failed",
  TIMEOUT: "Timeout",
  CANCELLED: "Cancelled",
};

export const CANCELLABLE = new Set([
  "PENDING",
  "RETRYING",
  "WAITING_FOR_RESOURCE",
  "GENERATING",
  "UPLOADING",
  "NEEDS_REVIEW",
]);
export const RETRYABLE = new Set(["FAILED", "TIMEOUT", "CANCELLED"]);

/** Which action buttons apply to a task, in display order. */
export function actionsFor(task) {
  const actions = [];
  if (task.status === "NEEDS_REVIEW" && !task.final) actions.push("approve", "reject");
  if (CANCELLABLE.has(task.status) && !task.final) actions.push("cancel");
  if (RETRYABLE.has(task.status) && task.final) actions.push("retry");
  return actions;
}

export const ACTION_LABELS = {
  cancel: "Cancel",
  retry: "Retry",
  approve: "Approve",
  reject: "Reject",
};

/** Builds an element: h("a", {href: "#/", class: "x", dataset: {testid: "y"}}, "text", child). */
export function h(tag, attrs, ...children) {
  const el = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (name === "class") el.className = value;
    else if (name === "dataset") Object.assign(el.dataset, value);
    else if (name === "text") el.textContent = value;
    else if (name.startsWith("on") && typeof value === "function") {
      el.addEventListener(name.slice(2), value);
    } else if (value === true) el.setAttribute(name, "");
    else el.setAttribute(name, String(value));
  }
  append(el, children);
  return el;
}

function append(el, children) {
  for (const child of children) {
    if (child === null || child === undefined || child === false) continue;
    if (Array.isArray(child)) append(el, child);
    else if (child instanceof Node) el.appendChild(child);
    else el.appendChild(document.createTextNode(String(child)));
  }
}

export function clear(el) {
  while (el.firstChild) el.removeChild(el.firstChild);
  return el;
}

export function setText(el, text) {
  const value = text === null || text === undefined ? "" : String(text);
  if (el.textContent !== value) el.textContent = value;
}

// ---- status badge ----------------------------------------------------------------------

export function badge(status) {
  const el = h("span", { class: "badge", dataset: { testid: "status-badge" } });
  updateBadge(el, status);
  return el;
}

export function updateBadge(el, status) {
  const value = status || "UNKNOWN";
  el.dataset.status = value;
  el.title = STATUS_LABELS[value] || value;
  setText(el, value);
}

// ---- progress bar ----------------------------------------------------------------------

export function progressBar(extraClass) {
  const fill = h("span", { class: "progress-fill" });
  const bar = h(
    "div",
    {
      class: `progress${extraClass ? ` ${extraClass}` : ""}`,
      role: "progressbar",
      "aria-valuemin": "0",
      "aria-valuenow": "0",
      "aria-valuemax": "0",
      "aria-label": "Progress",
      dataset: { testid: "progress" },
    },
    fill,
  );
  return bar;
}

/** Step, total and fraction of a task, with sensible fallbacks; null when nothing is known. */
export function progressOf(task) {
  const p = task.progress;
  const steps = task.params && Number.isFinite(task.params.steps) ? task.params.steps : null;
  if (!p || typeof p !== "object") {
    if (task.status === "SUCCESS") {
      return { step: steps || 1, total: steps || 1, fraction: 1, known: false };
    }
    return { step: 0, total: steps || 0, fraction: 0, known: false };
  }
  const step = Number.isFinite(p.step) ? p.step : 0;
  const total = Number.isFinite(p.total) ? p.total : steps || 0;
  let fraction = Number.isFinite(p.fraction) ? p.fraction : total > 0 ? step / total : 0;
  fraction = Math.max(0, Math.min(1, fraction));
  return { step, total, fraction, known: true };
}

export function updateProgress(bar, task) {
  const { step, total, fraction } = progressOf(task);
  bar.setAttribute("aria-valuenow", String(step));
  bar.setAttribute("aria-valuemax", String(total));
  bar.setAttribute("aria-valuetext", total ? `step ${step} of ${total}` : "not started");
  bar.dataset.status = task.status || "";
  bar.firstChild.style.width = `${(fraction * 100).toFixed(1)}%`;
}

export function stepText(task) {
  const { step, total, known } = progressOf(task);
  if (!known && task.status !== "SUCCESS") return total ? `0/${total}` : "—";
  return total ? `${step}/${total}` : `${step}`;
}

// ---- time ------------------------------------------------------------------------------

export function parseTime(value) {
  if (!value) return null;
  const t = Date.parse(value);
  return Number.isNaN(t) ? null : t;
}

/** "850 ms", "3.2 s", "4 min 12 s", "2 h 5 min", "3 d 4 h". */
export function formatDuration(ms) {
  if (ms === null || ms === undefined || !Number.isFinite(ms)) return "—";
  const v = Math.max(0, ms);
  if (v < 1000) return `${Math.round(v)} ms`;
  const s = v / 1000;
  if (s < 10) return `${s.toFixed(1)} s`;
  if (s < 60) return `${Math.floor(s)} s`;
  const m = Math.floor(s / 60);
  if (m < 60) return `${m} min ${Math.floor(s % 60)} s`;
  const hours = Math.floor(m / 60);
  if (hours < 24) return `${hours} h ${m % 60} min`;
  return `${Math.floor(hours / 24)} d ${hours % 24} h`;
}

/** Compact, for charts: "400 ms", "4.5 s", "17.9 min", "2.3 h". */
export function formatSeconds(seconds) {
  if (seconds === null || seconds === undefined || !Number.isFinite(seconds)) return "—";
  const s = Math.max(0, seconds);
  if (s < 1) return `${Math.round(s * 1000)} ms`;
  if (s < 60) return `${s < 10 ? s.toFixed(1) : Math.round(s)} s`;
  if (s < 3600) return `${(s / 60).toFixed(1)} min`;
  if (s < 86400) return `${(s / 3600).toFixed(1)} h`;
  return `${(s / 86400).toFixed(1)} d`;
}

export function formatRelative(t) {
  if (t === null) return "—";
  const ms = serverNow() - t;
  if (Math.abs(ms) < 5000) return "just now"; // clocks never agree to the millisecond
  if (ms < 0) return `in ${formatDuration(-ms)}`;
  return `${formatDuration(ms).replace(/ \d+ (s|min|h)$/, "")} ago`;
}

const timeFmt = new Intl.DateTimeFormat(undefined, {
  hour: "2-digit",
  minute: "2-digit",
  second: "2-digit",
});
const dateTimeFmt = new Intl.DateTimeFormat(undefined, {
  month: "short",
  day: "numeric",
  hour: "2-digit",
  minute: "2-digit",
  second: "2-digit",
});

const timeMsFmt = new Intl.DateTimeFormat(undefined, {
  hour: "2-digit",
  minute: "2-digit",
  second: "2-digit",
  fractionalSecondDigits: 3,
});
const dateTimeMsFmt = new Intl.DateTimeFormat(undefined, {
  month: "short",
  day: "numeric",
  hour: "2-digit",
  minute: "2-digit",
  second: "2-digit",
  fractionalSecondDigits: 3,
});

/** Local clock time, with milliseconds if asked; the date too when it is not today. */
export function formatClock(t, withMs) {
  if (t === null) return "—";
  const d = new Date(t);
  const sameDay = d.toDateString() === new Date().toDateString();
  if (withMs) return (sameDay ? timeMsFmt : dateTimeMsFmt).format(d);
  return (sameDay ? timeFmt : dateTimeFmt).format(d);
}

export function formatIso(t) {
  return t === null ? "" : new Date(t).toISOString();
}

export function formatBytes(n) {
  if (!Number.isFinite(n)) return "—";
  if (n < 1024) return `${n} B`;
  if (n < 1024 * 1024) return `${(n / 1024).toFixed(1)} KiB`;
  return `${(n / 1024 / 1024).toFixed(1)} MiB`;
}

/**
 * Live clocks: an element registered here has its text refreshed every second from
 * fn(), until it leaves the document (it is dropped once detached for a while).
 */
const tickers = new Map();
export function tick(el, fn) {
  tickers.set(el, fn);
  setText(el, fn());
}
export function untick(el) {
  tickers.delete(el);
}
setInterval(() => {
  for (const [el, fn] of tickers) {
    if (el.isConnected) setText(el, fn());
    else if (!el.closest("[data-keep-alive]")) tickers.delete(el);
  }
}, 1000);

/** Total time of a final task; time since it was created otherwise. */
export function durationText(task) {
  const created = parseTime(task.created_at);
  if (created === null) return "—";
  if (task.final) {
    const end = parseTime(task.finished_at) ?? parseTime(task.updated_at);
    return end === null ? "—" : formatDuration(end - created);
  }
  return formatDuration(serverNow() - created);
}

/** Where a waiting task stands: "#3 in queue", "#2 for gpu-a100", "retry in 4.2 s",
 * "scheduled in 5 min" (a delayed task not yet due). */
export function queueText(task) {
  const waiting = task.status === "PENDING" || task.status === "RETRYING";
  const scheduled = task.status === "PENDING" ? parseTime(task.scheduled_for) : null;
  if (scheduled !== null && scheduled > serverNow()) return `scheduled in ${formatDuration(scheduled - serverNow())}`;
  if (waiting && Number.isFinite(task.queue_position)) return `#${task.queue_position} in queue`;
  const slot = task.resource_wait;
  if (task.status === "WAITING_FOR_RESOURCE" && slot) return `#${slot.position} for ${slot.pool}`;
  if (task.status === "RETRYING") {
    const due = parseTime(task.next_retry_at);
    if (due !== null && due > serverNow()) return `retry in ${formatDuration(due - serverNow())}`;
    return "due";
  }
  if (task.status === "PENDING") return "queued";
  return "—";
}

// ---- error banner ----------------------------------------------------------------------

function detailText(detail) {
  if (detail === null || detail === undefined) return "";
  if (typeof detail !== "object") return String(detail);
  const where = detail.loc || detail.field || detail.path || detail.param;
  const what = detail.msg || detail.message || detail.reason;
  if (what) {
    const place = Array.isArray(where) ? where.join(".") : where;
    return place ? `${place}: ${what}` : String(what);
  }
  try {
    return JSON.stringify(detail);
  } catch (_) {
    return String(detail);
  }
}

export function showError(err, context) {
  // A 401 is answered by the API key form, not by an error.
  if (err && err.status === 401) return;
  const banner = document.getElementById("error-banner");
  const message = (err && err.message) || "Something went wrong.";
  setText(banner.querySelector(".banner-message"), context ? `${context}: ${message}` : message);
  const code = banner.querySelector(".banner-code");
  setText(code, (err && err.code) || "");
  code.hidden = !(err && err.code);
  const list = clear(banner.querySelector(".banner-details"));
  for (const detail of (err && err.details) || []) {
    const text = detailText(detail);
    if (text) list.appendChild(h("li", { text }));
  }
  banner.dataset.code = (err && err.code) || "";
  banner.hidden = false;
}

export function clearError() {
  const banner = document.getElementById("error-banner");
  banner.hidden = true;
  banner.dataset.code = "";
}

export function shortId(id) {
  const s = String(id || "");
  return s.length > 16 ? `${s.slice(0, 12)}…${s.slice(-4)}` : s;
}

export function describeTask(task) {
  const prompt = task.params && typeof task.params.prompt === "string" ? task.params.prompt : "";
  if (prompt) return prompt;
  if (task.kind === "pipeline" && Array.isArray(task.params && task.params.steps)) {
    return `pipeline: ${task.params.steps.map((s) => s.name).join(" → ")}`;
  }
  const op = task.params && typeof task.params.op === "string" ? ` (${task.params.op})` : "";
  return `${task.kind || "task"}${op}`;
}
