// The task page (#/tasks/<id>): status, progress, actions, the error, the output image or
// the live preview, the event timeline from the task's own stream, params and metadata.

import { EventStream, fetchBlobUrl, needsAuthForFiles, serverNow } from "./api.js";
import {
  ACTION_LABELS,
  STATUS_LABELS,
  actionsFor,
  h,
  clear,
  setText,
  badge,
  updateBadge,
  progressBar,
  updateProgress,
  progressOf,
  parseTime,
  formatDuration,
  formatRelative,
  formatClock,
  formatIso,
  formatBytes,
  tick,
  showError,
  shortId,
  describeTask,
  durationText,
  queueText,
} from "./ui.js";
import { on, refreshTask, performAction, rerunTask, mergeTask, applyProgress, notes } from "./live.js";
import { PipelineChain } from "./pipeline.js";

const ERROR_TITLES = {
  FAILED: "Failed",
  TIMEOUT: "Timed out",
  CANCELLED: "Cancelled after an error",
};

export function mountTaskPage(container, id) {
  const page = new TaskPage(id);
  clear(container).appendChild(page.root);
  page.start();
  return page;
}

class TaskPage {
  constructor(id) {
    this.id = id;
    this.task = null;
    this.events = new Map(); // seq -> status event
    this.lastFinal = false; // the last status event received was final
    this.lastFinalAt = null; // its time (ms), to tell a stale copy from a retried task
    this.lastSeq = 0;
    this.preview = null;
    this.previewAttempt = null;
    this.media = { key: null, blobUrl: null };
    this.renderedDetails = "";
    this.actionKey = null;
    this.streamState = "connecting";
    this.gone = false;
    this.offs = [];
    this.build();
  }

  // ---- skeleton ----

  build() {
    const $ = (tag, cls, attrs) => h(tag, Object.assign({ class: cls }, attrs || {}));
    this.root = h("article", {
      class: "task-page",
      "aria-busy": "true",
      dataset: { testid: "task-page", status: "", taskId: this.id },
    });
    this.title = $("h1", "task-title", { text: "Loading task…" });
    this.badge = badge(null);
    this.badge.hidden = true;
    this.stage = $("span", "stage");
    this.streamChip = $("span", "stream-chip", { dataset: { testid: "task-stream" }, role: "status" });
    this.idLine = $("p", "task-id mono", { text: this.id });
    this.bar = progressBar("large");
    this.progressText = $("span", "progress-text mono");
    this.facts = $("dl", "facts");
    this.notices = $("div", "notices");
    this.actions = $("div", "page-actions");
    this.errorBox = $("section", "card error-card", { dataset: { testid: "task-error" }, hidden: true });
    this.frame = $("div", "media-frame");
    this.outputs = $("ul", "outputs");
    this.timeline = $("ol", "timeline", { dataset: { testid: "timeline" } });
    this.params = $("dl", "kv");
    this.metadata = $("pre", "json");
    this.extra = $("dl", "kv");
    this.chain = new PipelineChain();
    this.body = h(
      "div",
      { class: "task-grid" },
      this.chain.root,
      h(
        "section",
        { class: "card media-card", "aria-label": "Image" },
        this.frame,
        this.outputs,
      ),
      h(
        "section",
        { class: "card timeline-card", "aria-labelledby": "timeline-title" },
        h("div", { class: "card-head" }, h("h2", { id: "timeline-title", text: "Timeline" }), this.streamChip),
        this.timeline,
      ),
      h("section", { class: "card", "aria-labelledby": "params-title" }, h("h2", { id: "params-title", text: "Params" }), this.params),
      h(
        "section",
        { class: "card", "aria-labelledby": "meta-title" },
        h("h2", { id: "meta-title", text: "Metadata" }),
        this.metadata,
        h("h3", { text: "Details" }),
        this.extra,
      ),
    );
    this.body.hidden = true;
    this.head = h(
      "header",
      { class: "card task-head" },
      h("div", { class: "task-head-top" }, h("div", { class: "task-head-status" }, this.badge, this.stage), this.actions),
      this.title,
      this.idLine,
      h("div", { class: "progress-block" }, this.bar, this.progressText),
      this.facts,
      this.notices,
    );
    this.stateBox = $("div", "page-state", { role: "status" });
    this.root.append(
      h("a", { class: "back", href: "#/", text: "← All tasks" }),
      this.stateBox,
      this.head,
      this.errorBox,
      this.body,
    );
    this.head.hidden = true;
    this.stateBox.append(h("span", { class: "spinner", "aria-hidden": "true" }), "Loading task…");
  }

