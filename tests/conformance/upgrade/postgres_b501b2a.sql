--
-- PostgreSQL database dump
--

\restrict Tne2m6xX7wWr0aM5PGmnAxk2VulKikbcwqOXckK5jbqVhn1gruyIzgiUrjs3Otw

-- Dumped from database version 15.18 (Debian 15.18-0+deb12u1)
-- Dumped by pg_dump version 15.18 (Debian 15.18-0+deb12u1)

SET statement_timeout = 0;
SET lock_timeout = 0;
SET idle_in_transaction_session_timeout = 0;
SET client_encoding = 'UTF8';
SET standard_conforming_strings = on;
SELECT pg_catalog.set_config('search_path', '', false);
SET check_function_bodies = false;
SET xmloption = content;
SET client_min_messages = warning;
SET row_security = off;

SET default_tablespace = '';

SET default_table_access_method = heap;

--
-- Name: breakers; Type: TABLE; Schema: public; Owner: -
--

CREATE TABLE public.breakers (
    name text NOT NULL,
    state text NOT NULL,
    opened_until double precision,
    updated_at double precision NOT NULL,
    by text NOT NULL,
    CONSTRAINT breakers_state_check CHECK ((state = ANY (ARRAY['closed'::text, 'open'::text, 'half_open'::text])))
);


--
-- Name: counters; Type: TABLE; Schema: public; Owner: -
--

CREATE TABLE public.counters (
    name text NOT NULL,
    labels text NOT NULL,
    shard smallint NOT NULL,
    n bigint NOT NULL
);


--
-- Name: events; Type: TABLE; Schema: public; Owner: -
--

CREATE TABLE public.events (
    seq bigint NOT NULL,
    id text NOT NULL,
    task_id text NOT NULL,
    tenant text NOT NULL,
    event text NOT NULL,
    from_status text,
    to_status text NOT NULL,
    final boolean NOT NULL,
    attempt integer NOT NULL,
    epoch integer NOT NULL,
    error text,
    at double precision NOT NULL,
    dwell_s double precision
);


--
-- Name: events_seq_seq; Type: SEQUENCE; Schema: public; Owner: -
--

ALTER TABLE public.events ALTER COLUMN seq ADD GENERATED ALWAYS AS IDENTITY (
    SEQUENCE NAME public.events_seq_seq
    START WITH 1
    INCREMENT BY 1
    NO MINVALUE
    NO MAXVALUE
    CACHE 1
);


--
-- Name: idempotency_keys; Type: TABLE; Schema: public; Owner: -
--

CREATE TABLE public.idempotency_keys (
    tenant text NOT NULL,
    key text NOT NULL,
    fingerprint text NOT NULL,
    task_id text NOT NULL,
    created_at double precision NOT NULL
);


--
-- Name: leaders; Type: TABLE; Schema: public; Owner: -
--

CREATE TABLE public.leaders (
    name text NOT NULL,
    owner text NOT NULL,
    epoch integer NOT NULL,
    expires_at double precision NOT NULL
);


--
-- Name: pool_slots; Type: TABLE; Schema: public; Owner: -
--

CREATE TABLE public.pool_slots (
    pool text NOT NULL,
    task_id text NOT NULL,
    epoch integer NOT NULL,
    units integer NOT NULL,
    held boolean NOT NULL,
    since double precision NOT NULL
);


--
-- Name: pools; Type: TABLE; Schema: public; Owner: -
--

CREATE TABLE public.pools (
    name text NOT NULL,
    capacity integer NOT NULL
);


--
-- Name: rate_buckets; Type: TABLE; Schema: public; Owner: -
--

CREATE TABLE public.rate_buckets (
    name text NOT NULL,
    tokens double precision NOT NULL,
    updated_at double precision NOT NULL
);


--
-- Name: retry_clock; Type: TABLE; Schema: public; Owner: -
--

CREATE TABLE public.retry_clock (
    name text NOT NULL,
    next_at double precision NOT NULL
);


--
-- Name: schema_migrations; Type: TABLE; Schema: public; Owner: -
--

