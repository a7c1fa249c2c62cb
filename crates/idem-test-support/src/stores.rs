//! Stores that misbehave on purpose, wrapping a real one.

use std::time::Duration;

use idem_core::{
    BoxFuture, Claim, ClaimOutcome, ClaimRequest, Record, Store, StoreError, StoredResponse,
};

/// `S`, whose claims answer late: each claim is made at once, and its
/// answer comes back `delay` later (a slow network on the way back), so a
/// caller that gives up meanwhile leaves a claim that was made.
#[derive(Debug)]
pub struct SlowClaimAnswers<S> {
    /// The store that keeps the records.
    pub inner: S,
    /// How late each claim's answer comes back.
    pub delay: Duration,
}

impl<S: Store> Store for SlowClaimAnswers<S> {
    fn claim<'a>(
        &'a self,
        request: &'a ClaimRequest,
    ) -> BoxFuture<'a, Result<ClaimOutcome, StoreError>> {
        Box::pin(async move {
            let outcome = self.inner.claim(request).await;
            tokio::time::sleep(self.delay).await;
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
}
