//! The [`ResponseFuture`] of [`IdempotencyService`](super::IdempotencyService).

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use http::Response;

use super::body::ResponseBody;

type Inner<B, E> = Pin<Box<dyn Future<Output = Result<Response<ResponseBody<B>>, E>> + Send>>;

/// The future returned by [`IdempotencyService`](super::IdempotencyService):
/// resolves to the response once the request's outcome is recorded (see
/// [`IdempotencyLayer`](super::IdempotencyLayer) for when that is).
///
/// Dropping it while the handler runs leaves the key UNKNOWN; see the
/// layer's docs on cancellation.
#[must_use = "futures do nothing unless polled"]
pub struct ResponseFuture<B, E> {
    inner: Inner<B, E>,
}

impl<B, E> ResponseFuture<B, E> {
    pub(crate) fn new(
        future: impl Future<Output = Result<Response<ResponseBody<B>>, E>> + Send + 'static,
    ) -> Self {
        ResponseFuture {
            inner: Box::pin(future),
        }
    }
}

impl<B, E> Future for ResponseFuture<B, E> {
    type Output = Result<Response<ResponseBody<B>>, E>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.inner.as_mut().poll(cx)
    }
}

impl<B, E> fmt::Debug for ResponseFuture<B, E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}
