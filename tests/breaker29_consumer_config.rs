//! Breaker 29: JetStream consumers configured so the inbox consumer would
//! lose messages. The JetStream consumer settings decide redelivery, and
//! three of them defeat the inbox: ack policy `None` (a message counts as
//! done on delivery, so a nak for a clean failure is ignored), ack policy
//! `All` (a later ack also acks an earlier message waiting for its
//! redelivery) and a `max_deliver` below the engine's `dead_letter_after`
//! (the server gives up on a failing message before it reaches the dead
//! letters). Each test runs a handler that fails cleanly and then expects
//! the message booked or dead-lettered, never dropped; `Consumer::new`
//! refusing the setting with a clear error also passes.
//!
//! Needs `scripts/with-nats` (skipped without it; a failure under CI=true).

#[path = "common/nats_env.rs"]
mod nats_env;
use nats_env::{nats_url, stream_under, unique_name};

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::jetstream::{self, consumer};
use idempotency::nats::{self, async_nats, Backoff, Consumer, Incoming, NatsError};
use idempotency::{BoxError, Engine, LocalTx};

type TestResult = Result<(), BoxError>;

struct Setup {
    _dir: tempfile::TempDir,
    engine: Arc<Engine>,
    js: jetstream::Context,
    pull: consumer::PullConsumer,
}

/// A fresh stream with `messages` messages (ids `m-0`..), a pull consumer
/// with `ack_policy` and `max_deliver`, and a redb engine.
async fn setup(
    url: &str,
    ack_policy: consumer::AckPolicy,
    max_deliver: i64,
    dead_letter_after: u32,
    messages: usize,
) -> Result<Setup, BoxError> {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let name = unique_name(&format!("B29C{}_", NEXT.fetch_add(1, Ordering::SeqCst)));
    let client = nats::connect(url, Backoff::default(), Duration::from_secs(10)).await?;
    let js = jetstream::new(client);
    let stream = stream_under(&js, &name).await?;
    for i in 0..messages {
        let mut headers = async_nats::HeaderMap::new();
        headers.insert(nats::MSG_ID_HEADER, format!("m-{i}").as_str());
        js.publish_with_headers(format!("{name}.ev"), headers, "x".into())
            .await?
            .await?;
    }
    let pull = stream
        .create_consumer(consumer::pull::Config {
            durable_name: Some(format!("{name}_c")),
            ack_policy,
            ack_wait: Duration::from_secs(1),
            max_deliver,
            ..Default::default()
        })
        .await?;
    let dir = tempfile::tempdir()?;
    let engine = Engine::builder()
        .sweep_interval(None)
        .dead_letter_after(dead_letter_after)
        .open(dir.path().join("idem.redb"))?;
    Ok(Setup {
        _dir: dir,
        engine: Arc::new(engine),
        js,
        pull,
    })
}

/// A handler that fails cleanly on the first delivery of each message and
/// records the ids it booked after that.
fn fails_first_time(
    booked: &Arc<Mutex<Vec<String>>>,
) -> impl Fn(&Incoming, &mut LocalTx<'_>) -> Result<(), BoxError> + Send + Sync + 'static {
    let booked = Arc::clone(booked);
    move |m: &Incoming, _: &mut LocalTx<'_>| {
        if m.attempt == 1 {
            return Err("ledger busy".into());
        }
        booked
            .lock()
            .map_err(|_| "poisoned")?
            .push(m.message_id.clone());
        Ok(())
    }
}

/// Asserts that `Consumer::new`'s refusal names the setting.
fn assert_refused(err: &NatsError, setting: &str) {
    match err {
        NatsError::ConsumerConfig { problem, .. } => {
            assert!(problem.contains(setting), "{err}");
        }
        other => panic!("expected ConsumerConfig, got {other:?}"),
    }
}

/// Fetches for up to `passes` rounds of 300 ms, until `done`.
async fn consume(c: &Consumer, passes: usize, mut done: impl FnMut() -> bool) -> TestResult {
    for _ in 0..passes {
        c.consume_once(16, Duration::from_millis(300)).await?;
        if done() {
            break;
        }
    }
    Ok(())
}

/// Ack policy None: the server counts the message done on its first
/// delivery, so the nak after the clean failure is ignored and the
/// message never comes back: it is neither booked nor dead-lettered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ack_policy_none_does_not_lose_a_cleanly_failed_message() -> TestResult {
    let Some(url) = nats_url() else { return Ok(()) };
    let s = setup(&url, consumer::AckPolicy::None, -1, 5, 1).await?;
    let booked = Arc::new(Mutex::new(Vec::new()));
    let c = match Consumer::new(
        Arc::clone(&s.engine),
        "ledger",
        s.js.clone(),
        s.pull.clone(),
        fails_first_time(&booked),
    ) {
        Err(e) => {
            assert_refused(&e, "AckPolicy::Explicit");
            return Ok(());
        }
        Ok(c) => c.retry_delay(Duration::from_millis(10)),
    };
    let seen = Arc::clone(&booked);
    let _ = consume(&c, 10, || seen.lock().is_ok_and(|b| !b.is_empty())).await;
    assert_eq!(*booked.lock().map_err(|_| "poisoned")?, vec!["m-0"]);
    Ok(())
}

