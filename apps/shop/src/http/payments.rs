//! Payments: `POST /payments` (guarded by the idempotency layer), reading,
//! capturing, and what payments did to an account (`/accounts`, `/emails`).

use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use idem_axum::{DeferredClaim, Idempotency, IdempotencyLayer, Problem};
use idem_core::{OperationId, UnixMillis};
use idem_sql::{Created, Transition};
use serde::{Deserialize, Serialize};
use tracing::warn;
use utoipa::{IntoParams, ToSchema};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::router::UtoipaMethodRouterExt;
use utoipa_axum::routes;

use super::auth::Client;
use super::error::{Error, KeyRefusal, Result};
use super::{input, AppState, ProblemDoc};
use crate::bank::{BankError, ChargeRequest};
use crate::db::dialect::{PAYMENT_KEY, PAYMENT_KEY_BINDING};
use crate::db::{self, Account, Email, Payment, ShopTx, PAYMENT_COLUMNS};

/// The payment routes. `POST /payments` needs an `Idempotency-Key`
/// (`layer`); with `claim_in_transaction` its handler claims the key in the
/// transaction that records the payment.
pub(super) fn router(state: &AppState, layer: IdempotencyLayer) -> OpenApiRouter<AppState> {
    // Credentials first (401), then anything but JSON is 415, before the
    // idempotency layer fingerprints the body. Layers go on the method
    // router, so that another method still gets 405.
    let json = || axum::middleware::from_fn(super::auth::require_client_json);
    // What makes the request unrunnable is refused before the claim, and
    // not stored: the corrected request may come again under the same key.
    let allowed = state.fault_injection;
    let layer = layer.validate(move |parts, body| {
        Simulate::parse(&parts.headers, allowed, SimulateOn::Payment)
            .and_then(|_| NewPayment::parse(body))
            .map(drop)
            .map_err(IntoResponse::into_response)
    });
    let create = if state.claim_in_transaction {
        routes!(create_payment_in_tx).map(|r| r.route_layer(layer.claim_in_transaction()))
    } else {
        routes!(create_payment).map(|r| r.route_layer(layer))
    };
    OpenApiRouter::new()
        .routes(create.map(|r| r.route_layer(json())))
        .routes(routes!(create_payment_bare).map(|r| r.route_layer(json())))
        .routes(routes!(get_payment))
        .routes(routes!(capture_payment))
        .routes(routes!(get_account))
        .routes(routes!(get_emails))
}

/// A payment to make.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct NewPayment {
    /// The account to charge.
    #[schema(pattern = "^[A-Za-z0-9_.:-]{1,64}$", example = "acc_1")]
    pub(crate) account_id: String,
    /// In minor units (cents).
    #[schema(minimum = 1, maximum = 1_000_000_000, example = 1000)]
    pub(crate) amount: i64,
    /// Three letters.
    #[schema(pattern = "^[A-Za-z]{3}$", example = "EUR")]
    pub(crate) currency: String,
}

impl NewPayment {
    pub(super) fn parse(body: &[u8]) -> Result<Self> {
        let new: Self = input::json(body)?;
        new.check()?;
        Ok(new)
    }

    /// The bounds every payment keeps, over HTTP and gRPC.
    pub(crate) fn check(&self) -> Result<()> {
        input::identifier("account_id", &self.account_id)?;
        input::amount(self.amount)?;
        input::currency(&self.currency)
    }
}

/// The longest bank delay `X-Simulate` may ask for.
const MAX_SIMULATED_DELAY: Duration = Duration::from_secs(60);

/// Demo-only fault injection from the `X-Simulate` header, as far as
/// `--fault-injection` allows it.
#[derive(Debug, Default)]
pub(crate) struct Simulate {
    pub(crate) bank_delay: Option<Duration>,
    pub(crate) bank_error: bool,
    pub(crate) crash_before_bank: bool,
    pub(crate) crash_after_bank: bool,
    /// Checkout only: after the charge step's output is stored, before the
    /// order is marked paid.
    pub(super) crash_after_charge: bool,
}

