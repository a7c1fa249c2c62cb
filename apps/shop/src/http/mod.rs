//! The HTTP API: one module per resource, each owning its routes and its
//! part of the OpenAPI document (`GET /openapi.json`).
//!
//! - [`payments`]: `POST /payments` (guarded by idem's layer), reading and
//!   capturing payments, `/accounts/{id}`, `/emails`;
//! - [`orders`]: `POST /orders`, deduplicated by its natural key;
//! - [`checkout`]: `POST /orders/{id}/checkout`, in two named steps
//!   (idem-once), each done once whatever crashes between them;
//! - [`catalog`]: products with `ETag`/`If-Match`, and stock;
//! - [`webhooks`]: the bank's events, once per event id;
//! - [`auth`]: who is calling; [`input`]: what a request may hold;
//!   [`error`]: the one error type every handler returns.

pub(crate) mod auth;
pub(crate) mod catalog;
pub(crate) mod checkout;
pub(crate) mod error;
pub(crate) mod input;
pub(crate) mod orders;
pub(crate) mod payments;
pub(crate) mod webhooks;

use std::sync::Arc;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Router;
use idem_axum::{IdempotencyLayer, Problem};
use idem_core::{Policy, Store};
use serde::Serialize;
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::openapi::{ContentBuilder, OpenApi, RefOr, ResponseBuilder};
use utoipa::ToSchema;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::bank::Bank;
use crate::config::FaultInjection;
use crate::db::Database;
use error::Result;

/// Shared state of the handlers, behind one `Arc`: axum clones the state
/// for every request (the route's service, then the `State` extractor),
/// and one reference count to bump and drop is cheaper than one per field,
/// on counters every request on every core touches.
#[derive(Debug, Clone)]
pub(crate) struct AppState(Arc<Shared>);

impl AppState {
    pub(crate) fn new(shared: Shared) -> Self {
        Self(Arc::new(shared))
    }
}

impl std::ops::Deref for AppState {
    type Target = Shared;

    fn deref(&self) -> &Shared {
        &self.0
    }
}

/// What [`AppState`] holds.
#[derive(Debug)]
pub(crate) struct Shared {
    pub(crate) db: Database,
    /// The fake bank, with connections of its own.
    pub(crate) bank: Bank,
    pub(crate) messaging: Arc<crate::messaging::Messaging>,
    /// Whether idempotency records live in `db`, so that handlers complete
    /// them in their own transaction (not so with Redis alone).
    pub(crate) transactional: bool,
    /// idem's records (the layer's store), where checkout steps are kept.
    pub(crate) records: Arc<dyn Store>,
    /// How long a record is kept: a payment key bound to its operation
    /// (with Redis alone) is bound for as long.
    pub(crate) retention: std::time::Duration,
    /// How long a claim's lease lasts.
    pub(crate) lease: std::time::Duration,
    /// With the records in Redis alone, that store: a claim made by a
    /// request its key is not bound to is withdrawn from it.
    pub(crate) redis_alone: Option<idem_redis::RedisStore>,
    /// Whether `POST /payments` claims inside its own transaction.
    pub(crate) claim_in_transaction: bool,
    /// The payments that may hold their claiming transaction at once
    /// (`--claim-tx-limit`): a bulkhead between a slow bank and the pool.
    pub(crate) claim_tx_slots: Arc<tokio::sync::Semaphore>,
    /// How long a payment waits for one of those slots.
    pub(crate) claim_tx_wait: std::time::Duration,
    /// What `X-Simulate` may ask for.
    pub(crate) fault_injection: FaultInjection,
    /// The secret the bank signs its webhooks with, if one is configured.
    pub(crate) webhook_secret: Option<Arc<[u8]>>,
    pub(crate) metrics: metrics_exporter_prometheus::PrometheusHandle,
}

/// An RFC 9457 problem, as every error of shop is answered
/// (`application/problem+json`).
#[derive(Debug, Serialize, ToSchema)]
#[schema(as = Problem)]
pub(crate) struct ProblemDoc {
    /// A URI naming the kind of problem.
    #[serde(rename = "type")]
    kind: String,
    /// A short, human-readable summary of the kind.
    title: String,
    /// The HTTP status code.
    status: u16,
    /// What went wrong with this request.
    #[serde(skip_serializing_if = "Option::is_none")]
    detail: Option<String>,
}