CREATE TABLE public.schema_migrations (
    version integer NOT NULL,
    name text NOT NULL,
    applied_at timestamp with time zone DEFAULT now() NOT NULL
);


--
-- Name: task_counts; Type: TABLE; Schema: public; Owner: -
--

CREATE TABLE public.task_counts (
    tenant text NOT NULL,
    status text NOT NULL,
    shard smallint NOT NULL,
    n bigint NOT NULL
);


--
-- Name: tasks; Type: TABLE; Schema: public; Owner: -
--

CREATE TABLE public.tasks (
    id text NOT NULL,
    tenant text NOT NULL,
    kind text NOT NULL,
    status text NOT NULL,
    priority integer NOT NULL,
    ready_at double precision NOT NULL,
    params text NOT NULL,
    metadata text NOT NULL,
    inputs text NOT NULL,
    fingerprint text NOT NULL,
    idempotency_key text,
    dedup_key text,
    attempt integer DEFAULT 0 NOT NULL,
    max_attempts integer NOT NULL,
    epoch integer DEFAULT 0 NOT NULL,
    version integer DEFAULT 1 NOT NULL,
    lease_owner text,
    lease_expires_at double precision,
    state_deadline_at double precision,
    deadline_s double precision NOT NULL,
    deadline_at double precision NOT NULL,
    timeouts text NOT NULL,
    stage text,
    progress_step integer,
    progress_total integer,
    progress_at double precision,
    cancel_requested boolean DEFAULT false NOT NULL,
    cancel_requested_at double precision,
    next_retry_at double precision,
    result_prefix text,
    error text,
    result text,
    created_at double precision NOT NULL,
    updated_at double precision NOT NULL,
    status_since double precision NOT NULL,
    started_at double precision,
    finished_at double precision,
    due_at double precision GENERATED ALWAYS AS (
CASE
    WHEN (status = ANY (ARRAY['WAITING_FOR_RESOURCE'::text, 'GENERATING'::text, 'UPLOADING'::text])) THEN LEAST(COALESCE(lease_expires_at, deadline_at), COALESCE(state_deadline_at, deadline_at), deadline_at)
    WHEN (status = ANY (ARRAY['PENDING'::text, 'RETRYING'::text])) THEN deadline_at
    ELSE NULL::double precision
END) STORED,
    webhook text
);


--
-- Name: webhook_cursor; Type: TABLE; Schema: public; Owner: -
--

CREATE TABLE public.webhook_cursor (
    name text NOT NULL,
    seq bigint NOT NULL
);


--
-- Name: webhook_deliveries; Type: TABLE; Schema: public; Owner: -
--

CREATE TABLE public.webhook_deliveries (
    event_id text NOT NULL,
    seq bigint NOT NULL,
    task_id text NOT NULL,
    tenant text NOT NULL,
    event text NOT NULL,
    url text NOT NULL,
    payload text NOT NULL,
    status text NOT NULL,
    attempts integer DEFAULT 0 NOT NULL,
    next_attempt_at double precision NOT NULL,
    last_error text,
    response_status integer,
    created_at double precision NOT NULL,
    updated_at double precision NOT NULL
);


--
-- Data for Name: breakers; Type: TABLE DATA; Schema: public; Owner: -
--

INSERT INTO public.breakers VALUES ('image.generate', 'open', 1796161372.8625052, 1796161342.8625057, 'p1');


--
-- Data for Name: counters; Type: TABLE DATA; Schema: public; Owner: -
--

INSERT INTO public.counters VALUES ('transitions', 'PENDING>WAITING_FOR_RESOURCE', 1, 3);
INSERT INTO public.counters VALUES ('transitions', 'WAITING_FOR_RESOURCE>GENERATING', 9, 1);
INSERT INTO public.counters VALUES ('transitions', 'WAITING_FOR_RESOURCE>GENERATING', 5, 1);
INSERT INTO public.counters VALUES ('transitions', 'GENERATING>UPLOADING', 12, 1);
INSERT INTO public.counters VALUES ('transitions', 'UPLOADING>SUCCESS', 6, 1);
INSERT INTO public.counters VALUES ('failures', 'acme:boom', 9, 1);
INSERT INTO public.counters VALUES ('transitions', 'WAITING_FOR_RESOURCE>FAILED', 9, 1);
INSERT INTO public.counters VALUES ('breaker_transitions', 'image.generate>open', 10, 1);


