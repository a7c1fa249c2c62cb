//! One error type for every handler, and the problem+json it renders as.
//!
//! Handlers return `Result<_, Error>` and use `?`: a database error is
//! classified here (an outage is `503` with `Retry-After`, a refused value
//! `400`, a unique violation `409`, the rest `500`), so no handler decides
//! that on its own.

use axum::extract::Request;
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use idem_axum::Problem;
use tracing::{error, warn};

use crate::bank::BankError;

/// The problem types of shop's own, and what each means (served at
/// `GET /problems`, one section each).
pub(crate) const SHOP_PROBLEMS: &[(&str, &str)] = &[
    ("validation", "The request is malformed or a value is out of range; nothing was written."),
    ("unauthorized", "<code>Authorization: Bearer &lt;client-id&gt;</code> is missing or unusable."),
    ("not-found", "No such resource for this client (another client's is not shown either), or no such route."),
    ("conflict", "The request conflicts with the resource's state."),
    ("payment-state-conflict", "The payment is in a state the action does not apply to."),
    ("client-reference-reused", "The order reference names another order (other items)."),
    ("order-already-paid", "The order is paid, or being paid, under another <code>Idempotency-Key</code>, or under this one with other payment details once its record expired."),
    ("corrupt-order", "A stored order is unreadable: a failure of ours."),
    ("bad-signature", "The webhook's <code>X-Bank-Signature</code> is missing or wrong."),
    ("event-id-reused", "The webhook's event id was processed before for another type or payment; nothing was done."),
    ("bank-unavailable", "The bank could not be reached (or <code>X-Simulate: bank-error</code>); nothing was charged."),
    ("database-unavailable", "The database is unavailable; retry after <code>Retry-After</code>."),
    ("busy", "Too many payments are in progress on this instance (<code>--claim-tx-limit</code>); nothing was claimed or charged: retry after <code>Retry-After</code> with the same key."),
    ("outbox-lagging", "<code>GET /healthz</code>: the oldest event waiting in the outbox has waited longer than <code>--outbox-max-lag-secs</code> allows: the relay is not keeping up with the rate events are written at, or the broker is not confirming them. Nothing is lost: events wait in the outbox and go out as it catches up."),
    ("relay-stopped", "<code>GET /healthz</code>: the outbox relay stopped on an error waiting cannot mend (its detail names it); it is restarted with a growing delay, and events wait in the outbox meanwhile."),
    ("payload-too-large", "The body is over the limit."),
    ("unsupported-media-type", "The body is not JSON."),
    ("header-fields-too-large", "Too many or too large header fields."),
    ("method-not-allowed", "The route does not take this method."),
    ("bad-request", "The request is invalid (a path segment that does not decode, and the like)."),
    ("internal", "A failure of ours."),
];