  // ---- life cycle ----

  start() {
    this.offs.push(
      on("task", (task) => {
        if (task.id === this.id) this.setTask(mergeTask(this.task, task));
      }),
      on("progress", (event) => {
        if (event.task_id === this.id) this.onProgress(event);
      }),
      on("status", (event) => {
        if (event.task_id !== this.id) return false;
        // The page's own stream re-fetches while it is open. A closed one (the task had
        // ended) resumes when the task moves again, e.g. after a retry from elsewhere.
        if (!this.stream.isOpen && !(Number(event.seq) <= this.lastSeq)) this.reopenStream();
        return !this.stream.isOpen;
      }),
    );
    this.stream = new EventStream(`/v1/tasks/${encodeURIComponent(this.id)}/events`, {
      status: (event) => this.onStatus(event),
      progress: (event) => this.onProgress(event),
      state: (state) => this.setStreamState(state),
      ended: () => this.lastFinal,
      probe: () => this.load(),
    });
    // The stream opens once the task is known to exist (see setTask), so a wrong id costs
    // one 404, not two.
    this.load();
    tick(this.streamChip, () => this.streamText());
  }

  unmount() {
    this.gone = true;
    this.stream.close();
    this.chain.close();
    for (const off of this.offs) off();
    if (this.media.blobUrl) URL.revokeObjectURL(this.media.blobUrl);
    document.title = "kiln";
  }

  async load() {
    try {
      const task = await refreshTask(this.id);
      // Normally the copy arrives through the "task" listener; this covers a copy that
      // publishTask held back as older than one seen before.
      if (!this.task && task && !this.gone) this.setTask(task);
    } catch (err) {
      if (this.gone) return;
      if (err.status === 404 || err.status === 401 || err.status === 403) this.stream.close();
      if (!this.task) this.showLoadError(err);
      else if (err.status !== 0) showError(err, "Could not refresh the task");
    }
  }

  reopenStream() {
    if (this.gone || !this.task || this.stream.isOpen) return;
    // lastFinal stays: if nothing new follows the final event, the server ends the stream
    // again at once and the page closes it quietly.
    this.stream.open(this.lastSeq || undefined);
  }

  showLoadError(err) {
    this.root.setAttribute("aria-busy", "false");
    clear(this.stateBox);
    if (err.status === 404) {
      this.root.dataset.status = "NOT_FOUND";
      this.stateBox.append(
        h("h1", { class: "task-title", text: "Task not found" }),
        h("p", {}, err.message, " ", h("code", { text: err.code })),
        h("p", { class: "muted mono", text: this.id }),
      );
      showError(err, "Task not found");
      return;
    }
    this.stateBox.append(
      h("p", {}, "Could not load the task: ", err.message, " ", h("code", { text: err.code })),
      err.status === 401
        ? h("p", { class: "muted", text: "Enter an API key above to continue." })
        : h("button", { type: "button", class: "btn", text: "Try again", onclick: () => this.retryLoad() }),
    );
    showError(err, "Could not load the task");
  }

  retryLoad() {
    clear(this.stateBox).append(h("span", { class: "spinner", "aria-hidden": "true" }), "Loading task…");
    this.load();
  }

  // ---- incoming data ----

