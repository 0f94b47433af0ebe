// kiln dashboard: entry point. Hash routes:
//   #/            overview: counts, queue, task list, charts, submit and upload forms
//   #/new         the same, with the submit form focused
//   #/tasks/<id>  one task, live
// Plain ES modules, no build step; every request goes through api.js, except uploads, which
// upload-worker.js sends off the main thread (with the key api.js holds).

import { apiKey, setApiKey, onUnauthorized } from "./api.js";
import { clearError } from "./ui.js";
import { on, startFeed, stopFeed } from "./live.js";
import { createOverview } from "./overview.js";
import { mountTaskPage } from "./taskpage.js";

const view = document.getElementById("view");
const conn = document.getElementById("conn");
const authPanel = document.getElementById("auth");
const authForm = document.getElementById("auth-form");
const authHint = document.getElementById("auth-hint");
const forgetKey = document.getElementById("forget-key");

let overview = null;
let page = null;
let overviewScroll = 0;

// ---- routing ---------------------------------------------------------------------------

function parseRoute() {
  const hash = location.hash || "#/";
  const task = hash.match(/^#\/tasks\/([^/?#]+)\/?$/);
  if (task) {
    let id = task[1];
    try {
      id = decodeURIComponent(id);
    } catch (_) {
      // keep it as written
    }
    return { name: "task", id };
  }
  return { name: hash === "#/new" ? "new" : "overview" };
}

function route() {
  const next = parseRoute();
  clearError();
  if (page) {
    page.unmount();
    page = null;
  }
  for (const link of document.querySelectorAll("[data-nav]")) {
    const current =
      (next.name === "new" && link.dataset.nav === "new") ||
      (next.name === "overview" && link.dataset.nav === "tasks");
    if (current) link.setAttribute("aria-current", "page");
    else link.removeAttribute("aria-current");
  }
  if (next.name === "task") {
    if (overview && overview.root.isConnected) {
      overviewScroll = window.scrollY;
      overview.root.remove();
    }
    page = mountTaskPage(view, next.id);
    window.scrollTo(0, 0);
    return;
  }
  document.title = "kiln";
  if (!overview) {
    overview = createOverview(); // loads everything once
    view.replaceChildren(overview.root);
  } else if (!overview.root.isConnected) {
    view.replaceChildren(overview.root);
    overview.shown();
    if (next.name === "overview") window.scrollTo(0, overviewScroll);
  }
  if (next.name === "new") overview.focusForm();
}

// ---- connection indicator --------------------------------------------------------------

const CONN_TEXT = { live: "live", reconnecting: "reconnecting…", closed: "offline", connecting: "connecting…" };

on("connection", (state) => {
  // The feed closes after a 401 too: then the key is what is missing, not the server.
  const keyNeeded = state === "closed" && !authPanel.hidden;
  conn.dataset.state = state;
  conn.textContent = keyNeeded ? "key needed" : CONN_TEXT[state] || state;
  conn.title =
    state === "live"
      ? "Receiving live events"
      : state === "reconnecting"
        ? "The event stream dropped; reconnecting and resuming where it left off"
        : "";
});

// ---- API key ---------------------------------------------------------------------------

onUnauthorized(() => {
  const hadKey = Boolean(apiKey());
  authHint.textContent = hadKey
    ? "The server refused the saved API key. Enter another one."
    : "This kiln server asks for an API key. It stays in this browser only.";
  if (authPanel.hidden) {
    authPanel.hidden = false;
    authForm.elements["api-key"].focus();
  }
  stopFeed();
  conn.dataset.state = "closed";
  conn.textContent = "key needed";
});

authForm.addEventListener("submit", (e) => {
  e.preventDefault();
  const key = authForm.elements["api-key"].value.trim();
  if (!key) return;
  setApiKey(key);
  authForm.reset();
  authPanel.hidden = true;
  restart();
});

forgetKey.addEventListener("click", () => {
  setApiKey("");
  restart();
});

/** Starts everything again with the current key. */
function restart() {
  forgetKey.hidden = !apiKey();
  clearError();
  startFeed();
  if (overview) overview.reload();
  if (page) route();
}

// ---- boot ------------------------------------------------------------------------------

document.querySelector("#error-banner .banner-close").addEventListener("click", clearError);
window.addEventListener("hashchange", route);
forgetKey.hidden = !apiKey();
startFeed();
route();
