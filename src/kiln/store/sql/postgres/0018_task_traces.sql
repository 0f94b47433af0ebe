-- kiln schema v18 (PostgreSQL): the W3C trace context a task was submitted in
-- (OpenTelemetry, the optional extra kiln[otel]): written in the submit transaction only
-- when tracing is on, read when an attempt's spans are emitted, deleted with the task by
-- retention.
CREATE TABLE task_traces (
    task_id text PRIMARY KEY,
    traceparent text NOT NULL,
    tracestate text
);
