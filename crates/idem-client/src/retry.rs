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
    fn key(
        &self,
        req: &mut Request,
        extensions: &Extensions,
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
        let existing = req
            .headers()
            .get(IDEMPOTENCY_KEY)
            .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned());
        let key = match (existing, extensions.get::<IntentKey>()) {
            (Some(k), _) => k,
            (None, Some(k)) => k.0.clone(),
            (None, None) => match self.key_kind {
                KeyKind::V4 => IntentKey::random().0,
                KeyKind::V7 => IntentKey::time_ordered().0,
            },
        };
        let refused = |failure| {
            Err(RetryError::new(
                0,
                Some(key.clone()),
                Duration::ZERO,
                StopReason::InvalidKey,
                failure,
            ))
        };
        if !(1..=255).contains(&key.len()) || !key.bytes().all(|b| b.is_ascii_graphic()) {
            return refused(LastFailure::KeyNotVisibleAscii);
        }
        match HeaderValue::from_str(&key) {
            Ok(value) => {
                req.headers_mut().insert(IDEMPOTENCY_KEY, value);
                Ok(Some(key))
            }
            Err(e) => refused(LastFailure::InvalidKey(e)),
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