  onStatus(event) {
    if (event.task_id && event.task_id !== this.id) {
      if (this.task && this.task.kind === "pipeline") this.load(); // a step moved
      return;
    }
    const seq = Number.isFinite(event.seq) ? event.seq : this.events.size + 1e12;
    this.events.set(seq, event);
    if (Number.isFinite(event.seq)) this.lastSeq = Math.max(this.lastSeq, event.seq);
    this.lastFinal = Boolean(event.final);
    if (this.lastFinal) this.lastFinalAt = parseTime(event.at);
    this.renderTimeline();
    this.load();
  }

  onProgress(event) {
    if (event.task_id && event.task_id !== this.id) {
      this.chain.progress(event); // a pipeline's step
      return;
    }
    if (typeof event.preview === "string" && event.preview.startsWith("data:image/")) {
      this.preview = event.preview;
      this.previewAttempt = this.task ? this.task.attempt : null;
    }
    const next = applyProgress(this.task, event);
    if (next) {
      this.task = next;
      this.renderProgress();
    }
    if (this.task) this.renderMedia();
  }

  setStreamState(state) {
    this.streamState = state;
    setText(this.streamChip, this.streamText());
    this.streamChip.dataset.state = state;
    if (state === "reconnecting" && !this.events.size) this.renderTimeline();
  }

  streamText() {
    if (this.streamState === "reconnecting") return "reconnecting…";
    if (this.streamState === "live") return "live";
    if (this.streamState === "closed") return this.task && this.task.final ? "complete" : "";
    return "connecting…";
  }

  setTask(task) {
    if (this.gone) return;
    const first = !this.task;
    this.task = task;
    if (first) {
      this.stream.open();
      this.stateBox.hidden = true;
      this.head.hidden = false;
      this.body.hidden = false;
      this.root.setAttribute("aria-busy", "false");
    }
    // A task that moves again after its final event (a retry) is followed live again; a
    // late copy from before that final event is not a reason to reconnect.
    const updated = parseTime(task.updated_at);
    const movedOn = this.lastFinalAt === null || (updated !== null && updated > this.lastFinalAt);
    if (!task.final && !this.stream.isOpen && movedOn) this.reopenStream();
    this.render();
  }

  // ---- rendering ----

  render() {
    const task = this.task;
    this.root.dataset.status = task.status;
    document.title = `${task.status} · ${shortId(task.id)} — kiln`;
    this.badge.hidden = false;
    updateBadge(this.badge, task.status);
    setText(this.title, describeTask(task));
    this.title.title = describeTask(task);
    setText(this.idLine, `${task.id} · ${task.kind || ""}`);
    this.renderProgress();
    this.renderFacts();
    this.renderNotices();
    this.renderActions();
    this.renderError();
    this.renderMedia();
    this.renderDetails();
    this.chain.render(task);
    setText(this.streamChip, this.streamText());
  }

  renderProgress() {
    const task = this.task;
    this.root.dataset.status = task.status;
    updateBadge(this.badge, task.status);
    updateProgress(this.bar, task);
    const { step, total, fraction, known } = progressOf(task);
    const parts = [];
    if (task.stage) parts.push(task.stage);
    if (known || task.status === "SUCCESS") {
      parts.push(total ? `step ${step}/${total}` : `step ${step}`, `${Math.round(fraction * 100)}%`);
    } else {
      parts.push(total ? `step 0/${total}` : "not started");
    }
    setText(this.progressText, parts.join(" · "));
    setText(this.stage, task.cancel_requested && !task.final ? "cancelling…" : "");
    if (this.placeholderText) setText(this.placeholderText, this.placeholderMessage());
  }