/// Which route `X-Simulate` is read for: a checkout also takes
/// `crash-after-charge`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SimulateOn {
    Payment,
    Checkout,
}

impl Simulate {
    pub(crate) fn parse(
        headers: &HeaderMap,
        allowed: crate::config::FaultInjection,
        route: SimulateOn,
    ) -> Result<Self> {
        use crate::config::FaultInjection;
        let mut sim = Simulate::default();
        for value in headers.get_all("x-simulate") {
            if allowed == FaultInjection::Off {
                return Err(Error::validation(
                    "X-Simulate is refused: this shop runs with --fault-injection off",
                ));
            }
            let value = value
                .to_str()
                .map_err(|_| Error::validation("X-Simulate must be ASCII"))?;
            for directive in value.split(',').map(str::trim).filter(|d| !d.is_empty()) {
                match directive {
                    "bank-error" => sim.bank_error = true,
                    "crash-before-bank" => sim.crash_before_bank = true,
                    "crash-after-bank" => sim.crash_after_bank = true,
                    "crash-after-charge" if route == SimulateOn::Checkout => {
                        sim.crash_after_charge = true
                    }
                    d => match d.strip_prefix("bank-delay=").map(str::parse::<u64>) {
                        Some(Ok(ms)) if Duration::from_millis(ms) <= MAX_SIMULATED_DELAY => {
                            sim.bank_delay = Some(Duration::from_millis(ms))
                        }
                        _ => {
                            let checkout = match route {
                                SimulateOn::Checkout => ", crash-after-charge",
                                SimulateOn::Payment => "",
                            };
                            return Err(Error::validation(format!(
                                "unknown X-Simulate directive {d:?}; expected bank-delay=MS (at most 60000), bank-error, crash-before-bank, crash-after-bank{checkout}"
                            )));
                        }
                    },
                }
            }
        }
        if (sim.crash_before_bank || sim.crash_after_bank || sim.crash_after_charge)
            && allowed != FaultInjection::All
        {
            return Err(Error::validation(
                "X-Simulate crashes are refused: this shop runs with --fault-injection safe",
            ));
        }
        Ok(sim)
    }
}

/// Aborts the process at once, as a killed pod would: no unwinding, no
/// response, no cleanup.
pub(super) fn crash(at: &str) -> ! {
    eprintln!("shop: simulated crash {at}");
    std::process::abort()
}

/// `POST /payments` as the OpenAPI document describes it, for either of
/// its handlers (the claim mode picks one; the contract is the same).
macro_rules! create_payment_doc {
    ($handler:item) => {
        #[utoipa::path(
            post,
            path = "/payments",
            tag = "payments",
            operation_id = "create_payment",
            security(("bearer" = [])),
            params(
                ("Idempotency-Key" = String, Header, description = "One key per intended payment, 1 to 255 visible ASCII characters; retries send the same key.", pattern = "^[!-~]{1,255}$"),
                ("X-Simulate" = Option<String>, Header, description = "Demo fault injection (see --fault-injection): bank-delay=MS (at most 60000), bank-error, crash-before-bank, crash-after-bank; comma-separated.", pattern = "^(bank-error|bank-delay=[0-9]{1,3})$"),
            ),
            request_body(content = NewPayment, content_type = "application/json"),
            responses(
                (status = 201, description = "Charged; a replay answers the same with `Idempotent-Replayed: true`", body = Payment,
                    headers(("Location" = String, description = "The payment"))),
                (status = 409, description = "The same key is in flight (`Retry-After`), or another attempt holds it", body = ProblemDoc, content_type = "application/problem+json"),
                (status = 415, description = "The body is not JSON", body = ProblemDoc, content_type = "application/problem+json"),
                (status = 422, description = "The key was used for another request", body = ProblemDoc, content_type = "application/problem+json"),
                (status = 502, description = "The bank could not be reached (or X-Simulate: bank-error); retry with the same key", body = ProblemDoc, content_type = "application/problem+json"),
            )
        )]
        $handler
    };
}

