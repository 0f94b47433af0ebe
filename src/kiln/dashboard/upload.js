// The upload form: an image and an `image.transform` (resize, thumbnail, crop, convert),
// sent as multipart/form-data by upload-worker.js so the page stays responsive however large
// the file. The status box below the form has one state at a time (data-state):
//   idle       nothing sent yet
//   uploading  a <progress> of the bytes sent; then "waiting for the server"
//   done       the task, with its live status and progress (deduplicated answers say so)
//   failed     the server's error code and message, as it wrote them
// The server is the judge of the file and the params; the form only checks that the fields
// the chosen op needs are filled in.

import { currentKey, observeServerTime, reportUnauthorized } from "./api.js";
import {
  h,
  clear,
  setText,
  badge,
  updateBadge,
  progressBar,
  updateProgress,
  stepText,
  formatBytes,
  shortId,
  clearError,
} from "./ui.js";
import { on, publishTask, applyProgress, mergeTask, notes } from "./live.js";

const ACCEPT = "image/png,image/jpeg,image/webp";
const OPS = [
  ["thumbnail", "Thumbnail"],
  ["resize", "Resize"],
  ["crop", "Crop"],
  ["convert", "Convert"],
];
const OP_HINTS = {
  thumbnail: "Fits inside width × height, keeping the aspect ratio.",
  resize: "Exactly width × height.",
  crop: "The box, in pixels of the upright picture.",
  convert: "Only re-encodes, in the format chosen.",
};
const FORMATS = [
  ["", "As input"],
  ["png", "PNG"],
  ["webp", "WebP"],
  ["jpeg", "JPEG"],
];
const SIZE_OPS = new Set(["resize", "thumbnail"]);
const BOX = ["left", "top", "right", "bottom"];

function numberInput(name, label, { value, placeholder, min } = {}) {
  const input = h("input", {
    id: `u-${name}`,
    name,
    type: "number",
    inputmode: "numeric",
    min: min ?? 1,
    max: 8192,
    step: 1,
    value,
    placeholder,
    dataset: { testid: `upload-${name}` },
  });
  return h("div", { class: "field" }, h("label", { for: `u-${name}`, text: label }), input);
}

function selectField(name, label, options, value) {
  const select = h(
    "select",
    { id: `u-${name}`, name, dataset: { testid: `upload-${name}` } },
    options.map(([v, text]) => h("option", { value: v, text, selected: v === value })),
  );
  return h("div", { class: "field" }, h("label", { for: `u-${name}`, text: label }), select);
}

