-- kiln schema v8: the worker processes, each a row it keeps fresh with its beat
-- (kiln/store/workers.py). A row whose expires_at passed is a worker gone: it is no longer
-- listed, and deleted an hour later.
CREATE TABLE workers (
    id         text PRIMARY KEY,
    host       text NOT NULL,
    pid        integer NOT NULL,
    version    text NOT NULL,
    kinds      text NOT NULL,
    slots      integer NOT NULL,
    running    integer NOT NULL,
    resources  text NOT NULL,
    models     text NOT NULL,
    started_at double precision NOT NULL,
    seen_at    double precision NOT NULL,
    expires_at double precision NOT NULL
);
CREATE INDEX workers_expires ON workers (expires_at);
