// The overview: live counts per status, the queue, the task list, the submit and upload
// forms and the failure / dwell charts. Built once and kept (detached) while a task page is
// shown, so it stays current and the list keeps its place.

import { api, observeServerTime, serverNow } from "./api.js";
import {
  STATUSES,
  STATUS_LABELS,
  ACTION_LABELS,
  actionsFor,
  h,
  clear,
  setText,
  badge,
  updateBadge,
  progressBar,
  updateProgress,
  stepText,
  parseTime,
  formatDuration,
  formatSeconds,
  formatRelative,
  formatClock,
  formatIso,
  tick,
  showError,
  clearError,
  shortId,
  describeTask,
  durationText,
  queueText,
} from "./ui.js";
import { on, publishTask, performAction, mergeTask, applyProgress, notes } from "./live.js";
import { createUploadForm } from "./upload.js";
import { createBreakerPanel } from "./breakers.js";
import { createWorkerPanel } from "./workers.js";
import { createUsagePanel } from "./usage.js";
import { createBulkBar } from "./bulk.js";

const PAGE_SIZE = 50;
const STATS_PERIOD_MS = 10000;
const QUEUE_MIN_GAP_MS = 2000;
const QUEUE_MAX_PAGES = 5;

/** The line under a row's badge: queue position, retry countdown or stage. */
function statusLine(task) {
  if (task.final) return ""; // the stage of a finished task is history
  if (task.cancel_requested) return "cancelling…";
  if (task.status === "PENDING" || task.status === "RETRYING") return queueText(task);
  if (task.status === "WAITING_FOR_RESOURCE" && task.resource_wait) return queueText(task);
  return task.stage || "";
}

export function createOverview() {
  const root = h("div", { class: "overview", "data-keep-alive": "", dataset: { testid: "overview" } });
  const counts = createCounts();
  const list = createTaskList(counts);
  const form = createSubmitForm();
  const upload = createUploadForm();
  const charts = createCharts();
  const breakers = createBreakerPanel();
  const workers = createWorkerPanel();
  const usage = createUsagePanel();

  root.append(
    counts.el,
    h(
      "div",
      { class: "overview-grid" },
      h("div", { class: "area-list" }, list.el),
      h("div", { class: "area-form" }, form.el, upload.el),
      h("div", { class: "area-charts" }, workers.el, usage.el, breakers.el, charts.el),
    ),
  );

  counts.onFilter = (status) => list.setFilter(status);
  list.onFilterChange = (status) => counts.showFilter(status);
  list.onBulkDone = () => {
    refreshStats();
    list.load();
  };

  let statsTimer = 0;
  let statsFailed = false;
  async function refreshStats() {
    try {
      const stats = await api("/v1/stats");
      statsFailed = false;
      counts.setStats(stats);
      charts.render(stats, null);
      breakers.render(stats);
      workers.render(stats);
      usage.refresh();
    } catch (err) {
      charts.render(null, err);
      counts.setError(err);
      if (!statsFailed) showError(err, "Could not load stats");
      statsFailed = true;
    }
  }

  function poll() {
    clearTimeout(statsTimer);
    statsTimer = setTimeout(async () => {
      if (root.isConnected && document.visibilityState !== "hidden") {
        await refreshStats();
        list.refreshQueue(true);
      }
      poll();
    }, STATS_PERIOD_MS);
  }

  document.addEventListener("visibilitychange", () => {
    if (document.visibilityState === "visible" && root.isConnected) {
      refreshStats();
      list.refreshQueue(true);
    }
  });
  on("resync", () => {
    refreshStats();
    list.resync();
  });

  function reload() {
    refreshStats();
    list.load();
    poll();
  }
  reload();

  return {
    root,
    /** Called each time the overview is put back on screen. */
    shown() {
      refreshStats();
      list.refreshQueue(true);
      poll();
    },
    focusForm() {
      form.focus();
    },
    reload,
  };
}

// ---- counts ----------------------------------------------------------------------------

