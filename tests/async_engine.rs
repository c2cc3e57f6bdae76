//! The async entry points (`begin_async`, `complete_async`, `fail_async`)
//! answer exactly as the synchronous ones do: the same `Begin` outcomes in
//! the same situations, the same errors on a poisoned engine. Guards
//! against the two paths drifting apart, and against a dropped future
//! losing what it was doing: a claim committed after its `begin_async`
//! future was dropped must be released (not left PROCESSING until its
//! lease runs out), and a `complete_async` future dropped at once must
//! still record the outcome. Also guards against `begin_async` holding its
//! runtime thread while a commit waits: resuming a key with effect steps
//! settles a step by a write that must be awaited, not waited for.

mod common;
#[path = "common/faulty_backend.rs"]
mod faulty_backend;

use std::error::Error;
use std::future::Future;
use std::pin::pin;
use std::sync::mpsc;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use idempotency::{
    Begin, EffectStep, Engine, Envelope, Failure, Fingerprint, IdempotencyKey, ManualClock,
    StepResolution,
};

use common::{claimed, replay};
use faulty_backend::FaultyBackend;

type TestResult = Result<(), Box<dyn Error + Send + Sync>>;

fn key(name: &str) -> Result<IdempotencyKey, idempotency::Error> {
    IdempotencyKey::new("async", name)
}

fn fp(n: u8) -> Fingerprint {
    Fingerprint::builder().part("n", &[n]).finish()
}

/// A name for each kind of answer, to compare sync and async runs.
fn kind(b: &Begin) -> String {
    match b {
        Begin::Claimed(_) => "claimed".into(),
        Begin::Replay(r) => format!("replay {} {:?}", r.envelope.status, r.envelope.body),
        Begin::Processing { .. } => "processing".into(),
        Begin::Mismatch => "mismatch".into(),
        Begin::InDoubt(_) => "unknown".into(),
        Begin::Tombstoned { .. } => "tombstoned".into(),
    }
}

/// One scripted session against `engine`, through the sync or async calls;
/// returns every answer's kind in order.
async fn script(
    engine: &Engine,
    use_async: bool,
) -> Result<Vec<String>, Box<dyn Error + Send + Sync>> {
    let mut seen = Vec::new();
    let begin = |k: IdempotencyKey, f: Fingerprint| async move {
        if use_async {
            engine.begin_async(&k, f).await
        } else {
            engine.begin(&k, f)
        }
    };
    let done = |c, e: Envelope| async move {
        if use_async {
            engine.complete_async(c, e).await
        } else {
            engine.complete(c, e)
        }
    };
    let fail = |c, f: Failure| async move {
        if use_async {
            engine.fail_async(c, f).await
        } else {
            engine.fail(c, f)
        }
    };
    // Claim, then processing, mismatch; complete, then replay.
    let first = begin(key("a")?, fp(1)).await?;
    seen.push(kind(&first));
    seen.push(kind(&begin(key("a")?, fp(1)).await?));
    seen.push(kind(&begin(key("a")?, fp(2)).await?));
    done(claimed(first)?, Envelope::new(1, 201, "made")).await?;
    seen.push(kind(&begin(key("a")?, fp(1)).await?));
    seen.push(kind(&begin(key("a")?, fp(2)).await?));
    // A retryable failure frees the key; a final one is replayed.
    let c = claimed(begin(key("b")?, fp(1)).await?)?;
    fail(c, Failure::Retryable).await?;
    let c = claimed(begin(key("b")?, fp(1)).await?)?;
    seen.push("claimed again".into());
    fail(c, Failure::Final(Envelope::new(1, 402, "no"))).await?;
    seen.push(kind(&begin(key("b")?, fp(1)).await?));
    // An unknown outcome: processing until the lease ends, then unknown.
    let c = claimed(begin(key("c")?, fp(1)).await?)?;
    let reason = "the provider timed out".to_string();
    fail(c, Failure::InDoubt { reason }).await?;
    seen.push(kind(&begin(key("c")?, fp(1)).await?));
    // A response over the limit comes back with the claim, unused.
    let c = claimed(begin(key("d")?, fp(1)).await?)?;
    let big = Envelope::new(1, 200, vec![0_u8; 70_000]);
    match done(c, big).await {
        Err(idempotency::Error::ResponseTooLarge { .. }) => seen.push("too large".into()),
        other => seen.push(format!("unexpected {other:?}")),
    }
    Ok(seen)
}