--
-- Data for Name: events; Type: TABLE DATA; Schema: public; Owner: -
--

INSERT INTO public.events OVERRIDING SYSTEM VALUE VALUES (1, 'tsk_01m8sry3aj7aatsmjqfcq82606:1', 'tsk_01m8sry3aj7aatsmjqfcq82606', 'acme', 'submit', NULL, 'PENDING', false, 0, 0, NULL, 1796161342.8029118, NULL);
INSERT INTO public.events OVERRIDING SYSTEM VALUE VALUES (2, 'tsk_01m8sry3bx0mt76xx5772we082:1', 'tsk_01m8sry3bx0mt76xx5772we082', 'globex', 'submit', NULL, 'PENDING', false, 0, 0, NULL, 1796161342.8456857, NULL);
INSERT INTO public.events OVERRIDING SYSTEM VALUE VALUES (3, 'tsk_01m8sry3bzvnxvy7mx5zcf932z:1', 'tsk_01m8sry3bzvnxvy7mx5zcf932z', 'acme', 'submit', NULL, 'PENDING', false, 0, 0, NULL, 1796161342.8477285, NULL);
INSERT INTO public.events OVERRIDING SYSTEM VALUE VALUES (4, 'tsk_01m8sry3aj7aatsmjqfcq82606:2', 'tsk_01m8sry3aj7aatsmjqfcq82606', 'acme', 'claim', 'PENDING', 'WAITING_FOR_RESOURCE', false, 1, 1, NULL, 1796161342.8487399, 0.04582810401916504);
INSERT INTO public.events OVERRIDING SYSTEM VALUE VALUES (5, 'tsk_01m8sry3bx0mt76xx5772we082:2', 'tsk_01m8sry3bx0mt76xx5772we082', 'globex', 'claim', 'PENDING', 'WAITING_FOR_RESOURCE', false, 1, 1, NULL, 1796161342.8487399, 0.0030541419982910156);
INSERT INTO public.events OVERRIDING SYSTEM VALUE VALUES (6, 'tsk_01m8sry3bzvnxvy7mx5zcf932z:2', 'tsk_01m8sry3bzvnxvy7mx5zcf932z', 'acme', 'claim', 'PENDING', 'WAITING_FOR_RESOURCE', false, 1, 1, NULL, 1796161342.8487399, 0.0010113716125488281);
INSERT INTO public.events OVERRIDING SYSTEM VALUE VALUES (7, 'tsk_01m8sry3c4cp3rrgbwcmamzfw0:1', 'tsk_01m8sry3c4cp3rrgbwcmamzfw0', 'acme', 'submit', NULL, 'PENDING', false, 0, 0, NULL, 1796161342.853066, NULL);
INSERT INTO public.events OVERRIDING SYSTEM VALUE VALUES (8, 'tsk_01m8sry3aj7aatsmjqfcq82606:3', 'tsk_01m8sry3aj7aatsmjqfcq82606', 'acme', 'acquire', 'WAITING_FOR_RESOURCE', 'GENERATING', false, 1, 1, NULL, 1796161342.8556361, 0.006896257400512695);
INSERT INTO public.events OVERRIDING SYSTEM VALUE VALUES (9, 'tsk_01m8sry3bx0mt76xx5772we082:3', 'tsk_01m8sry3bx0mt76xx5772we082', 'globex', 'acquire', 'WAITING_FOR_RESOURCE', 'GENERATING', false, 1, 1, NULL, 1796161342.856898, 0.008158206939697266);
INSERT INTO public.events OVERRIDING SYSTEM VALUE VALUES (10, 'tsk_01m8sry3bx0mt76xx5772we082:4', 'tsk_01m8sry3bx0mt76xx5772we082', 'globex', 'generated', 'GENERATING', 'UPLOADING', false, 1, 1, NULL, 1796161342.8582356, 0.0013375282287597656);
INSERT INTO public.events OVERRIDING SYSTEM VALUE VALUES (11, 'tsk_01m8sry3bx0mt76xx5772we082:5', 'tsk_01m8sry3bx0mt76xx5772we082', 'globex', 'uploaded', 'UPLOADING', 'SUCCESS', true, 1, 1, NULL, 1796161342.8591926, 0.0009570121765136719);
INSERT INTO public.events OVERRIDING SYSTEM VALUE VALUES (12, 'tsk_01m8sry3bzvnxvy7mx5zcf932z:3', 'tsk_01m8sry3bzvnxvy7mx5zcf932z', 'acme', 'fail', 'WAITING_FOR_RESOURCE', 'FAILED', true, 1, 1, '{"code":"boom","message":"x","retryable":false}', 1796161342.8605587, 0.011818885803222656);