function createCounts() {
  const tiles = {};
  const counts = {};
  let loaded = false;

  const depthNum = h("span", { class: "tile-num", text: "–" });
  const depthTile = h(
    "div",
    { class: "tile tile-summary", dataset: { testid: "queue-depth", count: "0" } },
    h("span", { class: "tile-label", text: "Queue depth" }),
    depthNum,
    h("span", { class: "tile-hint", text: "pending + retrying" }),
  );
  const oldestNum = h("span", { class: "tile-num", text: "–" });
  const oldestHint = h("span", { class: "tile-hint", text: "oldest pending task" });
  const oldestTile = h(
    "div",
    { class: "tile tile-summary", dataset: { testid: "oldest-waiting" } },
    h("span", { class: "tile-label", text: "Oldest waiting" }),
    oldestNum,
    oldestHint,
  );

  const self = {
    el: h("section", { class: "counts", "aria-label": "Tasks by status" }, depthTile, oldestTile),
    onFilter: () => {},
    oldest: null, // {at: ms, capped: bool} or null
  };

  for (const status of STATUSES) {
    const num = h("span", { class: "tile-num", text: "–" });
    const tile = h(
      "button",
      {
        type: "button",
        class: "tile",
        "aria-pressed": "false",
        title: `Show only ${STATUS_LABELS[status].toLowerCase()} tasks`,
        dataset: { testid: `count-${status}`, status, count: "0" },
        onclick: () => self.onFilter(tile.getAttribute("aria-pressed") === "true" ? null : status),
      },
      h("span", { class: "tile-label" }, h("span", { class: "dot", "aria-hidden": "true" }), STATUS_LABELS[status]),
      num,
    );
    tiles[status] = { tile, num };
    self.el.appendChild(tile);
  }

  function render() {
    for (const status of STATUSES) {
      const n = Math.max(0, counts[status] || 0);
      const { tile, num } = tiles[status];
      tile.dataset.count = String(n);
      tile.classList.toggle("is-zero", n === 0);
      setText(num, loaded ? n.toLocaleString() : "–");
    }
    const depth = Math.max(0, counts.PENDING || 0) + Math.max(0, counts.RETRYING || 0);
    depthTile.dataset.count = String(depth);
    setText(depthNum, loaded ? depth.toLocaleString() : "–");
  }

  tick(oldestNum, () => {
    if (!loaded) return "–";
    if (!(counts.PENDING > 0) || !self.oldest) return "—";
    const age = formatDuration(serverNow() - self.oldest.at);
    return self.oldest.capped ? `≥ ${age}` : age;
  });
  tick(oldestHint, () =>
    loaded && !(counts.PENDING > 0) ? "queue is empty" : "oldest pending task",
  );

  self.setStats = (stats) => {
    const next = (stats && stats.counts) || {};
    for (const status of STATUSES) counts[status] = Number(next[status]) || 0;
    loaded = true;
    self.el.classList.remove("is-stale");
    render();
  };
  self.setError = () => {
    self.el.classList.add("is-stale");
  };
  /** A status event moves one task between two counts. */
  self.apply = (event) => {
    if (!loaded) return;
    if (event.from && counts[event.from] !== undefined) {
      counts[event.from] = Math.max(0, counts[event.from] - 1);
    }
    if (event.status) counts[event.status] = (counts[event.status] || 0) + 1;
    render();
  };
  self.showFilter = (status) => {
    for (const s of STATUSES) tiles[s].tile.setAttribute("aria-pressed", String(s === status));
  };
  render();
  return self;
}

// ---- charts ----------------------------------------------------------------------------

function seconds(value) {
  return value === null || value === undefined || value === "" ? NaN : Number(value);
}

