//! One guarded call's way through: who and which key, its message read
//! and fingerprinted, the claim, the handler on a task of its own, and
//! the answer stored or the claim released.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderValue, Request, Response};
use http_body_util::{BodyExt, Full};
use idem_core::{
    on_missing_key, Claim, ClaimOutcome, ClaimRequest, FencingToken, Fingerprint, IdempotencyKey,
    KeyError, MissingKey, OperationId, RecordState, Store, StoreError,
};
use idem_once::{Found, Refusal};
use tonic::{body::Body, Code};
use tower::Service;
use tracing::{debug, info, warn, Instrument};

use crate::answer::{self, Buffered};
use crate::frame;
use crate::layer::{Config, Guarded};
use crate::refusal::LayerRefusal;
use idem_once::detached::Running;

/// The request metadata carrying the key.
pub const IDEMPOTENCY_KEY: &str = idem_core::IDEMPOTENCY_KEY_HEADER;

/// The key as binary metadata, which is refused (`INVALID_ARGUMENT`).
const IDEMPOTENCY_KEY_BIN: &str = "idempotency-key-bin";

/// What the handler of a guarded call finds in its request's extensions
/// (`request.extensions().get::<Idempotency>()`): the claim it runs under,
/// and how the layer is to settle it once the handler answers.
#[derive(Debug, Clone)]
pub struct Idempotency {
    scope: String,
    key: String,
    operation_id: OperationId,
    token: FencingToken,
    takeover: bool,
    /// When the winning claim was sent: its lease counts from then.
    claimed_at: Instant,
    lease: Duration,
    settle: Arc<Mutex<Settle>>,
    /// The handler answered with a head that does not release: its answer
    /// is being read and stored, its effect done or unknown. A panic from
    /// here on (a body stream, a store's driver) keeps the claim, as a
    /// failure does.
    answering: Arc<AtomicBool>,
}

/// How the layer settles the claim once the handler answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Settle {
    /// By the answer's status: stored, or released (see the crate docs).
    ByAnswer,
    /// The outcome is unknown: neither stored nor released, until the
    /// lease runs out.
    Kept,
    /// The answer is not the call's outcome: released whatever its status.
    Released,
    /// The claim was lost (its lease ran out): nothing stored or released.
    Lost,
}

impl Idempotency {
    /// The operation this call stands for: the same across every retry
    /// and takeover of its key. Pass it downstream (a payment provider, an
    /// email service) as *their* idempotency key.
    pub fn operation_id(&self) -> OperationId {
        self.operation_id
    }

    /// The key the client sent.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// The scope the key belongs to.
    pub fn scope(&self) -> &str {
        &self.scope
    }

    /// The claim's fencing token: what the store checks before it takes
    /// this call's answer, or lets its claim go.
    pub fn token(&self) -> FencingToken {
        self.token
    }

    /// Whether this attempt took the key over from one that crashed, was
    /// released or ran out of its lease: its effects may have happened
    /// already, under the same operation id.
    pub fn is_takeover(&self) -> bool {
        self.takeover
    }

    /// How much of the claim's lease is left, on this process's clock
    /// (counted from when the claim was sent): past it a retry may take
    /// the key over. Bound a downstream call by it.
    pub fn lease_left(&self) -> Duration {
        (self.claimed_at + self.lease).saturating_duration_since(Instant::now())
    }

    /// Tells the layer that this call's outcome is unknown (a downstream
    /// call timed out, or its connection broke after the request was
    /// sent): whatever the handler answers (`UNAVAILABLE`,
    /// `DEADLINE_EXCEEDED`) is passed on but neither stored nor releases
    /// the claim, which stays until its lease runs out. A retry before then
    /// gets `ABORTED`; one after it takes the claim over under the same
    /// operation id, so the effect is never attempted twice at once.
    ///
    /// Call it **before** starting an effect whose outcome may be lost, and
    /// [`settle_by_answer`](Self::settle_by_answer) once the outcome is
    /// known: if the handler panics or its task is dropped in between (a
    /// process shutting down), the claim is kept rather than released, so
    /// no retry runs beside an effect that may still be going on.
    pub fn keep_claim(&self) {
        self.set(Settle::Kept);
    }

