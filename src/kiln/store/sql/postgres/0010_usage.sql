-- kiln schema v10 (PostgreSQL): the GPU-second ledger (kiln/store/usage.py). One row per
-- attempt, written in the transaction of the transition that ends it; the key (task,
-- attempt, epoch) makes a replayed write add nothing. Rows outlive the task's retention
-- purge: they are billing data. waiting_s and generating_s are the dwell_s of the
-- attempt's event rows that leave WAITING_FOR_RESOURCE and GENERATING.
CREATE TABLE usage_ledger (
    task_id      text NOT NULL,
    attempt      integer NOT NULL,
    epoch        integer NOT NULL,
    tenant       text NOT NULL,
    kind         text NOT NULL,
    model        text,
    pool         text NOT NULL,
    worker       text,
    outcome      text NOT NULL,
    waiting_s    double precision NOT NULL,
    loading_s    double precision NOT NULL,
    generating_s double precision NOT NULL,
    share        double precision NOT NULL,
    ended_at     double precision NOT NULL,
    PRIMARY KEY (task_id, attempt, epoch)
);
CREATE INDEX usage_ledger_ended ON usage_ledger (ended_at);
CREATE INDEX usage_ledger_tenant_ended ON usage_ledger (tenant, ended_at);
