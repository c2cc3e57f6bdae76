//! One request through the layer: admission, `begin`, the handler, and
//! recording its outcome.

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::header::RETRY_AFTER;
use http::response::Parts as ResponseParts;
use http::{Request, Response, StatusCode};
use http_body::Body;
use http_body_util::BodyExt;
use parking_lot::Mutex;
use tokio::sync::OwnedSemaphorePermit;

use super::admit::{self, Admitted, FingerprintJob, Fingerprinted, Head};
use super::body::{Recording, RequestBody, ResponseBody};
use super::config::Config;
use super::problem::ProblemDetails;
use super::replay;
use super::runtime::{Holding, Runtime};
use super::store::{self, CompletionMessages, Outcome, Stored, POINTER_DIGESTS};
use super::{ClaimInfo, Disposition};
use crate::{Begin, BoxError, Claim, Engine, Failure, Fingerprint, IdempotencyKey};

/// How often a waiting duplicate re-reads a key held by another process.
const WAIT_POLL: Duration = Duration::from_millis(50);

type Answer<B, E> = Result<Response<ResponseBody<B>>, E>;

/// The answer when the layer sheds load.
// A future, so the shed path has the same type as the served path.
#[allow(clippy::unused_async)]
pub(crate) async fn overloaded<B, E>(retry_after: Duration) -> Answer<B, E> {
    Ok(ProblemDetails::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "overloaded",
        "Server at capacity",
        "the server is handling as many idempotent requests as it can; nothing was stored; \
         retry after Retry-After seconds",
    )
    .retry_after(ceil_secs(retry_after))
    .into_response())
}

pub(crate) async fn handle<S, ReqBody, ResBody>(
    cfg: Arc<Config>,
    mut inner: S,
    req: Request<ReqBody>,
    permit: Option<OwnedSemaphorePermit>,
) -> Answer<ResBody, S::Error>
where
    S: tower::Service<Request<RequestBody<ReqBody>>, Response = Response<ResBody>>,
    ReqBody: Body<Data = Bytes>,
    ReqBody::Error: Into<BoxError>,
    ResBody: Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    let (parts, body) = req.into_parts();
    let (key, route) = match admit::check_head(&cfg, &parts) {
        Ok(Head::Pass) => {
            drop(permit);
            let response = inner
                .call(Request::from_parts(parts, RequestBody::passed(body)))
                .await?;
            return Ok(response.map(ResponseBody::inner));
        }
        Ok(Head::Claim { key, route }) => (key, route),
        Err(problem) => return Ok(problem.into_response()),
    };
    // Held until the outcome is recorded (or, for a streamed response,
    // until its head is sent).
    let _permit = permit;
    let Admitted {
        key,
        route,
        lease,
        wait,
        job,
    } = match admit::admit(&cfg, &parts, key, route, body).await {
        Ok(admitted) => admitted,
        Err(problem) => return Ok(problem.into_response()),
    };
    let body = job.body.clone();
    let fingerprinted = match fingerprint(&cfg, job).await {
        Ok(fingerprinted) => fingerprinted,
        Err(problem) => return Ok(problem.into_response()),
    };
    let mut begin = match begin(&cfg, &key, fingerprinted.fingerprint, lease).await {
        Ok(begin) => begin,
        Err(problem) => return Ok(problem.into_response()),
    };
    let deadline = wait.map(|w| Instant::now() + w);
    let problem = loop {
        match begin {
            Begin::Claimed(claim) => {
                let holding = cfg.runtime.hold(key, route);
                let digests = fingerprinted
                    .digests
                    .and_then(|d| serde_json::to_string(&d).ok());
                return run_claimed(&cfg, inner, parts, body, claim, holding, digests).await;
            }
            Begin::Replay(replay) => return Ok(replay::replay_response(replay.envelope)),
            Begin::Processing { retry_after } => {
                if let Some(deadline) = deadline.filter(|d| Instant::now() < *d) {
                    wait_for(&cfg.runtime, &key, deadline).await;
                    match self::begin(&cfg, &key, fingerprinted.fingerprint, lease).await {
                        Ok(again) => begin = again,
                        Err(problem) => break problem,
                    }
                    continue;
                }
                let after = cfg.runtime.expected_remaining(&route, &key, retry_after);
                let lease_end = cfg
                    .engine
                    .clock()
                    .now_ms()
                    .saturating_add(crate::clock::duration_ms(retry_after));
                break ProblemDetails::new(
                    StatusCode::CONFLICT,
                    "processing",
                    "Request processing",
                    "a request with this Idempotency-Key is still being processed",
                )
                .retry_after(ceil_secs(after))
                .lease_ends_at(lease_end);
            }
            Begin::Mismatch => break mismatch(&cfg, key, fingerprinted.digests).await,
            Begin::InDoubt(in_doubt) => break outcome_unknown(&cfg, &in_doubt),
            Begin::Tombstoned { reusable_at_ms, .. } => break expired(&cfg, reusable_at_ms),
        }
    };
    Ok(problem.into_response())
}

