-- kiln schema v3: dwell percentiles come from the latest events in seq order (the rowid,
-- or events_tenant for one tenant), so the per-status index no longer pays for itself on
-- every event insert.
DROP INDEX events_dwell;