    /// Tells the layer that the answer is not the call's outcome (a rate
    /// limit met downstream): the claim is released whatever the status,
    /// so the retry runs again, under the same operation id.
    pub fn release_claim(&self) {
        self.set(Settle::Released);
    }

    /// Tells the layer that this attempt lost its claim (a step of
    /// `idem-once` said its lease ran out): whatever the handler answers is
    /// not stored, and the claim is neither completed nor released; the
    /// retry takes it over after the lease and resumes. Answer `ABORTED`
    /// so that the client retries.
    pub fn abandon(&self) {
        self.set(Settle::Lost);
    }

    /// Undoes [`keep_claim`](Self::keep_claim) or
    /// [`release_claim`](Self::release_claim): the answer is stored or
    /// releases the claim by its status, as usual.
    pub fn settle_by_answer(&self) {
        let mut settle = self.settle.lock().unwrap_or_else(|e| e.into_inner());
        if matches!(*settle, Settle::Kept | Settle::Released) {
            *settle = Settle::ByAnswer;
        }
    }

    fn set(&self, to: Settle) {
        *self.settle.lock().unwrap_or_else(|e| e.into_inner()) = to;
    }

    fn settle(&self) -> Settle {
        *self.settle.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether a handler that did not answer (it failed, panicked or was
    /// dropped) leaves the claim to its lease rather than release it.
    fn holds_on_failure(&self) -> bool {
        matches!(self.settle(), Settle::Kept | Settle::Lost)
            || self.answering.load(Ordering::SeqCst)
    }
}

/// How a guarded call ended, the `outcome` of `idem_grpc_calls_total`.
#[derive(Debug, Clone, Copy)]
enum Outcome {
    Fresh,
    Takeover,
    MissingKey,
    InvalidKey,
    Invalid,
    StoreUnavailable,
    Mismatch,
    Conflict,
    Replay,
    Released,
    ClaimLost,
    Kept,
    Overloaded,
}

fn count(outcome: Outcome) {
    let label = match outcome {
        Outcome::Fresh => "fresh",
        Outcome::Takeover => "takeover",
        Outcome::MissingKey => "missing_key",
        Outcome::InvalidKey => "invalid_key",
        Outcome::Invalid => "invalid",
        Outcome::StoreUnavailable => "store_unavailable",
        Outcome::Mismatch => "mismatch",
        Outcome::Conflict => "conflict",
        Outcome::Replay => "replay",
        Outcome::Released => "released",
        Outcome::ClaimLost => "claim_lost",
        Outcome::Kept => "kept",
        Outcome::Overloaded => "overloaded",
    };
    metrics::counter!("idem_grpc_calls_total", "outcome" => label).increment(1);
}

/// Serves one call to a guarded method.
pub(crate) async fn handle<S, B>(
    config: Arc<Config>,
    guarded: Guarded,
    mut inner: S,
    request: Request<Body>,
) -> Result<Response<Body>, S::Error>
where
    S: Service<Request<Body>, Response = Response<B>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let (parts, body) = request.into_parts();
    // The key as binary metadata is not read: refused, rather than let
    // the call through unguarded as if it had none.
    if parts.headers.contains_key(IDEMPOTENCY_KEY_BIN) {
        count(Outcome::InvalidKey);
        return Ok(answer::refuse(LayerRefusal::KeyInvalid.status(
            Code::InvalidArgument,
            "the key goes in idempotency-key (text metadata, 1 to 255 visible ASCII characters), not idempotency-key-bin",
        )));
    }
    let values = parts
        .headers
        .get_all(IDEMPOTENCY_KEY)
        .iter()
        .map(HeaderValue::as_bytes);
    let key = IdempotencyKey::from_header_values(values);
    // A call without a key, where none is required, is not guarded: it
    // passes through untouched, whatever its scope (as on the HTTP edge).
    let scope = if matches!(key, Err(KeyError::Missing))
        && matches!(on_missing_key(&config.policy), MissingKey::PassThrough)
    {
        String::new()
    } else {
        match config.scope.scope(&parts) {
            Ok(scope) if scope.len() > idem_core::MAX_SCOPE_LEN => {
                return Ok(answer::refuse(LayerRefusal::ScopeTooLong.status(
                    Code::Unauthenticated,
                    format!(
                        "the call's scope is {} bytes long; at most {} are kept",
                        scope.len(),
                        idem_core::MAX_SCOPE_LEN
                    ),
                )))
            }
            Ok(scope) => scope,
            Err(status) => return Ok(answer::refuse(status)),
        }
    };
    let key = match key {
        Ok(key) => key,
        Err(KeyError::Missing) => match on_missing_key(&config.policy) {
            MissingKey::PassThrough => {
                let call = inner.call(Request::from_parts(parts, body));
                return Ok(call.await?.map(Body::new));
            }
            MissingKey::Reject => {
                count(Outcome::MissingKey);
                return Ok(answer::refuse(LayerRefusal::KeyMissing.status(
                    Code::InvalidArgument,
                    format!(
                        "{} requires idempotency-key metadata: one key per intended call (1 to 255 visible ASCII characters), sent again with every retry",
                        parts.uri.path()
                    ),
                )));
            }
        },
        Err(e) => {
            count(Outcome::InvalidKey);
            return Ok(answer::refuse(LayerRefusal::KeyInvalid.status(
                Code::InvalidArgument,
                format!("the idempotency-key metadata is invalid: {e}"),
            )));
        }
    };
    // Counted from here (its message still to read) until its handler's
    // task ends, even once the caller has gone, so that a graceful
    // shutdown waits for it (`idem_once::detached::idle`): taken and
    // checked in one step, so calls arriving together cannot all pass one
    // count.
    let Some(counted) = Running::admit(config.max_running) else {
        count(Outcome::Overloaded);
        debug!(max = ?config.max_running, "too many guarded calls running; refused before the claim");
        return Ok(answer::overloaded(config.policy.retry_after()));
    };
    let span = tracing::info_span!("idempotency", method = parts.uri.path(), scope = ?scope, key = ?key.as_str());
    async move {
        let max = config.policy.max_body();
        // The frame's 5 bytes ride on top of the message's limit.
        let bytes = match frame::read_body(body, max.saturating_add(5)).await {
            Ok(bytes) => bytes,
            Err(e) => return Ok(answer::refuse(e.into_status())),
        };
        let read = frame::message(&parts.headers, &bytes, max)
            .map_err(frame::FrameError::into_status)
            .and_then(|message| Ok(((guarded.read)(&parts, &message)?, message)));
        let (canonical, message) = match read {
            Ok(read) => read,
            Err(status) => {
                count(Outcome::Invalid);
                debug!(code = ?status.code(), "refused before the claim; nothing stored");
                return Ok(answer::refuse(status));
            }
        };
        // The service gets the message as the layer read it: uncompressed,
        // with no `grpc-encoding`. An encoding the layer reads but the
        // service was not built to accept (or a header naming one on an
        // uncompressed frame) would otherwise be refused by the service
        // after the claim, and that refusal stored and replayed.
        let mut parts = parts;
        let bytes =
            if parts.headers.remove(frame::GRPC_ENCODING).is_some() && bytes.first() == Some(&1) {
                frame::framed(&message)
            } else {
                bytes
            };
        let fingerprint = Fingerprint::of_request(
            "GRPC",
            parts.uri.path(),
            Some("application/grpc"),
            &canonical,
        );
        let claim_request = ClaimRequest {
            scope: scope.clone(),
            key: key.as_str().to_owned(),
            fingerprint,
            lease: config.policy.lease(),
            retention: config.policy.retention(),
        };
        let call = Call { scope, key };
        run_claimed(config, inner, parts, bytes, claim_request, call, counted).await
    }
    .instrument(span)
    .await
}

/// Whose call it is, and its key: what the handler is told beside the
/// claim.
struct Call {
    scope: String,
    key: IdempotencyKey,
}

/// Claims until the claim is ours (with when it was sent), or the answer
/// to send instead.
async fn claim(
    config: &Config,
    request: &ClaimRequest,
) -> Result<(Claim, Instant), Response<Body>> {
    let store = &config.store;
    let sent = Mutex::new(Instant::now());
    let found = idem_once::claim_until_decided(&config.policy, &request.fingerprint, || async {
        *sent.lock().unwrap_or_else(|e| e.into_inner()) = Instant::now();
        Ok(match store.claim(request).await? {
            ClaimOutcome::Acquired(claim) => Found::Acquired(claim),
            ClaimOutcome::Existing(record) => Found::Existing(record),
        })
    })
    .await;
    let sent = *sent.lock().unwrap_or_else(|e| e.into_inner());
    found.map(|claim| (claim, sent)).map_err(|refusal| match refusal {
        Refusal::Replay(record) => match &record.state {
            RecordState::Completed { response, .. } => {
                count(Outcome::Replay);
                debug!("replaying the stored answer");
                answer::replay(response)
            }
            RecordState::InProgress { .. } => answer::in_flight(config.policy.retry_after()),
        },
        Refusal::Mismatch => {
            count(Outcome::Mismatch);
            info!("key reused with another message");
            answer::refuse(LayerRefusal::KeyReused.status(
                Code::FailedPrecondition,
                "this idempotency-key was first used with another request message or method; a new call needs a new key",
            ))
        }
        Refusal::InFlight { retry_after } => {
            count(Outcome::Conflict);
            debug!(?retry_after, "a call with this key is in flight");
            answer::in_flight(retry_after)
        }
        Refusal::Unavailable(e) => {
            count(Outcome::StoreUnavailable);
            warn!(error = %e, "idempotency store unavailable");
            answer::refuse(LayerRefusal::StoreUnavailable.status(
                Code::Unavailable,
                "the idempotency store is unavailable; nothing ran: retry with the same idempotency-key",
            ))
        }
    })
}

/// Claims the key, then runs the handler holding the claim, both on a
/// task of their own, then stores its answer or releases the claim. A
/// client that goes away (or whose deadline passes) cancels neither
/// half-way: not the handler, so its answer is stored and the retry gets
/// the replay; nor the claim, which the store may have committed before
/// its answer came back: dropped then, it would leave the key held for a
/// lease by a handler that never runs.
async fn run_claimed<S, B>(
    config: Arc<Config>,
    mut inner: S,
    mut parts: http::request::Parts,
    bytes: Bytes,
    request: ClaimRequest,
    call: Call,
    counted: Running,
) -> Result<Response<Body>, S::Error>
where
    S: Service<Request<Body>, Response = Response<B>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let store = config.store.clone();
    // The claim and its handle, once won: what a task that panicked held.
    let won: Arc<OnceLock<(Claim, Idempotency)>> = Arc::default();
    let watched = won.clone();
    let run = async move {
        let _counted = counted;
        let (claim, claimed_at) = match claim(&config, &request).await {
            Ok(claimed) => claimed,
            Err(answer) => return Ok(answer),
        };
        count(if claim.takeover {
            Outcome::Takeover
        } else {
            Outcome::Fresh
        });
        debug!(operation_id = %claim.operation_id, takeover = claim.takeover, "claimed");
        let handle = Idempotency {
            scope: call.scope,
            key: call.key.into_string(),
            operation_id: claim.operation_id,
            token: claim.token,
            takeover: claim.takeover,
            claimed_at,
            lease: config.policy.lease(),
            settle: Arc::new(Mutex::new(Settle::ByAnswer)),
            answering: Arc::default(),
        };
        let _ = won.set((claim.clone(), handle.clone()));
        parts.extensions.insert(handle.clone());
        // The answer is stored as sent and replayed to any client: it must
        // not be compressed with an encoding only this caller accepts.
        parts.headers.remove("grpc-accept-encoding");
        let request = Request::from_parts(parts, Body::new(Full::new(bytes)));
        // Should this task panic, or be dropped with its runtime, the
        // guard still frees the key (unless the handler said to keep it).
        let mut guard = ReleaseOnDrop(Some((config.store.clone(), claim.clone(), handle.clone())));
        let result = inner.call(request).await;
        let finished = finish(&config, &claim, &handle, result).await;
        guard.0 = None;
        finished
    };
    match idem_once::detached::join(tokio::spawn(run.in_current_span())).await {
        Ok(result) => result,
        Err(e) => match watched.get() {
            Some((_, handle)) if handle.holds_on_failure() => {
                count(Outcome::Kept);
                warn!(
                    panicked = e.is_panic(),
                    "the call did not finish, its outcome unknown or its answer unstored; the claim stays until its lease runs out"
                );
                Ok(answer::refuse(LayerRefusal::HandlerFailed.status(
                    Code::Unavailable,
                    "the handler failed before its answer was stored, its outcome unknown; nothing was stored: retry with the same idempotency-key once its lease has run out",
                )))
            }
            Some((claim, _)) => {
                count(Outcome::Released);
                warn!(
                    panicked = e.is_panic(),
                    "the handler did not finish; releasing the claim"
                );
                release(&*store, claim).await;
                Ok(answer::refuse(LayerRefusal::HandlerFailed.status(
                    Code::Internal,
                    "the handler failed before answering; nothing was stored: retry with the same idempotency-key",
                )))
            }
            // The store's claim itself failed so: whether it took the key
            // is unknown (if it did, the key frees when its lease runs out).
            None => {
                count(Outcome::StoreUnavailable);
                warn!(panicked = e.is_panic(), "the claim did not finish");
                Ok(answer::refuse(LayerRefusal::StoreUnavailable.status(
                    Code::Unavailable,
                    "the idempotency store failed while claiming the key; retry with the same idempotency-key",
                )))
            }
        },
    }
}

