// The live layer shared by the views: the tenant-wide event feed (GET /v1/events),
// coalesced re-fetches of a task after its status changes, and the task actions.

import { api, EventStream, observeServerTime } from "./api.js";
import { showError } from "./ui.js";

const listeners = {
  task: new Set(), // a fresher copy of a task arrived: fn(task)
  status: new Set(), // a status event: fn(event) -> true when that task should be re-fetched
  progress: new Set(), // a progress event: fn(event)
  connection: new Set(), // the feed's state: fn("live" | "reconnecting" | "closed")
  resync: new Set(), // the feed came back after a drop: fn()
};

export function on(kind, fn) {
  listeners[kind].add(fn);
  return () => listeners[kind].delete(fn);
}

function emit(kind, arg) {
  let wanted = false;
  for (const fn of Array.from(listeners[kind])) {
    if (fn(arg) === true) wanted = true;
  }
  return wanted;
}

// ---- task copies -----------------------------------------------------------------------

const RANK = {
  PENDING: 0,
  RETRYING: 0,
  WAITING_FOR_RESOURCE: 1,
  GENERATING: 2,
  UPLOADING: 3,
  NEEDS_REVIEW: 4,
};

/**
 * Merges a re-fetched task over the copy on screen. Progress is saved on the task only at
 * a throttled rate, so a fetched copy may be behind the live progress events: keep the
 * further step while the task is in the same status and attempt.
 */
export function mergeTask(prev, next) {
  if (!prev) return next;
  if (
    prev.status === next.status &&
    prev.attempt === next.attempt &&
    prev.progress &&
    next.progress &&
    Number(prev.progress.step) > Number(next.progress.step)
  ) {
    return { ...next, progress: prev.progress, stage: next.stage || prev.stage };
  }
  return next;
}

/** Applies a progress event to a task copy; null when the event is stale for that copy. */
export function applyProgress(task, event) {
  if (!task || task.final) return null;
  const from = RANK[task.status];
  const to = RANK[event.status];
  if (from !== undefined && to !== undefined && to < from) return null;
  const next = { ...task };
  if (event.status) next.status = event.status;
  if (event.stage !== undefined) next.stage = event.stage;
  if (event.progress && typeof event.progress === "object") next.progress = event.progress;
  return next;
}

/** Notes about a task from this browser session, e.g. {deduplicated: true} after a submit. */
export const notes = new Map();

const inflight = new Map(); // task id -> {promise, again}
const newest = new Map(); // task id -> updated_at (ms) of the newest copy published

/** Shares a task copy with every view; drops a copy older than one already shared. */
export function publishTask(task) {
  if (!task || !task.id) return;
  const updated = Date.parse(task.updated_at || "");
  if (!Number.isNaN(updated)) {
    const seen = newest.get(task.id);
    if (seen !== undefined && updated < seen) return;
    newest.set(task.id, updated);
  }
  emit("task", task);
}

/** GET /v1/tasks/{id}, at most one at a time per task, repeated if asked again meanwhile. */
export function refreshTask(id) {
  const running = inflight.get(id);
  if (running) {
    running.again = true;
    return running.promise;
  }
  const entry = { again: false, promise: null };
  entry.promise = (async () => {
    try {
      let task;
      do {
        entry.again = false;
        task = await api(`/v1/tasks/${encodeURIComponent(id)}`);
        publishTask(task);
      } while (entry.again);
      return task;
    } finally {
      inflight.delete(id);
    }
  })();
  inflight.set(id, entry);
  return entry.promise;
}

// ---- actions ---------------------------------------------------------------------------

const ACTION_REQUESTS = {
  cancel: (id) => [`/v1/tasks/${id}/cancel`, undefined],
  retry: (id) => [`/v1/tasks/${id}/retry`, undefined],
  approve: (id) => [`/v1/tasks/${id}/review`, { decision: "approve" }],
  reject: (id) => [`/v1/tasks/${id}/review`, { decision: "reject" }],
};

/** Runs cancel / retry / approve / reject; resolves to the updated task or null. */
export async function performAction(taskId, action) {
  const [path, body] = ACTION_REQUESTS[action](encodeURIComponent(taskId));
  try {
    const task = await api(path, { method: "POST", body: body === undefined ? {} : body });
    if (task && task.id) publishTask(task);
    return task;
  } catch (err) {
    showError(err, `Could not ${action} the task`);
    // The task may have moved on (409): show where it is now.
    refreshTask(taskId).catch(() => {});
    return null;
  }
}

/** Runs a task again as a new task (a new variation, never the same task back);
 * resolves to the new task or null. */
export async function rerunTask(taskId) {
  try {
    const task = await api(`/v1/tasks/${encodeURIComponent(taskId)}/rerun`, {
      method: "POST",
      body: { dedup: false },
    });
    if (task && task.id) publishTask(task);
    return task;
  } catch (err) {
    showError(err, "Could not run the task again");
    return null;
  }
}

// ---- the tenant-wide feed --------------------------------------------------------------

let feed = null;

export function startFeed() {
  if (feed) feed.close();
  const stream = new EventStream("/v1/events", {
    status(event) {
      if (!event.task_id) return;
      // The feed starts live, so its first events carry the server's current time.
      observeServerTime(event.at);
      if (emit("status", event)) refreshTask(event.task_id).catch(() => {});
    },
    progress(event) {
      if (event.task_id) emit("progress", event);
    },
    state(state) {
      emit("connection", state);
    },
    reopened() {
      emit("resync");
    },
    probe() {
      api("/v1/stats").catch((err) => {
        if (err.status === 401) stream.close(); // resumes once a key is entered
      });
    },
  });
  feed = stream;
  stream.open();
}

export function stopFeed() {
  if (feed) feed.close();
  feed = null;
}
