// Talking to the kiln API: JSON requests with the error envelope, the API key, the
// server's clock, and resumable server-sent event streams.

const KEY_STORAGE = "kiln.apiKey";

let unauthorizedHandler = () => {};
let memoryKey = ""; // the key when localStorage is unavailable
let serverSkewMs = 0; // server clock minus browser clock (see observeServerTime)
let skewBound = null; // the largest lower bound of that skew seen so far

export class ApiError extends Error {
  constructor(status, code, message, details) {
    super(message);
    this.name = "ApiError";
    this.status = status;
    this.code = code;
    this.details = Array.isArray(details) ? details : [];
  }
}

export function apiKey() {
  try {
    return localStorage.getItem(KEY_STORAGE) || "";
  } catch (_) {
    return "";
  }
}

export function setApiKey(key) {
  try {
    if (key) localStorage.setItem(KEY_STORAGE, key);
    else localStorage.removeItem(KEY_STORAGE);
  } catch (_) {
    // Private mode without storage: the key then lasts for this page only.
  }
  memoryKey = key || "";
}

/** The key requests send: the saved one, or the one kept for this page only. */
export function currentKey() {
  return apiKey() || memoryKey;
}

/** Called with no arguments whenever the API answers 401. */
export function onUnauthorized(handler) {
  unauthorizedHandler = handler;
}

/** For a 401 that a request outside this module received (the upload worker's). */
export function reportUnauthorized() {
  unauthorizedHandler();
}

/** Browser time corrected by the server's clock, in ms since the epoch. */
export function serverNow() {
  return Date.now() + serverSkewMs;
}

/**
 * Learns the server's clock from a timestamp it just produced (a live status event's
 * `at`, a new task's `created_at`). Such a time is never later than the server's "now" on
 * arrival, so each one bounds the skew from below; the largest bound is the estimate.
 * Pass only fresh times: an old one (a replayed event) is a weak bound, harmless after a
 * good one but misleading as the first. Skews under a second are ignored.
 */
export function observeServerTime(iso) {
  const t = Date.parse(iso || "");
  if (Number.isNaN(t)) return;
  const bound = t - Date.now();
  skewBound = skewBound === null ? bound : Math.max(skewBound, bound);
  serverSkewMs = Math.abs(skewBound) > 1000 ? skewBound : 0;
}

/**
 * One JSON request. Resolves to the parsed body; rejects with an ApiError carrying the
 * envelope's code and message (code "network_error" when the server cannot be reached).
 */
export async function api(path, { method = "GET", body, signal } = {}) {
  const headers = { Accept: "application/json" };
  if (body !== undefined) headers["Content-Type"] = "application/json";
  const key = currentKey();
  if (key) headers.Authorization = `Bearer ${key}`;
  let res;
  try {
    res = await fetch(path, {
      method,
      headers,
      body: body === undefined ? undefined : JSON.stringify(body),
      signal,
      cache: "no-store",
    });
  } catch (err) {
    if (err && err.name === "AbortError") throw err;
    throw new ApiError(0, "network_error", "Cannot reach the kiln server.");
  }
  const data = await readJson(res);
  if (res.ok) return data;
  if (res.status === 401) unauthorizedHandler();
  const envelope = data && typeof data === "object" ? data.error : null;
  throw new ApiError(
    res.status,
    (envelope && envelope.code) || `http_${res.status}`,
    (envelope && envelope.message) || res.statusText || `The server answered ${res.status}.`,
    envelope && envelope.details,
  );
}

async function readJson(res) {
  let text = "";
  try {
    text = await res.text();
  } catch (_) {
    return null;
  }
  if (!text) return null;
  try {
    return JSON.parse(text);
  } catch (_) {
    return null;
  }
}