/// Ack policy All: acking message 2 also acks message 1, naked a moment
/// before for its redelivery, so message 1 never comes back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ack_policy_all_does_not_lose_a_cleanly_failed_message() -> TestResult {
    let Some(url) = nats_url() else { return Ok(()) };
    let s = setup(&url, consumer::AckPolicy::All, -1, 5, 2).await?;
    let booked = Arc::new(Mutex::new(Vec::new()));
    // Fails m-0's first delivery only; m-1 is booked at once.
    let inner = Arc::clone(&booked);
    let handler = move |m: &Incoming, _: &mut LocalTx<'_>| -> Result<(), BoxError> {
        if m.message_id == "m-0" && m.attempt == 1 {
            return Err("ledger busy".into());
        }
        inner
            .lock()
            .map_err(|_| "poisoned")?
            .push(m.message_id.clone());
        Ok(())
    };
    let c = match Consumer::new(
        Arc::clone(&s.engine),
        "ledger",
        s.js.clone(),
        s.pull.clone(),
        handler,
    ) {
        Err(e) => {
            assert_refused(&e, "AckPolicy::Explicit");
            return Ok(());
        }
        Ok(c) => c.retry_delay(Duration::from_millis(10)),
    };
    let seen = Arc::clone(&booked);
    let _ = consume(&c, 10, || seen.lock().is_ok_and(|b| b.len() == 2)).await;
    let mut got = booked.lock().map_err(|_| "poisoned")?.clone();
    got.sort();
    assert_eq!(got, vec!["m-0", "m-1"]);
    Ok(())
}

/// max_deliver 2 with dead_letter_after 4: a handler that always fails
/// cleanly is stopped by the server after 2 deliveries, before the engine
/// dead-letters it, so the message is neither booked nor a dead letter.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_deliver_below_dead_letter_after_does_not_lose_a_message() -> TestResult {
    let Some(url) = nats_url() else { return Ok(()) };
    let s = setup(&url, consumer::AckPolicy::Explicit, 2, 4, 1).await?;
    let failing =
        |_: &Incoming, _: &mut LocalTx<'_>| -> Result<(), BoxError> { Err("ledger closed".into()) };
    let c = match Consumer::new(
        Arc::clone(&s.engine),
        "ledger",
        s.js.clone(),
        s.pull.clone(),
        failing,
    ) {
        Err(e) => {
            assert_refused(&e, "max_deliver");
            assert!(e.to_string().contains("dead_letter_after (4)"), "{e}");
            return Ok(());
        }
        Ok(c) => c.retry_delay(Duration::from_millis(10)),
    };
    let engine = Arc::clone(&s.engine);
    let _ = consume(&c, 12, || {
        engine.dead_letters(10).is_ok_and(|d| !d.is_empty())
    })
    .await;
    assert_eq!(
        s.engine.dead_letters(10)?.len(),
        1,
        "lost: not a dead letter"
    );
    Ok(())
}

/// The settings the inbox needs are accepted: explicit acks with
/// max_deliver unlimited, or equal to dead_letter_after (then the last
/// delivery is the one that dead-letters).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn explicit_acks_with_enough_deliveries_are_accepted() -> TestResult {
    let Some(url) = nats_url() else { return Ok(()) };
    let s = setup(&url, consumer::AckPolicy::Explicit, 3, 3, 1).await?;
    let failing =
        |_: &Incoming, _: &mut LocalTx<'_>| -> Result<(), BoxError> { Err("ledger closed".into()) };
    let c = Consumer::new(
        Arc::clone(&s.engine),
        "ledger",
        s.js.clone(),
        s.pull.clone(),
        failing,
    )?
    .retry_delay(Duration::from_millis(10));
    let engine = Arc::clone(&s.engine);
    consume(&c, 20, || {
        engine.dead_letters(10).is_ok_and(|d| !d.is_empty())
    })
    .await?;
    let letters = s.engine.dead_letters(10)?;
    assert_eq!(letters.len(), 1);
    assert_eq!(letters[0].attempts, 3);
    let s = setup(&url, consumer::AckPolicy::Explicit, -1, 3, 0).await?;
    Consumer::new(
        Arc::clone(&s.engine),
        "ledger",
        s.js.clone(),
        s.pull.clone(),
        |_: &Incoming, _: &mut LocalTx<'_>| Ok(()),
    )?;
    Ok(())
}