--
-- Data for Name: idempotency_keys; Type: TABLE DATA; Schema: public; Owner: -
--

INSERT INTO public.idempotency_keys VALUES ('acme', 'key-a', '2552c9cb3bd6176a48604339f2a96e6c6997f2b3938e42e81ac10c9dc9fa7df5', 'tsk_01m8sry3c4cp3rrgbwcmamzfw0', 1796161342.853066);


--
-- Data for Name: leaders; Type: TABLE DATA; Schema: public; Owner: -
--

INSERT INTO public.leaders VALUES ('supervisor', 's1', 1, 1796161372.8651423);


--
-- Data for Name: pool_slots; Type: TABLE DATA; Schema: public; Owner: -
--



--
-- Data for Name: pools; Type: TABLE DATA; Schema: public; Owner: -
--



--
-- Data for Name: rate_buckets; Type: TABLE DATA; Schema: public; Owner: -
--

INSERT INTO public.rate_buckets VALUES ('tenant:acme', 19, 1796161342.863982);


--
-- Data for Name: retry_clock; Type: TABLE DATA; Schema: public; Owner: -
--



--
-- Data for Name: schema_migrations; Type: TABLE DATA; Schema: public; Owner: -
--

INSERT INTO public.schema_migrations VALUES (1, '0001_init.sql', '2026-12-01 21:42:22.813379+00');
INSERT INTO public.schema_migrations VALUES (2, '0002_retention.sql', '2026-12-01 21:42:22.824443+00');
INSERT INTO public.schema_migrations VALUES (3, '0003_pools.sql', '2026-12-01 21:42:22.826334+00');
INSERT INTO public.schema_migrations VALUES (4, '0004_webhooks.sql', '2026-12-01 21:42:22.830483+00');
INSERT INTO public.schema_migrations VALUES (6, '0006_breakers.sql', '2026-12-01 21:42:22.834318+00');


--
-- Data for Name: task_counts; Type: TABLE DATA; Schema: public; Owner: -
--

INSERT INTO public.task_counts VALUES ('acme', 'PENDING', 0, 1);
INSERT INTO public.task_counts VALUES ('globex', 'PENDING', 8, 1);
INSERT INTO public.task_counts VALUES ('acme', 'PENDING', 6, 1);
INSERT INTO public.task_counts VALUES ('acme', 'PENDING', 1, -2);
INSERT INTO public.task_counts VALUES ('acme', 'WAITING_FOR_RESOURCE', 1, 2);
INSERT INTO public.task_counts VALUES ('globex', 'PENDING', 1, -1);
INSERT INTO public.task_counts VALUES ('globex', 'WAITING_FOR_RESOURCE', 1, 1);
INSERT INTO public.task_counts VALUES ('acme', 'PENDING', 8, 1);
INSERT INTO public.task_counts VALUES ('acme', 'GENERATING', 9, 1);
INSERT INTO public.task_counts VALUES ('globex', 'GENERATING', 5, 1);
INSERT INTO public.task_counts VALUES ('globex', 'WAITING_FOR_RESOURCE', 5, -1);
INSERT INTO public.task_counts VALUES ('globex', 'GENERATING', 12, -1);
INSERT INTO public.task_counts VALUES ('globex', 'UPLOADING', 12, 1);
INSERT INTO public.task_counts VALUES ('globex', 'SUCCESS', 6, 1);
INSERT INTO public.task_counts VALUES ('globex', 'UPLOADING', 6, -1);
INSERT INTO public.task_counts VALUES ('acme', 'FAILED', 9, 1);
INSERT INTO public.task_counts VALUES ('acme', 'WAITING_FOR_RESOURCE', 9, -2);