/// Why a request was not served.
#[derive(Debug, thiserror::Error)]
pub(crate) enum Error {
    /// `400`: the request is malformed or a value is out of range; nothing
    /// was written.
    #[error("the request is invalid: {0}")]
    Validation(String),
    /// `401`: no credentials, or unusable ones.
    #[error("authentication required: {0}")]
    Unauthorized(&'static str),
    /// `404`: no such resource for this client (another client's is not
    /// shown either).
    #[error("no {what} {id:?}")]
    NotFound {
        /// What was looked for: `payment`, `order`, `product`.
        what: &'static str,
        /// The id asked for.
        id: String,
    },
    /// A statement failed; see [`Error::into_response`] for the status.
    #[error("database: {0}")]
    Database(#[from] sqlx::Error),
    /// The payment was charged but could not be recorded: `503` that tells
    /// the client to retry with the same key (the bank will not charge
    /// twice), or else `500`. Never a `4xx`: that would be stored and
    /// replayed, saying the request was refused when the bank charged it;
    /// a `5xx` lets the key go, so the retry records the charge once the
    /// fault is mended.
    #[error("recording the payment: {0}")]
    Recording(sqlx::Error),
    /// A payment's key could not be bound to its operation (with Redis
    /// alone), before anything was charged: `503` when a retry may get
    /// past it, else `500`; never a `4xx`, which would be stored.
    #[error("binding the payment key: {0}")]
    Binding(sqlx::Error),
    /// The key refused as the idempotency layer refuses it, over HTTP and
    /// gRPC alike (its problem type, its `ErrorInfo`); not stored.
    #[error("{0:?}")]
    Refused(KeyRefusal),
    /// The bank could not be reached, or refused.
    #[error("bank: {0:?}")]
    Bank(#[from] BankError),
    /// A problem of the resource's own (a state conflict, a reused
    /// reference, a bad signature).
    #[error("{}", .0.kind())]
    Problem(Problem),
    /// An answer a library already made (a replay, `409`, `412`, `428`).
    #[error("answered {}", .0.status())]
    Answered(Response),
}

/// How a key is refused, as the idempotency layer says it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum KeyRefusal {
    /// Used before for another request: `422` (gRPC `FAILED_PRECONDITION`).
    Reused,
    /// Held by another request for now: `409` with `Retry-After` (gRPC
    /// `ABORTED`).
    InUse,
}

/// What handlers return.
pub(crate) type Result<T, E = Error> = std::result::Result<T, E>;

impl From<Problem> for Error {
    fn from(problem: Problem) -> Self {
        Self::Problem(problem)
    }
}

impl Error {
    /// A `400` validation problem.
    pub(crate) fn validation(detail: impl Into<String>) -> Self {
        Self::Validation(detail.into())
    }
}

impl IntoResponse for Error {
    fn into_response(self) -> Response {
        match self {
            Self::Validation(detail) => Problem::new(
                StatusCode::BAD_REQUEST,
                "validation",
                "The request is invalid",
            )
            .detail(detail)
            .into_response(),
            Self::Unauthorized(detail) => {
                let mut response = Problem::new(
                    StatusCode::UNAUTHORIZED,
                    "unauthorized",
                    "Authentication required",
                )
                .detail(detail)
                .into_response();
                response
                    .headers_mut()
                    .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
                response
            }
            Self::NotFound { what, id } => Problem::new(
                StatusCode::NOT_FOUND,
                "not-found",
                format!("No such {what}"),
            )
            .detail(format!("no {what} {id:?}"))
            .into_response(),
            Self::Recording(e) if is_unavailable(&e) => {
                error!(error = %e, "could not record the payment");
                Problem::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "database-unavailable",
                    "The payment could not be recorded",
                )
                .detail("retry with the same Idempotency-Key; the bank will not charge twice")
                .retry_after(1)
                .into_response()
            }
            Self::Recording(e) => {
                error!(error = %e, "the payment was charged but could not be recorded");
                Problem::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "internal",
                    "The payment could not be recorded",
                )
                .detail("retry with the same Idempotency-Key; the bank will not charge twice")
                .into_response()
            }
            Self::Database(e) => database(&e),
            Self::Binding(e) if is_unavailable(&e) => {
                error!(error = %e, "could not bind the payment key; nothing was charged");
                Problem::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "database-unavailable",
                    "The database is unavailable",
                )
                .detail("nothing was charged; retry with the same Idempotency-Key")
                .retry_after(1)
                .into_response()
            }
            Self::Binding(e) => {
                error!(error = %e, "could not bind the payment key; nothing was charged");
                Problem::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "internal",
                    "The payment could not be started",
                )
                .detail("nothing was charged")
                .into_response()
            }
            Self::Refused(KeyRefusal::Reused) => {
                idem_axum::IdempotencyRejection::KeyReused.into_response()
            }
            Self::Refused(KeyRefusal::InUse) => idem_axum::IdempotencyRejection::KeyInUse {
                retry_after: std::time::Duration::from_secs(1),
            }
            .into_response(),
            Self::Bank(e) => {
                warn!(error = ?e, "bank call failed");
                match e {
                    // The fake bank keeps its ledger in our database: when
                    // that is down, say so, as every other path does.
                    BankError::Ledger(e) if is_unavailable(&e) => database(&e),
                    _ => Problem::new(
                        StatusCode::BAD_GATEWAY,
                        "bank-unavailable",
                        "The bank could not be reached",
                    )
                    .detail("retry with the same Idempotency-Key; the bank will not charge twice")
                    .into_response(),
                }
            }
            Self::Problem(problem) => problem.into_response(),
            Self::Answered(response) => response,
        }
    }
}

