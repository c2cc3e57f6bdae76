//! Breaker 29b: unreadable messages the consumer's scan did not reach.
//!
//! The scan for messages the client cannot read looked at the 64 stream
//! sequences after the consumer's ack floor and no further. Two ways a
//! poison message sat beyond them and stalled the consumer for good (each
//! empty pass looked at the same 64 sequences again):
//! - a consumer with a filter subject on a stream with many subjects: the
//!   other subjects' messages fill the 64 sequences;
//! - 70 messages that failed cleanly and wait for a long retry delay, all
//!   still pending above the ack floor.
//!
//! Measured: the 70-pending case fails without the scan fix (nothing
//! booked, no letter, 30 passes) and passes with it (50 runs, 25 of them
//! beside CPU and fsync load). Its one failure with the fix looked the
//! same: nothing booked, no letter, no error. The likely cause, since
//! removed: stream names made of the process id alone. A test looped by
//! hand against one server reuses process ids (pid_max 32768 here), the
//! old stream and consumer were found again, and JetStream dropped the new
//! run's messages as duplicates of the old run's ids. Names now come from
//! `nats_env::unique_name`, and `stream_under` refuses a stream that
//! exists. The filtered case passes with and without the fix (nats-server
//! 2.9.10 moves the filtered consumer's ack floor past the other
//! subjects), so it guards the filter path only. On failure each test
//! prints every pass and the consumer's state at the broker.

#[path = "common/nats_env.rs"]
mod nats_env;
use nats_env::{nats_url, raw_hpub, stream_under, unique_name};

use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::jetstream::{self, consumer};
use idempotency::nats::{self, async_nats, Backoff, Consumer, Incoming};
use idempotency::{BoxError, Engine, LocalTx};

type TestResult = Result<(), BoxError>;

async fn publish(js: &jetstream::Context, subject: &str, id: &str) -> TestResult {
    let mut headers = async_nats::HeaderMap::new();
    headers.insert(nats::MSG_ID_HEADER, id);
    js.publish_with_headers(subject.to_owned(), headers, id.to_owned().into())
        .await?
        .await?;
    Ok(())
}

fn engine(dir: &tempfile::TempDir) -> Result<Arc<Engine>, BoxError> {
    Ok(Arc::new(
        Engine::builder()
            .sweep_interval(None)
            .dead_letter_after(1000)
            .open(dir.path().join("idem.redb"))?,
    ))
}

/// Consumes until `good` is booked and one letter is filed (at most 30
/// passes); returns what each pass did or the error it gave, for the
/// failure messages.
async fn consume_until(
    c: &Consumer,
    engine: &Engine,
    booked: &Mutex<Vec<String>>,
    good: &str,
) -> Result<Vec<String>, BoxError> {
    let mut passes = Vec::new();
    for _ in 0..30 {
        match c.consume_once(16, Duration::from_millis(300)).await {
            Ok(pass) => passes.push(format!("{pass:?}")),
            Err(e) => passes.push(format!("error: {e}")),
        }
        let done = booked
            .lock()
            .map_err(|_| "poisoned")?
            .iter()
            .any(|b| b == good);
        if done && engine.dead_letters(10)?.len() == 1 {
            break;
        }
    }
    Ok(passes)
}