/// The whole API, with its OpenAPI document at `GET /openapi.json`.
///
/// `POST /payments` requires an `Idempotency-Key`; `POST /orders` honours
/// one when sent (orders are deduplicated by their natural key anyway).
pub(crate) fn router(state: AppState, store: Arc<dyn Store>, policy: Policy) -> Router {
    let max_body = policy.max_body();
    let key_required = IdempotencyLayer::new(store.clone(), policy.clone(), auth::scope);
    let key_optional = match policy.to_builder().require_key(false).build() {
        Ok(p) => IdempotencyLayer::new(store, p, auth::scope),
        // unreachable: the settings came from a valid policy
        Err(_) => key_required.clone(),
    };
    let (api, doc) = OpenApiRouter::with_openapi(base_document())
        .routes(routes!(healthz))
        .routes(routes!(get_metrics))
        .routes(routes!(demo_page))
        .routes(routes!(openapi_json))
        .routes(routes!(problems))
        .merge(checkout::router(&state, key_required.clone()))
        .merge(payments::router(&state, key_required))
        .merge(orders::router(key_optional))
        .merge(catalog::router())
        .merge(webhooks::router())
        .split_for_parts();
    let doc = Arc::new(finish_document(doc));
    api.layer(axum::Extension(doc))
        .fallback(not_found)
        // One body limit for every route, the idempotency layer's: declared
        // sizes are refused before any read, streamed ones when they pass it.
        .layer(axum::extract::DefaultBodyLimit::max(max_body))
        .layer(axum::middleware::from_fn_with_state(
            max_body,
            input::refuse_oversized,
        ))
        .layer(axum::middleware::from_fn(error::problems_everywhere))
        .layer(axum::middleware::from_fn(input::refuse_large_headers))
        .with_state(state)
}

/// The document's title, version and security scheme.
fn base_document() -> OpenApi {
    let mut doc = OpenApi::default();
    doc.info.title = "shop".into();
    doc.info.version = env!("CARGO_PKG_VERSION").into();
    doc.info.description = Some(
        "A demo payments service that cannot charge twice, built on idem. \
         Every error is application/problem+json."
            .into(),
    );
    doc.components
        .get_or_insert_with(Default::default)
        .add_security_scheme(
            "bearer",
            SecurityScheme::Http(
                HttpBuilder::new()
                    .scheme(HttpAuthScheme::Bearer)
                    .description(Some(
                        "The token is the client id: 1 to 255 visible ASCII characters.",
                    ))
                    .build(),
            ),
        );
    doc
}

/// Adds what every operation may answer, whatever its own responses: a
/// malformed request (`400`), credentials missing where required (`401`),
/// a body over the limit (`413`), a failure of ours (`500`) and an outage
/// (`503`, with `Retry-After`); all problem+json.
fn finish_document(mut doc: OpenApi) -> OpenApi {
    let problem = |description: &str| {
        ResponseBuilder::new()
            .description(description)
            .content(
                "application/problem+json",
                ContentBuilder::new()
                    .schema(Some(RefOr::Ref(utoipa::openapi::Ref::from_schema_name(
                        "Problem",
                    ))))
                    .build(),
            )
            .build()
    };
    for item in doc.paths.paths.values_mut() {
        for op in [
            &mut item.get,
            &mut item.put,
            &mut item.post,
            &mut item.delete,
            &mut item.patch,
        ]
        .into_iter()
        .flatten()
        {
            let secured = op.security.as_ref().is_some_and(|s| !s.is_empty());
            let responses = &mut op.responses.responses;
            let mut add = |status: &str, description: &str| {
                responses
                    .entry(status.to_owned())
                    .or_insert_with(|| RefOr::T(problem(description)));
            };
            add(
                "400",
                "The request is malformed or a value is out of range; nothing was written",
            );
            if secured {
                add(
                    "401",
                    "Authorization: Bearer <client-id> is missing or unusable",
                );
            }
            add("413", "The body is over the limit");
            add("500", "A failure of ours");
            add(
                "503",
                "The database is unavailable; retry after Retry-After",
            );
        }
    }
    doc
}

async fn not_found() -> Response {
    Problem::new(StatusCode::NOT_FOUND, "not-found", "No such resource")
        .detail("no route here; GET /openapi.json lists them")
        .into_response()
}

/// The live demo page, embedded in the binary.
#[utoipa::path(get, path = "/", tag = "operations",
    responses((status = 200, description = "The demo page", content_type = "text/html", body = String)))]
async fn demo_page() -> Response {
    (
        [(header::CONTENT_TYPE, "text/html; charset=utf-8")],
        include_str!("../../assets/index.html"),
    )
        .into_response()
}

/// Metrics in Prometheus' text format.
#[utoipa::path(get, path = "/metrics", tag = "operations",
    responses((status = 200, description = "The metrics", content_type = "text/plain", body = String)))]