  renderFacts() {
    const task = this.task;
    const fact = (label, value, testid) =>
      h("div", { class: "fact" }, h("dt", { text: label }), h("dd", { dataset: testid ? { testid } : {} }, value));
    const when = (value) => {
      const t = parseTime(value);
      if (t === null) return "—";
      return h("time", { datetime: formatIso(t), title: formatIso(t) }, formatClock(t));
    };
    const duration = h("span", { class: "mono" });
    tick(duration, () => (this.task ? durationText(this.task) : ""));
    const queue = h("span");
    tick(queue, () => (this.task ? queueText(this.task) : ""));
    const created = parseTime(task.created_at);
    const createdRel = h("span", { class: "muted" });
    tick(createdRel, () => ` (${formatRelative(created)})`);
    clear(this.facts).append(
      fact("Attempt", `${task.attempt ?? 0}/${task.max_attempts ?? "?"}`, "attempt"),
      fact("Queue", queue, "queue-position"),
      fact("Duration", duration, "duration"),
      fact("Priority", String(task.priority ?? 0)),
      fact("Created", h("span", {}, when(task.created_at), createdRel)),
      fact("Started", when(task.started_at)),
      fact("Finished", when(task.finished_at)),
    );
    if (task.rerun_of) {
      const link = h("a", { href: `#/tasks/${encodeURIComponent(task.rerun_of)}`, class: "mono", text: task.rerun_of });
      this.facts.append(fact("Rerun of", link, "rerun-of"));
    }
    if (task.pipeline_id) {
      const href = `#/tasks/${encodeURIComponent(task.pipeline_id)}`;
      const step = task.step ? ` (step ${task.step.name}${task.step.copy ? ` #${task.step.copy + 1}` : ""})` : "";
      const link = h("a", { href, class: "mono", text: task.pipeline_id });
      this.facts.append(fact("Pipeline", h("span", {}, link, step), "pipeline-of"));
    }
  }

  renderNotices() {
    const task = this.task;
    const items = [];
    const note = notes.get(task.id);
    if (task.deduplicated || (note && note.deduplicated)) {
      items.push(["info", "This request matched an existing task, so no new task was made."]);
    }
    if (task.cancel_requested && !task.final) {
      items.push(["warn", "Cancel requested — the worker stops at its next heartbeat."]);
    }
    if (task.status === "NEEDS_REVIEW") {
      items.push(["review", "The output is stored and waits for a moderation decision."]);
    }
    clear(this.notices);
    for (const [kind, text] of items) {
      this.notices.appendChild(h("p", { class: `notice notice-${kind}`, text }));
    }
    const scheduled = task.status === "PENDING" ? parseTime(task.scheduled_for) : null;
    if (scheduled !== null) {
      const line = h("p", { class: "notice notice-info", dataset: { testid: "scheduled" } });
      tick(line, () =>
        scheduled > serverNow()
          ? `Scheduled — runs at ${formatClock(scheduled, true)} (in ${formatDuration(scheduled - serverNow())}).`
          : "Its scheduled time has come; waiting for a worker.",
      );
      this.notices.appendChild(line);
    }
    if (task.status === "RETRYING" && parseTime(task.next_retry_at) !== null) {
      const due = parseTime(task.next_retry_at);
      const line = h("p", { class: "notice notice-warn" });
      tick(line, () =>
        due > serverNow() ? `Next attempt in ${formatDuration(due - serverNow())}.` : "Next attempt is due; waiting for a worker.",
      );
      this.notices.appendChild(line);
    }
  }

  renderActions() {
    const task = this.task;
    const actions = actionsFor(task);
    const key = `${actions.join(",")}|${task.cancel_requested ? 1 : 0}|${task.final ? 1 : 0}`;
    if (key === this.actionKey) return;
    this.actionKey = key;
    clear(this.actions);
    for (const action of actions) {
      const pending = action === "cancel" && task.cancel_requested;
      const button = h("button", {
        type: "button",
        class: `btn action-${action}`,
        disabled: pending,
        dataset: { testid: action },
        text: pending ? "Cancelling…" : ACTION_LABELS[action],
        onclick: async () => {
          button.disabled = true;
          await performAction(task.id, action);
          if (this.gone) return;
          this.actionKey = null;
          this.renderActions();
        },
      });
      this.actions.appendChild(button);
    }
    if (task.final) this.actions.appendChild(this.rerunButton(task));
  }

