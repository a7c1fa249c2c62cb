-- The shop's tables on SQLite and PostgreSQL (the same SQL), applied at
-- start, idempotently.
CREATE TABLE IF NOT EXISTS shop_payments (
    id             TEXT   PRIMARY KEY,
    client_id      TEXT   NOT NULL,
    account_id     TEXT   NOT NULL,
    amount         BIGINT NOT NULL CHECK (amount > 0),
    currency       TEXT   NOT NULL,
    status         TEXT   NOT NULL,
    bank_charge_id TEXT   NOT NULL,
    -- the last safety net: one payment per operation, whatever the layers above do
    operation_id   TEXT   NOT NULL,
    created_at     BIGINT NOT NULL,
    CONSTRAINT shop_payments_operation_id_key UNIQUE (operation_id)
);
CREATE INDEX IF NOT EXISTS shop_payments_account ON shop_payments (client_id, account_id);

-- The fake bank's ledger. It stands for an external system: it commits on
-- its own and deduplicates on the operation id it is given.
CREATE TABLE IF NOT EXISTS bank_charges (
    id           TEXT   PRIMARY KEY,
    -- the merchant the charge was made for: the shop's client
    client_id    TEXT   NOT NULL,
    operation_id TEXT   NOT NULL UNIQUE,
    account_id   TEXT   NOT NULL,
    amount       BIGINT NOT NULL,
    currency     TEXT   NOT NULL,
    created_at   BIGINT NOT NULL,
    -- the merchant's own reference for the charge (an order id), or ''
    reference    TEXT   NOT NULL DEFAULT ''
);
CREATE INDEX IF NOT EXISTS bank_charges_account ON bank_charges (client_id, account_id);

-- Orders are created once per natural key, with or without an Idempotency-Key;
-- natural keys are per client: two clients may use the same reference.
CREATE TABLE IF NOT EXISTS shop_orders (
    id               TEXT   PRIMARY KEY,
    client_id        TEXT   NOT NULL,
    customer_id      TEXT   NOT NULL,
    client_reference TEXT   NOT NULL,
    items            TEXT   NOT NULL,
    status           TEXT   NOT NULL,
    created_at       BIGINT NOT NULL,
    CONSTRAINT shop_orders_natural_key UNIQUE (client_id, customer_id, client_reference)
);

-- A checkout binds an order to the one operation (Idempotency-Key) that
-- pays it: another key for the same order is refused, never charged.
CREATE TABLE IF NOT EXISTS shop_checkouts (
    order_id        TEXT   PRIMARY KEY,
    client_id       TEXT   NOT NULL,
    operation_id    TEXT   NOT NULL,
    -- the key is kept too: the same key back with a new operation id (its
    -- record expired, or Redis lost it) resumes under the bound one
    idempotency_key TEXT   NOT NULL,
    created_at      BIGINT NOT NULL,
    -- what it pays with (account, amount, currency): the same key back
    -- with other ones is another checkout ('' in rows made before it)
    intent          TEXT   NOT NULL DEFAULT ''
);

-- With the records in Redis alone (`--idem-store redis`), a payment's
-- Idempotency-Key is bound here to the operation that charges for it,
-- before the bank is called: the key back with a new operation id (Redis
-- lost its record) resumes under the bound one, which the bank knows, and
-- is never charged again. Kept for the records' retention.
CREATE TABLE IF NOT EXISTS shop_payment_keys (
    client_id       TEXT   NOT NULL,
    idempotency_key TEXT   NOT NULL,
    operation_id    TEXT   NOT NULL,
    -- what it pays with, and by which route
    intent          TEXT   NOT NULL,
    bound_at        BIGINT NOT NULL,
    PRIMARY KEY (client_id, idempotency_key)
);
CREATE INDEX IF NOT EXISTS shop_payment_keys_bound_at ON shop_payment_keys (bound_at);

-- Products are written with optimistic concurrency (ETag / If-Match).
CREATE TABLE IF NOT EXISTS shop_products (
    sku     TEXT   PRIMARY KEY,
    name    TEXT   NOT NULL,
    price   BIGINT NOT NULL,
    version BIGINT NOT NULL
);

-- The bank's webhook events, processed once per event id.
CREATE TABLE IF NOT EXISTS shop_bank_events (
    event_id    TEXT   PRIMARY KEY,
    type        TEXT   NOT NULL,
    payment_id  TEXT   NOT NULL,
    received_at BIGINT NOT NULL
);
CREATE INDEX IF NOT EXISTS shop_bank_events_payment ON shop_bank_events (payment_id);

-- What the reserve-stock consumer reserved, per SKU.
CREATE TABLE IF NOT EXISTS shop_stock (
    sku      TEXT   PRIMARY KEY,
    reserved BIGINT NOT NULL
);

-- What the send-email consumer sent: one confirmation per payment.
CREATE TABLE IF NOT EXISTS shop_emails (
    id         TEXT   PRIMARY KEY,
    payment_id TEXT   NOT NULL,
    account_id TEXT   NOT NULL,
    subject    TEXT   NOT NULL,
    created_at BIGINT NOT NULL
);
CREATE INDEX IF NOT EXISTS shop_emails_account ON shop_emails (account_id);
-- A client's emails are read from its payments (see `queries::EMAILS`).
CREATE INDEX IF NOT EXISTS shop_emails_payment ON shop_emails (payment_id);