async fn get_metrics(State(state): State<AppState>) -> Response {
    // As of now, not as of the relay's last round (which may hang on a
    // broker that does not confirm): what `/healthz` compares with
    // `--outbox-max-lag-secs`.
    metrics::gauge!("shop_outbox_lag_seconds").set(state.messaging.lag().as_secs_f64());
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        state.metrics.render(),
    )
        .into_response()
}

/// Whether the database answers, whether the outbox relay runs and, with
/// Redis alone, whether Redis does: every payment needs the store of its
/// mode.
#[utoipa::path(get, path = "/healthz", tag = "operations",
    responses((status = 200, description = "Healthy", content_type = "text/plain", body = String),
        (status = 503, description = "The database, or the idempotency store the mode depends on, cannot be reached; or the outbox relay has stopped (`relay-stopped`, with its last error) or is behind (`outbox-lagging`)", content_type = "application/problem+json", body = ProblemDoc)))]
async fn healthz(State(state): State<AppState>) -> Result<&'static str> {
    // On a connection of its own: it reports the database, not how long
    // the business pool's queue is.
    state
        .db
        .health_conn()
        .await?
        .execute("SELECT 1", &[])
        .await?;
    if let Some(stopped) = state.messaging.relay_stopped() {
        let wait = stopped
            .retry_at
            .saturating_duration_since(std::time::Instant::now());
        return Err(Problem::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "relay-stopped",
            "The outbox relay has stopped",
        )
        .detail(format!(
            "the outbox relay stopped on: {}; it is restarted in {} ms. Events wait in the outbox until it runs again.",
            stopped.error,
            wait.as_millis()
        ))
        .retry_after(wait.as_secs().max(1))
        .into());
    }
    if let Some((lag, limit)) = state.messaging.lagging() {
        return Err(Problem::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "outbox-lagging",
            "The outbox relay is behind",
        )
        .detail(format!(
            "the oldest event waiting in the outbox has waited {} s, more than the {} s allowed (--outbox-max-lag-secs): the relay is not keeping up, or the broker is not confirming. Events are kept and go out in order as it catches up.",
            lag.as_secs(),
            limit.as_secs()
        ))
        .retry_after(1)
        .into());
    }
    if !state.transactional {
        // Redis alone holds the records: without it no payment is taken.
        let read = tokio::time::timeout(
            std::time::Duration::from_secs(2),
            state.records.get("shop-healthz", "healthz"),
        )
        .await;
        let why = match read {
            Ok(Ok(_)) => None,
            Ok(Err(e)) => Some(e.to_string()),
            Err(_) => Some("no answer within 2 s".to_owned()),
        };
        if let Some(why) = why {
            return Err(Problem::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "store-unavailable",
                "The idempotency store (Redis) cannot be reached",
            )
            .detail(format!("{why}; every payment needs it in this mode"))
            .retry_after(1)
            .into());
        }
    }
    Ok("ok")
}

/// What each problem `type` the service answers with means: one section
/// per type, its slug the anchor (`/problems#not-found`).
#[utoipa::path(get, path = "/problems", tag = "operations",
    responses((status = 200, description = "The problem types", content_type = "text/html", body = String)))]
async fn problems() -> Response {
    let mut page = String::from(
        "<!doctype html><meta charset=\"utf-8\"><title>shop: problem types</title>\n\
         <h1>Problem types</h1>\n<p>Every error is <code>application/problem+json</code>; \
         its <code>type</code> is this page and one of the sections below.</p>\n",
    );
    for (slug, meaning) in error::SHOP_PROBLEMS {
        page.push_str(&format!(
            "<h2 id=\"{slug}\">{slug}</h2>\n<p>{meaning}</p>\n"
        ));
    }
    for slug in idem_axum::IdempotencyRejection::PROBLEM_TYPES {
        page.push_str(&format!(
            "<h2 id=\"{slug}\">{slug}</h2>\n<p>Answered by idem: see \
             <a href=\"{}{slug}\">its definition</a>.</p>\n",
            idem_axum::problem::DEFAULT_PROBLEM_TYPE_BASE
        ));
    }
    ([(header::CONTENT_TYPE, "text/html; charset=utf-8")], page).into_response()
}

/// This document.
#[utoipa::path(get, path = "/openapi.json", tag = "operations",
    responses((status = 200, description = "The OpenAPI 3.1 document", body = Object)))]
async fn openapi_json(axum::Extension(doc): axum::Extension<Arc<OpenApi>>) -> Response {
    axum::Json(&*doc).into_response()
}
