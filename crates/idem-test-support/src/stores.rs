//! Stores that misbehave on purpose, wrapping a real one.

use std::fmt::Debug;
use std::time::Duration;

use idem_core::{
    BoxFuture, Claim, ClaimOutcome, ClaimRequest, Record, Store, StoreError, StoredResponse,
};

/// `S`, whose claims answer late: each claim is made at once, and its
/// answer comes back [`ClaimDelay::delay`] later (a slow network on the way
/// back), so a caller that gives up meanwhile leaves a claim that was made.
/// Every other call goes straight to `S`.
#[derive(Debug)]
pub struct SlowClaimAnswers<S, D = Duration> {
    /// The store that keeps the records.
    pub inner: S,
    /// How late each claim's answer comes back.
    pub delay: D,
}

/// How late [`SlowClaimAnswers`] lets a claim's answer come back: a
/// [`Duration`] for every claim alike, or a type of the test's own that
/// picks the claims (and may count them).
pub trait ClaimDelay: Send + Sync + Debug + 'static {
    /// The delay for the answer to `request`, asked once the claim is made.
    fn delay(&self, request: &ClaimRequest) -> Duration;
}

impl ClaimDelay for Duration {
    fn delay(&self, _: &ClaimRequest) -> Duration {
        *self
    }
}

impl<S: Store, D: ClaimDelay> Store for SlowClaimAnswers<S, D> {
    fn claim<'a>(
        &'a self,
        request: &'a ClaimRequest,
    ) -> BoxFuture<'a, Result<ClaimOutcome, StoreError>> {
        Box::pin(async move {
            let outcome = self.inner.claim(request).await;
            let delay = self.delay.delay(request);
            if !delay.is_zero() {
                tokio::time::sleep(delay).await;
            }
            outcome
        })
    }
    fn complete<'a>(
        &'a self,
        claim: &'a Claim,
        response: &'a StoredResponse,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        self.inner.complete(claim, response)
    }
    fn release<'a>(&'a self, claim: &'a Claim) -> BoxFuture<'a, Result<(), StoreError>> {
        self.inner.release(claim)
    }
    fn get<'a>(
        &'a self,
        scope: &'a str,
        key: &'a str,
    ) -> BoxFuture<'a, Result<Option<Record>, StoreError>> {
        self.inner.get(scope, key)
    }
    fn sweep(&self, batch: usize) -> BoxFuture<'_, Result<u64, StoreError>> {
        self.inner.sweep(batch)
    }
    fn kind(&self) -> &'static str {
        self.inner.kind()
    }
    fn settled<'a>(&'a self, claim: &'a Claim) -> BoxFuture<'a, ()> {
        self.inner.settled(claim)
    }
}
