-- kiln schema v13: the GPU-second ledger (kiln/store/usage.py). One row per attempt,
-- written in the transaction of the transition that ends it; the key (task, attempt,
-- epoch) makes a replayed write add nothing. Rows outlive the task's retention purge: they
-- are billing data. waiting_s and generating_s are the dwell_s of the attempt's event rows
-- that leave WAITING_FOR_RESOURCE and GENERATING.
CREATE TABLE usage_ledger (
    task_id      TEXT NOT NULL,
    attempt      INTEGER NOT NULL,
    epoch        INTEGER NOT NULL,
    tenant       TEXT NOT NULL,
    kind         TEXT NOT NULL,
    model        TEXT,
    pool         TEXT NOT NULL,
    worker       TEXT,
    outcome      TEXT NOT NULL,
    waiting_s    REAL NOT NULL,
    loading_s    REAL NOT NULL,
    generating_s REAL NOT NULL,
    share        REAL NOT NULL,
    ended_at     REAL NOT NULL,
    PRIMARY KEY (task_id, attempt, epoch)
) WITHOUT ROWID;
CREATE INDEX usage_ledger_ended ON usage_ledger (ended_at);
CREATE INDEX usage_ledger_tenant_ended ON usage_ledger (tenant, ended_at);
