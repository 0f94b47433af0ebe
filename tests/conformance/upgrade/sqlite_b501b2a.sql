BEGIN TRANSACTION;
CREATE TABLE breakers (
    name         TEXT PRIMARY KEY,
    state        TEXT NOT NULL CHECK (state IN ('closed', 'open', 'half_open')),
    opened_until REAL,
    updated_at   REAL NOT NULL,
    "by"         TEXT NOT NULL
) WITHOUT ROWID;
INSERT INTO "breakers" VALUES('image.generate','open',1.79616136750018978119e+09,1.79616133750019025799e+09,'p1');
CREATE TABLE counters (
    name   TEXT NOT NULL,
    labels TEXT NOT NULL,
    n      INTEGER NOT NULL,
    PRIMARY KEY (name, labels)
) WITHOUT ROWID;
INSERT INTO "counters" VALUES('breaker_transitions','image.generate>open',1);
INSERT INTO "counters" VALUES('failures','acme:boom',1);
INSERT INTO "counters" VALUES('transitions','GENERATING>UPLOADING',1);
INSERT INTO "counters" VALUES('transitions','PENDING>WAITING_FOR_RESOURCE',3);
INSERT INTO "counters" VALUES('transitions','UPLOADING>SUCCESS',1);
INSERT INTO "counters" VALUES('transitions','WAITING_FOR_RESOURCE>FAILED',1);
INSERT INTO "counters" VALUES('transitions','WAITING_FOR_RESOURCE>GENERATING',2);
CREATE TABLE events (
    seq          INTEGER PRIMARY KEY AUTOINCREMENT,
    id           TEXT NOT NULL UNIQUE,
    task_id      TEXT NOT NULL,
    tenant       TEXT NOT NULL,
    event        TEXT NOT NULL,
    from_status  TEXT,
    to_status    TEXT NOT NULL,
    final        INTEGER NOT NULL,
    attempt      INTEGER NOT NULL,
    epoch        INTEGER NOT NULL,
    error        TEXT,
    at           REAL NOT NULL,
    dwell_s      REAL
);
INSERT INTO "events" VALUES(1,'tsk_01m8srxy4k3g6q8nvg3gdxw14x:1','tsk_01m8srxy4k3g6q8nvg3gdxw14x','acme','submit',NULL,'PENDING',0,0,0,NULL,1.79616133749356150632e+09,NULL);
INSERT INTO "events" VALUES(2,'tsk_01m8srxy4q0nemnqrvhh7v8hvk:1','tsk_01m8srxy4q0nemnqrvhh7v8hvk','globex','submit',NULL,'PENDING',0,0,0,NULL,1.79616133749519872662e+09,NULL);
INSERT INTO "events" VALUES(3,'tsk_01m8srxy4q1z998j5sa6p62yhw:1','tsk_01m8srxy4q1z998j5sa6p62yhw','acme','submit',NULL,'PENDING',0,0,0,NULL,1.79616133749569916724e+09,NULL);
INSERT INTO "events" VALUES(4,'tsk_01m8srxy4k3g6q8nvg3gdxw14x:2','tsk_01m8srxy4k3g6q8nvg3gdxw14x','acme','claim','PENDING','WAITING_FOR_RESOURCE',0,1,1,NULL,1796161337.49608,2.5184154510498046875e-03);
INSERT INTO "events" VALUES(5,'tsk_01m8srxy4q0nemnqrvhh7v8hvk:2','tsk_01m8srxy4q0nemnqrvhh7v8hvk','globex','claim','PENDING','WAITING_FOR_RESOURCE',0,1,1,NULL,1796161337.49608,0.000881195068359375);
INSERT INTO "events" VALUES(6,'tsk_01m8srxy4q1z998j5sa6p62yhw:2','tsk_01m8srxy4q1z998j5sa6p62yhw','acme','claim','PENDING','WAITING_FOR_RESOURCE',0,1,1,NULL,1796161337.49608,3.807544708251953125e-04);
INSERT INTO "events" VALUES(7,'tsk_01m8srxy4shca9e3cfphxsarx2:1','tsk_01m8srxy4shca9e3cfphxsarx2','acme','submit',NULL,'PENDING',0,0,0,NULL,1.79616133749722385408e+09,NULL);
INSERT INTO "events" VALUES(8,'tsk_01m8srxy4k3g6q8nvg3gdxw14x:3','tsk_01m8srxy4k3g6q8nvg3gdxw14x','acme','acquire','WAITING_FOR_RESOURCE','GENERATING',0,1,1,NULL,1.79616133749770855903e+09,1.6286373138427734375e-03);
INSERT INTO "events" VALUES(9,'tsk_01m8srxy4q0nemnqrvhh7v8hvk:3','tsk_01m8srxy4q0nemnqrvhh7v8hvk','globex','acquire','WAITING_FOR_RESOURCE','GENERATING',0,1,1,NULL,1.79616133749822735792e+09,2.1474361419677734375e-03);
INSERT INTO "events" VALUES(10,'tsk_01m8srxy4q0nemnqrvhh7v8hvk:4','tsk_01m8srxy4q0nemnqrvhh7v8hvk','globex','generated','GENERATING','UPLOADING',0,1,1,NULL,1.79616133749859380715e+09,3.664493560791015625e-04);
INSERT INTO "events" VALUES(11,'tsk_01m8srxy4q0nemnqrvhh7v8hvk:5','tsk_01m8srxy4q0nemnqrvhh7v8hvk','globex','uploaded','UPLOADING','SUCCESS',1,1,1,NULL,1.79616133749894404418e+09,3.502368927001953125e-04);
INSERT INTO "events" VALUES(12,'tsk_01m8srxy4q1z998j5sa6p62yhw:3','tsk_01m8srxy4q1z998j5sa6p62yhw','acme','fail','WAITING_FOR_RESOURCE','FAILED',1,1,1,'{"code":"boom","message":"x","retryable":false}',1.79616133749951195717e+09,3.4320354461669921875e-03);
CREATE TABLE idempotency_keys (
    tenant      TEXT NOT NULL,
    key         TEXT NOT NULL,
    fingerprint TEXT NOT NULL,
    task_id     TEXT NOT NULL,
    created_at  REAL NOT NULL,
    PRIMARY KEY (tenant, key)
) WITHOUT ROWID;
INSERT INTO "idempotency_keys" VALUES('acme','key-a','2552c9cb3bd6176a48604339f2a96e6c6997f2b3938e42e81ac10c9dc9fa7df5','tsk_01m8srxy4shca9e3cfphxsarx2',1.79616133749722385408e+09);
CREATE TABLE leaders (
    name       TEXT PRIMARY KEY,
    owner      TEXT NOT NULL,
    epoch      INTEGER NOT NULL,
    expires_at REAL NOT NULL
) WITHOUT ROWID;
INSERT INTO "leaders" VALUES('supervisor','s1',1,1.79616136750068163875e+09);
CREATE TABLE pool_slots (
    pool    TEXT NOT NULL,
    task_id TEXT NOT NULL,
    epoch   INTEGER NOT NULL,
    units   INTEGER NOT NULL,
    held    INTEGER NOT NULL,
    since   REAL NOT NULL,
    PRIMARY KEY (pool, task_id)
) WITHOUT ROWID;
CREATE TABLE pools (
    name     TEXT PRIMARY KEY,
    capacity INTEGER NOT NULL
) WITHOUT ROWID;
CREATE TABLE rate_buckets (
    name       TEXT PRIMARY KEY,
    tokens     REAL NOT NULL,
    updated_at REAL NOT NULL
) WITHOUT ROWID;
INSERT INTO "rate_buckets" VALUES('tenant:acme',19.0,1.79616133750048875806e+09);
CREATE TABLE retry_clock (
    name    TEXT PRIMARY KEY,
    next_at REAL NOT NULL
) WITHOUT ROWID;
CREATE TABLE schema_migrations (version INTEGER PRIMARY KEY, name TEXT NOT NULL, applied_at TEXT NOT NULL);
INSERT INTO "schema_migrations" VALUES(1,'0001_init.sql','2026-12-01 21:42:17');
INSERT INTO "schema_migrations" VALUES(2,'0002_due_index.sql','2026-12-01 21:42:17');
INSERT INTO "schema_migrations" VALUES(3,'0003_events_without_dwell_index.sql','2026-12-01 21:42:17');
INSERT INTO "schema_migrations" VALUES(4,'0004_retention.sql','2026-12-01 21:42:17');
INSERT INTO "schema_migrations" VALUES(5,'0005_pools.sql','2026-12-01 21:42:17');
INSERT INTO "schema_migrations" VALUES(6,'0006_webhooks.sql','2026-12-01 21:42:17');
INSERT INTO "schema_migrations" VALUES(8,'0008_breakers.sql','2026-12-01 21:42:17');
CREATE TABLE task_counts (
    tenant TEXT NOT NULL,
    status TEXT NOT NULL,
    n      INTEGER NOT NULL,
    PRIMARY KEY (tenant, status)
) WITHOUT ROWID;
INSERT INTO "task_counts" VALUES('acme','FAILED',1);
INSERT INTO "task_counts" VALUES('acme','GENERATING',1);
INSERT INTO "task_counts" VALUES('acme','PENDING',1);
INSERT INTO "task_counts" VALUES('acme','WAITING_FOR_RESOURCE',0);
INSERT INTO "task_counts" VALUES('globex','GENERATING',0);
INSERT INTO "task_counts" VALUES('globex','PENDING',0);
INSERT INTO "task_counts" VALUES('globex','SUCCESS',1);
INSERT INTO "task_counts" VALUES('globex','UPLOADING',0);
INSERT INTO "task_counts" VALUES('globex','WAITING_FOR_RESOURCE',0);
CREATE TABLE tasks (
    id                  TEXT PRIMARY KEY,
    tenant              TEXT NOT NULL,
    kind                TEXT NOT NULL,
    status              TEXT NOT NULL,
    priority            INTEGER NOT NULL,
    ready_at            REAL NOT NULL,
    params              TEXT NOT NULL,
    metadata            TEXT NOT NULL,
    inputs              TEXT NOT NULL,
    fingerprint         TEXT NOT NULL,
    idempotency_key     TEXT,
    dedup_key           TEXT,
    attempt             INTEGER NOT NULL DEFAULT 0,
    max_attempts        INTEGER NOT NULL,
    epoch               INTEGER NOT NULL DEFAULT 0,
    version             INTEGER NOT NULL DEFAULT 1,
    lease_owner         TEXT,
    lease_expires_at    REAL,
    state_deadline_at   REAL,
    deadline_s          REAL NOT NULL,
    deadline_at         REAL NOT NULL,
    timeouts            TEXT NOT NULL,
    stage               TEXT,
    progress_step       INTEGER,
    progress_total      INTEGER,
    progress_at         REAL,
    cancel_requested    INTEGER NOT NULL DEFAULT 0,
    cancel_requested_at REAL,
    next_retry_at       REAL,
    result_prefix       TEXT,
    error               TEXT,
    result              TEXT,
    created_at          REAL NOT NULL,
    updated_at          REAL NOT NULL,
    status_since        REAL NOT NULL,
    started_at          REAL,
    finished_at         REAL
, due_at REAL GENERATED ALWAYS AS (
    CASE
        WHEN status IN ('WAITING_FOR_RESOURCE', 'GENERATING', 'UPLOADING') THEN min(
            coalesce(lease_expires_at, deadline_at),
            coalesce(state_deadline_at, deadline_at),
            deadline_at)
        WHEN status IN ('PENDING', 'RETRYING') THEN deadline_at
    END) VIRTUAL, webhook TEXT);
