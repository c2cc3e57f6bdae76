//! The body types the layer hands on: [`RequestBody`] to the inner service,
//! [`ResponseBody`] to the server. Named types, so that no pre-1.0 body
//! crate is part of this crate's API.

use std::fmt;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::HeaderMap;
use http_body::{Body, Frame, SizeHint};

use super::runtime::Holding;
use super::store::{self, Outcome, Recorded, Stored};
use crate::{BoxError, Claim, Engine};

/// The request body the inner service receives: the original body of a
/// request passed through, or the body the layer read (and fingerprinted)
/// for a claimed one.
pub struct RequestBody<B> {
    kind: RequestKind<B>,
}

enum RequestKind<B> {
    Passed(Pin<Box<B>>),
    Buffered(Option<Bytes>),
}

impl<B> RequestBody<B> {
    pub(crate) fn passed(body: B) -> Self {
        RequestBody {
            kind: RequestKind::Passed(Box::pin(body)),
        }
    }

    pub(crate) fn buffered(bytes: Bytes) -> Self {
        RequestBody {
            kind: RequestKind::Buffered(Some(bytes).filter(|b| !b.is_empty())),
        }
    }
}

impl<B> Body for RequestBody<B>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match &mut self.kind {
            RequestKind::Passed(body) => body.as_mut().poll_frame(cx).map_err(Into::into),
            RequestKind::Buffered(bytes) => Poll::Ready(bytes.take().map(|b| Ok(Frame::data(b)))),
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            RequestKind::Passed(body) => body.is_end_stream(),
            RequestKind::Buffered(bytes) => bytes.is_none(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            RequestKind::Passed(body) => body.size_hint(),
            RequestKind::Buffered(bytes) => {
                SizeHint::with_exact(bytes.as_ref().map_or(0, |b| b.len() as u64))
            }
        }
    }
}

impl<B> fmt::Debug for RequestBody<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match self.kind {
            RequestKind::Passed(_) => "passed",
            RequestKind::Buffered(_) => "buffered",
        };
        f.debug_struct("RequestBody").field("kind", &kind).finish()
    }
}

/// The response body the layer returns: the inner service's body (passed
/// through, or streamed while a copy is recorded), a buffered stored body,
/// or one of the layer's own answers.
pub struct ResponseBody<B> {
    kind: ResponseKind<B>,
}

enum ResponseKind<B> {
    Inner(Pin<Box<B>>),
    Full(Option<Bytes>),
    Tee(Box<Tee<B>>),
}

impl<B> ResponseBody<B> {
    pub(crate) fn inner(body: B) -> Self {
        ResponseBody {
            kind: ResponseKind::Inner(Box::pin(body)),
        }
    }

    pub(crate) fn full(bytes: impl Into<Bytes>) -> Self {
        let bytes: Bytes = bytes.into();
        ResponseBody {
            kind: ResponseKind::Full(Some(bytes).filter(|b| !b.is_empty())),
        }
    }

    /// Streams `body` through and records the outcome when it ends.
    pub(crate) fn tee(body: B, record: Recording, room: usize) -> Self {
        ResponseBody {
            kind: ResponseKind::Tee(Box::new(Tee {
                inner: Box::pin(body),
                copy: Some(Vec::new()),
                room,
                seen: 0,
                record: Some(record),
                state: TeeState::Streaming,
                trailers: None,
            })),
        }
    }
}

impl<B> Body for ResponseBody<B>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match &mut self.kind {
            ResponseKind::Inner(body) => body.as_mut().poll_frame(cx).map_err(Into::into),
            ResponseKind::Full(bytes) => Poll::Ready(bytes.take().map(|b| Ok(Frame::data(b)))),
            ResponseKind::Tee(tee) => tee.poll_frame(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            ResponseKind::Inner(body) => body.is_end_stream(),
            ResponseKind::Full(bytes) => bytes.is_none(),
            ResponseKind::Tee(tee) => matches!(tee.state, TeeState::Done) && tee.trailers.is_none(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            ResponseKind::Inner(body) => body.size_hint(),
            ResponseKind::Full(bytes) => {
                SizeHint::with_exact(bytes.as_ref().map_or(0, |b| b.len() as u64))
            }
            ResponseKind::Tee(tee) => tee.inner.size_hint(),
        }
    }
}

impl<B> fmt::Debug for ResponseBody<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match self.kind {
            ResponseKind::Inner(_) => "inner",
            ResponseKind::Full(_) => "full",
            ResponseKind::Tee(_) => "streamed and recorded",
        };
        f.debug_struct("ResponseBody").field("kind", &kind).finish()
    }
}