--
-- Data for Name: tasks; Type: TABLE DATA; Schema: public; Owner: -
--

INSERT INTO public.tasks VALUES ('tsk_01m8sry3c4cp3rrgbwcmamzfw0', 'acme', 'conformance.job', 'PENDING', 0, 1796161342.853066, '{"prompt":"pending one"}', '{}', '[]', '2552c9cb3bd6176a48604339f2a96e6c6997f2b3938e42e81ac10c9dc9fa7df5', 'key-a', '3ccbf41f92ce94fb95e2cab318060677b3b8d58557628d3bdd8963f0a7446383', 0, 3, 0, 1, NULL, NULL, NULL, 3600, 1796164942.853066, '{"generating_s":600.0,"uploading_s":120.0,"waiting_s":600.0}', NULL, NULL, NULL, NULL, false, NULL, NULL, NULL, NULL, NULL, 1796161342.853066, 1796161342.853066, 1796161342.853066, NULL, NULL, DEFAULT, NULL);
INSERT INTO public.tasks VALUES ('tsk_01m8sry3aj7aatsmjqfcq82606', 'acme', 'conformance.job', 'GENERATING', 2, 1796161342.8029118, '{"prompt":"running one"}', '{}', '[]', '58b4c1242c2c75c14edc7abfe856ca1943e43d845767f71f83b39d81d870f846', NULL, '621b6166a264cf0eb5ff8d15508c0ad89c00fe2b8a0842825cc1a7c2ca8fe133', 1, 3, 1, 3, 'w1', 1796161942.8487399, 1796161942.8487399, 3600, 1796164942.8029118, '{"generating_s":600.0,"uploading_s":120.0,"waiting_s":600.0}', NULL, NULL, NULL, NULL, false, NULL, NULL, 'tasks/tsk_01m8sry3aj7aatsmjqfcq82606/1-1', NULL, NULL, 1796161342.8029118, 1796161342.8556361, 1796161342.8556361, 1796161342.8487399, NULL, DEFAULT, NULL);
INSERT INTO public.tasks VALUES ('tsk_01m8sry3bx0mt76xx5772we082', 'globex', 'conformance.job', 'SUCCESS', 0, 1796161342.8456857, '{"prompt":"done one"}', '{}', '[]', 'ee162934904253a5caea56e548e098a945887127105a35c14a27ad529f706c58', NULL, '35d24c18bec8fe65508f96dab480f1211fe157b599ef83054a7b72103e480016', 1, 3, 1, 5, NULL, NULL, NULL, 3600, 1796164942.8456857, '{"generating_s":600.0,"uploading_s":120.0,"waiting_s":600.0}', NULL, NULL, NULL, NULL, false, NULL, NULL, 'tasks/tsk_01m8sry3bx0mt76xx5772we082/1-1', NULL, '{"outputs":[{"name":"image.png","sha256":"abc","size":3}]}', 1796161342.8456857, 1796161342.8591926, 1796161342.8591926, 1796161342.8487399, 1796161342.8591926, DEFAULT, NULL);
INSERT INTO public.tasks VALUES ('tsk_01m8sry3bzvnxvy7mx5zcf932z', 'acme', 'conformance.job', 'FAILED', 0, 1796161342.8477285, '{"prompt":"failed one"}', '{}', '[]', 'c61b98edaae428903a900cb3c4f9723649bd9b9795eb007f7cd073ab4ebaeafa', NULL, 'f3ac1c2464cbf36753ca5345a976eb26169fd51ab714fef936174aab1463bfd2', 1, 1, 1, 3, NULL, NULL, NULL, 3600, 1796164942.8477285, '{"generating_s":600.0,"uploading_s":120.0,"waiting_s":600.0}', NULL, NULL, NULL, NULL, false, NULL, NULL, 'tasks/tsk_01m8sry3bzvnxvy7mx5zcf932z/1-1', NULL, NULL, 1796161342.8477285, 1796161342.8605587, 1796161342.8605587, 1796161342.8487399, 1796161342.8605587, DEFAULT, NULL);


