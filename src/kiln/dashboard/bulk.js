// Bulk cancel and retry from the task list: an action bar that names what the list shows
// (its status and kind) and the bulk filter's own narrowing fields (error code, created
// since); "Retry…" and "Cancel…" first ask for a dry run, confirm the exact count in a
// dialog, then send the pages one by one (POST /v1/tasks/retry or /cancel, each with the
// previous answer's cursor and filter), with progress, a Stop button between pages, and a
// summary. The API decides what a key may touch; a refusal shows its code and message.

import { api } from "./api.js";
import { STATUSES, CANCELLABLE, RETRYABLE, h, clear, setText } from "./ui.js";

const PAGE_LIMIT = 100;
const MAX_PAGE_LIMIT = 1000;
const ACTIONS = {
  retry: { verb: "Retry", done: "retried", applies: RETRYABLE, any: "FAILED, TIMEOUT or CANCELLED" },
  cancel: { verb: "Cancel", done: "cancelled", applies: CANCELLABLE, any: "live" },
};
const DURATION = /^\s*\d+(\.\d+)?\s*(s|m|h|d|w)\s*$/;

/** A created-since text as the API takes it: unix seconds as a number, else the text. */
function moment(text) {
  return /^\d+(\.\d+)?$/.test(text) ? Number(text) : text;
}

/** "Retry 37 FAILED tasks with code upstream_unavailable?" */
export function describeAction(action, count, wanted) {
  const { verb, any } = ACTIONS[action];
  const statuses = wanted.status ? wanted.status : any;
  let text = `${verb} ${count.toLocaleString()} ${statuses} ${count === 1 ? "task" : "tasks"}`;
  if (wanted.kind) text += ` of kind ${wanted.kind}`;
  if (wanted.code) text += ` with code ${wanted.code}`;
  if (wanted.since) {
    text += DURATION.test(wanted.since) ? ` created in the last ${wanted.since.trim()}` : ` created since ${wanted.since}`;
  }
  return `${text}?`;
}

function field(id, label, input) {
  return h("div", { class: "field bulk-field" }, h("label", { for: id, text: label }), input);
}

/**
 * The bar. `list` gives and sets the list's filters: status() / kind(), setStatus(s) /
 * setKind(k); `refresh()` reloads the list and the counts after an action.
 */
export function createBulkBar(list, refresh) {
  const statusSelect = h(
    "select",
    { id: "bulk-status", name: "status", dataset: { testid: "bulk-status" } },
    h("option", { value: "", text: "Any status" }),
    STATUSES.map((s) => h("option", { value: s, text: s })),
  );
  const kindInput = h("input", {
    id: "bulk-kind", name: "kind", type: "text", placeholder: "any", spellcheck: "false",
    autocomplete: "off", maxlength: "200", dataset: { testid: "bulk-kind" },
  });
  const codeInput = h("input", {
    id: "bulk-code", name: "code", type: "text", placeholder: "any", spellcheck: "false",
    autocomplete: "off", maxlength: "200", dataset: { testid: "bulk-code" },
  });
  const sinceInput = h("input", {
    id: "bulk-since", name: "since", type: "text", placeholder: "1h, 2d, 2026-12-01T00:00:00Z",
    spellcheck: "false", autocomplete: "off", maxlength: "64", dataset: { testid: "bulk-since" },
  });
  const retryButton = h("button", {
    type: "button", class: "btn action-retry", text: "Retry…", dataset: { testid: "bulk-retry" }, "aria-describedby": "bulk-hint",
    onclick: () => start("retry", retryButton),
  });
  const cancelButton = h("button", {
    type: "button", class: "btn action-cancel", text: "Cancel…", dataset: { testid: "bulk-cancel" }, "aria-describedby": "bulk-hint",
    onclick: () => start("cancel", cancelButton),
  });
  const hint = h("p", { class: "bulk-hint muted small", id: "bulk-hint" });
  const el = h(
    "div",
    { class: "bulk-bar", role: "group", "aria-label": "Act on the listed tasks", dataset: { testid: "bulk-bar" } },
    h(
      "div",
      { class: "bulk-fields" },
      field("bulk-status", "Status", statusSelect),
      field("bulk-kind", "Kind", kindInput),
      field("bulk-code", "Error code", codeInput),
      field("bulk-since", "Created since", sinceInput),
      h("div", { class: "bulk-buttons" }, retryButton, cancelButton),
    ),
    hint,
  );
  const dialog = createDialog(refresh);
  document.body.appendChild(dialog.el);

  statusSelect.addEventListener("change", () => list.setStatus(statusSelect.value || null));
  kindInput.addEventListener("change", () => list.setKind(kindInput.value.trim() || null));
  for (const input of [codeInput, sinceInput]) input.addEventListener("input", render);

  /** What the bar names now: the list's filters and the narrowing fields. */
  function wanted() {
    return {
      status: list.status() || null,
      kind: list.kind() || null,
      code: codeInput.value.trim() || null,
      since: sinceInput.value.trim() || null,
    };
  }

  function render() {
    const w = wanted();
    statusSelect.value = w.status || "";
    if (document.activeElement !== kindInput) kindInput.value = w.kind || "";
    const busy = dialog.busy();
    const canRetry = !w.status || RETRYABLE.has(w.status);
    const canCancel = !w.status || CANCELLABLE.has(w.status);
    retryButton.disabled = busy || !canRetry;
    cancelButton.disabled = busy || !canCancel;
    const narrowing = w.code || w.since ? " Error code and created since narrow the action further." : "";
    setText(
      hint,
      canRetry || canCancel
        ? `Acts on every task these fields name, not only the rows shown.${narrowing}`
        : `${w.status} tasks can be neither retried nor cancelled.`,
    );
  }

  function start(action, trigger) {
    const w = wanted();
    const filter = {};
    if (w.status) filter.status = [w.status];
    if (w.kind) filter.kind = [w.kind];
    if (w.code) filter.code = [w.code];
    if (w.since) filter.created_after = moment(w.since);
    dialog.open(action, w, filter, trigger, limit(), render);
    render();
  }

  function limit() {
    const n = Number(el.dataset.pageSize); // tests make pages small with data-page-size
    return Number.isInteger(n) && n >= 1 ? Math.min(n, MAX_PAGE_LIMIT) : PAGE_LIMIT;
  }

  render();
  return { el, render };
}