create_payment_doc! {
/// Charges an account, once per `Idempotency-Key`.
///
/// The bank is charged under the claim's operation id; the payment and the
/// idempotency record commit in one transaction. A retry with the same key
/// and body replays the first answer (`Idempotent-Replayed: true`); while
/// the first runs it is `409`; with another body `422`.
async fn create_payment(
    State(state): State<AppState>,
    idem: Idempotency,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response> {
    let simulate = Simulate::parse(&headers, state.fault_injection, SimulateOn::Payment)?;
    let new = NewPayment::parse(&body)?;
    let operation_id = bound_operation(&state, &idem, Route::Http, &new).await?;
    let payment = charge_new(&state, idem.scope(), operation_id, &simulate, new).await?;
    record_payment(
        &state,
        Some(&idem),
        idem.scope(),
        operation_id,
        &payment,
        None,
    )
    .await
}
}

/// The route a payment came by: a key bound over one is another request
/// over the other, as the layer's fingerprint (which covers the path) has
/// it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Route {
    /// `POST /payments`.
    Http,
    /// `shop.v1.Payments/CreatePayment`.
    Grpc,
}

/// The operation a payment charges under: the claim's, unless the records
/// live outside the database (`--idem-store redis`) and this key is bound
/// to another one already.
///
/// There, a record Redis lost (a failover without `WAIT`, an emptied
/// shard) would let the key run again under a new operation id, which the
/// bank has never seen: a second charge. So before the bank is called the
/// key is bound to the operation in the database (committed, as
/// checkout's binding is), and the same key back with a new operation id
/// resumes under the bound one: the bank answers with the charge it made,
/// and the payment recorded under it is the answer. The same key with
/// another payment (or by the other route) within the retention is `422`,
/// as its record would have answered; past the retention the key is new
/// again, and bound afresh.
pub(crate) async fn bound_operation(
    state: &AppState,
    idem: &impl KeyOf,
    route: Route,
    new: &NewPayment,
) -> Result<OperationId> {
    let operation_id = idem.operation();
    if state.transactional {
        // The records are in this database: a record is never lost, and
        // its claim binds the key already.
        return Ok(operation_id);
    }
    let (client, key) = (idem.client(), idem.idempotency_key());
    let via = match route {
        Route::Http => "POST /payments",
        Route::Grpc => "shop.v1.Payments/CreatePayment",
    };
    let intent = format!(
        "{via}\n{}",
        super::checkout::intent_of(&new.account_id, new.amount, &new.currency)
    );
    let op = operation_id.to_string();
    let now = UnixMillis::now().0;
    // A binding is taken for past its retention a lease before the record
    // is: it was made after the claim (within its lease), so it never
    // outlives the record it stands for (which a reuse of the key just past
    // the retention would meet as an old payment).
    let kept = state.retention.saturating_sub(state.lease);
    let kept = i64::try_from(kept.as_millis()).unwrap_or(i64::MAX);
    let binding = KeyBinding {
        client,
        key,
        operation: &op,
        intent: &intent,
        now,
        kept,
    };
    // Twice: a binding past its retention that the sweep deleted between
    // the read and the update is bound afresh on the second turn.
    let mut outcome = binding.bind(state).await?;
    if matches!(outcome, Binding::Moved) {
        outcome = binding.bind(state).await?;
    }
    let binding = outcome;
    match binding {
        Binding::This => Ok(operation_id),
        Binding::Earlier {
            operation_id: bound,
            intent: earlier,
        } if earlier == intent => {
            let bound = uuid::Uuid::parse_str(&bound)
                .map(OperationId)
                .map_err(|e| Error::Binding(sqlx::Error::Decode(Box::new(e))))?;
            warn!(key, operation_id = %bound, "a payment key back with a new operation id (its record was lost): resuming under the bound one");
            metrics::counter!("shop_payment_keys_resumed_total").increment(1);
            Ok(bound)
        }
        // Refusals that say nothing ran: neither stored nor replayed (the
        // layer's own `422` and `409` are not), the claim let go.
        Binding::Earlier { .. } => {
            // This claim (Redis lost the key's record, and this request
            // came first) would keep this request's fingerprint on the key
            // and refuse the key's own request until the retention ends:
            // withdrawn, as if never made. (Best effort: failing, the
            // release below keeps it, refused, for the retention.)
            if let Some(redis) = &state.redis_alone {
                let claim = idem_core::Claim {
                    scope: client.to_owned(),
                    key: key.to_owned(),
                    token: idem.token(),
                    operation_id,
                    locked_until: UnixMillis(0),
                    takeover: false,
                };
                if let Err(e) = redis.withdraw(&claim).await {
                    warn!(error = %e, "could not withdraw the claim of a request its key is not bound to");
                }
            }
            idem.release();
            Err(Error::Refused(KeyRefusal::Reused))
        }
        Binding::Moved => {
            idem.release();
            Err(Error::Refused(KeyRefusal::InUse))
        }
    }
}