--
-- Data for Name: webhook_cursor; Type: TABLE DATA; Schema: public; Owner: -
--

INSERT INTO public.webhook_cursor VALUES ('events', 0);


--
-- Data for Name: webhook_deliveries; Type: TABLE DATA; Schema: public; Owner: -
--



--
-- Name: events_seq_seq; Type: SEQUENCE SET; Schema: public; Owner: -
--

SELECT pg_catalog.setval('public.events_seq_seq', 12, true);


--
-- Name: breakers breakers_pkey; Type: CONSTRAINT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.breakers
    ADD CONSTRAINT breakers_pkey PRIMARY KEY (name);


--
-- Name: counters counters_pkey; Type: CONSTRAINT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.counters
    ADD CONSTRAINT counters_pkey PRIMARY KEY (name, labels, shard);


--
-- Name: events events_id_key; Type: CONSTRAINT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.events
    ADD CONSTRAINT events_id_key UNIQUE (id);


--
-- Name: events events_pkey; Type: CONSTRAINT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.events
    ADD CONSTRAINT events_pkey PRIMARY KEY (seq);


--
-- Name: idempotency_keys idempotency_keys_pkey; Type: CONSTRAINT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.idempotency_keys
    ADD CONSTRAINT idempotency_keys_pkey PRIMARY KEY (tenant, key);


--
-- Name: leaders leaders_pkey; Type: CONSTRAINT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.leaders
    ADD CONSTRAINT leaders_pkey PRIMARY KEY (name);


--
-- Name: pool_slots pool_slots_pkey; Type: CONSTRAINT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.pool_slots
    ADD CONSTRAINT pool_slots_pkey PRIMARY KEY (pool, task_id);


--
-- Name: pools pools_pkey; Type: CONSTRAINT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.pools
    ADD CONSTRAINT pools_pkey PRIMARY KEY (name);


--
-- Name: rate_buckets rate_buckets_pkey; Type: CONSTRAINT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.rate_buckets
    ADD CONSTRAINT rate_buckets_pkey PRIMARY KEY (name);


--
-- Name: retry_clock retry_clock_pkey; Type: CONSTRAINT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.retry_clock
    ADD CONSTRAINT retry_clock_pkey PRIMARY KEY (name);


--
-- Name: schema_migrations schema_migrations_pkey; Type: CONSTRAINT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.schema_migrations
    ADD CONSTRAINT schema_migrations_pkey PRIMARY KEY (version);


--
-- Name: task_counts task_counts_pkey; Type: CONSTRAINT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.task_counts
    ADD CONSTRAINT task_counts_pkey PRIMARY KEY (tenant, status, shard);


--
-- Name: tasks tasks_pkey; Type: CONSTRAINT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.tasks
    ADD CONSTRAINT tasks_pkey PRIMARY KEY (id);


--
-- Name: webhook_cursor webhook_cursor_pkey; Type: CONSTRAINT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.webhook_cursor
    ADD CONSTRAINT webhook_cursor_pkey PRIMARY KEY (name);


--
-- Name: webhook_deliveries webhook_deliveries_pkey; Type: CONSTRAINT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.webhook_deliveries
    ADD CONSTRAINT webhook_deliveries_pkey PRIMARY KEY (event_id);


--
-- Name: events_task; Type: INDEX; Schema: public; Owner: -
--

