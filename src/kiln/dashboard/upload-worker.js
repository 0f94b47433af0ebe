// The upload worker: sends one multipart submission (POST /v1/tasks) off the page's main
// thread, so a large file never freezes the page. XMLHttpRequest rather than fetch, because
// only XHR reports upload progress (bytes sent so far).
//
// In:  {file: File, request: {kind, params, ...}, key: "" | "<api key>", input: "image"}
// Out: {type: "progress", loaded, total}   bytes of the body sent so far (total 0 if unknown)
//      {type: "sent"}                      the whole body is out; the server is checking it
//      {type: "done", status, task, replayed}
//      {type: "error", status, code, message, details}
// The page starts one worker per upload and terminates it afterwards (which also aborts it).

self.onmessage = (event) => {
  const { file, request, key, input } = event.data || {};
  send(file, request, key, input || "image");
};

function send(file, request, key, input) {
  const body = new FormData();
  // The request part as a JSON file part: the server takes a form field or this.
  body.append("request", new Blob([JSON.stringify(request)], { type: "application/json" }), "request.json");
  body.append(input, file, file.name || input);

  const xhr = new XMLHttpRequest();
  xhr.open("POST", "/v1/tasks");
  xhr.setRequestHeader("Accept", "application/json");
  if (key) xhr.setRequestHeader("Authorization", `Bearer ${key}`);
  xhr.responseType = "text";

  xhr.upload.onprogress = (e) => {
    self.postMessage({ type: "progress", loaded: e.loaded, total: e.lengthComputable ? e.total : 0 });
  };
  xhr.upload.onload = () => self.postMessage({ type: "sent" });
  xhr.onload = () => answered(xhr);
  xhr.onerror = () =>
    fail(0, "network_error", "The connection to the kiln server closed before it answered.");
  xhr.ontimeout = () => fail(0, "network_error", "The kiln server did not answer in time.");
  xhr.send(body);
}

function answered(xhr) {
  const data = parseJson(xhr.responseText);
  if (xhr.status === 200 || xhr.status === 201) {
    if (data && typeof data === "object" && data.id) {
      const replayed = xhr.getResponseHeader("Idempotent-Replayed") === "true";
      self.postMessage({ type: "done", status: xhr.status, task: data, replayed });
      return;
    }
    fail(xhr.status, `http_${xhr.status}`, "The server answered without a task.");
    return;
  }
  // The error envelope, shown as the server wrote it; a bare answer (a proxy's) as its status.
  const envelope = data && typeof data === "object" ? data.error : null;
  fail(
    xhr.status,
    (envelope && envelope.code) || `http_${xhr.status}`,
    (envelope && envelope.message) || xhr.statusText || `The server answered ${xhr.status}.`,
    envelope && Array.isArray(envelope.details) ? envelope.details : [],
  );
}

function fail(status, code, message, details) {
  self.postMessage({ type: "error", status, code, message, details: details || [] });
}

function parseJson(text) {
  if (!text) return null;
  try {
    return JSON.parse(text);
  } catch (_) {
    return null;
  }
}