/// What a streamed response needs to record its outcome when it ends.
pub(crate) struct Recording {
    pub(crate) engine: Arc<Engine>,
    pub(crate) claim: Claim,
    pub(crate) stored: Stored,
    pub(crate) holding: Holding,
}

impl Recording {
    /// Submits the outcome (queued before this returns, so it is recorded
    /// even if the returned future is dropped); the claim is released from
    /// the layer's in-flight list once the outcome is durable.
    fn spawn(self, outcome: impl FnOnce(Stored) -> Outcome) -> Recorded {
        let Recording {
            engine,
            claim,
            stored,
            holding,
        } = self;
        let recorded = store::submit(engine, claim, outcome(stored));
        Box::pin(async move {
            let ok = recorded.await;
            if ok {
                holding.finished();
            }
            ok
        })
    }
}

/// A response body streamed to the client while a copy is kept, up to
/// `room` bytes, for the stored envelope.
struct Tee<B> {
    inner: Pin<Box<B>>,
    /// `None` once the body outgrew `room`.
    copy: Option<Vec<u8>>,
    room: usize,
    /// Body bytes seen so far.
    seen: u64,
    /// `Some` until the outcome is handed to the engine.
    record: Option<Recording>,
    state: TeeState,
    /// Trailers held back until the outcome is durable.
    trailers: Option<HeaderMap>,
}

enum TeeState {
    Streaming,
    Recording(Recorded),
    Done,
}

impl<B> Tee<B>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    fn poll_frame(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        loop {
            match &mut self.state {
                TeeState::Streaming => match self.inner.as_mut().poll_frame(cx) {
                    Poll::Pending => return Poll::Pending,
                    Poll::Ready(Some(Ok(frame))) => match frame.into_data() {
                        Ok(data) => {
                            self.keep(&data);
                            return Poll::Ready(Some(Ok(Frame::data(data))));
                        }
                        Err(frame) => match frame.into_trailers() {
                            // Trailers end the body: record first.
                            Ok(trailers) => {
                                self.trailers = Some(trailers);
                                self.finish();
                            }
                            // Unknown frame kinds carry no body bytes.
                            Err(frame) => return Poll::Ready(Some(Ok(frame))),
                        },
                    },
                    Poll::Ready(Some(Err(e))) => {
                        let e: BoxError = e.into();
                        if let Some(record) = self.record.take() {
                            let reason = format!("the response body failed while streaming: {e}");
                            drop(
                                record.spawn(|_| Outcome::Fail(crate::Failure::InDoubt { reason })),
                            );
                        }
                        self.state = TeeState::Done;
                        return Poll::Ready(Some(Err(e)));
                    }
                    Poll::Ready(None) => self.finish(),
                },
                TeeState::Recording(recording) => {
                    let recorded = match recording.as_mut().poll(cx) {
                        Poll::Pending => return Poll::Pending,
                        Poll::Ready(recorded) => recorded,
                    };
                    self.state = TeeState::Done;
                    if !recorded {
                        // The end of the stream is withheld: the client sees
                        // an incomplete response, never a complete one whose
                        // outcome was not recorded.
                        self.trailers = None;
                        return Poll::Ready(Some(Err(
                            "the response's outcome could not be recorded".into(),
                        )));
                    }
                }
                TeeState::Done => {
                    return Poll::Ready(self.trailers.take().map(|t| Ok(Frame::trailers(t))));
                }
            }
        }
    }

    fn keep(&mut self, data: &Bytes) {
        self.seen = self.seen.saturating_add(data.len() as u64);
        if let Some(copy) = &mut self.copy {
            if copy.len() + data.len() <= self.room {
                copy.extend_from_slice(data);
            } else {
                self.copy = None;
            }
        }
    }

    /// The body ended: record the outcome, with the copy or marked not
    /// retained.
    fn finish(&mut self) {
        let Some(record) = self.record.take() else {
            self.state = TeeState::Done;
            return;
        };
        let (copy, seen) = (self.copy.take(), self.seen);
        let outcome = move |stored: Stored| match copy {
            Some(body) => stored.with_body(body),
            None => stored.not_retained(Some(seen)),
        };
        self.state = TeeState::Recording(record.spawn(outcome));
    }
}

impl<B> Drop for Tee<B> {
    fn drop(&mut self) {
        // The client went away mid-stream: the handler answered, so the
        // work is done; the body was not all seen, so it is not retained.
        if let Some(record) = self.record.take() {
            drop(record.spawn(|stored| stored.not_retained(None)));
        }
    }
}
