//! The JetStream relay and consumer against a real `nats-server -js`
//! (`scripts/with-nats`): guards against a relay that marks a message
//! published before the server's ack or publishes it under a new id after a
//! crash, a consumer that acks before its commit, repeats a write on a
//! redelivery (inside or outside JetStream's dedup window), dead-letters a
//! message early or never, panics or stalls on a message without a usable
//! id, or hangs on a broker that is not there.
//!
//! Without `IDEMPOTENCY_TEST_NATS` every test is skipped with a message;
//! with `CI=true` that is a failure.

#[path = "common/nats_env.rs"]
mod nats_env;
use nats_env::{nats_url, unique_name};
#[path = "common/nats_ledger.rs"]
mod nats_ledger;
use nats_ledger::book;

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::{self, consumer, stream};
use idempotency::nats::{self, async_nats, Backoff, Consumer, Incoming, NatsError, Relay};
use idempotency::{
    BoxError, Engine, Envelope, Fingerprint, IdempotencyKey, LocalTx, OutgoingMessage,
};

type TestResult = Result<(), BoxError>;

/// A stream of this test's own (subjects `<name>.>`), a durable pull
/// consumer on it with a 1 s ack wait, and a redb engine.
struct Setup {
    _dir: tempfile::TempDir,
    engine: Arc<Engine>,
    js: jetstream::Context,
    stream: stream::Stream,
    pull: consumer::PullConsumer,
    subject: String,
}

async fn setup(
    url: &str,
    duplicate_window: Duration,
    dead_letter_after: u32,
) -> Result<Setup, BoxError> {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let name = unique_name(&format!("T{}_", NEXT.fetch_add(1, Ordering::SeqCst)));
    let client = nats::connect(url, Backoff::default(), Duration::from_secs(10)).await?;
    let js = jetstream::new(client);
    let stream = js
        .create_stream(stream::Config {
            name: name.clone(),
            subjects: vec![format!("{name}.>")],
            storage: stream::StorageType::File,
            duplicate_window,
            ..Default::default()
        })
        .await?;
    let pull = stream
        .create_consumer(consumer::pull::Config {
            durable_name: Some(format!("{name}_ledger")),
            ack_policy: consumer::AckPolicy::Explicit,
            ack_wait: Duration::from_secs(1),
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
        stream,
        pull,
        subject: format!("{name}.payment.succeeded"),
    })
}

/// Bookings per message id, sorted by id (see [`nats_ledger::bookings`]).
fn bookings(engine: &Engine) -> Result<Vec<(String, u64)>, BoxError> {
    Ok(nats_ledger::bookings(engine)?.into_iter().collect())
}

/// Three payments' events in the outbox (one completion each).
fn three_events(s: &Setup) -> Result<Vec<String>, BoxError> {
    let mut ids = Vec::new();
    for i in 0..3 {
        let key = IdempotencyKey::new("tenant-1:pay", format!("p-{i}"))?;
        let claim = match s.engine.begin(&key, Fingerprint::of_json(b"{}", &[])?)? {
            idempotency::Begin::Claimed(c) => c,
            other => return Err(format!("{other:?}").into()),
        };
        ids.push(format!("{}/0", claim.reference()));
        s.engine.complete_with_messages(
            claim,
            Envelope::new(0, 201, "paid"),
            vec![OutgoingMessage::new(
                s.subject.clone(),
                format!("{{\"payment\":{i}}}"),
            )],
        )?;
    }
    Ok(ids)
}

async fn stream_messages(s: &Setup) -> Result<u64, BoxError> {
    Ok(s.stream.get_info().await?.state.messages)
}

/// Consumes until `done` says so, at most `passes` fetches.
async fn consume_until(
    c: &Consumer,
    passes: usize,
    mut done: impl FnMut(&nats::ConsumePass) -> bool,
) -> Result<nats::ConsumePass, BoxError> {
    let mut total = nats::ConsumePass::default();
    for _ in 0..passes {
        let pass = c.consume_once(16, Duration::from_millis(300)).await?;
        total += pass;
        if done(&total) {
            return Ok(total);
        }
    }
    Err(format!("not done after {passes} passes: {total:?}").into())
}