function createCharts() {
  const failuresBody = h("div", { class: "chart-body", text: "Loading…" });
  const dwellBody = h("div", { class: "chart-body", text: "Loading…" });
  const updated = h("p", { class: "chart-foot muted small" });
  const el = h(
    "div",
    { class: "charts" },
    h(
      "section",
      { class: "card", dataset: { testid: "failures-chart" }, "aria-labelledby": "failures-title" },
      h("h2", { id: "failures-title", text: "Failure reasons" }),
      h("p", { class: "muted small", text: "Failed attempts by error code, last hour" }),
      failuresBody,
    ),
    h(
      "section",
      { class: "card", dataset: { testid: "dwell-chart" }, "aria-labelledby": "dwell-title" },
      h("h2", { id: "dwell-title", text: "Time in each state" }),
      h(
        "p",
        { class: "muted small legend" },
        h("span", { class: "swatch p50", "aria-hidden": "true" }),
        "p50 ",
        h("span", { class: "swatch p95", "aria-hidden": "true" }),
        "p95",
      ),
      dwellBody,
      updated,
    ),
  );

  function renderFailures(failures) {
    const entries = Object.entries(failures || {})
      .map(([code, n]) => [code, Number(n) || 0])
      .filter(([, n]) => n > 0)
      .sort((a, b) => b[1] - a[1] || a[0].localeCompare(b[0]));
    clear(failuresBody);
    if (!entries.length) {
      failuresBody.appendChild(h("p", { class: "chart-empty", text: "No failed attempts in the last hour." }));
      return;
    }
    const max = entries[0][1];
    const listEl = h("ul", { class: "bars" });
    for (const [code, n] of entries.slice(0, 10)) {
      listEl.appendChild(
        h(
          "li",
          { class: "bar-row", dataset: { code } },
          h(
            "div",
            { class: "bar-top" },
            h("span", { class: "bar-label mono", title: code, text: code }),
            h("span", { class: "bar-value mono", text: n.toLocaleString() }),
          ),
          h(
            "span",
            { class: "bar-track" },
            h("span", { class: "bar-fill failure", style: `width:${Math.max(2, (n / max) * 100)}%` }),
          ),
        ),
      );
    }
    failuresBody.appendChild(listEl);
    if (entries.length > 10) {
      const rest = entries.slice(10).reduce((sum, [, n]) => sum + n, 0);
      failuresBody.appendChild(
        h("p", { class: "muted small", text: `+ ${entries.length - 10} more codes (${rest} attempts)` }),
      );
    }
  }

  function renderDwell(dwell) {
    const known = new Set(STATUSES);
    const statuses = STATUSES.concat(Object.keys(dwell || {}).filter((s) => !known.has(s)));
    const entries = [];
    for (const status of statuses) {
      const d = dwell && dwell[status];
      if (!d || typeof d !== "object") continue;
      const p50 = seconds(d.p50);
      const p95 = seconds(d.p95);
      if (!Number.isFinite(p50) && !Number.isFinite(p95)) continue;
      entries.push({ status, p50: Number.isFinite(p50) ? p50 : null, p95: Number.isFinite(p95) ? p95 : null });
    }
    clear(dwellBody);
    if (!entries.length) {
      dwellBody.appendChild(h("p", { class: "chart-empty", text: "No state changes measured yet." }));
      return;
    }
    const max = Math.max(...entries.map((e) => Math.max(e.p95 || 0, e.p50 || 0)), 0.001);
    const listEl = h("ul", { class: "bars dwell" });
    for (const e of entries) {
      const pct = (v) => (v === null ? 0 : Math.max(1.5, (v / max) * 100));
      listEl.appendChild(
        h(
          "li",
          { class: "bar-row", dataset: { status: e.status } },
          h(
            "div",
            { class: "bar-top" },
            h(
              "span",
              { class: "bar-label" },
              h("span", { class: "dot", "aria-hidden": "true" }),
              STATUS_LABELS[e.status] || e.status,
            ),
            h(
              "span",
              { class: "bar-value mono" },
              `p50 ${formatSeconds(e.p50)}`,
              h("span", { class: "muted", text: ` · p95 ${formatSeconds(e.p95)}` }),
            ),
          ),
          h(
            "span",
            { class: "bar-track", title: `p50 ${formatSeconds(e.p50)} · p95 ${formatSeconds(e.p95)}` },
            h("span", { class: "bar-fill p95", style: `width:${pct(e.p95)}%` }),
            h("span", { class: "bar-fill p50", style: `width:${pct(e.p50)}%` }),
          ),
        ),
      );
    }
    dwellBody.appendChild(listEl);
  }

  let everLoaded = false;
  return {
    el,
    render(stats, err) {
      if (err) {
        if (!everLoaded) {
          for (const body of [failuresBody, dwellBody]) {
            clear(body).appendChild(
              h("p", { class: "chart-empty error-text" }, `Unavailable: ${err.message} `, h("code", { text: err.code })),
            );
          }
        }
        setText(updated, `Last refresh failed (${err.code}); retrying every 10 s.`);
        return;
      }
      everLoaded = true;
      renderFailures(stats.failures_last_hour ?? stats.failures);
      renderDwell(stats.dwell_seconds);
      setText(updated, `Updated ${formatClock(Date.now())} · refreshes every 10 s`);
    },
  };
}