/// An engine whose clock stands still, so lease answers are the same on
/// both runs.
fn engine() -> Result<Engine, idempotency::OpenError> {
    Engine::builder()
        .clock(ManualClock::new(1_000_000))
        .lease(Duration::from_secs(3600))
        .max_response_bytes(64 * 1024)
        .sweep_interval(None)
        .in_memory()
}

#[tokio::test]
async fn async_calls_answer_as_the_sync_ones_do() -> TestResult {
    let sync_engine = engine()?;
    // The sync calls block this (current-thread) runtime's only thread,
    // which nothing else needs meanwhile.
    let sync_answers = common_block_on(script(&sync_engine, false))?;
    let async_engine = engine()?;
    let async_answers = script(&async_engine, true).await?;
    assert_eq!(sync_answers, async_answers);
    assert_eq!(async_answers[0], "claimed");
    assert_eq!(async_answers[3], "replay 201 [109, 97, 100, 101]");
    assert_eq!(async_answers.last().map(String::as_str), Some("too large"));
    Ok(())
}

/// Runs a future whose every step is synchronous (the sync calls).
fn common_block_on<F: Future>(f: F) -> F::Output {
    let mut f = pin!(f);
    let mut cx = Context::from_waker(Waker::noop());
    loop {
        if let Poll::Ready(out) = f.as_mut().poll(&mut cx) {
            return out;
        }
    }
}