/// The answer for a key whose earlier attempt's outcome is unknown: the
/// operation's reference, each effect step's name and state (never its
/// evidence: a provider's answer may hold data the client should not see),
/// and whether a retry can help without an operator.
fn outcome_unknown(cfg: &Config, in_doubt: &crate::InDoubt) -> ProblemDetails {
    tracing::info!(key = %in_doubt.key, reference = %in_doubt.reference, steps = in_doubt.steps.len(), "outcome unknown");
    let steps: Vec<serde_json::Value> = in_doubt
        .steps
        .iter()
        .map(|s| serde_json::json!({ "name": s.name, "state": s.state.as_str() }))
        .collect();
    // With steps, a settled key resumes: the retry runs the handler again,
    // and only the calls not yet confirmed are made.
    let detail = if in_doubt.steps.is_empty() {
        "an earlier request with this Idempotency-Key may have had effects that \
         were not recorded; it is being recovered and will not be executed again"
    } else {
        "an earlier request with this Idempotency-Key stopped while an external call's \
         outcome was unknown; each such call is being checked with its provider. Once all \
         are settled, a retry runs the request again and makes only the calls not already \
         confirmed"
    };
    ProblemDetails::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "outcome-unknown",
        "Outcome being recovered",
        detail,
    )
    .retry_after(ceil_secs(cfg.in_doubt_retry_after))
    .lease_ends_at(in_doubt.resolvable_at_ms)
    .member("reference", in_doubt.reference.clone().into())
    .member("steps", steps.into())
    .member(
        "retry_can_help",
        cfg.engine.settles_in_doubt(in_doubt).into(),
    )
}

/// The answer for a key whose record expired and is kept as a tombstone
/// until `reusable_at_ms`.
fn expired(cfg: &Config, reusable_at_ms: u64) -> ProblemDetails {
    let now_ms = cfg.engine.clock().now_ms();
    let wait = Duration::from_millis(reusable_at_ms.saturating_sub(now_ms));
    let at = std::time::UNIX_EPOCH + Duration::from_millis(reusable_at_ms);
    ProblemDetails::new(
        cfg.expired_status,
        "key-expired",
        "Idempotency-Key expired",
        format!(
            "this Idempotency-Key expired; it may not be reused before {} \
             (in {} s); use a new key",
            httpdate::fmt_http_date(at),
            ceil_secs(wait)
        ),
    )
    .instant("reusable_at", reusable_at_ms)
}

/// Waits until this process's claim on `key` is done, or for one poll
/// interval if another process holds it, never past `deadline`.
async fn wait_for(runtime: &Runtime, key: &IdempotencyKey, deadline: Instant) {
    let left = deadline.saturating_duration_since(Instant::now());
    match runtime.watch(key) {
        // `changed` fails (returns) once the holder drops its sender.
        Some(mut done) => drop(tokio::time::timeout(left, done.changed()).await),
        None => tokio::time::sleep(left.min(WAIT_POLL)).await,
    }
}

/// The mismatch answer, naming the JSON Pointers whose values differ from
/// the stored request's when both requests have per-pointer digests.
async fn mismatch(
    cfg: &Config,
    key: IdempotencyKey,
    digests: Option<Vec<(String, String)>>,
) -> ProblemDetails {
    let problem = ProblemDetails::new(
        cfg.mismatch_status,
        "key-mismatch",
        "Idempotency-Key reused",
        "this Idempotency-Key was already used for a different request",
    );
    let Some(digests) = digests else {
        return problem;
    };
    // A point read: a snapshot read on a healthy redb engine, done here;
    // a network round trip on PostgreSQL, done on the blocking pool.
    let record = if cfg.engine.calls_may_block() {
        let engine = cfg.engine.clone();
        tokio::task::spawn_blocking(move || engine.record(&key)).await
    } else {
        Ok(cfg.engine.record(&key))
    };
    let stored = match record {
        Ok(Ok(Some(record))) => record.response,
        Ok(Err(e)) => {
            tracing::warn!(error = %e, "could not read the record to name differing pointers");
            None
        }
        _ => None,
    };
    let differing = stored
        .as_ref()
        .and_then(|envelope| envelope.header(POINTER_DIGESTS))
        .and_then(|stored| admit::differing_pointers(stored, &digests));
    match differing {
        Some(pointers) => problem.member("pointers", pointers.into()),
        None => problem,
    }
}