// ---- task list -------------------------------------------------------------------------

const COLUMNS = [
  ["task", "Task"],
  ["status", "Status"],
  ["progress", "Progress"],
  ["attempt", "Attempt"],
  ["duration", "Duration"],
  ["actions", ""],
];

function createTaskList(counts) {
  const rows = new Map(); // id -> row
  const awaitingInsert = new Set(); // ids of new tasks to add once fetched
  const state = { phase: "loading", error: null, cursor: null, filter: null, kind: null, generation: 0, more: false };

  const tbody = h("tbody");
  const table = h(
    "table",
    { class: "task-table" },
    h("colgroup", {}, COLUMNS.map(([key]) => h("col", { class: `col-${key}` }))),
    h(
      "thead",
      {},
      h(
        "tr",
        {},
        COLUMNS.map(([key, label]) =>
          h("th", { scope: "col", class: `c-${key}` }, label || h("span", { class: "visually-hidden", text: "Actions" })),
        ),
      ),
    ),
    tbody,
  );
  const stateBox = h("div", { class: "list-state", role: "status" });
  const moreButton = h("button", {
    type: "button",
    class: "btn",
    dataset: { testid: "load-more" },
    text: "Load more",
    onclick: () => loadMore(),
  });
  const foot = h("div", { class: "list-foot" }, moreButton);
  const filterChip = h("span", { class: "filter-chip", hidden: true });
  const title = h("h2", { text: "Tasks" });
  const bulk = createBulkBar(
    {
      status: () => state.filter,
      kind: () => state.kind,
      setStatus: (status) => setFilter(status),
      setKind: (kind) => setKind(kind),
    },
    () => list.onBulkDone(),
  );
  const el = h(
    "section",
    { class: "card tasks-card", "aria-labelledby": "tasks-title" },
    h("header", { class: "card-head" }, title, filterChip),
    bulk.el,
    h("div", { class: "table-wrap" }, table),
    stateBox,
    foot,
  );
  title.id = "tasks-title";

  const list = { el, onFilterChange: () => {}, onBulkDone: () => {} };

  function matchesFilter(task) {
    return (!state.filter || task.status === state.filter) && (!state.kind || task.kind === state.kind);
  }

  /** "FAILED", "image.generate", "FAILED image.generate": what the filters name. */
  function filterText() {
    return [state.filter, state.kind].filter(Boolean).join(" ");
  }

  function render() {
    const empty = rows.size === 0;
    table.hidden = empty;
    clear(stateBox);
    stateBox.removeAttribute("data-testid");
    stateBox.setAttribute("aria-busy", String(state.phase === "loading"));
    if (state.phase === "loading" && empty) {
      stateBox.append(h("span", { class: "spinner", "aria-hidden": "true" }), "Loading tasks…");
    } else if (state.phase === "error" && empty) {
      const err = state.error;
      stateBox.append(
        h("p", {}, "Could not load tasks: ", err.message, " ", h("code", { text: err.code })),
        err.status === 401
          ? h("p", { class: "muted", text: "Enter an API key above to continue." })
          : h("button", { type: "button", class: "btn", text: "Try again", onclick: () => load() }),
      );
    } else if (empty) {
      stateBox.dataset.testid = "empty-state";
      if (state.filter || state.kind) {
        stateBox.append(
          h("p", { text: `No ${filterText()} tasks.` }),
          h("button", { type: "button", class: "btn", text: "Show all tasks", onclick: () => showAll() }),
        );
      } else {
        stateBox.append(
          h("p", { class: "empty-title" }, "No tasks yet — ", h("a", { href: "#/new", text: "submit one" })),
          h("p", { class: "muted small", text: "Tasks appear here as soon as they are accepted." }),
        );
      }
    }
    stateBox.hidden = !stateBox.firstChild;
    foot.hidden = !state.cursor || state.phase !== "ready";
    moreButton.disabled = state.more;
    setText(moreButton, state.more ? "Loading…" : "Load more");
    filterChip.hidden = !state.filter && !state.kind;
    if (state.filter || state.kind) {
      clear(filterChip).append(
        ...[
          "Showing ",
          state.filter ? badge(state.filter) : null,
          state.kind ? h("code", { class: "filter-kind", text: state.kind }) : null,
        ].filter(Boolean),
        h("button", {
          type: "button",
          class: "linklike",
          text: "Show all",
          onclick: () => showAll(),
        }),
      );
      // The chip's badge is a label, not a task's status.
      const label = filterChip.querySelector(".badge");
      if (label) label.removeAttribute("data-testid");
    }
    bulk.render();
  }

  function createRow(task) {
    const prompt = h("span", { class: "task-prompt" });
    const link = h("a", { class: "task-link", href: `#/tasks/${encodeURIComponent(task.id)}` }, prompt);
    const sub = h("span", { class: "mono" });
    const statusBadge = badge(task.status);
    const stage = h("span", { class: "stage" });
    const bar = progressBar();
    const steps = h("span", { class: "steps mono" });
    const attempt = h("span", { class: "mono" });
    const duration = h("span", { class: "mono" });
    const created = h("span", { class: "created" });
    const actions = h("div", { class: "row-actions" });
    const tr = h(
      "tr",
      { class: "task-row", dataset: { testid: "task-row", taskId: task.id, status: task.status } },
      h("td", { class: "c-task", "data-label": "Task" }, link, h("span", { class: "task-sub" }, sub, " · ", created)),
      h("td", { class: "c-status", "data-label": "Status" }, statusBadge, stage),
      h("td", { class: "c-progress", "data-label": "Progress" }, h("div", { class: "progress-line" }, bar, steps)),
      h("td", { class: "c-attempt", "data-label": "Attempt" }, attempt),
      h("td", { class: "c-duration", "data-label": "Duration" }, duration),
      h("td", { class: "c-actions", "data-label": "Actions" }, actions),
    );
    const row = { task, tr, prompt, sub, statusBadge, stage, bar, steps, attempt, duration, created, actions, actionKey: null };
    tr.addEventListener("click", (e) => {
      if (e.target.closest("a, button") || String(window.getSelection() || "")) return;
      location.hash = `#/tasks/${encodeURIComponent(row.task.id)}`;
    });
    tick(duration, () => durationText(row.task));
    tick(stage, () => statusLine(row.task));
    tick(created, () => formatRelative(parseTime(row.task.created_at)));
    updateRow(row, task);
    return row;
  }

  function updateRow(row, task) {
    row.task = task;
    row.tr.dataset.status = task.status;
    row.tr.classList.toggle("is-final", Boolean(task.final));
    setText(row.prompt, describeTask(task));
    row.prompt.title = describeTask(task);
    setText(row.sub, shortId(task.id));
    row.sub.title = `${task.id} (${task.kind || "unknown kind"})`;
    updateBadge(row.statusBadge, task.status);
    setText(row.stage, statusLine(task));
    updateProgress(row.bar, task);
    setText(row.steps, stepText(task));
    setText(row.attempt, `${task.attempt ?? 0}/${task.max_attempts ?? "?"}`);
    setText(row.duration, durationText(task));
    const created = parseTime(task.created_at);
    row.created.title = created === null ? "" : formatIso(created);
    renderActions(row);
  }

  function renderActions(row) {
    const actions = actionsFor(row.task);
    const key = `${actions.join(",")}|${row.task.cancel_requested ? 1 : 0}`;
    if (key === row.actionKey) return;
    row.actionKey = key;
    clear(row.actions);
    for (const action of actions) {
      const disabled = action === "cancel" && row.task.cancel_requested;
      const button = h("button", {
        type: "button",
        class: `btn small action-${action}`,
        dataset: { testid: action },
        disabled,
        text: disabled ? "Cancelling…" : ACTION_LABELS[action],
        "aria-label": `${ACTION_LABELS[action]} task ${row.task.id}`,
        onclick: async () => {
          button.disabled = true;
          await performAction(row.task.id, action);
          button.disabled = false;
          row.actionKey = null;
          renderActions(row);
        },
      });
      row.actions.appendChild(button);
    }
  }

  function addRow(task, position) {
    if (rows.has(task.id)) {
      const row = rows.get(task.id);
      updateRow(row, mergeTask(row.task, task));
      return;
    }
    const row = createRow(task);
    rows.set(task.id, row);
    if (position === "end") {
      tbody.appendChild(row.tr);
      return;
    }
    // Newest first: before the first row created earlier than this task.
    const created = parseTime(task.created_at) || 0;
    for (const other of tbody.children) {
      const otherRow = rows.get(other.dataset.taskId);
      if (otherRow && (parseTime(otherRow.task.created_at) || 0) < created) {
        tbody.insertBefore(row.tr, other);
        return;
      }
    }
    tbody.appendChild(row.tr);
  }

  function removeAll() {
    rows.clear();
    clear(tbody);
  }

  function listUrl(cursor) {
    const q = new URLSearchParams({ limit: String(PAGE_SIZE) });
    if (state.filter) q.set("status", state.filter);
    if (state.kind) q.set("kind", state.kind);
    if (cursor) q.set("cursor", cursor);
    return `/v1/tasks?${q}`;
  }

  async function load() {
    const generation = ++state.generation;
    state.phase = "loading";
    state.error = null;
    state.more = false;
    render();
    try {
      const page = await api(listUrl(null));
      if (generation !== state.generation) return;
      removeAll();
      for (const task of page.items || []) addRow(task, "end");
      state.cursor = page.next_cursor || null;
      state.phase = "ready";
    } catch (err) {
      if (generation !== state.generation) return;
      state.phase = "error";
      state.error = err;
      removeAll();
      showError(err, "Could not load tasks");
    }
    render();
  }

  async function loadMore() {
    if (!state.cursor || state.more) return;
    const generation = state.generation;
    state.more = true;
    render();
    try {
      const page = await api(listUrl(state.cursor));
      if (generation !== state.generation) return;
      for (const task of page.items || []) addRow(task, "end");
      state.cursor = page.next_cursor || null;
    } catch (err) {
      showError(err, "Could not load more tasks");
    } finally {
      if (generation === state.generation) {
        state.more = false;
        render();
      }
    }
  }

  /** After the feed dropped: merge the first page again instead of losing the place. */
  async function resync() {
    if (state.phase !== "ready") {
      load();
      return;
    }
    try {
      const page = await api(listUrl(null));
      for (const task of page.items || []) addRow(task);
      render();
    } catch (_) {
      // The feed's own state already says the connection is troubled.
    }
  }

  function setFilter(status) {
    if (state.filter === status) return;
    state.filter = status;
    list.onFilterChange(status);
    load();
  }

  function setKind(kind) {
    if (state.kind === kind) return;
    state.kind = kind;
    load();
  }

  function showAll() {
    state.kind = null;
    if (state.filter) setFilter(null);
    else load();
  }

  // Queue positions of visible rows, and the age of the oldest pending task. The list is
  // newest first, so the oldest is on the last page: walk there only when it may have changed
  // (the known oldest left PENDING) and on the periodic refresh.
  const queue = { timer: 0, last: 0, running: false, again: false, oldestId: null, needFull: true };
  function refreshQueue(full) {
    if (full) queue.needFull = true;
    if (queue.running) queue.again = true;
    if (queue.timer || queue.running) return;
    const wait = Math.max(0, queue.last + QUEUE_MIN_GAP_MS - Date.now());
    queue.timer = setTimeout(runQueueRefresh, wait);
  }
  async function runQueueRefresh() {
    queue.timer = 0;
    queue.running = true;
    queue.last = Date.now();
    const walk = queue.needFull;
    queue.needFull = false;
    try {
      let cursor = null;
      let pages = 0;
      let oldest = null;
      do {
        const q = new URLSearchParams({ status: "PENDING", limit: "200" });
        if (cursor) q.set("cursor", cursor);
        const page = await api(`/v1/tasks?${q}`);
        for (const task of page.items || []) {
          const row = rows.get(task.id);
          if (row) updateRow(row, mergeTask(row.task, task));
          const at = parseTime(task.created_at);
          if (at !== null && (!oldest || at < oldest.at)) oldest = { at, id: task.id };
        }
        cursor = page.next_cursor || null;
        pages += 1;
      } while (cursor && walk && pages < QUEUE_MAX_PAGES);
      // Places in the lines of shared resource pools move as slots free up, with no event.
      const holding = await api("/v1/tasks?status=WAITING_FOR_RESOURCE&limit=200");
      for (const task of holding.items || []) {
        const row = rows.get(task.id);
        if (row) updateRow(row, mergeTask(row.task, task));
      }
      if (!cursor) {
        counts.oldest = oldest ? { at: oldest.at, capped: false } : null;
        queue.oldestId = oldest ? oldest.id : null;
      } else if (walk) {
        // More than QUEUE_MAX_PAGES pages pending: the age shown is a lower bound.
        counts.oldest = oldest ? { at: oldest.at, capped: true } : null;
        queue.oldestId = null;
      }
    } catch (_) {
      // Stats and the list show their own errors; this is a refinement.
      if (walk) queue.needFull = true;
    } finally {
      queue.running = false;
      if (queue.again) {
        queue.again = false;
        refreshQueue(false);
      }
    }
  }

  on("status", (event) => {
    counts.apply(event);
    const queueMoved =
      event.from === "PENDING" || event.from === "RETRYING" || event.status === "PENDING" || event.from === null;
    if (event.from === "PENDING" && event.task_id === queue.oldestId) queue.needFull = true;
    if (queueMoved) refreshQueue(false);
    // A row shown, or one being fetched: read the task again (a fetch in flight answers
    // with the status before this event).
    if (rows.has(event.task_id) || awaitingInsert.has(event.task_id)) return true;
    if (state.phase !== "ready") return false;
    const isNew = event.event === "submit" || event.from === null || event.from === undefined;
    if ((isNew && !state.filter) || (state.filter && event.status === state.filter)) {
      awaitingInsert.add(event.task_id);
      return true;
    }
    return false;
  });
  on("task", (task) => {
    const row = rows.get(task.id);
    if (row) {
      updateRow(row, mergeTask(row.task, task));
      return;
    }
    if (!awaitingInsert.has(task.id) && !notes.has(task.id)) return;
    awaitingInsert.delete(task.id);
    if (state.phase !== "ready" || !matchesFilter(task)) return;
    // A task older than the loaded pages belongs to a later page.
    const last = tbody.lastElementChild && rows.get(tbody.lastElementChild.dataset.taskId);
    if (state.cursor && last && (parseTime(task.created_at) || 0) < (parseTime(last.task.created_at) || 0)) return;
    addRow(task);
    render();
  });
  on("progress", (event) => {
    const row = rows.get(event.task_id);
    if (!row) return;
    const next = applyProgress(row.task, event);
    if (next) updateRow(row, next);
  });

  Object.assign(list, { load, resync, setFilter, refreshQueue });
  render();
  return list;
}