// ---- the dialog: dry run, confirmation, pages, summary ---------------------------------

function createDialog(refresh) {
  const title = h("h2", { id: "bulk-title", class: "bulk-title" });
  const message = h("p", { id: "bulk-message", class: "bulk-message", dataset: { testid: "bulk-message" } });
  const bar = h("div", {
    class: "progress bulk-progress", role: "progressbar", "aria-label": "Tasks done",
    "aria-valuemin": "0", "aria-valuenow": "0", "aria-valuemax": "0", dataset: { testid: "bulk-progress" },
  }, h("span", { class: "progress-fill" }));
  const progressText = h("p", { class: "bulk-progress-text mono small", dataset: { testid: "bulk-progress-text" } });
  const progress = h("div", { class: "bulk-progress-box", role: "status", "aria-live": "polite" }, bar, progressText);
  const summary = h("p", { class: "bulk-summary", role: "status", dataset: { testid: "bulk-summary" } });
  const errorBox = h("div", { class: "bulk-error", role: "alert", dataset: { testid: "bulk-error" } });
  const confirm = h("button", { type: "button", class: "btn primary", dataset: { testid: "bulk-confirm" } });
  const stop = h("button", { type: "button", class: "btn", text: "Stop", dataset: { testid: "bulk-stop" } });
  const dismiss = h("button", { type: "button", class: "btn", dataset: { testid: "bulk-close" } });
  const el = h(
    "dialog",
    {
      class: "bulk-dialog card",
      "aria-labelledby": "bulk-title",
      "aria-describedby": "bulk-message",
      dataset: { testid: "bulk-dialog" },
    },
    title,
    message,
    progress,
    summary,
    errorBox,
    h("div", { class: "bulk-dialog-actions" }, dismiss, stop, confirm),
  );

  // One run at a time; `run` is the current one (null when the dialog is closed).
  let run = null;

  function show(phase) {
    run.phase = phase;
    el.dataset.phase = phase;
    progress.hidden = phase !== "running" && phase !== "done";
    confirm.hidden = phase !== "confirm";
    stop.hidden = phase !== "running";
    dismiss.hidden = phase === "running";
    setText(dismiss, phase === "confirm" ? "Keep them" : "Close");
    summary.hidden = phase !== "done";
    errorBox.hidden = !run.error;
    if (run.error) {
      const err = run.error;
      clear(errorBox).append(
        h("p", {}, h("code", { class: "bulk-error-code", text: err.code }), " ", err.message),
        ...(err.details || [])
          .filter((d) => d && d.msg)
          .map((d) => h("p", { class: "small muted", text: `${(d.loc || []).join(".")}: ${d.msg}` })),
      );
      el.dataset.errorCode = err.code;
    }
  }

  function renderProgress() {
    const { done } = ACTIONS[run.action];
    const total = Math.max(run.count, run.changed + run.skipped);
    bar.setAttribute("aria-valuenow", String(run.changed + run.skipped));
    bar.setAttribute("aria-valuemax", String(total));
    bar.firstChild.style.width = `${total ? ((run.changed + run.skipped) / total) * 100 : 100}%`;
    const asked = run.action === "cancel" && run.asked ? `, ${run.asked} asked to stop` : "";
    setText(progressText, `pages ${run.pages} · ${done} ${run.changed - run.asked}${asked} · skipped ${run.skipped}`);
    Object.assign(el.dataset, { pages: String(run.pages), changed: String(run.changed), skipped: String(run.skipped) });
  }

  async function open(action, wanted, filter, trigger, limit, onChange) {
    if (run) return;
    const empty = Object.keys(filter).length === 0;
    run = {
      action, wanted, filter, trigger, limit, onChange, all: empty, count: 0,
      pages: 0, changed: 0, asked: 0, skipped: 0, stopping: false, error: null, phase: "",
    };
    stop.disabled = false;
    setText(stop, "Stop");
    for (const key of ["count", "pages", "changed", "skipped", "errorCode"]) delete el.dataset[key];
    const { verb } = ACTIONS[action];
    setText(title, `${verb} tasks`);
    setText(trigger, "Counting…");
    trigger.setAttribute("aria-busy", "true");
    let answer;
    try {
      answer = await api(`/v1/tasks/${action}`, { method: "POST", body: body(null, filter, true) });
    } catch (err) {
      if (err.status === 401) return finish(); // the API key form takes over
      answer = null;
      run.error = err;
    } finally {
      setText(trigger, `${verb}…`);
      trigger.removeAttribute("aria-busy");
    }
    if (answer) {
      run.count = Number(answer.matched) || 0;
      run.filter = answer.filter || filter; // relative times made absolute: every page names the same tasks
      el.dataset.count = String(run.count);
      setText(message, describeAction(action, run.count, wanted) + (empty ? " (no filter: every such task)" : ""));
      setText(confirm, `${verb} ${run.count.toLocaleString()} ${run.count === 1 ? "task" : "tasks"}`);
      if (run.count === 0) setText(message, `No tasks match: nothing to ${action}.`);
    } else {
      setText(message, `Could not count the tasks to ${action}.`);
    }
    show(answer && run.count > 0 ? "confirm" : "closed-only");
    el.showModal();
    dismiss.focus(); // the safe choice first
    onChange();
  }

  function body(cursor, filter, dryRun) {
    const out = { filter, limit: run.limit };
    if (run.all) out.all = true;
    if (dryRun) out.dry_run = true;
    if (cursor) out.cursor = cursor;
    return out;
  }

  async function go() {
    const { done } = ACTIONS[run.action];
    show("running");
    renderProgress();
    stop.focus();
    let cursor = null;
    try {
      do {
        const page = await api(`/v1/tasks/${run.action}`, { method: "POST", body: body(cursor, run.filter, false) });
        run.pages += 1;
        run.asked += Number(page.cancel_requested) || 0;
        run.changed += (Number(page[done]) || 0) + (Number(page.cancel_requested) || 0);
        run.skipped += Number(page.skipped) || 0;
        cursor = page.cursor || null;
        run.filter = page.filter || run.filter; // sent back with the cursor
        renderProgress();
      } while (cursor && !run.stopping);
    } catch (err) {
      if (err.status === 401) return finish();
      run.error = err;
    }
    const changedText = `${ACTIONS[run.action].done} ${(run.changed - run.asked).toLocaleString()}`;
    const asked = run.asked ? `, asked ${run.asked.toLocaleString()} running to stop` : "";
    const pages = `${run.pages} ${run.pages === 1 ? "page" : "pages"}`;
    const tail = `${changedText}${asked}, skipped ${run.skipped.toLocaleString()} (changed meanwhile), in ${pages}.`;
    let head = "Done:";
    if (run.error) head = "Stopped by an error:";
    else if (cursor) head = "Stopped before the last page:";
    setText(summary, `${head} ${tail}`);
    el.dataset.outcome = run.error ? "error" : cursor ? "stopped" : "done";
    show("done");
    dismiss.focus();
    refresh();
  }

  function finish() {
    if (el.open) el.close();
    const trigger = run && run.trigger;
    const onChange = run && run.onChange;
    run = null;
    delete el.dataset.outcome;
    if (onChange) onChange();
    if (trigger && trigger.isConnected) trigger.focus();
  }

  confirm.addEventListener("click", () => {
    if (run && run.phase === "confirm") go();
  });
  stop.addEventListener("click", () => {
    if (!run || run.phase !== "running") return;
    run.stopping = true;
    stop.disabled = true;
    setText(stop, "Stopping…");
  });
  dismiss.addEventListener("click", () => finish());
  // Escape: closes unless pages are being sent (then Stop is the way out).
  el.addEventListener("cancel", (e) => {
    e.preventDefault();
    if (run && run.phase !== "running") finish();
  });

  return {
    el,
    open,
    busy: () => run !== null,
  };
}