fn ceil_secs(d: Duration) -> u64 {
    u64::try_from(d.as_millis().div_ceil(1000))
        .unwrap_or(u64::MAX)
        .max(1)
}

/// A 503 for a failed engine call (storage failing, the engine poisoned or
/// closed): nothing was run, and a retry with the same key is safe. The
/// error goes to the log only.
fn engine_problem(e: &dyn std::fmt::Display) -> ProblemDetails {
    tracing::error!(error = %e, "idempotency engine failed");
    ProblemDetails::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "engine-error",
        "Idempotency store unavailable",
        "the idempotency store could not process this request; it was not run; \
         retry with the same Idempotency-Key",
    )
    .retry_after(1)
}

/// A 500 for a key whose stored record is damaged (issue 14: a damaged
/// record is an error, never a replay of wrong bytes and never a fresh
/// run): nothing was run, and retrying does not help until an operator
/// repairs the record (`idem verify` lists it). No `Retry-After`.
fn corrupt_problem() -> ProblemDetails {
    ProblemDetails::new(
        StatusCode::INTERNAL_SERVER_ERROR,
        "stored-record-corrupt",
        "Stored record damaged",
        "the stored record for this Idempotency-Key is damaged; the request was not run; \
         an operator must repair the record before this key can be used",
    )
}

/// A 500 for a key whose evidence log is full (`Error::HistoryFull`): the
/// engine refuses every further transition of the key, so a retry meets the
/// same refusal until an operator acts (`idem show`, then `idem purge`).
/// Nothing was run. No `Retry-After`.
fn log_full_problem() -> ProblemDetails {
    ProblemDetails::new(
        StatusCode::INTERNAL_SERVER_ERROR,
        "evidence-log-full",
        "Evidence log full",
        "this Idempotency-Key has been retried so often that its evidence log is full; the \
         request was not run; retrying does not help: an operator must settle or purge the key",
    )
}

/// The handler answered but its outcome could not be recorded.
fn not_recorded(cfg: &Config) -> ProblemDetails {
    ProblemDetails::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "outcome-not-recorded",
        "Outcome not recorded",
        "the request was processed but its outcome could not be recorded; retry with the same \
         Idempotency-Key: it will not run again, and the retry is answered once the outcome \
         is recovered",
    )
    .retry_after(ceil_secs(cfg.in_doubt_retry_after))
}

/// Computes the request's fingerprint: on this worker for a body under
/// [`admit::INLINE_FINGERPRINT_BYTES`], else on the blocking pool (a large
/// JSON body first waits, asynchronously, for a fingerprinting permit: a
/// bound on the CPU and memory that canonicalizing takes at once).
async fn fingerprint(cfg: &Config, job: FingerprintJob) -> Result<Fingerprinted, ProblemDetails> {
    if job.runs_inline() {
        return job.run();
    }
    let permit = if job.is_heavy() {
        cfg.runtime.fingerprints.clone().acquire_owned().await.ok()
    } else {
        None
    };
    let joined = tokio::task::spawn_blocking(move || {
        let fingerprinted = job.run();
        drop(permit);
        fingerprinted
    })
    .await;
    joined.unwrap_or_else(|e| {
        Err(engine_problem(&format_args!(
            "fingerprinting did not finish: {e}"
        )))
    })
}

/// Runs `begin`: awaited on this worker when the engine's calls do not
/// block (redb, healthy: see [`Engine::begin_async`]), else on the
/// blocking pool (PostgreSQL, or a poisoned engine whose next write tries
/// a reopen). A claim won after the request future was dropped is released
/// either way (by the store, or by [`begin_blocking`]'s handoff).
async fn begin(
    cfg: &Config,
    key: &IdempotencyKey,
    fingerprint: Fingerprint,
    lease: Option<Duration>,
) -> Result<Begin, ProblemDetails> {
    let engine = &cfg.engine;
    if engine.calls_may_block() {
        return begin_blocking(engine.clone(), key.clone(), fingerprint, lease).await;
    }
    let begun = match lease {
        Some(lease) => engine.begin_with_lease_async(key, fingerprint, lease).await,
        None => engine.begin_async(key, fingerprint).await,
    };
    begun.map_err(|e| begin_problem(key, &e))
}

