// The GPU usage panel: the GPU-second ledger (GET /v1/usage) over the last 24 hours, by
// kind and model: attempts, GPU-seconds (seconds generating, a model load included) and
// the mean wait for a resource, read at most once a minute. A tenant's key sees its own
// attempts; the admin's, all.

import { api, serverNow } from "./api.js";
import { h, clear, formatSeconds } from "./ui.js";

const WINDOW_MS = 24 * 3600 * 1000;
// The report sums a day of the ledger: read it at most once a minute, not every stats poll.
const REFRESH_MS = 60 * 1000;

function usageRow(item) {
  const model = item.model || "no model";
  const wait = item.attempts ? item.waiting_s / item.attempts : 0;
  return h(
    "li",
    { class: "usage-row", dataset: { testid: "usage-row", kind: item.kind, model } },
    h("span", { class: "usage-name mono", text: `${item.kind} · ${model}` }),
    h("span", {
      class: "usage-gpu",
      dataset: { testid: "usage-gpu" },
      text: `${formatSeconds(item.gpu_seconds)} GPU`,
    }),
    h("span", {
      class: "usage-attempts muted small",
      text: `${item.attempts} attempt${item.attempts === 1 ? "" : "s"} · waited ${formatSeconds(wait)} each`,
    }),
  );
}

export function createUsagePanel() {
  const body = h("div", { class: "chart-body", text: "Loading…" });
  const el = h(
    "section",
    { class: "card usage-card", dataset: { testid: "usage", count: "0" }, "aria-labelledby": "usage-title" },
    h("h2", { id: "usage-title", text: "GPU usage" }),
    h("p", {
      class: "muted small",
      text: "Attempts that ended in the last 24 hours, by kind and model (the ledger)",
    }),
    body,
  );

  let readAt = -Infinity;
  return {
    el,
    async refresh() {
      if (Date.now() - readAt < REFRESH_MS) return;
      readAt = Date.now();
      const since = new Date(serverNow() - WINDOW_MS).toISOString();
      let found;
      try {
        found = await api(`/v1/usage?group_by=kind,model&from=${encodeURIComponent(since)}`);
      } catch (err) {
        readAt = -Infinity; // try again at the next poll
        clear(body);
        body.append(h("p", { class: "chart-empty", text: `Usage unavailable: ${err.message}` }));
        return;
      }
      clear(body);
      const items = found.items.filter((item) => item.attempts > 0);
      el.dataset.count = String(items.length);
      if (!items.length) {
        body.append(h("p", { class: "chart-empty", text: "No attempt ended in the last 24 hours." }));
        return;
      }
      items.sort((a, b) => b.gpu_seconds - a.gpu_seconds);
      body.append(h("ul", { class: "usage-list" }, ...items.map(usageRow)));
    },
  };
}