INSERT INTO "tasks" VALUES('tsk_01m8srxy4k3g6q8nvg3gdxw14x','acme','conformance.job','GENERATING',2,1.79616133749356150632e+09,'{"prompt":"running one"}','{}','[]','58b4c1242c2c75c14edc7abfe856ca1943e43d845767f71f83b39d81d870f846',NULL,'621b6166a264cf0eb5ff8d15508c0ad89c00fe2b8a0842825cc1a7c2ca8fe133',1,3,1,3,'w1',1796161937.49608,1796161937.49608,3600.0,1.79616493749356150632e+09,'{"generating_s":600.0,"uploading_s":120.0,"waiting_s":600.0}',NULL,NULL,NULL,NULL,0,NULL,NULL,'tasks/tsk_01m8srxy4k3g6q8nvg3gdxw14x/1-1',NULL,NULL,1.79616133749356150632e+09,1.79616133749770855903e+09,1.79616133749770855903e+09,1796161337.49608,NULL,NULL);
INSERT INTO "tasks" VALUES('tsk_01m8srxy4q0nemnqrvhh7v8hvk','globex','conformance.job','SUCCESS',0,1.79616133749519872662e+09,'{"prompt":"done one"}','{}','[]','ee162934904253a5caea56e548e098a945887127105a35c14a27ad529f706c58',NULL,'35d24c18bec8fe65508f96dab480f1211fe157b599ef83054a7b72103e480016',1,3,1,5,NULL,NULL,NULL,3600.0,1.79616493749519872662e+09,'{"generating_s":600.0,"uploading_s":120.0,"waiting_s":600.0}',NULL,NULL,NULL,NULL,0,NULL,NULL,'tasks/tsk_01m8srxy4q0nemnqrvhh7v8hvk/1-1',NULL,'{"outputs":[{"name":"image.png","sha256":"abc","size":3}]}',1.79616133749519872662e+09,1.79616133749894404418e+09,1.79616133749894404418e+09,1796161337.49608,1.79616133749894404418e+09,NULL);
INSERT INTO "tasks" VALUES('tsk_01m8srxy4q1z998j5sa6p62yhw','acme','conformance.job','FAILED',0,1.79616133749569916724e+09,'{"prompt":"failed one"}','{}','[]','c61b98edaae428903a900cb3c4f9723649bd9b9795eb007f7cd073ab4ebaeafa',NULL,'f3ac1c2464cbf36753ca5345a976eb26169fd51ab714fef936174aab1463bfd2',1,1,1,3,NULL,NULL,NULL,3600.0,1.7961649374956991672e+09,'{"generating_s":600.0,"uploading_s":120.0,"waiting_s":600.0}',NULL,NULL,NULL,NULL,0,NULL,NULL,'tasks/tsk_01m8srxy4q1z998j5sa6p62yhw/1-1',NULL,NULL,1.79616133749569916724e+09,1.79616133749951195717e+09,1.79616133749951195717e+09,1796161337.49608,1.79616133749951195717e+09,NULL);
INSERT INTO "tasks" VALUES('tsk_01m8srxy4shca9e3cfphxsarx2','acme','conformance.job','PENDING',0,1.79616133749722385408e+09,'{"prompt":"pending one"}','{}','[]','2552c9cb3bd6176a48604339f2a96e6c6997f2b3938e42e81ac10c9dc9fa7df5','key-a','3ccbf41f92ce94fb95e2cab318060677b3b8d58557628d3bdd8963f0a7446383',0,3,0,1,NULL,NULL,NULL,3600.0,1.79616493749722385409e+09,'{"generating_s":600.0,"uploading_s":120.0,"waiting_s":600.0}',NULL,NULL,NULL,NULL,0,NULL,NULL,NULL,NULL,NULL,1.79616133749722385408e+09,1.79616133749722385408e+09,1.79616133749722385408e+09,NULL,NULL,NULL);
CREATE TABLE webhook_cursor (
    name TEXT PRIMARY KEY,
    seq  INTEGER NOT NULL
);
INSERT INTO "webhook_cursor" VALUES('events',0);
CREATE TABLE webhook_deliveries (
    event_id        TEXT PRIMARY KEY,
    seq             INTEGER NOT NULL,
    task_id         TEXT NOT NULL,
    tenant          TEXT NOT NULL,
    event           TEXT NOT NULL,
    url             TEXT NOT NULL,
    payload         TEXT NOT NULL,
    status          TEXT NOT NULL,
    attempts        INTEGER NOT NULL DEFAULT 0,
    next_attempt_at REAL NOT NULL,
    last_error      TEXT,
    response_status INTEGER,
    created_at      REAL NOT NULL,
    updated_at      REAL NOT NULL
);
CREATE INDEX tasks_tenant_id ON tasks (tenant, id);
CREATE INDEX tasks_tenant_status_id ON tasks (tenant, status, id);
CREATE UNIQUE INDEX tasks_dedup ON tasks (tenant, dedup_key)
    WHERE dedup_key IS NOT NULL AND status NOT IN ('FAILED', 'TIMEOUT', 'CANCELLED');