CREATE INDEX events_task ON public.events USING btree (task_id, seq);


--
-- Name: events_tenant; Type: INDEX; Schema: public; Owner: -
--

CREATE INDEX events_tenant ON public.events USING btree (tenant, seq);


--
-- Name: idempotency_keys_task; Type: INDEX; Schema: public; Owner: -
--

CREATE INDEX idempotency_keys_task ON public.idempotency_keys USING btree (task_id);


--
-- Name: pool_slots_task; Type: INDEX; Schema: public; Owner: -
--

CREATE INDEX pool_slots_task ON public.pool_slots USING btree (task_id);


--
-- Name: tasks_cancel_due; Type: INDEX; Schema: public; Owner: -
--

CREATE INDEX tasks_cancel_due ON public.tasks USING btree (cancel_requested_at) WHERE (cancel_requested AND (status = ANY (ARRAY['WAITING_FOR_RESOURCE'::text, 'GENERATING'::text, 'UPLOADING'::text])));


--
-- Name: tasks_claim; Type: INDEX; Schema: public; Owner: -
--

CREATE INDEX tasks_claim ON public.tasks USING btree (kind, priority DESC, ready_at, id) WHERE (status = ANY (ARRAY['PENDING'::text, 'RETRYING'::text]));


--
-- Name: tasks_claim_tenant; Type: INDEX; Schema: public; Owner: -
--

CREATE INDEX tasks_claim_tenant ON public.tasks USING btree (kind, tenant, priority DESC, ready_at, id) WHERE (status = ANY (ARRAY['PENDING'::text, 'RETRYING'::text]));


--
-- Name: tasks_dedup; Type: INDEX; Schema: public; Owner: -
--

CREATE UNIQUE INDEX tasks_dedup ON public.tasks USING btree (tenant, dedup_key) WHERE ((dedup_key IS NOT NULL) AND (status <> ALL (ARRAY['FAILED'::text, 'TIMEOUT'::text, 'CANCELLED'::text])));


--
-- Name: tasks_due; Type: INDEX; Schema: public; Owner: -
--

CREATE INDEX tasks_due ON public.tasks USING btree (due_at) WHERE (due_at IS NOT NULL);


--
-- Name: tasks_finished; Type: INDEX; Schema: public; Owner: -
--

CREATE INDEX tasks_finished ON public.tasks USING btree (finished_at) WHERE (status = ANY (ARRAY['SUCCESS'::text, 'FAILED'::text, 'TIMEOUT'::text, 'CANCELLED'::text]));


--
-- Name: tasks_progress; Type: INDEX; Schema: public; Owner: -
--

CREATE INDEX tasks_progress ON public.tasks USING btree (progress_at) WHERE (progress_at IS NOT NULL);


--
-- Name: tasks_ready; Type: INDEX; Schema: public; Owner: -
--

CREATE INDEX tasks_ready ON public.tasks USING btree (ready_at) WHERE (status = ANY (ARRAY['PENDING'::text, 'RETRYING'::text]));


--
-- Name: tasks_tenant_id; Type: INDEX; Schema: public; Owner: -
--

CREATE INDEX tasks_tenant_id ON public.tasks USING btree (tenant, id);


--
-- Name: tasks_tenant_status_id; Type: INDEX; Schema: public; Owner: -
--

CREATE INDEX tasks_tenant_status_id ON public.tasks USING btree (tenant, status, id);


--
-- Name: webhook_deliveries_due; Type: INDEX; Schema: public; Owner: -
--

CREATE INDEX webhook_deliveries_due ON public.webhook_deliveries USING btree (next_attempt_at, seq) WHERE (status = 'pending'::text);


--
-- Name: webhook_deliveries_task; Type: INDEX; Schema: public; Owner: -
--

CREATE INDEX webhook_deliveries_task ON public.webhook_deliveries USING btree (task_id, seq);


--
-- PostgreSQL database dump complete
--

\unrestrict Tne2m6xX7wWr0aM5PGmnAxk2VulKikbcwqOXckK5jbqVhn1gruyIzgiUrjs3Otw

