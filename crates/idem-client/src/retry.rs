//! The retry loop: [`IdempotentRetry`] as reqwest middleware.

use std::time::{Duration, Instant};

use http::{Extensions, HeaderValue};
use reqwest::{Request, Response};
use reqwest_middleware::{Middleware, Next, Result};
use tracing::debug;

use super::*;

impl IdempotentRetry {
    /// The key this request is sent with, written into its header: one
    /// for a keyed method, and for any request the caller gave a key of
    /// its own (the header, or an [`IntentKey`]).
    ///
    /// The key chosen is also left in `extensions` as the request's
    /// [`IntentKey`]: a layer outside this one that sends the request again
    /// with the same extensions (another retry middleware) sends it under
    /// the same key, never a second generated one.
    fn key(
        &self,
        req: &mut Request,
        extensions: &mut Extensions,
    ) -> std::result::Result<Option<String>, RetryError> {
        if !self.keyed_methods.contains(req.method())
            && !req.headers().contains_key(IDEMPOTENCY_KEY)
            && extensions.get::<IntentKey>().is_none()
        {
            return Ok(None);
        }
        // The caller's own key, as it is: one that is not visible ASCII is
        // refused below (nothing sent), never replaced by a generated one,
        // which the caller's next retry of the intent would not share.
        let mut headers = req
            .headers()
            .get_all(IDEMPOTENCY_KEY)
            .iter()
            .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned());
        let existing = headers.next();
        // The same key written twice is one key (sent once).
        let repeated = headers.find(|h| Some(h) != existing.as_ref());
        let intent = extensions.get::<IntentKey>().map(|k| k.0.clone());
        let refused = |key: &str, failure| {
            Err(RetryError::new(
                0,
                Some(key.to_owned()),
                Duration::ZERO,
                StopReason::InvalidKey,
                failure,
            ))
        };
        // Two keys named for one request: which one the intent is cannot
        // be told (the server refuses a repeated header with `400`).
        let other = repeated.or_else(|| {
            intent
                .as_ref()
                .filter(|k| existing.as_ref().is_some_and(|e| e != *k))
                .cloned()
        });
        if let (Some(first), Some(second)) = (&existing, other) {
            return refused(first, LastFailure::KeysDisagree(second));
        }
        let key = match (existing, intent) {
            (Some(k), _) | (None, Some(k)) => k,
            (None, None) => match self.key_kind {
                KeyKind::V4 => IntentKey::random().0,
                KeyKind::V7 => IntentKey::time_ordered().0,
            },
        };
        if !(1..=255).contains(&key.len()) || !key.bytes().all(|b| b.is_ascii_graphic()) {
            return refused(&key, LastFailure::KeyNotVisibleAscii);
        }
        match HeaderValue::from_str(&key) {
            Ok(value) => {
                req.headers_mut().insert(IDEMPOTENCY_KEY, value);
                extensions.insert(IntentKey(key.clone()));
                Ok(Some(key))
            }
            Err(e) => refused(&key, LastFailure::InvalidKey(e)),
        }
    }
}

#[async_trait::async_trait]
impl Middleware for IdempotentRetry {
    async fn handle(
        &self,
        mut req: Request,
        extensions: &mut Extensions,
        next: Next<'_>,
    ) -> Result<Response> {
        let key = self.key(&mut req, extensions)?;
        // Without a key, only a method that is idempotent by definition is
        // sent again: a `POST` or `PATCH` left unkeyed (`keyed_methods`
        // narrowed) could take effect twice, so it is sent once and its
        // answer, or error, passed on as it is.
        if key.is_none() && !req.method().is_idempotent() {
            let mut r = next.run(req, extensions).await?;
            attach_outcome(&mut r, 1, &key);
            return Ok(r);
        }
        let started = Instant::now();
        // `None`: a budget too large to represent, that is no budget.
        let deadline = started.checked_add(self.max_elapsed);
        let mut backoff = idem_core::Backoff::new(self.base_delay, self.max_delay);
        let mut attempts = 0u32;
        loop {
            attempts += 1;
            let give_up = |reason: StopReason, mut last: LastFailure| {
                if let LastFailure::Status(r) = &mut last {
                    attach_outcome(r, attempts, &key);
                }
                let e = RetryError::new(attempts, key.clone(), started.elapsed(), reason, last);
                debug!(attempts, key = ?key, reason = %e.reason(), "giving up");
                reqwest_middleware::Error::from(e)
            };
            // The last attempt, or a body that cannot be cloned (a stream),
            // sends the request itself: no retry after it.
            let last_allowed = attempts >= self.max_attempts;
            let copy = if last_allowed { None } else { req.try_clone() };
            let Some(copy) = copy else {
                return match judge(next.run(req, extensions).await) {
                    Verdict::Done(mut r) => {
                        attach_outcome(&mut r, attempts, &key);
                        Ok(r)
                    }
                    Verdict::Retry(last, _) if last_allowed => {
                        Err(give_up(StopReason::AttemptsExhausted, last))
                    }
                    Verdict::Retry(last, _) => Err(give_up(StopReason::BodyNotCloneable, last)),
                    Verdict::Fail(last) => Err(give_up(StopReason::NotRetryable, last)),
                };
            };
            let (last, retry_after) = match judge(next.clone().run(copy, extensions).await) {
                Verdict::Done(mut r) => {
                    attach_outcome(&mut r, attempts, &key);
                    return Ok(r);
                }
                Verdict::Fail(last) => return Err(give_up(StopReason::NotRetryable, last)),
                Verdict::Retry(last, retry_after) => (last, retry_after),
            };
            let remaining = deadline.map(|d| d.saturating_duration_since(Instant::now()));
            if remaining.is_some_and(|r| r.is_zero()) {
                return Err(give_up(StopReason::BudgetExhausted, last));
            }
            let pause = match retry_after {
                Some(after) => {
                    let after = after.max(self.base_delay).min(self.max_retry_after);
                    if remaining.is_some_and(|r| after > r) {
                        return Err(give_up(StopReason::RetryAfterBeyondBudget, last));
                    }
                    after
                }
                None => {
                    let pause = backoff.next_wait();
                    remaining.map_or(pause, |r| pause.min(r))
                }
            };
            debug!(attempt = attempts, ?pause, key = ?key, last = %last, "retrying");
            drop(last);
            tokio::time::sleep(pause).await;
        }
    }
}