CREATE INDEX tasks_claim ON tasks (kind, priority DESC, ready_at, id)
    WHERE status IN ('PENDING', 'RETRYING');
CREATE INDEX tasks_ready ON tasks (ready_at) WHERE status IN ('PENDING', 'RETRYING');
CREATE INDEX tasks_cancel_due ON tasks (cancel_requested_at)
    WHERE cancel_requested = 1 AND status IN ('WAITING_FOR_RESOURCE', 'GENERATING', 'UPLOADING');
CREATE INDEX tasks_progress ON tasks (progress_at) WHERE progress_at IS NOT NULL;
CREATE INDEX events_task ON events (task_id, seq);
CREATE INDEX events_tenant ON events (tenant, seq);
CREATE INDEX tasks_due ON tasks (due_at) WHERE due_at IS NOT NULL;
CREATE INDEX tasks_finished ON tasks (finished_at)
    WHERE status IN ('SUCCESS', 'FAILED', 'TIMEOUT', 'CANCELLED');
CREATE INDEX idempotency_keys_task ON idempotency_keys (task_id);
CREATE INDEX pool_slots_task ON pool_slots (task_id);
CREATE INDEX tasks_claim_tenant ON tasks (kind, tenant, priority DESC, ready_at, id)
    WHERE status IN ('PENDING', 'RETRYING');
CREATE INDEX webhook_deliveries_due ON webhook_deliveries (next_attempt_at, seq)
    WHERE status = 'pending';
CREATE INDEX webhook_deliveries_task ON webhook_deliveries (task_id, seq);
DELETE FROM "sqlite_sequence";
INSERT INTO "sqlite_sequence" VALUES('events',12);
COMMIT;
