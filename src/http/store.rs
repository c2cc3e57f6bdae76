//! Between the layer and the engine: recording outcomes, and building the
//! stored envelope from a response (`replay.rs` turns it back into a
//! response).
//!
//! The layer keeps two headers of its own in stored envelopes, under the
//! reserved prefix `idempotency-layer-` (never sent on a replay; a
//! handler's headers with that prefix are not stored):
//!
//! - `idempotency-layer-body-not-retained`: the body was dropped because the
//!   response was larger than `max_response_bytes`; the value is the body's
//!   length in bytes, or `unknown`.
//! - `idempotency-layer-pointer-digests`: a JSON array of
//!   `[pointer, digest]` pairs, the digest of each fingerprinted JSON
//!   Pointer's value (see [`super::admit`]), to name the differing pointers
//!   of a later mismatch.

use std::future::Future;
use std::sync::Arc;

use http::header::{CONNECTION, LOCATION};
use http::{HeaderMap, StatusCode};

use super::config::{Config, HeaderPolicy};
use super::IDEMPOTENT_REPLAYED;
use crate::{Claim, Engine, Envelope, Failure, OutgoingMessage};

/// Prefix of the layer's own envelope headers.
pub(crate) const RESERVED_PREFIX: &str = "idempotency-layer-";
/// Marks an envelope whose body was not retained.
pub(crate) const NOT_RETAINED: &str = "idempotency-layer-body-not-retained";
// The marker alone (a `u64` length has at most 20 digits) always fits the
// smallest `max_response_bytes`: `not_retained` never builds an envelope
// the engine refuses.
const _: () = assert!(
    NOT_RETAINED.len() + 20 + Envelope::HEADER_OVERHEAD_BYTES
        <= crate::EngineBuilder::MIN_RESPONSE_BYTES
);
/// Per-pointer digests of the request.
pub(crate) const POINTER_DIGESTS: &str = "idempotency-layer-pointer-digests";

/// Outbox messages a handler sends with its success: insert it into the
/// response extensions (with axum: return `(Extension(CompletionMessages(..)),
/// response)`), and the layer stores the messages in the same write as the
/// completion ([`Engine::complete_with_messages`]), under the ids
/// `<claim reference>/<n>`. So a message exists exactly when the request
/// completed: a handler that crashes, is retried and runs again sends it
/// once, and a relay ([`Engine::outbox`], or `nats::Relay` with the `nats`
/// feature) publishes it.
///
/// Stored only with a *stored success* (a 1xx–3xx response, or one the
/// handler marks [`super::Disposition::Store`], that is not a final
/// failure): a retryable, in-doubt or final-failure response drops them, as
/// nothing succeeded. Their topics and payloads count against the engine's
/// `max_response_bytes`, with the response; over it, the outcome is not
/// recorded (503 `outcome-not-recorded`).
#[derive(Clone, Debug, Default)]
pub struct CompletionMessages(pub Vec<OutgoingMessage>);

impl CompletionMessages {
    /// The handler's messages, removed from its response's extensions.
    pub(crate) fn take(extensions: &mut http::Extensions) -> Vec<OutgoingMessage> {
        extensions
            .remove::<CompletionMessages>()
            .map(|m| m.0)
            .unwrap_or_default()
    }
}

/// How a finished claim is reported to the engine.
pub(crate) enum Outcome {
    /// A success, with the outbox messages to store in the same write.
    Complete(Envelope, Vec<OutgoingMessage>),
    Fail(Failure),
}

/// Records an outcome (blocking: waits for the commit). Returns whether it
/// is durable; a failure is logged, with the key, never sent to a client.
pub(crate) fn record(engine: &Engine, claim: Claim, outcome: Outcome) -> bool {
    let key = claim.key().clone();
    let done = match outcome {
        Outcome::Complete(envelope, messages) if messages.is_empty() => {
            engine.complete(claim, envelope)
        }
        Outcome::Complete(envelope, messages) => {
            engine.complete_with_messages(claim, envelope, messages)
        }
        Outcome::Fail(failure) => engine.fail(claim, failure),
    };
    match done {
        Ok(()) => true,
        Err(e) => {
            tracing::error!(%key, error = %e, "could not record the outcome");
            false
        }
    }
}

