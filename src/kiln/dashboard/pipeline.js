// A pipeline's chain of steps on its task page (docs/pipelines.md): each copy of each step
// in order, with its status badge, progress bar, a link to its own page and its output
// thumbnail. The pipeline's stream carries its steps' events: a step's status change
// re-reads the pipeline (its `steps`), a step's progress moves that step's bar at once.

import { fetchBlobUrl, needsAuthForFiles } from "./api.js";
import { h, clear, setText, badge, updateBadge, progressBar, updateProgress, showError } from "./ui.js";

export class PipelineChain {
  constructor() {
    this.list = h("ol", { class: "chain", dataset: { testid: "pipeline-steps" } });
    this.root = h(
      "section",
      { class: "card chain-card", "aria-labelledby": "chain-title", hidden: true },
      h("h2", { id: "chain-title", text: "Steps" }),
      this.list,
    );
    this.rows = new Map(); // "name/copy" -> {row, badge, bar, text, link, thumb, key}
    this.blobUrls = [];
  }

  /** Show the steps of ``task`` (hidden for a task that is not a pipeline). */
  render(task) {
    const steps = Array.isArray(task.steps) ? task.steps : null;
    this.root.hidden = !steps;
    if (!steps) return;
    const copies = new Map();
    for (const step of steps) copies.set(step.name, (copies.get(step.name) || 0) + 1);
    for (const step of steps) {
      const key = `${step.name}/${step.copy}`;
      let row = this.rows.get(key);
      if (!row) {
        row = this.makeRow(step, copies.get(step.name) > 1);
        this.rows.set(key, row);
        this.list.appendChild(row.row);
      }
      this.update(row, step);
    }
  }

  makeRow(step, repeated) {
    const label = repeated ? `${step.name} #${step.copy + 1}` : step.name;
    const row = {
      badge: badge(step.status || "PENDING"),
      bar: progressBar("small"),
      text: h("span", { class: "chain-progress mono" }),
      link: h("a", { class: "chain-name", text: label }),
      kind: h("span", { class: "muted small", text: step.kind }),
      thumb: h("span", { class: "chain-thumb" }),
      taskId: null,
      thumbKey: null,
    };
    row.row = h(
      "li",
      { class: "chain-step", dataset: { testid: "pipeline-step", step: `${step.name}/${step.copy}` } },
      h("div", { class: "chain-head" }, row.link, row.kind, row.badge),
      h("div", { class: "chain-bar" }, row.bar, row.text),
      row.thumb,
    );
    return row;
  }

  update(row, step) {
    row.taskId = step.task_id;
    row.row.dataset.status = step.status || "NOT_MADE";
    if (step.task_id) row.link.href = `#/tasks/${encodeURIComponent(step.task_id)}`;
    updateBadge(row.badge, step.status || "WAITING");
    row.badge.title = step.status ? row.badge.title : "not made yet: waits for its inputs";
    const shown = { status: step.status, progress: step.progress, params: {} };
    updateProgress(row.bar, shown);
    const p = step.progress;
    setText(row.text, step.status === "SUCCESS" ? "done" : p ? `${p.step}/${p.total}` : step.status ? "" : "waits for inputs");
    this.showThumb(row, step.outputs || []);
  }

  /** A step's live progress (from the pipeline's stream), before the next re-read. */
  progress(event) {
    for (const row of this.rows.values()) {
      if (row.taskId === event.task_id && event.progress) {
        updateProgress(row.bar, { status: event.status, progress: event.progress, params: {} });
        setText(row.text, `${event.progress.step}/${event.progress.total}`);
      }
    }
  }

  showThumb(row, outputs) {
    const image = outputs.find((o) => o.url && String(o.content_type || "").startsWith("image/"));
    const key = image ? `${image.url}:${image.sha256}` : null;
    if (key === row.thumbKey) return;
    row.thumbKey = key;
    clear(row.thumb);
    if (!image) return;
    const img = h("img", { class: "chain-img", alt: `${image.name}`, dataset: { testid: "step-output" } });
    row.thumb.appendChild(img);
    if (!needsAuthForFiles()) {
      img.src = image.url;
      return;
    }
    fetchBlobUrl(image.url)
      .then((url) => {
        this.blobUrls.push(url);
        img.src = url;
      })
      .catch((err) => showError(err, "Could not load a step's output"));
  }

  close() {
    for (const url of this.blobUrls) URL.revokeObjectURL(url);
  }
}