/// A payment key to bind to an operation, in the database.
struct KeyBinding<'a> {
    client: &'a str,
    key: &'a str,
    operation: &'a str,
    intent: &'a str,
    /// The shop's clock (ms).
    now: i64,
    /// How long a binding counts (ms): the records' retention, less a lease.
    kept: i64,
}

impl KeyBinding<'_> {
    /// One transaction: the key bound to this operation, or what it was
    /// bound to before.
    async fn bind(&self, state: &AppState) -> Result<Binding> {
        let mut tx = state.db.begin().await.map_err(Error::Binding)?;
        match self.bind_in(state, &mut *tx).await {
            Ok(binding) => {
                tx.commit().await.map_err(Error::Binding)?;
                Ok(binding)
            }
            Err(e) => {
                rollback(tx).await;
                Err(Error::Binding(e))
            }
        }
    }

    async fn bind_in(&self, state: &AppState, tx: &mut dyn ShopTx) -> Result<Binding, sqlx::Error> {
        let (client, key, op, intent, now) =
            (self.client, self.key, self.operation, self.intent, self.now);
        let created = db::create_once(
            &mut *tx,
            (state.db.sql().insert_payment_key, PAYMENT_KEY_BINDING),
            &[
                client.into(),
                key.into(),
                op.into(),
                intent.into(),
                now.into(),
            ],
            "SELECT operation_id, intent, bound_at FROM shop_payment_keys
             WHERE client_id = $1 AND idempotency_key = $2",
            &[client.into(), key.into()],
        )
        .await?;
        let row = match created {
            Created::Created(_) => return Ok(Binding::This),
            Created::Existing(row) => row,
        };
        let bound = row.text("operation_id")?;
        // This operation's own (a retry that took its lease over, which
        // keeps its record for another retention): kept as long too.
        // Another past its retention: the key is new again.
        let fresh = bound == op;
        if fresh || row.int("bound_at")?.saturating_add(self.kept) <= now {
            let moved = tx
                .execute(
                    "UPDATE shop_payment_keys SET operation_id = $3, intent = $4, bound_at = $5
                     WHERE client_id = $1 AND idempotency_key = $2 AND operation_id = $6",
                    &[
                        client.into(),
                        key.into(),
                        op.into(),
                        intent.into(),
                        now.into(),
                        (&bound).into(),
                    ],
                )
                .await?;
            return Ok(if fresh || moved == 1 {
                Binding::This
            } else {
                Binding::Moved
            });
        }
        Ok(Binding::Earlier {
            operation_id: bound,
            intent: row.text("intent")?,
        })
    }
}

/// What a payment key was bound to.
enum Binding {
    /// This attempt's operation.
    This,
    /// Another operation, within the retention.
    Earlier {
        operation_id: String,
        intent: String,
    },
    /// Another attempt bound it afresh meanwhile (past the retention).
    Moved,
}

/// The claim a payment runs under, over HTTP or gRPC.
pub(crate) trait KeyOf {
    /// The claim's operation id.
    fn operation(&self) -> OperationId;
    /// The client (the records' scope).
    fn client(&self) -> &str;
    /// The `Idempotency-Key`.
    fn idempotency_key(&self) -> &str;
    /// Lets the claim go whatever the answer: it is not the request's
    /// outcome, and is not stored.
    fn release(&self);
    /// The claim's fencing token.
    fn token(&self) -> idem_core::FencingToken;
}