/// Whether `e` means the database could not be reached or is busy: the
/// only failure a retry helps with.
fn is_unavailable(e: &sqlx::Error) -> bool {
    idem_sql::is_unavailable(e)
        // the session ended for sitting idle in its transaction past the
        // lease (a claim held by the transaction): the retry takes over
        || matches!(e, sqlx::Error::Database(d) if d.code().as_deref() == Some("25P03"))
}

/// A failed statement as an answer: an outage is `503` with `Retry-After`;
/// a constraint or a value the database refused is the request's fault
/// (`409`/`400`, no `Retry-After`); the rest is ours (`500`, no
/// `Retry-After`: the same request would fail again).
fn database(e: &sqlx::Error) -> Response {
    error!(error = %e, "database statement failed");
    if is_unavailable(e) {
        return Problem::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "database-unavailable",
            "The database is unavailable",
        )
        .retry_after(1)
        .into_response();
    }
    if let sqlx::Error::Database(d) = e {
        if idem_sql::DuplicateKey::of(e).is_some() {
            return Problem::new(
                StatusCode::CONFLICT,
                "conflict",
                "The request conflicts with what exists",
            )
            .into_response();
        }
        if d.is_check_violation()
            || d.is_foreign_key_violation()
            || d.code().is_some_and(|c| c.starts_with("22"))
        {
            return Error::validation("a value was refused by the database").into_response();
        }
    }
    Problem::new(
        StatusCode::INTERNAL_SERVER_ERROR,
        "internal",
        "The request failed",
    )
    .into_response()
}

/// Middleware over every route: an error answer that is not problem+json
/// yet (an unknown route, a method not allowed, a body too large, an
/// extractor's rejection) becomes one, with its status and headers (such as
/// `Allow`) kept.
pub(crate) async fn problems_everywhere(request: Request, next: Next) -> Response {
    let response = next.run(request).await;
    let status = response.status();
    let is_problem = response
        .headers()
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"application/problem+json"));
    if !(status.is_client_error() || status.is_server_error()) || is_problem {
        return response;
    }
    let (mut parts, body) = response.into_parts();
    let detail = match axum::body::to_bytes(body, 4096).await {
        Ok(b) if !b.is_empty() => String::from_utf8_lossy(&b).into_owned(),
        _ => String::new(),
    };
    let (kind, title) = match status {
        StatusCode::NOT_FOUND => ("not-found", "No such resource"),
        StatusCode::METHOD_NOT_ALLOWED => ("method-not-allowed", "Method not allowed"),
        StatusCode::PAYLOAD_TOO_LARGE => ("payload-too-large", "The body is too large"),
        StatusCode::UNSUPPORTED_MEDIA_TYPE => ("unsupported-media-type", "The body must be JSON"),
        StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE => (
            "header-fields-too-large",
            "The request headers are too large",
        ),
        s if s.is_client_error() => ("bad-request", "The request is invalid"),
        _ => ("internal", "The request failed"),
    };
    let mut problem = Problem::new(status, kind, title);
    if !detail.is_empty() {
        problem = problem.detail(detail);
    }
    let fresh = problem.into_response();
    parts.headers.remove(header::CONTENT_LENGTH);
    parts.headers.remove(header::CONTENT_TYPE);
    let (fresh_parts, body) = fresh.into_parts();
    parts.headers.extend(fresh_parts.headers);
    Response::from_parts(parts, body)
}