/// The answer to a failed `begin`: a 500 where only an operator can help
/// (a damaged record, a full evidence log), else a 503 `engine-error`.
fn begin_problem(key: &IdempotencyKey, e: &crate::Error) -> ProblemDetails {
    match e {
        crate::Error::Corrupt {
            what: crate::Corrupted::Record(_),
            ..
        } => {
            tracing::error!(%key, error = %e, "stored record is damaged");
            corrupt_problem()
        }
        crate::Error::HistoryFull { .. } => {
            tracing::error!(%key, error = %e, "evidence log full: an operator must act");
            log_full_problem()
        }
        _ => {
            tracing::error!(%key, error = %e, "begin failed");
            engine_problem(e)
        }
    }
}

type BeginAnswer = Result<Begin, ProblemDetails>;

/// Where a blocking `begin` leaves its answer. If the request future is
/// dropped before taking it, a won claim is released (the handler never
/// ran), by whichever side comes second.
enum Slot {
    Waiting,
    Ready(Box<BeginAnswer>),
    Taken,
    Abandoned,
}

struct Handoff {
    engine: Arc<Engine>,
    slot: Mutex<Slot>,
}

/// Marks the handoff abandoned when the request future is dropped.
struct AbandonOnDrop(Arc<Handoff>);

impl Drop for AbandonOnDrop {
    fn drop(&mut self) {
        let previous = std::mem::replace(&mut *self.0.slot.lock(), Slot::Abandoned);
        if let Slot::Ready(answer) = previous {
            let Ok(Begin::Claimed(claim)) = *answer else {
                return;
            };
            let engine = self.0.engine.clone();
            let release = move || release(&engine, claim);
            match tokio::runtime::Handle::try_current() {
                Ok(runtime) => drop(runtime.spawn_blocking(release)),
                Err(_) => release(),
            }
        }
    }
}

fn release(engine: &Engine, claim: Claim) {
    let key = claim.key().clone();
    if let Err(e) = engine.fail(claim, Failure::Retryable) {
        tracing::warn!(%key, error = %e, "could not release an abandoned claim");
    }
}

/// Runs the synchronous `begin` on the blocking pool.
async fn begin_blocking(
    engine: Arc<Engine>,
    key: IdempotencyKey,
    fingerprint: Fingerprint,
    lease: Option<Duration>,
) -> BeginAnswer {
    let handoff = Arc::new(Handoff {
        engine,
        slot: Mutex::new(Slot::Waiting),
    });
    let guard = AbandonOnDrop(handoff.clone());
    let worker = handoff.clone();
    let joined = tokio::task::spawn_blocking(move || {
        let engine = &worker.engine;
        let begun = match lease {
            Some(lease) => engine.begin_with_lease(&key, fingerprint, lease),
            None => engine.begin(&key, fingerprint),
        };
        let answer = begun.map_err(|e| begin_problem(&key, &e));
        let mut slot = worker.slot.lock();
        if matches!(*slot, Slot::Abandoned) {
            drop(slot);
            if let Ok(Begin::Claimed(claim)) = answer {
                release(engine, claim);
            }
        } else {
            *slot = Slot::Ready(Box::new(answer));
        }
    })
    .await;
    let taken = std::mem::replace(&mut *handoff.slot.lock(), Slot::Taken);
    drop(guard);
    match (taken, joined) {
        (Slot::Ready(answer), _) => *answer,
        (_, Err(e)) => Err(engine_problem(&format_args!(
            "the engine call did not finish: {e}"
        ))),
        (_, Ok(())) => Err(engine_problem(&"the engine call left no answer")),
    }
}

/// Which [`Disposition`] a response gets: the handler's, else the status
/// table's.
fn disposition(cfg: &Config, head: &mut ResponseParts) -> Disposition {
    let status = head.status;
    if let Some(d) = head.extensions.remove::<Disposition>() {
        return d;
    }
    if let Some(&(_, d)) = cfg.by_status.iter().find(|(s, _)| *s == status) {
        return d;
    }
    if status == StatusCode::SERVICE_UNAVAILABLE && head.headers.contains_key(RETRY_AFTER) {
        return Disposition::Retry;
    }
    if status.is_server_error() {
        cfg.server_errors
    } else if status.is_client_error() {
        cfg.client_errors
    } else {
        Disposition::Store
    }
}