impl KeyOf for Idempotency {
    fn operation(&self) -> OperationId {
        self.operation_id()
    }
    fn client(&self) -> &str {
        self.scope()
    }
    fn idempotency_key(&self) -> &str {
        self.key()
    }
    fn release(&self) {
        self.release_claim();
    }
    fn token(&self) -> idem_core::FencingToken {
        Idempotency::token(self)
    }
}

create_payment_doc! {
/// `POST /payments` with `--claim-in-transaction`: the claim commits
/// first (binding the key to this request and its operation id before the
/// bank is called), then the transaction that records the payment holds it:
/// duplicates get 409 while it is open, and a crash or rollback frees it at
/// once for a retry of the same request.
async fn create_payment_in_tx(
    State(state): State<AppState>,
    deferred: DeferredClaim,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response> {
    // The bulkhead: each payment here holds a connection for the whole bank
    // call. Past the limit, wait for a turn holding no connection, then
    // answer rather than drain the pool every other request (and the
    // claims) need. A repeat of a finished payment (a replay, or 422 for
    // another body) needs no turn: while every turn is taken, the key's
    // record answers it, without waiting behind the slow ones. The read
    // and the wait together take at most --claim-tx-wait-ms.
    let slot = match state.claim_tx_slots.clone().try_acquire_owned() {
        Ok(slot) => Some(slot),
        Err(_) => {
            let until = tokio::time::Instant::now() + state.claim_tx_wait;
            let record = deferred.answered_by_record(&*state.records);
            if let Ok(Some(answered)) = tokio::time::timeout_at(until, record).await {
                return Ok(answered.into_response());
            }
            let turn = state.claim_tx_slots.clone().acquire_owned();
            tokio::time::timeout_at(until, turn).await.ok().and_then(Result::ok)
        }
    };
    let Some(_slot) = slot else {
        return Err(Problem::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "busy",
            "Too many payments in progress",
        )
        .detail("nothing was claimed or charged; retry with the same Idempotency-Key")
        .retry_after(1)
        .into());
    };
    // A replay, 409, 422 or 503; no transaction was begun. (`Config::check`
    // refuses the flag on databases other than PostgreSQL.)
    let (mut tx, idem) = state
        .db
        .begin_claimed(&deferred)
        .await
        .map_err(Error::Answered)?;
    let operation_id = idem.operation_id();
    match charge(&state, idem.scope(), operation_id, &headers, &body).await {
        Ok(payment) => {
            record_payment(
                &state,
                Some(&idem),
                idem.scope(),
                operation_id,
                &payment,
                Some(tx),
            )
            .await
        }
        Err(refused) => {
            let response = refused.into_response();
            if !response.status().is_client_error() {
                // Anything else rolls back: the claim is free for the retry.
                rollback(tx).await;
                return Ok(response);
            }
            // A client error is an answer: it commits with the claim, for replay.
            match tx.complete_in(&idem, response).await {
                Ok(response) => {
                    tx.commit().await.map_err(Error::Recording)?;
                    Ok(response)
                }
                Err(e) => {
                    rollback(tx).await;
                    Err(Error::Answered(e.into_response()))
                }
            }
        }
    }
}
}

/// Ends a transaction that must not commit, now, before the answer leaves:
/// a transaction left to its drop ends later, holding its locks (and, with
/// `--claim-in-transaction`, the claim) until it does.
async fn rollback(tx: Box<dyn ShopTx>) {
    if let Err(e) = tx.rollback().await {
        // The connection broke: the server ended the transaction with it.
        warn!(error = %e, "rollback failed");
    }
}