impl Error {
    /// This error as a gRPC status (shop's gRPC API): the cases of the
    /// HTTP answers, in gRPC's codes. What a retry may get past
    /// (`UNAVAILABLE`, `INTERNAL`) frees the idempotency key; the rest is
    /// an answer.
    pub(crate) fn into_status(self) -> tonic::Status {
        use tonic::Status;
        match self {
            Self::Validation(detail) => Status::invalid_argument(detail),
            Self::Unauthorized(detail) => Status::unauthenticated(detail),
            Self::NotFound { what, id } => Status::not_found(format!("no {what} {id:?}")),
            Self::Refused(KeyRefusal::Reused) => idem_tonic::LayerRefusal::KeyReused.status(
                tonic::Code::FailedPrecondition,
                "the idempotency-key was used with another message or method",
            ),
            Self::Refused(KeyRefusal::InUse) => idem_tonic::LayerRefusal::InFlight.status(
                tonic::Code::Aborted,
                "a call with this idempotency-key is running; retry with the same key",
            ),
            Self::Binding(e) if is_unavailable(&e) => {
                error!(error = %e, "could not bind the payment key; nothing was charged");
                Status::unavailable("the database is unavailable; nothing was charged: retry with the same idempotency-key")
            }
            Self::Binding(e) => {
                error!(error = %e, "could not bind the payment key; nothing was charged");
                Status::internal("the payment could not be started")
            }
            Self::Database(e) | Self::Recording(e) if is_unavailable(&e) => {
                error!(error = %e, "database unavailable");
                Status::unavailable("the database is unavailable; retry with the same idempotency-key: the bank will not charge twice")
            }
            Self::Bank(BankError::Ledger(e)) if is_unavailable(&e) => {
                error!(error = %e, "the bank's ledger is unavailable");
                Status::unavailable("the database is unavailable; retry with the same idempotency-key: the bank will not charge twice")
            }
            Self::Bank(e) => {
                warn!(error = ?e, "bank call failed");
                Status::unavailable("the bank could not be reached; retry with the same idempotency-key: the bank will not charge twice")
            }
            Self::Database(e) | Self::Recording(e) => {
                error!(error = %e, "database statement failed");
                Status::internal("the request failed")
            }
            other => {
                let message = other.to_string();
                let code = match other.into_response().status().as_u16() {
                    400 => tonic::Code::InvalidArgument,
                    401 => tonic::Code::Unauthenticated,
                    403 => tonic::Code::PermissionDenied,
                    404 => tonic::Code::NotFound,
                    409 | 412 | 422 => tonic::Code::FailedPrecondition,
                    429 | 503 | 502 => tonic::Code::Unavailable,
                    _ => tonic::Code::Internal,
                };
                Status::new(code, message)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    /// Database failures are told apart: only an unreachable database is a
    /// 503 with Retry-After.
    #[tokio::test]
    async fn refused_values_are_4xx_and_only_an_outage_says_retry() {
        let pool = sqlx::SqlitePool::connect("sqlite::memory:").await.unwrap();
        sqlx::query("CREATE TABLE t (id TEXT PRIMARY KEY, n INTEGER CHECK (n > 0))")
            .execute(&pool)
            .await
            .unwrap();
        sqlx::query("INSERT INTO t VALUES ('a', 1)")
            .execute(&pool)
            .await
            .unwrap();
        let fail = |sql: &'static str| {
            let pool = pool.clone();
            async move { sqlx::query(sql).execute(&pool).await.unwrap_err() }
        };
        let answer = |e: sqlx::Error| Error::from(e).into_response();
        let unique = answer(fail("INSERT INTO t VALUES ('a', 2)").await);
        assert_eq!(unique.status(), StatusCode::CONFLICT);
        let check = answer(fail("INSERT INTO t VALUES ('b', 0)").await);
        assert_eq!(check.status(), StatusCode::BAD_REQUEST);
        let ours = answer(fail("SELECT * FROM missing").await);
        assert_eq!(ours.status(), StatusCode::INTERNAL_SERVER_ERROR);
        // Charged but not recorded: never an answer that is stored.
        for statement in [
            "INSERT INTO t VALUES ('b', 0)",
            "INSERT INTO t VALUES ('a', 2)",
        ] {
            let recording = Error::Recording(fail(statement).await).into_response();
            assert_eq!(recording.status(), StatusCode::INTERNAL_SERVER_ERROR);
        }
        for r in [&unique, &check, &ours] {
            assert!(r.headers().get(header::RETRY_AFTER).is_none());
        }
        pool.close().await;
        let closed = answer(fail("SELECT 1").await);
        assert_eq!(closed.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert!(closed.headers().get(header::RETRY_AFTER).is_some());
        let recording = Error::Recording(fail("SELECT 1").await).into_response();
        assert_eq!(recording.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert!(recording.headers().get(header::RETRY_AFTER).is_some());
    }
}