async fn run_claimed<S, ReqBody, ResBody>(
    cfg: &Config,
    mut inner: S,
    parts: http::request::Parts,
    body: Bytes,
    claim: Claim,
    holding: Holding,
    digests: Option<String>,
) -> Answer<ResBody, S::Error>
where
    S: tower::Service<Request<RequestBody<ReqBody>>, Response = Response<ResBody>>,
    ResBody: Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    let engine = cfg.engine.clone();
    let mut req = Request::from_parts(parts, RequestBody::buffered(body));
    req.extensions_mut().insert(ClaimInfo {
        key: claim.key().clone(),
        reference: claim.reference().to_owned(),
        fencing_token: claim.fencing_token(),
    });
    req.extensions_mut().insert(claim.effects());
    let called = match std::panic::catch_unwind(AssertUnwindSafe(|| inner.call(req))) {
        Ok(future) => CatchUnwind(Box::pin(future)).await,
        Err(panic) => Err(panic),
    };
    let response = match called {
        Ok(Ok(response)) => response,
        Ok(Err(e)) => {
            let reason = "the inner service returned an error".to_string();
            store::record_outcome(engine, claim, Outcome::Fail(Failure::InDoubt { reason })).await;
            return Err(e);
        }
        Err(panic) => {
            let failure = match cfg.panics {
                Disposition::Retry => Failure::Retryable,
                Disposition::Store | Disposition::InDoubt => Failure::InDoubt {
                    reason: "the handler panicked".into(),
                },
            };
            store::record_outcome(engine, claim, Outcome::Fail(failure)).await;
            std::panic::resume_unwind(panic);
        }
    };
    let (mut head, body) = response.into_parts();
    let status = head.status;
    let failure = match disposition(cfg, &mut head) {
        Disposition::Store => None,
        Disposition::Retry => Some(Failure::Retryable),
        Disposition::InDoubt => Some(Failure::InDoubt {
            reason: format!("the handler answered {status} with its outcome unknown"),
        }),
    };
    if let Some(failure) = failure {
        // Not stored: recorded before the head goes out; the body streams
        // through. If recording fails, the answer still says "not done" or
        // "unknown", which is true either way.
        if store::record_outcome(engine, claim, Outcome::Fail(failure)).await {
            holding.finished();
        }
        return Ok(Response::from_parts(head, ResponseBody::inner(body)));
    }
    let messages = CompletionMessages::take(&mut head.extensions);
    let stored = Stored::new(cfg, status, &head.headers, digests).with_messages(messages);
    let room = stored.room();
    match body.size_hint().exact() {
        Some(len) if len <= room as u64 => {
            // Converted at once: the body's own error type need not be `Send`.
            let collected: Result<_, BoxError> = body.collect().await.map_err(Into::into);
            let bytes = match collected {
                Ok(collected) => collected.to_bytes(),
                Err(e) => {
                    let reason = format!("the response body failed: {e}");
                    tracing::error!(key = %claim.key(), %reason, "response body failed");
                    store::record_outcome(
                        engine,
                        claim,
                        Outcome::Fail(Failure::InDoubt { reason }),
                    )
                    .await;
                    return Ok(ProblemDetails::new(
                        StatusCode::INTERNAL_SERVER_ERROR,
                        "response-error",
                        "Response failed",
                        "the response body failed while being read; the request's outcome is \
                         being recovered",
                    )
                    .into_response());
                }
            };
            if !store::record_outcome(engine, claim, stored.with_body(bytes.to_vec())).await {
                return Ok(not_recorded(cfg).into_response());
            }
            holding.finished();
            Ok(Response::from_parts(head, ResponseBody::full(bytes)))
        }
        Some(len) => {
            // Too large to keep, known now: record the completion without
            // the body, then stream it.
            if !store::record_outcome(engine, claim, stored.not_retained(Some(len))).await {
                return Ok(not_recorded(cfg).into_response());
            }
            holding.finished();
            Ok(Response::from_parts(head, ResponseBody::inner(body)))
        }
        None => {
            let recording = Recording {
                engine,
                claim,
                stored,
                holding,
            };
            Ok(Response::from_parts(
                head,
                ResponseBody::tee(body, recording, room),
            ))
        }
    }
}

/// Polls a future, turning a panic into an `Err` with its payload.
struct CatchUnwind<F>(Pin<Box<F>>);

impl<F: Future> Future for CatchUnwind<F> {
    type Output = Result<F::Output, Box<dyn std::any::Any + Send>>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let future = self.0.as_mut();
        match std::panic::catch_unwind(AssertUnwindSafe(|| future.poll(cx))) {
            Ok(Poll::Ready(output)) => Poll::Ready(Ok(output)),
            Ok(Poll::Pending) => Poll::Pending,
            Err(panic) => Poll::Ready(Err(panic)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_after_rounds_up() {
        assert_eq!(ceil_secs(Duration::ZERO), 1);
        assert_eq!(ceil_secs(Duration::from_millis(1001)), 2);
        assert_eq!(ceil_secs(Duration::from_secs(3)), 3);
    }
}
