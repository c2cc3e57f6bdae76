//! Breaker 29: a JetStream message whose `Nats-Msg-Id` header is not
//! UTF-8 (nats-server stores it; only a raw HPUB can send it).
//!
//! async-nats 0.51 fails to parse the HMSG ("header isn't valid utf-8"),
//! drops its connection and reconnects; the server redelivers, and the
//! same happens again. Before the fix `Consumer::consume_once` never saw
//! the message, returned no error (fetches just came back empty), never
//! dead-lettered it, and the good message behind it was never booked
//! either: the consumer stalled silently. Now an empty pass while messages
//! await an ack reads them by stream sequence; the unreadable one goes to
//! the dead letters (the reason names the stream sequence and the bad
//! bytes) and is deleted from the stream, and the good one is booked once.

#[path = "common/nats_env.rs"]
mod nats_env;
use nats_env::{nats_url, raw_hpub, stream_under, unique_name};

use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::{self, consumer};
use idempotency::nats::{self, async_nats, Backoff, Consumer, Incoming};
use idempotency::{BoxError, Engine, LocalTx};

type TestResult = Result<(), BoxError>;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_non_utf8_message_id_is_dead_lettered_and_consuming_goes_on() -> TestResult {
    let Some(url) = nats_url() else { return Ok(()) };
    let name = unique_name("B29H");
    let client = nats::connect(&url, Backoff::default(), Duration::from_secs(10)).await?;
    let js = jetstream::new(client);
    let stream = stream_under(&js, &name).await?;
    let pull = stream
        .create_consumer(consumer::pull::Config {
            durable_name: Some(format!("{name}_c")),
            ack_policy: consumer::AckPolicy::Explicit,
            ack_wait: Duration::from_secs(1),
            ..Default::default()
        })
        .await?;
    let subject = format!("{name}.ev");
    raw_hpub(&url, &subject, b"bad-\xff\xfe-id", b"poison")?;
    let mut headers = async_nats::HeaderMap::new();
    headers.insert(nats::MSG_ID_HEADER, "good-1");
    js.publish_with_headers(subject.clone(), headers, "good".into())
        .await?
        .await?;
    let dir = tempfile::tempdir()?;
    let engine = Arc::new(
        Engine::builder()
            .sweep_interval(None)
            .open(dir.path().join("idem.redb"))?,
    );
    let booked = Arc::new(std::sync::Mutex::new(Vec::new()));
    let seen = Arc::clone(&booked);
    let handler = move |m: &Incoming, _: &mut LocalTx<'_>| -> Result<(), BoxError> {
        seen.lock()
            .map_err(|_| "poisoned")?
            .push(m.message_id.clone());
        Ok(())
    };
    let c = Consumer::new(
        Arc::clone(&engine),
        "ledger",
        js.clone(),
        pull.clone(),
        handler,
    )?;
    let mut errors = Vec::new();
    for _ in 0..20 {
        match c.consume_once(16, Duration::from_millis(300)).await {
            Ok(_) => {}
            Err(e) => errors.push(e.to_string()),
        }
        if booked.lock().map_err(|_| "poisoned")?.len() == 1 && engine.dead_letters(10)?.len() == 1
        {
            break;
        }
    }
    let letters = engine.dead_letters(10)?;
    eprintln!("errors: {errors:?}\nletters: {letters:?}");
    assert_eq!(
        *booked.lock().map_err(|_| "poisoned")?,
        vec!["good-1".to_owned()]
    );
    assert_eq!(letters.len(), 1, "{letters:?} errors {errors:?}");
    assert_eq!(letters[0].payload, b"poison");
    assert_eq!(letters[0].topic, subject);
    assert_eq!(letters[0].attempts, 0);
    assert_eq!(letters[0].message_id, r"bad-\xff\xfe-id");
    assert!(
        letters[0].reason.contains(&format!("stream {name} seq 1"))
            && letters[0].reason.contains(r"bad-\xff\xfe-id"),
        "{}",
        letters[0].reason
    );
    // Gone from the stream, so no consumer of it stalls again.
    let raw = stream.get_raw_message(1).await;
    assert!(raw.is_err(), "seq 1 still stored");
    // Nothing more comes: a pass books nothing and files no second letter.
    c.consume_once(16, Duration::from_millis(300)).await?;
    assert_eq!(booked.lock().map_err(|_| "poisoned")?.len(), 1);
    assert_eq!(engine.dead_letters(10)?.len(), 1);
    Ok(())
}