// ---- submit form -----------------------------------------------------------------------

function numberField(name, label, { min, max, step = 1, value, placeholder, hint }) {
  const input = h("input", {
    id: `f-${name}`,
    name,
    type: "number",
    inputmode: "numeric",
    min,
    max,
    step,
    value,
    placeholder,
    dataset: { testid: name },
  });
  return h(
    "div",
    { class: "field" },
    h("label", { for: `f-${name}`, text: label }),
    input,
    hint ? h("span", { class: "hint", text: hint }) : null,
  );
}

function createSubmitForm() {
  const prompt = h("textarea", {
    id: "f-prompt",
    name: "prompt",
    rows: "3",
    required: true,
    maxlength: "2000",
    placeholder: "a red fox in snow",
    dataset: { testid: "prompt" },
  });
  const submit = h("button", { type: "submit", class: "btn primary", dataset: { testid: "submit" }, text: "Generate" });
  const formError = h("p", { class: "form-error", role: "alert", hidden: true });
  const review = h("input", { id: "f-review", name: "review", type: "checkbox", dataset: { testid: "review" } });
  const form = h(
    "form",
    { class: "submit-form", dataset: { testid: "submit-form" }, novalidate: true },
    h("div", { class: "field" }, h("label", { for: "f-prompt", text: "Prompt" }), prompt),
    h(
      "div",
      { class: "field-grid" },
      numberField("width", "Width", { min: 64, max: 2048, step: 8, value: 512 }),
      numberField("height", "Height", { min: 64, max: 2048, step: 8, value: 512 }),
      numberField("steps", "Steps", { min: 1, max: 150, value: 30 }),
      numberField("seed", "Seed", { min: 0, max: 4294967295, placeholder: "auto" }),
      numberField("step_ms", "Pace (ms/step)", { min: 0, max: 10000, value: 40 }),
    ),
    h(
      "details",
      { class: "more-options" },
      h("summary", { text: "Simulate trouble" }),
      h(
        "div",
        { class: "field-grid" },
        numberField("fail_attempts", "Failing attempts", { min: 0, max: 10, value: 0 }),
        h("div", { class: "field checkbox" }, review, h("label", { for: "f-review", text: "Flag for review" })),
      ),
    ),
    formError,
    h("div", { class: "form-actions" }, submit),
  );

  function intValue(name) {
    const raw = form.elements[name].value.trim();
    return raw === "" ? null : Number(raw);
  }

  form.addEventListener("submit", async (e) => {
    e.preventDefault();
    formError.hidden = true;
    if (!form.checkValidity()) {
      form.reportValidity();
      return;
    }
    const params = {
      prompt: prompt.value,
      width: intValue("width") ?? 512,
      height: intValue("height") ?? 512,
      steps: intValue("steps") ?? 30,
    };
    const seed = intValue("seed");
    if (seed !== null) params.seed = seed;
    const simulate = { step_ms: intValue("step_ms") ?? 40 };
    const failAttempts = intValue("fail_attempts");
    if (failAttempts) simulate.fail_attempts = failAttempts;
    if (review.checked) simulate.review = true;
    params.simulate = simulate;

    submit.disabled = true;
    setText(submit, "Submitting…");
    try {
      const task = await api("/v1/tasks", { method: "POST", body: { kind: "image.generate", params } });
      if (task.deduplicated !== true) observeServerTime(task.created_at); // made just now
      clearError();
      notes.set(task.id, { deduplicated: Boolean(task.deduplicated) });
      publishTask(task);
      location.hash = `#/tasks/${encodeURIComponent(task.id)}`;
    } catch (err) {
      showError(err, "Could not submit the task");
      if (err.status !== 401) {
        clear(formError).append(err.message, " ", h("code", { text: err.code }));
        formError.hidden = false;
      }
    } finally {
      submit.disabled = false;
      setText(submit, "Generate");
    }
  });

  const el = h(
    "section",
    { class: "card form-card", id: "new", "aria-labelledby": "new-title" },
    h("h2", { id: "new-title", text: "New image" }),
    form,
  );
  return {
    el,
    focus() {
      el.scrollIntoView({ block: "start", behavior: "smooth" });
      prompt.focus({ preventScroll: true });
    },
  };
}