export function createUploadForm() {
  const file = h("input", {
    id: "u-file",
    name: "image",
    type: "file",
    accept: ACCEPT,
    dataset: { testid: "upload-file" },
  });
  const fileHint = h("span", { class: "hint", text: "PNG, JPEG or WebP" });
  const sizeFields = h(
    "div",
    { class: "field-grid", dataset: { fields: "size" } },
    numberInput("width", "Width", { value: 256 }),
    numberInput("height", "Height", { value: 256 }),
  );
  const boxFields = h(
    "div",
    { class: "field-grid", dataset: { fields: "box" } },
    BOX.map((side) => numberInput(side, side[0].toUpperCase() + side.slice(1), { min: 0, placeholder: "px" })),
  );
  const opHint = h("p", { class: "hint op-hint", dataset: { testid: "upload-op-hint" } });
  const submit = h("button", { type: "submit", class: "btn primary", dataset: { testid: "upload-submit" }, text: "Upload" });
  const formError = h("p", { class: "form-error", role: "alert", hidden: true, dataset: { testid: "upload-form-error" } });
  const form = h(
    "form",
    { class: "upload-form", dataset: { testid: "upload-form" }, novalidate: true },
    h("div", { class: "field" }, h("label", { for: "u-file", text: "Image" }), file, fileHint),
    h("div", { class: "field-grid" }, selectField("op", "Transform", OPS, "thumbnail"), selectField("format", "Format", FORMATS, "")),
    opHint,
    sizeFields,
    boxFields,
    formError,
    h("div", { class: "form-actions" }, submit),
  );
  const status = createStatusBox();

  function showOpFields() {
    const op = form.elements.op.value;
    sizeFields.hidden = !SIZE_OPS.has(op);
    boxFields.hidden = op !== "crop";
    setText(opHint, OP_HINTS[op] || "");
  }
  form.elements.op.addEventListener("change", showOpFields);
  showOpFields();

  file.addEventListener("change", () => {
    const picked = file.files && file.files[0];
    setText(fileHint, picked ? `${picked.name} · ${formatBytes(picked.size)}` : "PNG, JPEG or WebP");
  });

  function value(name) {
    const raw = form.elements[name].value.trim();
    return raw === "" ? null : Number(raw);
  }

  /** The request part, or a sentence saying what is missing. */
  function buildRequest() {
    const op = form.elements.op.value;
    const params = { op };
    if (SIZE_OPS.has(op)) {
      const width = value("width");
      const height = value("height");
      if (width === null || height === null) return `A ${op} needs a width and a height.`;
      Object.assign(params, { width, height });
    }
    if (op === "crop") {
      const box = BOX.map(value);
      if (box.includes(null)) return "A crop needs its box: left, top, right and bottom.";
      params.box = box;
    }
    if (form.elements.format.value) params.format = form.elements.format.value;
    return { kind: "image.transform", params };
  }

  form.addEventListener("submit", (e) => {
    e.preventDefault();
    formError.hidden = true;
    const picked = file.files && file.files[0];
    const request = picked ? buildRequest() : "Pick an image file first.";
    if (typeof request === "string") {
      setText(formError, request);
      formError.hidden = false;
      return;
    }
    submit.disabled = true;
    status.start(picked, request, () => {
      submit.disabled = false;
    });
  });

  const el = h(
    "section",
    { class: "card form-card upload-card", id: "upload", "aria-labelledby": "upload-title", dataset: { testid: "upload-card" } },
    h("h2", { id: "upload-title", text: "Transform an image" }),
    form,
    status.el,
  );
  return { el };
}

function failureTitle(message) {
  if (message.status) return `Refused (${message.status})`;
  return message.code === "cancelled" ? "Cancelled" : "Failed";
}

// ---- the status box --------------------------------------------------------------------