/// The same work as `POST /payments` with no idempotency at all: the
/// baseline the benchmarks compare against. A retry here charges again, so
/// a shop started to be exposed (`--fault-injection off`) does not serve
/// it: `404`.
#[utoipa::path(
    post,
    path = "/bare/payments",
    tag = "payments",
    security(("bearer" = [])),
    params(
        ("X-Simulate" = Option<String>, Header, description = "Demo fault injection, as on POST /payments.", pattern = "^(bank-error|bank-delay=[0-9]{1,3})$"),
    ),
    request_body(content = NewPayment, content_type = "application/json"),
    responses(
        (status = 201, description = "Charged", body = Payment,
            headers(("Location" = String, description = "The payment"))),
        (status = 404, description = "Not served with `--fault-injection off`", body = ProblemDoc, content_type = "application/problem+json"),
        (status = 415, description = "The body is not JSON", body = ProblemDoc, content_type = "application/problem+json"),
        (status = 502, description = "The bank could not be reached (or X-Simulate: bank-error)", body = ProblemDoc, content_type = "application/problem+json"),
    )
)]
async fn create_payment_bare(
    State(state): State<AppState>,
    Client(client_id): Client,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response> {
    if state.fault_injection == crate::config::FaultInjection::Off {
        return Err(Error::NotFound {
            what: "route",
            id: "/bare/payments".to_owned(),
        });
    }
    let operation_id = OperationId::generate();
    let payment = charge(&state, &client_id, operation_id, &headers, &body).await?;
    record_payment(&state, None, &client_id, operation_id, &payment, None).await
}

/// Validates the request and charges the bank under `operation_id`. `Err`
/// is the answer to send, with nothing of ours written.
async fn charge(
    state: &AppState,
    client_id: &str,
    operation_id: OperationId,
    headers: &HeaderMap,
    body: &[u8],
) -> Result<Payment> {
    let simulate = Simulate::parse(headers, state.fault_injection, SimulateOn::Payment)?;
    let new = NewPayment::parse(body)?;
    charge_new(state, client_id, operation_id, &simulate, new).await
}

/// Charges the bank under `operation_id` for a payment already parsed and
/// checked (over HTTP or gRPC). `Err` is the answer to send, with nothing
/// of ours written.
pub(crate) async fn charge_new(
    state: &AppState,
    client_id: &str,
    operation_id: OperationId,
    simulate: &Simulate,
    new: NewPayment,
) -> Result<Payment> {
    if simulate.crash_before_bank {
        crash("before the bank call");
    }
    if simulate.bank_error {
        return Err(BankError::Simulated.into());
    }
    let charge = ChargeRequest {
        client_id,
        operation_id,
        account_id: &new.account_id,
        amount: new.amount,
        currency: &new.currency,
        reference: "",
    };
    let bank_charge_id = state.bank.charge(&charge).await?;
    // The bank charged; its answer is slow to come back.
    if let Some(d) = simulate.bank_delay {
        tokio::time::sleep(d).await;
    }
    if simulate.crash_after_bank {
        crash("after the bank call");
    }
    Ok(Payment {
        id: format!("pay_{}", uuid::Uuid::now_v7().simple()),
        account_id: new.account_id,
        amount: new.amount,
        currency: new.currency,
        status: "authorized".to_owned(),
        bank_charge_id,
    })
}

/// Writes the payment and completes the idempotency record in one
/// transaction — `open`, if the handler claimed in it, or a new one: both
/// commit, or neither.
///
/// The payment is created once per operation id: if another attempt of the
/// same operation recorded it already (an attempt that outlived its lease,
/// with records outside this database), this one answers with that payment,
/// the effect that exists, instead of an error.
async fn record_payment(
    state: &AppState,
    idem: Option<&Idempotency>,
    client_id: &str,
    operation_id: OperationId,
    payment: &Payment,
    open: Option<Box<dyn ShopTx>>,
) -> Result<Response> {
    let mut tx = match open {
        Some(tx) => tx,
        None => state.db.begin().await.map_err(Error::Recording)?,
    };
    let staged = async {
        let recorded = write_payment(state, &mut *tx, client_id, operation_id, payment).await?;
        let response = payment_created(&recorded);
        // Fenced by the claim's token: if a retry took this request
        // over, this fails and the transaction rolls back.
        // With a store outside this database (Redis alone), the layer
        // completes the record after the handler returns instead.
        match idem {
            Some(idem) if state.transactional => tx
                .complete_in(idem, response)
                .await
                .map_err(|e| Error::Answered(e.into_response())),
            _ => Ok(response),
        }
    }
    .await;
    match staged {
        Ok(response) => {
            tx.commit().await.map_err(Error::Recording)?;
            state.messaging.wake();
            Ok(response)
        }
        Err(refused) => {
            rollback(tx).await;
            Err(refused)
        }
    }
}

/// Writes the payment in a transaction of its own (for a caller whose
/// record the idempotency layer completes, as over gRPC): the payment as
/// recorded, once per operation id.
pub(crate) async fn record_payment_alone(
    state: &AppState,
    client_id: &str,
    operation_id: OperationId,
    payment: &Payment,
) -> Result<Payment> {
    let mut tx = state.db.begin().await.map_err(Error::Recording)?;
    match write_payment(state, &mut *tx, client_id, operation_id, payment).await {
        Ok(recorded) => {
            tx.commit().await.map_err(Error::Recording)?;
            state.messaging.wake();
            Ok(recorded)
        }
        Err(refused) => {
            rollback(tx).await;
            Err(refused)
        }
    }
}

/// Writes the payment, with its event, in `tx`, once per operation id;
/// the payment as recorded.
async fn write_payment(
    state: &AppState,
    tx: &mut dyn ShopTx,
    client_id: &str,
    operation_id: OperationId,
    payment: &Payment,
) -> Result<Payment> {
    let operation_id = operation_id.to_string();
    let now = UnixMillis::now().0;
    let fetch = format!("SELECT {PAYMENT_COLUMNS} FROM shop_payments WHERE operation_id = $1");
    let created = db::create_once(
        &mut *tx,
        (state.db.sql().insert_payment, PAYMENT_KEY),
        &[
            (&payment.id).into(),
            client_id.into(),
            (&payment.account_id).into(),
            payment.amount.into(),
            (&payment.currency).into(),
            (&payment.status).into(),
            (&payment.bank_charge_id).into(),
            (&operation_id).into(),
            now.into(),
        ],
        &fetch,
        &[(&operation_id).into()],
    )
    .await
    .map_err(Error::Recording)?;
    let recorded = match created {
        Created::Created(row) => {
            // The event commits with the payment.
            let event = crate::messaging::payment_authorized(&state.messaging, payment);
            tx.enqueue(&event).await.map_err(Error::Recording)?;
            row
        }
        // The safety net caught a second attempt of this operation:
        // converge on the payment that exists (its event went with it).
        Created::Existing(row) => {
            warn!(operation_id = %operation_id, "payment recorded by another attempt of this operation; answering with it");
            row
        }
    };
    Payment::try_from(&recorded).map_err(Error::Recording)
}

/// `201 Created` with the payment and its `Location`.
fn payment_created(payment: &Payment) -> Response {
    (
        StatusCode::CREATED,
        [(header::LOCATION, format!("/payments/{}", payment.id))],
        Json(payment),
    )
        .into_response()
}

/// The calling client's payment; another client's is `404`, as if it did
/// not exist.
#[utoipa::path(
    get,
    path = "/payments/{id}",
    tag = "payments",
    security(("bearer" = [])),
    params(("id" = String, Path, description = "The payment id", pattern = "^[A-Za-z0-9_.:-]{1,64}$")),
    responses(
        (status = 200, description = "The payment", body = Payment),
        (status = 404, description = "No such payment for this client", body = ProblemDoc, content_type = "application/problem+json"),
    )
)]
async fn get_payment(
    State(state): State<AppState>,
    Client(client): Client,
    Path(id): Path<String>,
) -> Result<Json<Payment>> {
    input::identifier("the payment id", &id)?;
    match db::payment(&*state.db, &client, &id).await? {
        Some(p) => Ok(Json(p)),
        None => Err(no_such_payment(id)),
    }
}

