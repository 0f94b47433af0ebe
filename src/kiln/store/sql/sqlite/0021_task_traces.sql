-- kiln schema v21: the W3C trace context a task was submitted in (OpenTelemetry, the
-- optional extra kiln[otel]): written in the submit transaction only when tracing is on,
-- read when an attempt's spans are emitted, deleted with the task by retention.
CREATE TABLE task_traces (
    task_id TEXT PRIMARY KEY,
    traceparent TEXT NOT NULL,
    tracestate TEXT
);
