//! Who is calling: `Authorization: Bearer <client-id>`.
//!
//! A demo's authentication: the token *is* the client id. It is the
//! idempotency scope (clients never see each other's keys) and the owner of
//! every payment, order, email and event the client creates; another
//! client's resource answers `404`, as if it did not exist.

use axum::extract::{FromRequestParts, Request};
use axum::http::request::Parts;
use axum::http::{header, HeaderMap};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::error::{Error, Result};

/// The calling client, from `Authorization: Bearer <client-id>`.
#[derive(Debug, Clone)]
pub(crate) struct Client(pub(crate) String);

impl<S: Send + Sync> FromRequestParts<S> for Client {
    type Rejection = Error;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self> {
        client_id(&parts.headers).map(Client)
    }
}

/// The calling client: `Authorization: Bearer <client-id>` (the scheme in
/// any case, RFC 9110), the id 1 to 255 visible ASCII characters. No header,
/// another scheme or a bad token is `401`; two headers are `400`.
pub(crate) fn client_id(headers: &HeaderMap) -> Result<String> {
    let mut values = headers.get_all(header::AUTHORIZATION).iter();
    let Some(value) = values.next() else {
        return Err(Error::Unauthorized(
            "send Authorization: Bearer <client-id>",
        ));
    };
    if values.next().is_some() {
        return Err(Error::validation(
            "send one Authorization header, not several",
        ));
    }
    let token = value
        .to_str()
        .ok()
        .and_then(|v| v.split_once(' '))
        .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
        .map(|(_, token)| token.trim())
        .filter(|t| !t.is_empty() && t.len() <= 255 && t.bytes().all(|b| b.is_ascii_graphic()));
    match token {
        Some(t) => Ok(t.to_owned()),
        None => Err(Error::Unauthorized(
            "send Authorization: Bearer <client-id> (1 to 255 visible ASCII characters)",
        )),
    }
}

/// The idempotency layer's scope: the calling client.
pub(crate) fn scope(parts: &Parts) -> std::result::Result<String, Response> {
    client_id(&parts.headers).map_err(IntoResponse::into_response)
}

/// Middleware for a client's routes that read a JSON body: without
/// credentials `401`, with a body that is not JSON `415`, before the
/// idempotency layer fingerprints it or the handler reads it, so both
/// always read the body the same way.
pub(crate) async fn require_client_json(request: Request, next: Next) -> Response {
    if let Err(refused) = client_id(request.headers()) {
        return refused.into_response();
    }
    super::input::require_json(request, next).await
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use axum::http::StatusCode;

    #[test]
    fn bearer_tokens() {
        let with = |values: &[&str]| {
            let mut h = HeaderMap::new();
            for v in values {
                h.append(header::AUTHORIZATION, v.parse().unwrap());
            }
            client_id(&h).map_err(|e| e.into_response().status())
        };
        assert_eq!(with(&["Bearer client-1"]), Ok("client-1".to_owned()));
        assert_eq!(with(&["bearer client-1"]), Ok("client-1".to_owned()));
        assert_eq!(with(&["BEARER client-1"]), Ok("client-1".to_owned()));
        assert_eq!(with(&[]), Err(StatusCode::UNAUTHORIZED));
        assert_eq!(with(&["Basic abc"]), Err(StatusCode::UNAUTHORIZED));
        assert_eq!(with(&["Bearer "]), Err(StatusCode::UNAUTHORIZED));
        assert_eq!(
            with(&["Bearer a", "Bearer b"]),
            Err(StatusCode::BAD_REQUEST)
        );
    }
}