/// The relay publishes with `Nats-Msg-Id` = the outbox id and marks only
/// acked messages; a relay killed between publish and mark publishes them
/// again with the same ids, which JetStream drops inside its window; the
/// consumer books each once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_republish_inside_the_window_is_dropped_by_jetstream() -> TestResult {
    let Some(url) = nats_url() else { return Ok(()) };
    let s = setup(&url, Duration::from_secs(120), 5).await?;
    let ids = three_events(&s)?;
    let relay = Relay::new(Arc::clone(&s.engine), s.js.clone());

    // The killed relay: published and acked, never marked.
    let taken = s.engine.outbox().take(10)?;
    let (acked, duplicates, failed) = relay.publish(&taken).await;
    assert!(failed.is_none(), "{failed:?}");
    assert_eq!((acked.len(), duplicates), (3, 0));
    assert_eq!(
        s.engine.outbox().len()?,
        3,
        "nothing is marked before the relay marks it"
    );

    // The restarted relay publishes the same ids again: all duplicates.
    let pass = relay.relay_once().await?;
    assert_eq!((pass.published, pass.duplicates), (3, 3));
    assert!(s.engine.outbox().is_empty()?);
    assert_eq!(
        stream_messages(&s).await?,
        3,
        "JetStream kept a republished id twice"
    );

    let c = Consumer::new(
        Arc::clone(&s.engine),
        "ledger",
        s.js.clone(),
        s.pull.clone(),
        book,
    )?;
    let total = consume_until(&c, 10, |t| t.processed == 3).await?;
    assert_eq!(total.duplicates, 0);
    let booked = bookings(&s.engine)?;
    let mut want: Vec<(String, u64)> = ids.into_iter().map(|id| (id, 1)).collect();
    want.sort();
    assert_eq!(booked, want);
    Ok(())
}

/// Outside JetStream's window the republished message is stored twice:
/// the inbox drops the second copy (acked, not booked again).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_republish_outside_the_window_is_dropped_by_the_inbox() -> TestResult {
    let Some(url) = nats_url() else { return Ok(()) };
    let s = setup(&url, Duration::from_millis(300), 5).await?;
    let ids = three_events(&s)?;
    let relay = Relay::new(Arc::clone(&s.engine), s.js.clone());
    let taken = s.engine.outbox().take(10)?;
    let (acked, _, failed) = relay.publish(&taken).await;
    assert!(failed.is_none() && acked.len() == 3, "{failed:?}");
    // The relay was down longer than the window.
    tokio::time::sleep(Duration::from_millis(600)).await;
    let pass = relay.relay_once().await?;
    assert_eq!(
        (pass.published, pass.duplicates),
        (3, 0),
        "the window should have passed"
    );
    assert_eq!(stream_messages(&s).await?, 6);

    let c = Consumer::new(
        Arc::clone(&s.engine),
        "ledger",
        s.js.clone(),
        s.pull.clone(),
        book,
    )?;
    let total = consume_until(&c, 10, |t| t.processed + t.duplicates == 6).await?;
    assert_eq!((total.processed, total.duplicates), (3, 3));
    let booked = bookings(&s.engine)?;
    assert_eq!(booked.len(), ids.len());
    assert!(
        booked.iter().all(|(_, n)| *n == 1),
        "double booking: {booked:?}"
    );
    Ok(())
}

/// A consumer killed between its commit and its ack: the redelivery (after
/// the 1 s ack wait) is a duplicate, acked, and the write is not repeated.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redelivery_after_commit_is_acked_not_rebooked() -> TestResult {
    let Some(url) = nats_url() else { return Ok(()) };
    let s = setup(&url, Duration::from_secs(120), 5).await?;
    let ids = three_events(&s)?;
    Relay::new(Arc::clone(&s.engine), s.js.clone())
        .relay_once()
        .await?;

    // The killed consumer: commits each message's booking, never acks.
    use futures_util::StreamExt;
    let mut batch = s
        .pull
        .fetch()
        .max_messages(3)
        .expires(Duration::from_secs(2))
        .messages()
        .await?;
    let mut committed = 0;
    while let Some(message) = batch.next().await {
        let message = message?;
        let id = message
            .headers
            .as_ref()
            .and_then(|h| h.get(nats::MSG_ID_HEADER))
            .map(|v| v.as_str().to_owned())
            .ok_or("no Nats-Msg-Id")?;
        let incoming = Incoming {
            message_id: id.clone(),
            subject: message.subject.to_string(),
            payload: message.payload.to_vec(),
            attempt: 1,
            stream_sequence: 0,
        };
        let done = s
            .engine
            .inbox("ledger")?
            .process_local(&id, move |tx| book(&incoming, tx))?;
        assert!(matches!(done, idempotency::Processed::Done), "{done:?}");
        committed += 1;
        drop(message); // no ack
    }
    assert_eq!(committed, 3);

    let c = Consumer::new(
        Arc::clone(&s.engine),
        "ledger",
        s.js.clone(),
        s.pull.clone(),
        book,
    )?;
    let total = consume_until(&c, 20, |t| t.duplicates == 3).await?;
    assert_eq!(
        total.processed, 0,
        "a committed message was processed again"
    );
    let booked = bookings(&s.engine)?;
    assert_eq!(booked.len(), ids.len());
    assert!(
        booked.iter().all(|(_, n)| *n == 1),
        "double booking: {booked:?}"
    );
    let info = s.pull.get_info().await?;
    assert_eq!(
        (info.num_pending, info.num_ack_pending),
        (0, 0),
        "left unacked"
    );
    Ok(())
}

