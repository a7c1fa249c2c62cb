-- The statements `POST /bare/payments` runs (bench/run.sh's ceiling for
-- bare and new keys): the bank's charge and its read-back, then the payment
-- and its outbox event in one transaction.
\set n random(1, 1000000000000)
INSERT INTO bank_charges (id, operation_id, account_id, amount, currency, created_at, client_id)
  VALUES ('ch-' || :client_id || '-' || :n, 'op-' || :client_id || '-' || :n, 'acc_bench', 100, 'EUR', 0, 'bench')
  ON CONFLICT (operation_id) DO NOTHING;
SELECT id FROM bank_charges WHERE operation_id = 'op-' || :client_id || '-' || :n;
BEGIN;
INSERT INTO shop_payments (id, client_id, account_id, amount, currency, status, bank_charge_id, operation_id, created_at)
  VALUES ('pay-' || :client_id || '-' || :n, 'bench', 'acc_bench', 100, 'EUR', 'authorized', 'ch-' || :client_id || '-' || :n, 'op-' || :client_id || '-' || :n, 0)
  ON CONFLICT (operation_id) DO NOTHING
  RETURNING id, account_id, amount, currency, status, bank_charge_id;
INSERT INTO idem_outbox (message_id, destination, ordering_key, payload, headers, created_at)
  VALUES ('msg-' || :client_id || '-' || :n, 'payments.authorized', NULL, '\x7b7d'::bytea, '\x'::bytea, now());
COMMIT;