  /** "Run again": a new task of the same kind and params (a new variation), then its page. */
  rerunButton(task) {
    const button = h("button", {
      type: "button",
      class: "btn action-rerun",
      dataset: { testid: "rerun" },
      title: "Make a new task with the same params",
      text: "Run again",
      onclick: async () => {
        button.disabled = true;
        const made = await rerunTask(task.id);
        if (this.gone) return;
        if (made && made.id) location.hash = `#/tasks/${encodeURIComponent(made.id)}`;
        else button.disabled = false;
      },
    });
    return button;
  }

  renderError() {
    const error = this.task.error;
    this.errorBox.hidden = !error;
    if (!error) return;
    const title = ERROR_TITLES[this.task.status] || "Last attempt failed";
    clear(this.errorBox).append(
      h(
        "div",
        { class: "error-head" },
        h("h2", { text: title }),
        h("code", { class: "error-code", dataset: { testid: "error-code" }, text: error.code || "error" }),
        h("span", {
          class: "muted small",
          text: error.retryable === true ? "retryable" : error.retryable === false ? "permanent" : "",
        }),
      ),
      h("p", { class: "error-message", dataset: { testid: "error-message" }, text: error.message || "" }),
    );
  }

  placeholderMessage() {
    const task = this.task;
    if (!task) return "";
    switch (task.status) {
      case "PENDING":
        if (parseTime(task.scheduled_for) !== null && parseTime(task.scheduled_for) > serverNow()) return "Scheduled — waits for its time";
        return Number.isFinite(task.queue_position) ? `Queued — #${task.queue_position} in line` : "Queued";
      case "WAITING_FOR_RESOURCE": {
        const slot = task.resource_wait;
        if (!slot) return "Waiting for a resource slot…";
        return `Waiting for ${slot.pool} — #${slot.position} in line (${slot.held} of ${slot.capacity} slots busy)`;
      }
      case "GENERATING": {
        const { step, total } = progressOf(task);
        return total ? `Generating — step ${step} of ${total}` : "Generating…";
      }
      case "UPLOADING":
        return "Uploading the result…";
      case "NEEDS_REVIEW":
        return "Held for review: the image is released once approved.";
      case "RETRYING":
        return "Waiting to retry…";
      case "SUCCESS":
        return "No image output.";
      default:
        return `No image (${STATUS_LABELS[task.status] || task.status}).`;
    }
  }

  renderMedia() {
    const task = this.task;
    const outputs = (task.result && Array.isArray(task.result.outputs) && task.result.outputs) || [];
    const first = outputs[0];
    const isImage = first && first.url && (!first.content_type || String(first.content_type).startsWith("image/"));
    const params = task.params || {};
    if (Number.isFinite(params.width) && Number.isFinite(params.height)) {
      this.frame.style.aspectRatio = `${params.width} / ${params.height}`;
    }
    // A preview belongs to one attempt, and shows while that attempt runs or is in review.
    if (this.preview && this.previewAttempt !== null && task.attempt !== this.previewAttempt) {
      this.preview = null;
    }
    const previewable = ["GENERATING", "UPLOADING", "NEEDS_REVIEW"].includes(task.status);
    if (isImage) this.showOutput(first);
    else if (this.preview && previewable) this.showPreview();
    else this.showPlaceholder();
    this.frame.classList.toggle("is-compact", this.media.key === "placeholder" && Boolean(task.final));
    this.renderOutputs(outputs);
  }

