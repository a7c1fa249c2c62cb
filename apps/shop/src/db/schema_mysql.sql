-- The shop's tables on MySQL / MariaDB, applied at start, idempotently
-- (each statement commits by itself). Identifiers and text are kept as
-- their bytes (VARBINARY, BLOB): compared exactly, with no collation to fold
-- case or pad spaces, so one client never matches another's rows.
CREATE TABLE IF NOT EXISTS shop_payments (
    id             VARBINARY(255)  NOT NULL PRIMARY KEY,
    client_id      VARBINARY(1020) NOT NULL,
    account_id     VARBINARY(255)  NOT NULL,
    amount         BIGINT          NOT NULL CHECK (amount > 0),
    currency       VARBINARY(16)   NOT NULL,
    status         VARBINARY(32)   NOT NULL,
    bank_charge_id VARBINARY(255)  NOT NULL,
    -- the last safety net: one payment per operation, whatever the layers above do
    operation_id   VARBINARY(64)   NOT NULL,
    created_at     BIGINT          NOT NULL,
    CONSTRAINT shop_payments_operation_id_key UNIQUE (operation_id),
    INDEX shop_payments_account (client_id, account_id)
) ENGINE = InnoDB;

-- The fake bank's ledger. It stands for an external system: it commits on
-- its own and deduplicates on the operation id it is given.
CREATE TABLE IF NOT EXISTS bank_charges (
    id           VARBINARY(255)  NOT NULL PRIMARY KEY,
    client_id    VARBINARY(1020) NOT NULL,
    operation_id VARBINARY(64)   NOT NULL,
    account_id   VARBINARY(255)  NOT NULL,
    amount       BIGINT          NOT NULL,
    currency     VARBINARY(16)   NOT NULL,
    created_at   BIGINT          NOT NULL,
    -- the merchant's own reference for the charge (an order id), or ''
    reference    VARBINARY(255)  NOT NULL DEFAULT '',
    CONSTRAINT bank_charges_operation_id_key UNIQUE (operation_id),
    INDEX bank_charges_account (client_id, account_id),
    INDEX bank_charges_reference (reference)
) ENGINE = InnoDB;

-- Orders are created once per natural key, per client.
CREATE TABLE IF NOT EXISTS shop_orders (
    id               VARBINARY(255)  NOT NULL PRIMARY KEY,
    client_id        VARBINARY(1020) NOT NULL,
    customer_id      VARBINARY(255)  NOT NULL,
    client_reference VARBINARY(255)  NOT NULL,
    items            LONGBLOB        NOT NULL,
    status           VARBINARY(32)   NOT NULL,
    created_at       BIGINT          NOT NULL,
    CONSTRAINT shop_orders_natural_key UNIQUE (client_id, customer_id, client_reference)
) ENGINE = InnoDB;

-- A checkout binds an order to the one operation (Idempotency-Key) that
-- pays it: another key for the same order is refused, never charged.
CREATE TABLE IF NOT EXISTS shop_checkouts (
    order_id        VARBINARY(255)  NOT NULL PRIMARY KEY,
    client_id       VARBINARY(1020) NOT NULL,
    operation_id    VARBINARY(64)   NOT NULL,
    -- the key is kept too: the same key back with a new operation id (its
    -- record expired, or Redis lost it) resumes under the bound one
    idempotency_key VARBINARY(255)  NOT NULL,
    created_at      BIGINT          NOT NULL,
    -- what it pays with (account, amount, currency): the same key back
    -- with other ones is another checkout ('' in rows made before it)
    intent          VARBINARY(255)  NOT NULL DEFAULT ''
) ENGINE = InnoDB;

-- With the records in Redis alone (`--idem-store redis`), a payment's
-- Idempotency-Key is bound here to the operation that charges for it,
-- before the bank is called: the key back with a new operation id (Redis
-- lost its record) resumes under the bound one, which the bank knows, and
-- is never charged again. Kept for the records' retention.
CREATE TABLE IF NOT EXISTS shop_payment_keys (
    client_id       VARBINARY(1020) NOT NULL,
    idempotency_key VARBINARY(255)  NOT NULL,
    operation_id    VARBINARY(64)   NOT NULL,
    -- what it pays with, and by which route
    intent          VARBINARY(255)  NOT NULL,
    bound_at        BIGINT          NOT NULL,
    PRIMARY KEY (client_id, idempotency_key),
    INDEX shop_payment_keys_bound_at (bound_at)
) ENGINE = InnoDB;

-- Products are written with optimistic concurrency (ETag / If-Match).
CREATE TABLE IF NOT EXISTS shop_products (
    sku     VARBINARY(255)  NOT NULL PRIMARY KEY,
    name    VARBINARY(1020) NOT NULL,
    price   BIGINT          NOT NULL,
    version BIGINT          NOT NULL
) ENGINE = InnoDB;

-- The bank's webhook events, processed once per event id.
CREATE TABLE IF NOT EXISTS shop_bank_events (
    event_id    VARBINARY(255) NOT NULL PRIMARY KEY,
    type        VARBINARY(255) NOT NULL,
    payment_id  VARBINARY(255) NOT NULL,
    received_at BIGINT         NOT NULL,
    INDEX shop_bank_events_payment (payment_id)
) ENGINE = InnoDB;

-- What the reserve-stock consumer reserved, per SKU.
CREATE TABLE IF NOT EXISTS shop_stock (
    sku      VARBINARY(255) NOT NULL PRIMARY KEY,
    reserved BIGINT         NOT NULL
) ENGINE = InnoDB;

-- What the send-email consumer sent: one confirmation per payment.
CREATE TABLE IF NOT EXISTS shop_emails (
    id         VARBINARY(255) NOT NULL PRIMARY KEY,
    payment_id VARBINARY(255) NOT NULL,
    account_id VARBINARY(255) NOT NULL,
    subject    BLOB           NOT NULL,
    created_at BIGINT         NOT NULL,
    INDEX shop_emails_account (account_id),
    -- A client's emails are read from its payments (see `queries::EMAILS`).
    INDEX shop_emails_payment (payment_id)
) ENGINE = InnoDB;