#[tokio::test]
async fn a_poisoned_engine_refuses_async_calls_as_it_refuses_sync_ones() -> TestResult {
    let (backend, faults) = FaultyBackend::new();
    let engine = Arc::new(
        Engine::builder()
            .sweep_interval(None)
            .open_with_backend(backend)?,
    );
    let held = claimed(engine.begin_async(&key("held")?, fp(1)).await?)?;
    faults.fail_writes();
    let failed = engine.begin_async(&key("x")?, fp(1)).await;
    assert!(failed.is_err(), "a claim on a failing disk: {failed:?}");
    let sync = engine.begin(&key("y")?, fp(1));
    let asyn = engine.begin_async(&key("y")?, fp(1)).await;
    let poisoned =
        |r: &idempotency::Result<Begin>| matches!(r, Err(idempotency::Error::Poisoned { .. }));
    assert!(poisoned(&sync), "sync begin: {sync:?}");
    assert!(poisoned(&asyn), "async begin: {asyn:?}");
    let completed = engine
        .complete_async(held, Envelope::new(1, 200, "x"))
        .await;
    assert!(
        matches!(completed, Err(idempotency::Error::Poisoned { .. })),
        "async complete: {completed:?}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_committed_after_its_future_was_dropped_is_released() -> TestResult {
    let engine = Arc::new(
        Engine::builder()
            .lease(Duration::from_millis(1))
            .sweep_interval(None)
            .in_memory()?,
    );
    // Hold the writer thread inside a local write, so the claim below is
    // queued and cannot be answered before its future is dropped.
    let (entered_tx, entered) = mpsc::channel();
    let (go, wait) = mpsc::channel::<()>();
    let local = {
        let engine = engine.clone();
        std::thread::spawn(move || {
            engine.execute_local(&key("writer-held")?, fp(9), move |_tx| {
                let _ = entered_tx.send(());
                let _ = wait.recv_timeout(Duration::from_secs(30));
                Ok(Envelope::new(1, 200, "local"))
            })?;
            Ok::<_, Box<dyn Error + Send + Sync>>(())
        })
    };
    entered.recv_timeout(Duration::from_secs(30))?;
    let k = key("dropped")?;
    {
        let mut begin = pin!(engine.begin_async(&k, fp(1)));
        let mut cx = Context::from_waker(Waker::noop());
        assert!(
            begin.as_mut().poll(&mut cx).is_pending(),
            "the writer is held"
        );
    } // dropped while its claim waits in the writer's queue
    go.send(())?;
    local.join().map_err(|_| "local write thread panicked")??;
    engine.flush()?;
    // Released, not PROCESSING: the next request claims the key at once
    // (the lease is 1 ms, so a record left PROCESSING would read as
    // UNKNOWN by now, never as free).
    let again = engine.begin_async(&k, fp(1)).await?;
    assert_eq!(kind(&again), "claimed");
    engine
        .fail_async(claimed(again)?, Failure::Retryable)
        .await?;
    Ok(())
}

#[tokio::test]
async fn a_dropped_complete_future_still_records_the_outcome() -> TestResult {
    let engine = engine()?;
    let k = key("fire-and-forget")?;
    let claim = claimed(engine.begin_async(&k, fp(1)).await?)?;
    drop(engine.complete_async(claim, Envelope::new(1, 201, "kept")));
    engine.flush()?;
    let replayed = replay(engine.begin_async(&k, fp(1)).await?)?;
    assert_eq!(replayed.envelope.body, b"kept");
    Ok(())
}

/// A redb in-memory backend whose next sync, once armed, waits until the
/// test opens the gate (at most `GATE_WAIT`, then notes that it starved).
#[derive(Debug)]
struct GatedBackend {
    inner: redb::backends::InMemoryBackend,
    gate: Gate,
}

#[derive(Clone, Debug, Default)]
struct Gate(Arc<GateState>);

#[derive(Debug, Default)]
struct GateState {
    armed: std::sync::atomic::AtomicBool,
    open: std::sync::Mutex<bool>,
    opened: std::sync::Condvar,
    starved: std::sync::atomic::AtomicBool,
}

/// Far longer than a commit in memory takes; only reached when the gate's
/// opener cannot run.
const GATE_WAIT: Duration = Duration::from_secs(3);

impl Gate {
    fn hold_next_sync(&self) {
        *self
            .0
            .open
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = false;
        self.0
            .armed
            .store(true, std::sync::atomic::Ordering::SeqCst);
    }

    fn open(&self) {
        *self
            .0
            .open
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = true;
        self.0.opened.notify_all();
    }

    fn starved(&self) -> bool {
        self.0.starved.load(std::sync::atomic::Ordering::SeqCst)
    }

    fn pass(&self) {
        if !self
            .0
            .armed
            .swap(false, std::sync::atomic::Ordering::SeqCst)
        {
            return;
        }
        let open = self
            .0
            .open
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let (open, wait) = self
            .0
            .opened
            .wait_timeout_while(open, GATE_WAIT, |open| !*open)
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if wait.timed_out() && !*open {
            self.0
                .starved
                .store(true, std::sync::atomic::Ordering::SeqCst);
        }
    }
}

impl redb::StorageBackend for GatedBackend {
    fn len(&self) -> std::io::Result<u64> {
        self.inner.len()
    }

    fn read(&self, offset: u64, out: &mut [u8]) -> std::io::Result<()> {
        self.inner.read(offset, out)
    }

    fn set_len(&self, len: u64) -> std::io::Result<()> {
        self.inner.set_len(len)
    }

    fn sync_data(&self) -> std::io::Result<()> {
        self.gate.pass();
        self.inner.sync_data()
    }

    fn write(&self, offset: u64, data: &[u8]) -> std::io::Result<()> {
        self.inner.write(offset, data)
    }
}

/// A key whose attempt charged (confirmed), reserved "receipt" and failed
/// in doubt; "receipt"'s provider says it sent it. `begin_async` from a
/// current-thread runtime settles "receipt" (a write) and resumes the key.
/// The write's commit waits for a task on that same runtime: awaited, the
/// task runs and the commit goes through; waited for on the runtime's only
/// thread, the task cannot run and the commit starves.
#[test]
fn begin_async_awaits_the_step_settlement_it_writes() -> TestResult {
    let gate = Gate::default();
    let backend = GatedBackend {
        inner: redb::backends::InMemoryBackend::new(),
        gate: gate.clone(),
    };
    let engine = Engine::builder()
        .clock(ManualClock::new(1_000_000))
        .lease(Duration::from_secs(3600))
        .sweep_interval(None)
        .step_resolver("receipt", |_| StepResolution::Executed(b"msg_1".to_vec()))
        .open_with_backend(backend)?;
    let k = key("steps-resume")?;
    let c = claimed(engine.begin(&k, fp(1))?)?;
    assert!(matches!(c.effect("charge")?, EffectStep::Run { .. }));
    c.confirm("charge", b"ch_1")?;
    assert!(matches!(c.effect("receipt")?, EffectStep::Run { .. }));
    engine.fail(
        c,
        Failure::InDoubt {
            reason: "mailer timed out".into(),
        },
    )?;

    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    gate.hold_next_sync();
    let answer = runtime.block_on(async {
        let opener = gate.clone();
        // Runs only when the task below yields.
        let opened = tokio::spawn(async move { opener.open() });
        let answer = engine.begin_async(&k, fp(1)).await;
        let _ = opened.await;
        answer
    })?;
    assert!(
        !gate.starved(),
        "begin_async held its runtime thread while a step settlement committed"
    );
    let c = claimed(answer)?;
    assert!(
        matches!(c.effect("receipt")?, EffectStep::Confirmed { ref evidence, .. } if evidence == b"msg_1"),
        "the resumed claim does not see the settled step"
    );
    Ok(())
}