  showOutput(output) {
    const key = `output:${output.url}:${output.sha256 || ""}`;
    if (this.media.key === key) return;
    this.media.key = key;
    this.placeholderText = null;
    const img = h("img", {
      class: "media-img",
      alt: `Output: ${describeTask(this.task)}`,
      dataset: { testid: "output-image" },
    });
    const failed = () => {
      if (this.media.key !== key) return;
      clear(this.frame).appendChild(h("p", { class: "media-placeholder", text: "The output could not be loaded." }));
    };
    img.addEventListener("error", failed);
    clear(this.frame).appendChild(img);
    if (!needsAuthForFiles()) {
      img.src = output.url;
      return;
    }
    fetchBlobUrl(output.url)
      .then((url) => {
        if (this.gone || this.media.key !== key) {
          URL.revokeObjectURL(url);
          return;
        }
        if (this.media.blobUrl) URL.revokeObjectURL(this.media.blobUrl);
        this.media.blobUrl = url;
        img.src = url;
      })
      .catch((err) => {
        failed();
        showError(err, "Could not load the output");
      });
  }

  showPreview() {
    let img = this.media.key === "preview" ? this.frame.querySelector("img") : null;
    if (!img) {
      this.media.key = "preview";
      this.placeholderText = null;
      img = h("img", {
        class: "media-img preview",
        alt: "Live preview",
        dataset: { testid: "preview-image" },
      });
      clear(this.frame).append(img, h("span", { class: "media-caption", text: "live preview" }));
    }
    if (img.getAttribute("src") !== this.preview) img.src = this.preview;
  }

  showPlaceholder() {
    if (this.media.key !== "placeholder") {
      this.media.key = "placeholder";
      this.placeholderText = h("span", {});
      clear(this.frame).appendChild(
        h(
          "div",
          { class: "media-placeholder", dataset: { testid: "media-placeholder" } },
          h("span", { class: "placeholder-icon", "aria-hidden": "true" }),
          this.placeholderText,
        ),
      );
    }
    this.frame.dataset.status = this.task.status;
    setText(this.placeholderText, this.placeholderMessage());
  }

  renderOutputs(outputs) {
    const key = JSON.stringify(outputs.map((o) => [o.name, o.url, o.sha256]));
    if (this.outputs.dataset.key === key) return;
    this.outputs.dataset.key = key;
    clear(this.outputs);
    for (const output of outputs) {
      const link = h("a", { href: output.url, target: "_blank", rel: "noopener", text: output.name || "output" });
      if (needsAuthForFiles()) {
        link.addEventListener("click", (e) => {
          e.preventDefault();
          fetchBlobUrl(output.url)
            .then((url) => {
              const a = h("a", { href: url, download: output.name || "output" });
              document.body.appendChild(a);
              a.click();
              a.remove();
              setTimeout(() => URL.revokeObjectURL(url), 10000);
            })
            .catch((err) => showError(err, "Could not download the output"));
        });
      }
      this.outputs.appendChild(
        h(
          "li",
          {},
          link,
          h("span", { class: "muted small" }, ` ${output.content_type || ""} · ${formatBytes(output.size)}`),
          output.sha256 ? h("span", { class: "mono muted small", title: output.sha256, text: ` · sha256 ${String(output.sha256).slice(0, 12)}…` }) : null,
        ),
      );
    }
  }