/// A recording under way: resolves to whether the outcome is durable.
pub(crate) type Recorded = std::pin::Pin<Box<dyn Future<Output = bool> + Send + Sync>>;

/// Records an outcome without blocking this thread: queued to the engine's
/// writer at once and awaited (see [`Engine::complete_async`]) on a healthy
/// redb engine; on the blocking pool where engine calls block (PostgreSQL,
/// or a poisoned engine trying to reopen). Either way the write is under
/// way before this returns, and runs to completion even if the returned
/// future is dropped.
pub(crate) fn submit(engine: Arc<Engine>, claim: Claim, outcome: Outcome) -> Recorded {
    if engine.calls_may_block() {
        let key = claim.key().clone();
        let job = move || record(&engine, claim, outcome);
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            let ok = job();
            return Box::pin(std::future::ready(ok));
        };
        let join = runtime.spawn_blocking(job);
        return Box::pin(async move {
            join.await.unwrap_or_else(|e| {
                tracing::error!(%key, error = %e, "recording the outcome did not finish");
                false
            })
        });
    }
    let key = claim.key().clone();
    let write = match outcome {
        Outcome::Complete(envelope, messages) => {
            engine.complete_with_messages_async(claim, envelope, messages)
        }
        Outcome::Fail(failure) => engine.fail_async(claim, failure),
    };
    Box::pin(async move {
        match write.await {
            Ok(()) => true,
            Err(e) => {
                tracing::error!(%key, error = %e, "could not record the outcome");
                false
            }
        }
    })
}

/// [`submit`], awaited.
pub(crate) async fn record_outcome(engine: Arc<Engine>, claim: Claim, outcome: Outcome) -> bool {
    submit(engine, claim, outcome).await
}

/// A final response's status and stored headers, before its body is known.
pub(crate) struct Stored {
    schema_version: u32,
    status: u16,
    headers: Vec<(String, Vec<u8>)>,
    is_final_failure: bool,
    /// `max_response_bytes`.
    limit: usize,
    /// The handler's [`CompletionMessages`], stored with a success.
    messages: Vec<OutgoingMessage>,
}

impl Stored {
    pub(crate) fn new(
        cfg: &Config,
        status: StatusCode,
        headers: &HeaderMap,
        digests: Option<String>,
    ) -> Stored {
        let mut stored = stored_headers(&cfg.headers, headers);
        if let Some(digests) = digests {
            stored.push((POINTER_DIGESTS.to_owned(), digests.into_bytes()));
        }
        Stored {
            schema_version: cfg.schema_version,
            status: status.as_u16(),
            headers: stored,
            is_final_failure: status.as_u16() >= 400,
            limit: cfg.engine.max_response_bytes(),
            messages: Vec::new(),
        }
    }

    /// Stores `messages` with the completion, if it is a success.
    pub(crate) fn with_messages(mut self, messages: Vec<OutgoingMessage>) -> Stored {
        self.messages = messages;
        self
    }

    /// What the headers count towards the limit (`Envelope::size_bytes`).
    fn headers_bytes(&self) -> usize {
        crate::envelope::headers_size_bytes(&self.headers)
    }

    /// How many body bytes fit beside the headers.
    pub(crate) fn room(&self) -> usize {
        self.limit.saturating_sub(self.headers_bytes())
    }