function createStatusBox() {
  const el = h("div", {
    class: "upload-status",
    role: "status",
    "aria-live": "polite",
    dataset: { testid: "upload-status", state: "idle" },
  });
  let worker = null;
  let watched = null; // {task, badge, bar, steps} of the task shown in the done state

  function setState(state, ...children) {
    el.dataset.state = state;
    clear(el).append(...children.filter(Boolean));
  }

  function idle() {
    watched = null;
    setState("idle", h("p", { class: "muted small", text: "Pick an image and a transform, then upload it." }));
  }

  function uploading(picked) {
    const progress = h("progress", {
      class: "upload-progress",
      max: picked.size || 1,
      value: 0,
      dataset: { testid: "upload-progress" },
    });
    const bytes = h("span", { class: "mono", dataset: { testid: "upload-bytes" } });
    const percent = h("span", { class: "mono", dataset: { testid: "upload-percent" } });
    const phase = h("span", { class: "muted", dataset: { testid: "upload-phase" } });
    const cancel = h("button", {
      type: "button",
      class: "btn small",
      dataset: { testid: "upload-cancel" },
      text: "Cancel",
      onclick: () => finish(failed(0, "cancelled", "The upload was cancelled.")),
    });
    setState(
      "uploading",
      h("div", { class: "upload-head" }, h("strong", { class: "upload-name", text: picked.name || "image" }), cancel),
      progress,
      h("div", { class: "upload-line" }, bytes, " · ", percent, " ", phase),
    );
    const show = (loaded, total) => {
      const max = total || picked.size || 1;
      progress.setAttribute("max", String(max));
      progress.setAttribute("value", String(Math.min(loaded, max)));
      setText(bytes, `${formatBytes(loaded)} of ${formatBytes(max)}`);
      setText(percent, `${Math.floor((Math.min(loaded, max) / max) * 100)}%`);
    };
    show(0, 0);
    setText(phase, "sending…");
    return {
      progress: show,
      sent() {
        el.dataset.phase = "waiting";
        setText(phase, "sent; the server is checking it…");
        cancel.hidden = true;
      },
    };
  }

  function done(message) {
    const task = message.task;
    if (!message.task.deduplicated && message.status === 201) observeServerTime(task.created_at);
    clearError();
    notes.set(task.id, { deduplicated: Boolean(task.deduplicated) });
    publishTask(task);
    const link = h("a", {
      class: "mono",
      href: `#/tasks/${encodeURIComponent(task.id)}`,
      title: task.id,
      dataset: { testid: "upload-task-link" },
      text: shortId(task.id),
    });
    const deduplicated = Boolean(task.deduplicated) || message.replayed;
    const headline = h("p", { class: "upload-headline", dataset: { testid: "upload-headline" } });
    if (deduplicated) {
      const already = task.status === "SUCCESS" ? "Already done" : "Already submitted";
      headline.append(h("strong", { text: already }), " — same as task ", link);
    } else {
      headline.append(h("strong", { text: "Uploaded" }), " — task ", link);
    }
    watched = { task, badge: badge(task.status), bar: progressBar(), steps: h("span", { class: "steps mono" }) };
    watched.bar.dataset.testid = "upload-task-progress";
    watched.badge.dataset.testid = "upload-task-status";
    el.dataset.deduplicated = String(deduplicated);
    el.dataset.taskId = task.id;
    setState(
      "done",
      headline,
      h("div", { class: "progress-line" }, watched.badge, watched.bar, watched.steps),
    );
    renderWatched();
  }

  function failed(status, code, message, details) {
    return { type: "error", status, code, message, details: details || [] };
  }

  function showFailure(message) {
    if (message.status === 401) reportUnauthorized();
    const list = h("ul", { class: "upload-details" });
    for (const detail of message.details || []) {
      const text = detail && typeof detail === "object" ? detail.msg || detail.message || JSON.stringify(detail) : String(detail);
      list.appendChild(h("li", { text }));
    }
    el.dataset.status = String(message.status || 0);
    setState(
      "failed",
      h(
        "p",
        { class: "upload-headline" },
        h("strong", { text: failureTitle(message) }),
        " ",
        h("code", { dataset: { testid: "upload-error-code" }, text: message.code }),
      ),
      h("p", { class: "upload-error", dataset: { testid: "upload-error-message" }, text: message.message }),
      list.firstChild ? list : null,
    );
  }

  function renderWatched() {
    if (!watched) return;
    updateBadge(watched.badge, watched.task.status);
    updateProgress(watched.bar, watched.task);
    setText(watched.steps, stepText(watched.task));
  }

  let onFinished = () => {};
  function finish(message) {
    if (worker) worker.terminate(); // also aborts a request still in flight
    worker = null;
    delete el.dataset.phase;
    if (message.type === "done") done(message);
    else showFailure(message);
    onFinished();
  }

  on("task", (task) => {
    if (watched && task.id === watched.task.id) {
      watched.task = mergeTask(watched.task, task);
      renderWatched();
    }
  });
  on("progress", (event) => {
    if (!watched || event.task_id !== watched.task.id) return;
    const next = applyProgress(watched.task, event);
    if (next) {
      watched.task = next;
      renderWatched();
    }
  });

  idle();
  return {
    el,
    /** Sends `picked` with the request part in a fresh worker; calls `finished` at the end. */
    start(picked, request, finished) {
      if (worker) worker.terminate();
      watched = null;
      delete el.dataset.deduplicated;
      delete el.dataset.taskId;
      delete el.dataset.status;
      onFinished = finished;
      const view = uploading(picked);
      worker = new Worker(new URL("./upload-worker.js", import.meta.url), { type: "module" });
      worker.onmessage = (e) => {
        const message = e.data || {};
        if (message.type === "progress") view.progress(message.loaded, message.total);
        else if (message.type === "sent") view.sent();
        else if (message.type === "done" || message.type === "error") finish(message);
      };
      worker.onerror = (e) => {
        e.preventDefault();
        finish(failed(0, "worker_error", "The upload worker stopped unexpectedly."));
      };
      worker.postMessage({ file: picked, request, key: currentKey(), input: "image" });
    },
  };
}
