// The workers panel: the live worker processes (`workers` of GET /v1/stats, there for the
// admin key only, as GET /v1/workers lists them), each with the attempts it has in hand of
// its slots, its kinds, the models it holds loaded and when it started (`started_at`, RFC
// 3339 like every time of the API). Hidden when stats carry no list.

import { h, clear, parseTime, formatRelative, formatClock } from "./ui.js";

function startedAt(worker) {
  const t = parseTime(worker.started_at);
  return h("time", {
    class: "worker-started muted small",
    datetime: worker.started_at,
    title: t === null ? "" : formatClock(t),
    dataset: { testid: "worker-started" },
    text: t === null ? "started —" : `started ${formatRelative(t)}`,
  });
}

function workerRow(worker) {
  const models = worker.models.length ? worker.models.join(", ") : "no model loaded";
  return h(
    "li",
    { class: "worker-row", dataset: { testid: "worker", pid: String(worker.pid), host: worker.host } },
    h("span", { class: "worker-name mono", text: `${worker.host} · ${worker.pid}` }),
    h("span", { class: "worker-load", text: `${worker.running}/${worker.slots} running` }),
    h("span", { class: "worker-kinds muted small", text: worker.kinds.join(", ") }),
    h("span", { class: "worker-models small", dataset: { testid: "worker-models" }, text: models }),
    startedAt(worker),
  );
}

export function createWorkerPanel() {
  const body = h("div", { class: "chart-body", text: "Loading…" });
  const el = h(
    "section",
    { class: "card workers-card", hidden: true, dataset: { testid: "workers", count: "0" }, "aria-labelledby": "workers-title" },
    h("h2", { id: "workers-title", text: "Workers" }),
    h("p", {
      class: "muted small",
      text: "Worker processes whose beat holds: attempts in hand of their slots, models loaded",
    }),
    body,
  );

  return {
    el,
    render(stats) {
      if (!stats) return;
      el.hidden = !Array.isArray(stats.workers); // a tenant's key: not its business
      if (el.hidden) return;
      clear(body);
      const workers = stats.workers;
      el.dataset.count = String(workers.length);
      if (!workers.length) {
        body.append(h("p", { class: "chart-empty", text: "No worker is running." }));
        return;
      }
      body.append(h("ul", { class: "worker-list" }, ...workers.map(workerRow)));
    },
  };
}