/// After the handler: store its answer, release the claim, or leave it to
/// its lease, as the answer's status and the handler's word
/// ([`Idempotency::keep_claim`] and the like) say.
async fn finish<B, E>(
    config: &Config,
    claim: &Claim,
    handle: &Idempotency,
    result: Result<Response<B>, E>,
) -> Result<Response<Body>, E>
where
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let response = match result {
        Ok(response) => response,
        Err(e) => {
            if handle.holds_on_failure() {
                count(Outcome::Kept);
                warn!("the handler failed, its outcome unknown; the claim stays until its lease runs out");
            } else {
                count(Outcome::Released);
                release(&*config.store, claim).await;
            }
            return Err(e);
        }
    };
    let (parts, body) = response.into_parts();
    if !releases_a_broken_answer(config, handle, &parts) {
        handle.answering.store(true, Ordering::SeqCst);
    }
    let collected = body.collect().await.map_err(|e| e.into().to_string());
    let collected = match collected {
        Ok(collected) => collected,
        Err(e) if releases_a_broken_answer(config, handle, &parts) => {
            warn!(error = %e, "the handler's answer failed; releasing the claim");
            count(Outcome::Released);
            release(&*config.store, claim).await;
            return Ok(answer::refuse(LayerRefusal::HandlerFailed.status(
                Code::Internal,
                "the handler's answer failed; nothing was stored: retry with the same idempotency-key",
            )));
        }
        Err(e) => {
            warn!(error = %e, "the handler's answer failed, its outcome unknown; the claim stays until its lease runs out");
            count(Outcome::Kept);
            return Ok(answer::refuse(LayerRefusal::HandlerFailed.status(
                Code::Unavailable,
                "the handler's answer failed, its outcome unknown; nothing was stored: retry with the same idempotency-key once its lease has run out",
            )));
        }
    };
    let trailers = collected.trailers().cloned();
    let data = collected.to_bytes();
    let code = answer::code_of(parts.status, &parts.headers, trailers.as_ref());
    // A refusal of idem's own that the handler passed on (a service it
    // called, guarded by idem too, said "in flight" or "unavailable"):
    // nothing happened that a replay should give. And `CANCELLED` passed on
    // (a call it made was cut off): the outcome is unknown.
    let passed_on = passed_on_refusal(&parts.headers, trailers.as_ref());
    match handle.settle() {
        Settle::ByAnswer if passed_on => {
            count(Outcome::Released);
            info!(
                ?code,
                "the handler passed on an idem refusal (nothing ran that a replay should give); releasing the claim"
            );
            release(&*config.store, claim).await;
        }
        Settle::ByAnswer if code == Code::Cancelled => {
            count(Outcome::Kept);
            info!(
                "the handler answered CANCELLED (a call it made was cut off, its outcome unknown); the claim stays until its lease runs out"
            );
        }
        Settle::Kept => {
            count(Outcome::Kept);
            info!(
                ?code,
                "the handler's outcome is unknown; the claim stays until its lease runs out"
            );
        }
        Settle::Lost => {
            count(Outcome::ClaimLost);
            info!(
                ?code,
                "the handler lost its claim; its answer is not stored"
            );
        }
        Settle::Released => {
            count(Outcome::Released);
            info!(
                ?code,
                "the handler's answer is not the call's outcome; releasing the claim"
            );
            release(&*config.store, claim).await;
        }
        Settle::ByAnswer if answer::is_stored(code, &config.policy) => {
            let stored = answer::stored(&parts.headers, trailers.as_ref(), data.clone(), |name| {
                config.replays(name)
            });
            match config.store.complete(claim, &stored).await {
                Ok(()) => debug!(?code, "stored the answer"),
                Err(StoreError::ClaimLost) => {
                    count(Outcome::ClaimLost);
                    warn!(
                        "the claim was taken over while the handler ran; its answer is not stored"
                    )
                }
                // The effect happened but its record did not complete: keep
                // the claim, so that only a retry after the lease runs out
                // runs again, under the same operation id.
                Err(e) => {
                    warn!(error = %e, "could not store the answer; the claim stays until its lease runs out")
                }
            }
        }
        Settle::ByAnswer => {
            count(Outcome::Released);
            info!(?code, "the handler failed; releasing the claim");
            release(&*config.store, claim).await;
        }
    }
    Ok(Response::from_parts(
        parts,
        Body::new(Buffered::new(data, trailers)),
    ))
}

