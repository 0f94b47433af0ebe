-- kiln schema v19: the seconds an attempt spent loading models (ctx.loading_model) while
-- in the status its event leaves (GENERATING); NULL when it loaded none.
ALTER TABLE events ADD COLUMN loading_s REAL;
