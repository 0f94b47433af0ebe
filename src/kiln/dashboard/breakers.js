// The circuit breaker panel: each upstream dependency's breaker as every worker shares it
// (`breakers` of GET /v1/stats), open ones first and highlighted.

import { h, clear, parseTime, formatClock } from "./ui.js";

const LABELS = { closed: "closed", half_open: "half-open", open: "open" };
const ORDER = { open: 0, half_open: 1, closed: 2 };

function untilText(breaker) {
  const until = parseTime(breaker.until);
  if (breaker.state === "open") return until === null ? "" : `next probe at ${formatClock(until)}`;
  if (breaker.state === "half_open") return "a probe may go through";
  return "";
}

export function createBreakerPanel() {
  const body = h("div", { class: "chart-body", text: "Loading…" });
  const el = h(
    "section",
    { class: "card breakers-card", dataset: { testid: "breakers", open: "0" }, "aria-labelledby": "breakers-title" },
    h("h2", { id: "breakers-title", text: "Circuit breakers" }),
    h("p", {
      class: "muted small",
      text: "Upstream dependencies: while one is open, the kinds that need it pause or fail fast",
    }),
    body,
  );

  return {
    el,
    render(stats) {
      if (!stats) return;
      const entries = Object.entries(stats.breakers || {}).sort(
        ([a, x], [b, y]) => (ORDER[x.state] ?? 3) - (ORDER[y.state] ?? 3) || a.localeCompare(b),
      );
      const open = entries.filter(([, breaker]) => breaker.state !== "closed").length;
      el.dataset.open = String(open);
      el.classList.toggle("has-open", open > 0);
      clear(body);
      if (!entries.length) {
        body.append(h("p", { class: "chart-empty", text: "None has tripped." }));
        return;
      }
      const list = h("ul", { class: "breaker-list" });
      for (const [name, breaker] of entries) {
        list.append(
          h(
            "li",
            { class: "breaker-row", dataset: { testid: "breaker", breaker: name, state: breaker.state } },
            h("span", { class: "breaker-name mono", text: name }),
            h("span", { class: "breaker-state", text: LABELS[breaker.state] || breaker.state }),
            h("span", { class: "breaker-until muted small", text: untilText(breaker) }),
          ),
        );
      }
      body.append(list);
    },
  };
}