/// Whether an answer's status (its trailers, or its headers for a
/// trailers-only answer) is one of idem's own refusals that say nothing
/// final happened: in flight, the store unavailable, a handler that failed
/// or a message that could not be read, passed on by a handler from a call
/// it made to a service guarded by idem.
fn passed_on_refusal(headers: &http::HeaderMap, trailers: Option<&http::HeaderMap>) -> bool {
    let Some(status) = trailers
        .and_then(tonic::Status::from_header_map)
        .or_else(|| tonic::Status::from_header_map(headers))
    else {
        return false;
    };
    matches!(
        LayerRefusal::of(&status),
        Some(
            LayerRefusal::InFlight
                | LayerRefusal::StoreUnavailable
                | LayerRefusal::HandlerFailed
                | LayerRefusal::MessageUnreadable
                | LayerRefusal::Overloaded
        )
    )
}

/// Releases its claim when dropped armed: the handler's task panicked or
/// was dropped before it finished (unless the handler said to keep it).
struct ReleaseOnDrop(Option<(Arc<dyn Store>, Claim, Idempotency)>);

impl Drop for ReleaseOnDrop {
    fn drop(&mut self) {
        let Some((store, claim, handle)) = self.0.take() else {
            return;
        };
        if handle.holds_on_failure() {
            warn!("the handler did not finish, its outcome unknown; the claim stays until its lease runs out");
            return;
        }
        warn!("the handler did not finish; releasing the claim");
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move { release(&*store, &claim).await });
        }
    }
}

