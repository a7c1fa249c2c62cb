//! [`IdempotencyService`]: the middleware itself.

use std::fmt;
use std::sync::Arc;
use std::task::{Context, Poll};

use http::{Request, Response};
use idem_core::BoxFuture;
use tonic::body::Body;
use tonic::server::NamedService;
use tower::Service;

use crate::handle::handle;
use crate::layer::Config;

/// The response future of [`IdempotencyService`].
pub type ResponseFuture<E> = BoxFuture<'static, Result<Response<Body>, E>>;

/// The middleware made by [`IdempotencyLayer`](crate::IdempotencyLayer).
pub struct IdempotencyService<S> {
    inner: S,
    config: Arc<Config>,
}

impl<S: Clone> Clone for IdempotencyService<S> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            config: self.config.clone(),
        }
    }
}

impl<S: fmt::Debug> fmt::Debug for IdempotencyService<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotencyService")
            .field("inner", &self.inner)
            .field("policy", &self.config.policy)
            .finish_non_exhaustive()
    }
}

impl<S> IdempotencyService<S> {
    pub(crate) fn new(inner: S, config: Arc<Config>) -> Self {
        Self { inner, config }
    }

    /// The wrapped service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// Unwraps the inner service.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

/// A guarded service keeps the name it is routed by, so that it can be
/// given to `Server::builder().add_service` on its own.
impl<S: NamedService> NamedService for IdempotencyService<S> {
    const NAME: &'static str = S::NAME;
}

impl<S, B> Service<Request<Body>> for IdempotencyService<S>
where
    S: Service<Request<Body>, Response = Response<B>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    B: http_body::Body<Data = bytes::Bytes> + Send + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    type Response = Response<Body>;
    type Error = S::Error;
    type Future = ResponseFuture<S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<Body>) -> Self::Future {
        // The clone that was driven to readiness serves this call; a fresh
        // clone stays behind for the next one.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let guarded = self.config.methods.get(request.uri().path()).cloned();
        match guarded {
            Some(guarded) => Box::pin(handle(self.config.clone(), guarded, inner, request)),
            None => {
                let call = inner.call(request);
                Box::pin(async move { Ok(call.await?.map(Body::new)) })
            }
        }
    }
}