/// The state at the broker of consumer `durable` of `stream`, for the
/// failure messages; printed with `passes` (shown when the test fails).
async fn state(
    stream: &jetstream::stream::Stream,
    durable: &str,
    passes: &[String],
) -> Result<String, BoxError> {
    let mut probe: consumer::PullConsumer = stream.get_consumer(durable).await?;
    let at_broker = match probe.info().await {
        Ok(i) => format!(
            "delivered {:?} ack floor {:?} pending {} ack pending {} redelivered {}",
            i.delivered, i.ack_floor, i.num_pending, i.num_ack_pending, i.num_redelivered
        ),
        Err(e) => format!("no consumer info: {e}"),
    };
    eprintln!("passes {passes:?}; consumer: {at_broker}");
    Ok(at_broker)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poison_message_behind_other_subjects_of_a_filtered_consumer_is_cleared() -> TestResult {
    let Some(url) = nats_url() else { return Ok(()) };
    let name = unique_name("B29BF");
    let client = nats::connect(&url, Backoff::default(), Duration::from_secs(10)).await?;
    let js = jetstream::new(client);
    let stream = stream_under(&js, &name).await?;
    let mine = format!("{name}.ledger");
    let pull = stream
        .create_consumer(consumer::pull::Config {
            durable_name: Some(format!("{name}_c")),
            filter_subject: mine.clone(),
            ack_policy: consumer::AckPolicy::Explicit,
            ack_wait: Duration::from_secs(1),
            ..Default::default()
        })
        .await?;
    publish(&js, &mine, "first").await?;
    for i in 0..100 {
        publish(&js, &format!("{name}.audit.{i}"), &format!("audit-{i}")).await?;
    }
    raw_hpub(&url, &mine, b"bad-\xff-id", b"poison")?;
    publish(&js, &mine, "good-after").await?;

    let dir = tempfile::tempdir()?;
    let engine = engine(&dir)?;
    let booked = Arc::new(Mutex::new(Vec::new()));
    let seen = Arc::clone(&booked);
    let handler = move |m: &Incoming, _: &mut LocalTx<'_>| -> Result<(), BoxError> {
        seen.lock()
            .map_err(|_| "poisoned")?
            .push(m.message_id.clone());
        Ok(())
    };
    let c = Consumer::new(Arc::clone(&engine), "ledger", js.clone(), pull, handler)?;
    // Before the poison message is delivered, "first" is booked and acked:
    // the ack floor stays at its sequence, 1.
    let passes = consume_until(&c, &engine, &booked, "good-after").await?;
    let at_broker = state(&stream, &format!("{name}_c"), &passes).await?;
    let letters = engine.dead_letters(10)?;
    assert_eq!(
        *booked.lock().map_err(|_| "poisoned")?,
        vec!["first".to_owned(), "good-after".to_owned()],
        "passes {passes:?} letters {letters:?}; consumer: {at_broker}"
    );
    assert_eq!(
        letters.len(),
        1,
        "{letters:?} passes {passes:?}; consumer: {at_broker}"
    );
    assert_eq!(letters[0].message_id, r"bad-\xff-id");
    assert!(
        letters[0]
            .reason
            .contains(&format!("stream {name} seq 102")),
        "{}",
        letters[0].reason
    );
    // The other subjects' messages are untouched.
    for seq in 2..=101 {
        stream.get_raw_message(seq).await?;
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poison_message_behind_70_pending_retries_is_cleared() -> TestResult {
    let Some(url) = nats_url() else { return Ok(()) };
    let name = unique_name("B29BR");
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
    for i in 0..70 {
        publish(&js, &subject, &format!("flaky-{i}")).await?;
    }
    raw_hpub(&url, &subject, b"bad-\xfe-id", b"poison")?;
    publish(&js, &subject, "good-after").await?;

    let dir = tempfile::tempdir()?;
    let engine = engine(&dir)?;
    let booked = Arc::new(Mutex::new(Vec::new()));
    let seen = Arc::clone(&booked);
    let handler = move |m: &Incoming, _: &mut LocalTx<'_>| -> Result<(), BoxError> {
        if m.message_id.starts_with("flaky-") {
            return Err("the ledger is busy".into());
        }
        seen.lock()
            .map_err(|_| "poisoned")?
            .push(m.message_id.clone());
        Ok(())
    };
    // The flaky ones are naked for an hour: they stay pending, above the
    // ack floor, for the whole test.
    let c = Consumer::new(Arc::clone(&engine), "ledger", js.clone(), pull, handler)?
        .retry_delay(Duration::from_secs(3600));
    let passes = consume_until(&c, &engine, &booked, "good-after").await?;
    let at_broker = state(&stream, &format!("{name}_c"), &passes).await?;
    let letters = engine.dead_letters(10)?;
    assert_eq!(
        *booked.lock().map_err(|_| "poisoned")?,
        vec!["good-after".to_owned()],
        "passes {passes:?} letters {letters:?}; consumer: {at_broker}"
    );
    assert_eq!(
        letters.len(),
        1,
        "{letters:?} passes {passes:?}; consumer: {at_broker}"
    );
    assert!(
        letters[0].reason.contains(&format!("stream {name} seq 71")),
        "{}",
        letters[0].reason
    );
    Ok(())
}