/// A handler that keeps failing cleanly: redelivered until the third
/// delivery (`dead_letter_after(3)`, counted by JetStream), then dead-
/// lettered and terminated; nothing was booked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clean_failures_are_dead_lettered_after_n_deliveries() -> TestResult {
    let Some(url) = nats_url() else { return Ok(()) };
    let s = setup(&url, Duration::from_secs(120), 3).await?;
    three_events(&s)?;
    Relay::new(Arc::clone(&s.engine), s.js.clone())
        .relay_once()
        .await?;
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
    let total = consume_until(&c, 40, |t| t.dead_lettered == 3).await?;
    assert_eq!((total.processed, total.retried), (0, 6), "{total:?}");
    let letters = s.engine.dead_letters(10)?;
    assert_eq!(letters.len(), 3);
    assert!(
        letters
            .iter()
            .all(|d| d.attempts == 3 && d.reason.contains("ledger closed")),
        "{letters:?}"
    );
    assert!(letters.iter().all(|d| d.topic == s.subject));
    assert!(bookings(&s.engine)?.is_empty());
    let info = s.pull.get_info().await?;
    assert_eq!((info.num_pending, info.num_ack_pending), (0, 0));
    Ok(())
}

/// Messages without a usable id (none, over the key limit) go to the dead
/// letters with a reason, and the consumer keeps consuming the next one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_messages_are_dead_lettered_and_consuming_goes_on() -> TestResult {
    let Some(url) = nats_url() else { return Ok(()) };
    let s = setup(&url, Duration::from_secs(120), 5).await?;
    s.js.publish(s.subject.clone(), "no id".into())
        .await?
        .await?;
    let mut headers = async_nats::HeaderMap::new();
    headers.insert(nats::MSG_ID_HEADER, "x".repeat(300).as_str());
    s.js.publish_with_headers(s.subject.clone(), headers, "long id".into())
        .await?
        .await?;
    let mut headers = async_nats::HeaderMap::new();
    headers.insert(nats::MSG_ID_HEADER, "good-1");
    s.js.publish_with_headers(s.subject.clone(), headers, "good".into())
        .await?
        .await?;

    let c = Consumer::new(
        Arc::clone(&s.engine),
        "ledger",
        s.js.clone(),
        s.pull.clone(),
        book,
    )?;
    let total = consume_until(&c, 10, |t| t.dead_lettered == 2 && t.processed == 1).await?;
    assert_eq!(total.retried, 0);
    let letters = s.engine.dead_letters(10)?;
    assert_eq!(letters.len(), 2);
    assert!(
        letters[0].message_id.is_empty() && letters[0].reason.contains("no Nats-Msg-Id"),
        "{letters:?}"
    );
    assert_eq!(letters[1].message_id.len(), 300);
    assert!(
        letters[1].reason.contains("unusable Nats-Msg-Id"),
        "{letters:?}"
    );
    assert_eq!(bookings(&s.engine)?, vec![("good-1".to_owned(), 1)]);
    Ok(())
}

/// A broker that is not there: `connect` gives up with an error naming the
/// URL after its deadline (it does not hang), having retried with backoff.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_to_a_missing_broker_is_a_clear_error() -> TestResult {
    let Some(_) = nats_url() else { return Ok(()) };
    // A port nothing listens on: bind one, then free it.
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let url = format!("nats://127.0.0.1:{port}");
    let backoff = Backoff {
        initial: Duration::from_millis(20),
        max: Duration::from_millis(100),
    };
    let err = nats::connect(&url, backoff, Duration::from_millis(500))
        .await
        .err()
        .ok_or("connected to nothing")?;
    match &err {
        NatsError::Connect {
            url: named,
            attempts,
            ..
        } => {
            assert_eq!(named, &url);
            assert!(*attempts >= 2, "no retry: {attempts}");
        }
        other => return Err(format!("expected Connect, got {other:?}").into()),
    }
    assert!(err.to_string().contains(&url), "{err}");
    Ok(())
}