/// Whether a claim whose handler answered, but whose answer's body then
/// failed, is released. A gRPC status comes in the trailers, after the
/// message: the handler ran and its outcome is unknown, so the claim stays
/// until its lease runs out (released, a retry would run the handler again
/// at once beside an effect that may be done), unless the handler said to
/// release it, or the head already named a status that is not stored (a
/// trailers-only failure, or an HTTP status other than `200`).
fn releases_a_broken_answer(
    config: &Config,
    handle: &Idempotency,
    head: &http::response::Parts,
) -> bool {
    match handle.settle() {
        Settle::Released => true,
        Settle::Kept | Settle::Lost => false,
        Settle::ByAnswer => {
            let named =
                head.status != http::StatusCode::OK || head.headers.contains_key("grpc-status");
            named
                && !answer::is_stored(
                    answer::code_of(head.status, &head.headers, None),
                    &config.policy,
                )
        }
    }
}

/// Releases `claim` so that the next retry runs afresh.
async fn release(store: &dyn Store, claim: &Claim) {
    let started = Instant::now();
    match store.release(claim).await {
        Ok(()) => debug!(elapsed = ?started.elapsed(), "released the claim"),
        Err(StoreError::ClaimLost) => debug!("nothing to release: the claim had moved on"),
        Err(e) => {
            warn!(error = %e, "could not release the claim; it frees itself when its lease runs out")
        }
    }
}