/// `404` for a payment id.
pub(super) fn no_such_payment(id: String) -> Error {
    Error::NotFound {
        what: "payment",
        id,
    }
}

/// Authorized → captured, once. A repeat answers `200` with the captured
/// payment; another state is `409`.
#[utoipa::path(
    post,
    path = "/payments/{id}/capture",
    tag = "payments",
    security(("bearer" = [])),
    params(("id" = String, Path, description = "The payment id", pattern = "^[A-Za-z0-9_.:-]{1,64}$")),
    responses(
        (status = 200, description = "The captured payment (also on a repeat)", body = Payment),
        (status = 404, description = "No such payment for this client", body = ProblemDoc, content_type = "application/problem+json"),
        (status = 409, description = "The payment is in a state that cannot be captured", body = ProblemDoc, content_type = "application/problem+json"),
    )
)]
async fn capture_payment(
    State(state): State<AppState>,
    Client(client): Client,
    Path(id): Path<String>,
) -> Result<Json<Payment>> {
    input::identifier("the payment id", &id)?;
    // Another client's payment is not found: it is neither moved nor shown.
    let update = "UPDATE shop_payments SET status = 'captured'
                  WHERE id = $1 AND client_id = $2 AND status = 'authorized'";
    let fetch =
        format!("SELECT {PAYMENT_COLUMNS} FROM shop_payments WHERE id = $1 AND client_id = $2");
    let mut conn = state.db.write_conn().await?;
    let moved = db::transition(
        &mut *conn,
        "captured",
        update,
        &fetch,
        &[(&id).into(), (&client).into()],
    )
    .await?;
    let moved: Transition<Payment> = match moved {
        Transition::Applied(r) => Transition::Applied(Payment::try_from(&r)?),
        Transition::AlreadyDone(r) => Transition::AlreadyDone(Payment::try_from(&r)?),
        Transition::NotFound => Transition::NotFound,
        Transition::Conflict { current, row } => Transition::Conflict {
            current,
            row: Payment::try_from(&row)?,
        },
    };
    match moved {
        Transition::Applied(p) | Transition::AlreadyDone(p) => Ok(Json(p)),
        Transition::NotFound => Err(no_such_payment(id)),
        Transition::Conflict { current, .. } => Err(Problem::new(
            StatusCode::CONFLICT,
            "payment-state-conflict",
            "The payment cannot be captured in its current state",
        )
        .detail(format!(
            "payment {id} is {current}; only an authorized payment can be captured"
        ))
        .into()),
    }
}

