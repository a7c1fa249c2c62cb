//! `application/problem+json` (RFC 9457) answers.

use axum::response::{IntoResponse, Response};
use http::{header, HeaderValue, StatusCode};
use serde::Serialize;

/// The prefix of every problem `type` idem answers with; the slug follows it
/// (`…/idempotency-key-missing`).
pub const PROBLEM_TYPE_BASE: &str = "https://idem.dev/problems/";

/// The media type of problem answers.
pub const PROBLEM_JSON: &str = "application/problem+json";

/// A problem details answer.
///
/// ```
/// use axum::response::IntoResponse;
/// use http::StatusCode;
/// use idem_axum::Problem;
///
/// let response = Problem::new(StatusCode::BAD_REQUEST, "validation", "The body is invalid")
///     .detail("amount must be a positive integer")
///     .into_response();
/// assert_eq!(response.status(), StatusCode::BAD_REQUEST);
/// assert_eq!(response.headers()["content-type"], "application/problem+json");
/// ```
#[derive(Debug, Clone, Serialize)]
pub struct Problem {
    #[serde(rename = "type")]
    kind: String,
    title: String,
    status: u16,
    #[serde(skip_serializing_if = "Option::is_none")]
    detail: Option<String>,
    #[serde(skip)]
    retry_after: Option<u64>,
}

impl Problem {
    /// A problem whose `type` is [`PROBLEM_TYPE_BASE`] followed by `slug`.
    pub fn new(status: StatusCode, slug: &str, title: impl Into<String>) -> Self {
        Self {
            kind: format!("{PROBLEM_TYPE_BASE}{slug}"),
            title: title.into(),
            status: status.as_u16(),
            detail: None,
            retry_after: None,
        }
    }

    /// Adds a human-readable explanation of this occurrence.
    pub fn detail(mut self, detail: impl Into<String>) -> Self {
        self.detail = Some(detail.into());
        self
    }

    /// Adds a `Retry-After` header, in seconds.
    pub fn retry_after(mut self, secs: u64) -> Self {
        self.retry_after = Some(secs);
        self
    }

    /// The problem's `type` URI.
    pub fn kind(&self) -> &str {
        &self.kind
    }
}

impl IntoResponse for Problem {
    fn into_response(self) -> Response {
        let status = StatusCode::from_u16(self.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let body = serde_json::to_vec(&self).unwrap_or_else(|_| b"{}".to_vec());
        let mut response = (status, body).into_response();
        let headers = response.headers_mut();
        headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(PROBLEM_JSON));
        if let Some(secs) = self.retry_after {
            headers.insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        response
    }
}