/** Fetches a protected file (an output) and returns an object URL for it. */
export async function fetchBlobUrl(path, signal) {
  const headers = {};
  const key = currentKey();
  if (key) headers.Authorization = `Bearer ${key}`;
  let res;
  try {
    res = await fetch(path, { headers, signal });
  } catch (err) {
    if (err && err.name === "AbortError") throw err;
    throw new ApiError(0, "network_error", "Cannot reach the kiln server.");
  }
  if (!res.ok) {
    const data = await readJson(res);
    if (res.status === 401) unauthorizedHandler();
    const envelope = data && data.error;
    throw new ApiError(
      res.status,
      (envelope && envelope.code) || `http_${res.status}`,
      (envelope && envelope.message) || `The output could not be loaded (${res.status}).`,
    );
  }
  return URL.createObjectURL(await res.blob());
}

/** Whether outputs can be shown with a plain <img src> (no key to send). */
export function needsAuthForFiles() {
  return Boolean(currentKey());
}

function streamUrl(path, after) {
  const url = new URL(path, location.href);
  if (after) url.searchParams.set("after", after);
  const key = currentKey();
  if (key) url.searchParams.set("access_token", key);
  return url.pathname + url.search;
}

/**
 * A server-sent event stream that survives drops. The browser's EventSource reconnects by
 * itself with Last-Event-ID; when it gives up (a non-200 answer), this reopens it with
 * ?after=<last id> after a backoff. Handlers:
 *   status(data), progress(data)  one parsed event each
 *   state("live" | "reconnecting" | "closed")
 *   ended()                      return true when a dropped connection is the expected end
 *   probe()                      after a refused connection: a request that shows why
 */
export class EventStream {
  constructor(path, handlers) {
    this.path = path;
    this.handlers = handlers;
    this.source = null;
    this.lastId = "";
    this.retryTimer = 0;
    this.backoffMs = 1000;
    this.dropped = false;
    this.closedForGood = false;
  }

  open(after) {
    this.closedForGood = false;
    if (after !== undefined && after !== null && after !== "") this.lastId = String(after);
    this.connect();
    return this;
  }

  connect() {
    this.detach();
    const source = new EventSource(streamUrl(this.path, this.lastId));
    this.source = source;
    source.addEventListener("status", (e) => this.dispatch("status", e));
    source.addEventListener("progress", (e) => this.dispatch("progress", e));
    source.addEventListener("message", (e) => this.dispatch(null, e));
    source.onopen = () => {
      this.backoffMs = 1000;
      const wasDropped = this.dropped;
      this.dropped = false;
      this.emitState("live");
      if (wasDropped && this.handlers.reopened) this.handlers.reopened();
    };
    source.onerror = () => this.onError(source);
  }

  dispatch(type, event) {
    if (event.lastEventId) this.lastId = event.lastEventId;
    let data;
    try {
      data = JSON.parse(event.data);
    } catch (_) {
      return; // a comment or keep-alive that is not JSON
    }
    if (!data || typeof data !== "object") return;
    const kind = type || data.type;
    if (kind === "status" && this.handlers.status) this.handlers.status(data);
    else if (kind === "progress" && this.handlers.progress) this.handlers.progress(data);
  }

  onError(source) {
    if (source !== this.source) return;
    if (this.handlers.ended && this.handlers.ended()) {
      this.close();
      return;
    }
    this.dropped = true;
    this.emitState("reconnecting");
    if (source.readyState === EventSource.CLOSED) {
      // The browser will not retry (the server refused): find out why, then retry later.
      this.detach();
      if (this.handlers.probe) this.handlers.probe();
      this.retryTimer = setTimeout(() => {
        if (!this.closedForGood) this.connect();
      }, this.backoffMs);
      this.backoffMs = Math.min(this.backoffMs * 2, 15000);
    }
  }

  emitState(state) {
    if (this.handlers.state) this.handlers.state(state);
  }

  detach() {
    clearTimeout(this.retryTimer);
    if (this.source) {
      this.source.onerror = null;
      this.source.onopen = null;
      this.source.close();
      this.source = null;
    }
  }

  close() {
    this.closedForGood = true;
    this.detach();
    this.emitState("closed");
  }

  get isOpen() {
    return !this.closedForGood && (this.source !== null || this.dropped);
  }
}