    /// The completion with its body.
    ///
    /// A body that does not fit beside the headers (even an empty one, when
    /// the headers alone are over the limit) is recorded as not retained:
    /// the engine would refuse the envelope, leaving a known outcome
    /// UNKNOWN.
    pub(crate) fn with_body(mut self, body: impl Into<Vec<u8>>) -> Outcome {
        let body: Vec<u8> = body.into();
        if self.headers_bytes().saturating_add(body.len()) > self.limit {
            return self.not_retained(Some(body.len() as u64));
        }
        let envelope = Envelope {
            schema_version: self.schema_version,
            status: self.status,
            headers: std::mem::take(&mut self.headers),
            body,
        };
        self.into_outcome(envelope)
    }

    /// The completion without its body (`len`: the body's length, if
    /// known). Headers are dropped too if even they do not fit, `Location`
    /// last.
    pub(crate) fn not_retained(mut self, len: Option<u64>) -> Outcome {
        let marker = len.map_or_else(|| "unknown".to_owned(), |n| n.to_string());
        let marker_bytes = Envelope::header_size_bytes(NOT_RETAINED, marker.as_bytes());
        if self.headers_bytes() + marker_bytes > self.limit {
            self.headers
                .retain(|(n, _)| n.eq_ignore_ascii_case(LOCATION.as_str()));
        }
        if self.headers_bytes() + marker_bytes > self.limit {
            self.headers.clear();
        }
        self.headers
            .push((NOT_RETAINED.to_owned(), marker.into_bytes()));
        let envelope = Envelope {
            schema_version: self.schema_version,
            status: self.status,
            headers: std::mem::take(&mut self.headers),
            body: Vec::new(),
        };
        self.into_outcome(envelope)
    }

    fn into_outcome(self, envelope: Envelope) -> Outcome {
        if self.is_final_failure {
            Outcome::Fail(Failure::Final(envelope))
        } else {
            Outcome::Complete(envelope, self.messages)
        }
    }
}

/// The response headers to store, in order, every value of each.
fn stored_headers(policy: &HeaderPolicy, headers: &HeaderMap) -> Vec<(String, Vec<u8>)> {
    // Headers named by `Connection` are hop-by-hop (RFC 9110 section 7.6.1).
    let named_by_connection: Vec<String> = headers
        .get_all(CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(|n| n.trim().to_ascii_lowercase())
        .collect();
    let mut out = Vec::new();
    for (name, value) in headers {
        let n = name.as_str();
        if !policy.stores(name)
            || n.starts_with(RESERVED_PREFIX)
            || *name == IDEMPOTENT_REPLAYED
            || named_by_connection.iter().any(|c| c == n)
        {
            continue;
        }
        out.push((n.to_owned(), value.as_bytes().to_vec()));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::header::{HeaderName, HeaderValue};

    #[test]
    fn hop_by_hop_credentials_and_date_are_not_stored() {
        let mut h = HeaderMap::new();
        for (n, v) in [
            ("content-type", "application/json"),
            ("content-encoding", "gzip"),
            ("content-length", "12"),
            ("set-cookie", "session=secret"),
            ("date", "Mon, 30 Nov 2026 12:00:00 GMT"),
            ("connection", "x-hop"),
            ("x-hop", "1"),
            ("transfer-encoding", "chunked"),
            ("idempotency-layer-body-not-retained", "1"),
            ("etag", "\"v1\""),
        ] {
            h.append(HeaderName::from_static(n), HeaderValue::from_static(v));
        }
        let names: Vec<String> = stored_headers(&HeaderPolicy::AllExcept(Vec::new()), &h)
            .into_iter()
            .map(|(n, _)| n)
            .collect();
        assert_eq!(names, ["content-type", "content-encoding", "etag"]);
        let only = HeaderPolicy::Only(vec![http::header::SET_COOKIE, http::header::ETAG]);
        let names: Vec<String> = stored_headers(&only, &h)
            .into_iter()
            .map(|(n, _)| n)
            .collect();
        // Named explicitly, a credential is stored (issue 25 item 6).
        assert_eq!(names, ["set-cookie", "etag"]);
    }
}