/// What the calling client's payments charged the account (another
/// client's payments are not counted).
#[utoipa::path(
    get,
    path = "/accounts/{account_id}",
    tag = "payments",
    security(("bearer" = [])),
    params(("account_id" = String, Path, description = "The account", pattern = "^[A-Za-z0-9_.:-]{1,64}$")),
    responses((status = 200, description = "The account's charges", body = Account))
)]
async fn get_account(
    State(state): State<AppState>,
    Client(client): Client,
    Path(account_id): Path<String>,
) -> Result<Json<Account>> {
    input::identifier("account_id", &account_id)?;
    Ok(Json(db::account(&*state.db, &client, &account_id).await?))
}

/// The query of `GET /emails`.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
struct EmailsQuery {
    /// The account whose confirmations to list.
    #[param(pattern = "^[A-Za-z0-9_.:-]{1,64}$")]
    account_id: String,
}

/// The confirmation emails sent for an account.
#[derive(Debug, Serialize, ToSchema)]
struct Emails {
    /// One per payment, oldest first: the newest 1,000.
    emails: Vec<Email>,
}

/// The confirmation emails the send-email consumer sent for the calling
/// client's payments on an account, one per payment.
#[utoipa::path(
    get,
    path = "/emails",
    tag = "payments",
    security(("bearer" = [])),
    params(EmailsQuery),
    responses((status = 200, description = "The emails", body = Emails))
)]
async fn get_emails(
    State(state): State<AppState>,
    Client(client): Client,
    Query(query): Query<EmailsQuery>,
) -> Result<Json<Emails>> {
    let account_id = query.account_id;
    input::identifier("account_id", &account_id)?;
    let emails = db::emails(&*state.db, &client, &account_id).await?;
    Ok(Json(Emails { emails }))
}