  renderDetails() {
    const task = this.task;
    const key = JSON.stringify([task.params, task.metadata, task.inputs, task.idempotency_key, task.updated_at, task.next_retry_at, task.scheduled_for]);
    if (key === this.renderedDetails) return;
    this.renderedDetails = key;
    clear(this.params);
    const params = task.params && typeof task.params === "object" ? task.params : {};
    const entries = Object.entries(params);
    if (!entries.length) this.params.appendChild(h("p", { class: "muted", text: "No params." }));
    for (const [name, value] of entries) {
      this.params.append(
        h("dt", { text: name }),
        h("dd", { class: typeof value === "string" ? "" : "mono" }, typeof value === "string" ? value : JSON.stringify(value)),
      );
    }
    const metadata = task.metadata;
    const hasMetadata = metadata && typeof metadata === "object" && Object.keys(metadata).length > 0;
    setText(this.metadata, hasMetadata ? JSON.stringify(metadata, null, 2) : "None");
    this.metadata.classList.toggle("muted", !hasMetadata);

    const inputs = Array.isArray(task.inputs) ? task.inputs : [];
    const rows = [
      ["Task id", task.id],
      ["Kind", task.kind],
      ["Idempotency key", task.idempotency_key || "—"],
      ["Inputs", inputs.length ? inputs.map((i) => `${i.name} (${i.content_type}, ${formatBytes(i.size)})`).join(", ") : "none"],
      ["Updated", task.updated_at ? formatClock(parseTime(task.updated_at), true) : "—"],
    ];
    if (task.next_retry_at) rows.push(["Next retry", formatClock(parseTime(task.next_retry_at), true)]);
    if (task.scheduled_for) rows.push(["Scheduled for", formatClock(parseTime(task.scheduled_for), true)]);
    clear(this.extra);
    for (const [name, value] of rows) {
      this.extra.append(h("dt", { text: name }), h("dd", { class: "mono", text: String(value) }));
    }
  }

  renderTimeline() {
    const list = Array.from(this.events.entries())
      .sort((a, b) => a[0] - b[0])
      .map(([, event]) => event);
    clear(this.timeline);
    if (!list.length) {
      const text = this.streamState === "reconnecting" ? "History unavailable — reconnecting…" : "Loading history…";
      this.timeline.appendChild(h("li", { class: "timeline-empty muted", text }));
      return;
    }
    list.forEach((event, i) => {
      const prev = i > 0 ? list[i - 1] : null;
      const at = parseTime(event.at);
      const prevAt = prev ? parseTime(prev.at) : null;
      const previousState = event.from || (prev && prev.status) || null;
      let meta;
      if (prev && at !== null && prevAt !== null) {
        meta = `after ${formatDuration(at - prevAt)} in ${previousState || "the previous state"}`;
      } else if (!event.from) {
        meta = "accepted";
      } else {
        meta = `from ${event.from}`;
      }
      if (Number.isFinite(event.attempt) && event.attempt > 0) meta += ` · attempt ${event.attempt}`;
      if (Number.isFinite(event.loading_s)) meta += ` · model loaded in ${formatDuration(event.loading_s * 1000)}`;
      const entry = h(
        "li",
        {
          class: "tl-entry",
          dataset: { testid: "timeline-entry", event: event.event || "", status: event.status || "", seq: String(event.seq ?? "") },
        },
        h("span", { class: "tl-dot", dataset: { status: event.status || "" }, "aria-hidden": "true" }),
        h(
          "div",
          { class: "tl-body" },
          h(
            "div",
            { class: "tl-head" },
            h("strong", { class: "tl-event", text: event.event || "event" }),
            h(
              "span",
              { class: "tl-move" },
              event.from ? h("span", { class: "chip", dataset: { status: event.from }, text: event.from }) : null,
              event.from ? h("span", { class: "arrow", "aria-label": "to", text: "→" }) : null,
              h("span", { class: "chip", dataset: { status: event.status || "" }, text: event.status || "?" }),
            ),
            h("time", { class: "tl-time mono", datetime: event.at || "", title: event.at || "", text: formatClock(at, true) }),
          ),
          h("div", { class: "tl-meta muted small", text: meta }),
          event.error && typeof event.error === "object"
            ? h("div", { class: "tl-error" }, h("code", { text: event.error.code || "error" }), " ", event.error.message || "")
            : null,
        ),
      );
      this.timeline.appendChild(entry);
    });
    const last = list[list.length - 1];
    const lastAt = parseTime(last.at);
    if (!last.final && lastAt !== null) {
      const since = h("li", { class: "tl-now muted small" });
      tick(since, () => `in ${last.status} for ${formatDuration(serverNow() - lastAt)} so far`);
      this.timeline.appendChild(since);
    }
  }
}
