-- kiln schema v17: preemption at step boundaries (KILN_PREEMPT_AFTER_S). The leading
-- supervisor asks one GENERATING holder of a full pool to yield by setting the time it
-- asked; the worker learns it from its heartbeat, and the column is cleared when the
-- attempt is given back (release) and by every claim.
ALTER TABLE tasks ADD COLUMN yield_requested_at REAL;
