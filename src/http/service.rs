//! The [`IdempotencyService`] made by the layer.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{Request, Response};
use http_body::Body;
use parking_lot::Mutex;
use tokio::sync::{AcquireError, OwnedSemaphorePermit};

use super::body::{RequestBody, ResponseBody};
use super::config::Config;
use super::future::ResponseFuture;
use super::{flow, IDEMPOTENCY_KEY};
use crate::BoxError;

type Acquire =
    Pin<Box<dyn Future<Output = Result<OwnedSemaphorePermit, AcquireError>> + Send + 'static>>;

/// The service made by [`IdempotencyLayer`](super::IdempotencyLayer).
///
/// `poll_ready` waits for one of the layer's in-flight permits (unless the
/// layer sheds load), then for the inner service.
pub struct IdempotencyService<S> {
    inner: S,
    cfg: Arc<Config>,
    /// The permit won by `poll_ready`, spent by the next `call`.
    permit: Option<OwnedSemaphorePermit>,
    /// A pending acquisition. Behind a mutex only so that the service is
    /// `Sync` (axum requires it); it is only touched through `&mut self`.
    acquiring: Mutex<Option<Acquire>>,
}

impl<S> IdempotencyService<S> {
    pub(crate) fn new(inner: S, cfg: Arc<Config>) -> Self {
        IdempotencyService {
            inner,
            cfg,
            permit: None,
            acquiring: Mutex::new(None),
        }
    }

    /// The inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The inner service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// Consumes the service, returning the inner one.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

impl<S: Clone> Clone for IdempotencyService<S> {
    /// A clone shares the layer's permits but holds none of its own.
    fn clone(&self) -> Self {
        IdempotencyService::new(self.inner.clone(), self.cfg.clone())
    }
}

impl<S: fmt::Debug> fmt::Debug for IdempotencyService<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotencyService")
            .field("inner", &self.inner)
            .field("holds_permit", &self.permit.is_some())
            .finish_non_exhaustive()
    }
}

impl<S, ReqBody, ResBody> tower::Service<Request<ReqBody>> for IdempotencyService<S>
where
    S: tower::Service<Request<RequestBody<ReqBody>>, Response = Response<ResBody>>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ReqBody: Body<Data = Bytes> + Send + 'static,
    ReqBody::Error: Into<BoxError>,
    ResBody: Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    type Response = Response<ResponseBody<ResBody>>;
    type Error = S::Error;
    type Future = ResponseFuture<ResBody, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        if self.permit.is_none() && self.cfg.shed.is_none() {
            let permits = &self.cfg.runtime.permits;
            let acquiring = self
                .acquiring
                .get_mut()
                .get_or_insert_with(|| Box::pin(permits.clone().acquire_owned()));
            match acquiring.as_mut().poll(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(result) => {
                    *self.acquiring.get_mut() = None;
                    // The semaphore is never closed; were it, the request
                    // simply runs without a permit.
                    self.permit = result.ok();
                }
            }
        }
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<ReqBody>) -> Self::Future {
        // The service that was polled ready goes into the future; a fresh
        // clone stays behind for the next call.
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        let mut permit = self.permit.take();
        let ours =
            self.cfg.methods.contains(req.method()) && req.headers().contains_key(&IDEMPOTENCY_KEY);
        if !ours {
            // Passed through (or refused before any engine work): the
            // permit goes back at once.
            permit = None;
        } else if let Some(retry_after) = self.cfg.shed {
            match self.cfg.runtime.permits.clone().try_acquire_owned() {
                Ok(p) => permit = Some(p),
                Err(_) => return ResponseFuture::new(flow::overloaded(retry_after)),
            }
        }
        ResponseFuture::new(flow::handle(self.cfg.clone(), inner, req, permit))
    }
}
