//! Breaker 29: an outbox message the relay can never publish (no stream
//! for its subject, a wildcard subject, a payload over the server's
//! `max_payload`) must not block the messages behind it forever, and a
//! wildcard subject must never be published.
//!
//! Before the fix the relay stopped at the first failure of a pass and
//! returned it, every pass, so the good message behind a bad one was never
//! published. Now a permanent failure is counted per message; at the
//! relay's `give_up_after` the message goes to the dead letters (consumer
//! `@outbox`, listable with `idem dead-letters`, published again with
//! `idem redrive` once the cause is fixed) and the relay goes on. A
//! transient failure (the server gone) is never counted: nothing is
//! dead-lettered however often it repeats.

#[path = "common/nats_env.rs"]
mod nats_env;
use nats_env::{nats_url, stream_under, unique_name};

use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::{self, stream};
use idempotency::nats::{self, async_nats, Backoff, NatsError, Relay};
use idempotency::{
    BoxError, Engine, Envelope, Fingerprint, IdempotencyKey, OutgoingMessage,
    OUTBOX_DEAD_LETTER_CONSUMER,
};

type TestResult = Result<(), BoxError>;

/// One completion per message, so each is its own outbox entry.
fn enqueue(engine: &Engine, messages: Vec<OutgoingMessage>) -> Result<(), BoxError> {
    for (i, message) in messages.into_iter().enumerate() {
        let key = IdempotencyKey::new("tenant-1:pay", format!("p-{i}"))?;
        let claim = match engine.begin(&key, Fingerprint::of_json(b"{}", &[])?)? {
            idempotency::Begin::Claimed(c) => c,
            other => return Err(format!("{other:?}").into()),
        };
        engine.complete_with_messages(claim, Envelope::new(0, 201, "paid"), vec![message])?;
    }
    Ok(())
}

fn engine(dir: &tempfile::TempDir) -> Result<Arc<Engine>, BoxError> {
    Ok(Arc::new(
        Engine::builder()
            .sweep_interval(None)
            // Room for an outbox message over the server's 1 MiB max_payload.
            .max_response_bytes(4 << 20)
            .open(dir.path().join("idem.redb"))?,
    ))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unpublishable_messages_are_dead_lettered_and_the_rest_go_on() -> TestResult {
    let Some(url) = nats_url() else { return Ok(()) };
    let name = unique_name("B29U");
    let client = nats::connect(&url, Backoff::default(), Duration::from_secs(10)).await?;
    let max_payload = client.server_info().max_payload;
    let js = jetstream::new(client);
    let stream = stream_under(&js, &name).await?;
    let dir = tempfile::tempdir()?;
    let engine = engine(&dir)?;
    let no_stream = format!("{name}nostream.ev");
    let wildcard = format!("{name}.*");
    let good = format!("{name}.ev");
    enqueue(
        &engine,
        vec![
            OutgoingMessage::new(no_stream.clone(), "a"),
            OutgoingMessage::new(wildcard.clone(), "b"),
            OutgoingMessage::new(good.clone(), vec![b'c'; max_payload + 1]),
            OutgoingMessage::new(good.clone(), "d"),
        ],
    )?;
    let relay = Relay::new(Arc::clone(&engine), js.clone()).give_up_after(2);
    let mut errors = Vec::new();
    let mut last = None;
    for _ in 0..10 {
        match relay.relay_once().await {
            Ok(pass) => last = Some(pass),
            Err(e) => {
                assert!(
                    matches!(
                        e,
                        NatsError::Unpublishable {
                            attempts: 1,
                            give_up_after: 2,
                            ..
                        }
                    ),
                    "{e:?}"
                );
                errors.push(e.to_string());
            }
        }
        if engine.outbox().is_empty()? {
            break;
        }
    }
    // Each bad message held the rest back once, then was given up.
    // (A pass that ends in an error returns only the error; the letters it
    // filed before are in the log and the list.)
    assert_eq!(errors.len(), 3, "{errors:?}");
    let last = last.ok_or("no pass succeeded")?;
    assert_eq!((last.published, last.dead_lettered), (1, 1), "{last:?}");
    assert!(engine.outbox().is_empty()?);
    let info = stream.get_info().await?;
    assert_eq!(info.state.messages, 1, "only the good message is stored");
    let stored = stream.get_raw_message(info.state.last_sequence).await?;
    assert_eq!(stored.subject.as_str(), good);
    assert_eq!(&stored.payload[..], b"d");
    let letters = engine.dead_letters(10)?;
    assert_eq!(letters.len(), 3, "{letters:?}");
    for (letter, (topic, says)) in letters.iter().zip([
        (&no_stream, "no JetStream stream takes the subject"),
        (&wildcard, "wildcard"),
        (&good, "max payload"),
    ]) {
        assert_eq!(letter.consumer, OUTBOX_DEAD_LETTER_CONSUMER);
        assert_eq!(&letter.topic, topic);
        assert_eq!(letter.attempts, 2);
        assert!(letter.reason.contains(says), "{}", letter.reason);
    }
    // The operator fixes the cause and redrives: it is published.
    js.create_stream(stream::Config {
        name: format!("{name}NS"),
        subjects: vec![no_stream.clone()],
        ..Default::default()
    })
    .await?;
    let id = engine
        .redrive(letters[0].seq)?
        .ok_or("no letter to redrive")?;
    let pass = relay.relay_once().await?;
    assert_eq!(pass.published, 1);
    let fixed = js.get_stream(format!("{name}NS")).await?;
    let stored = fixed.get_raw_message(1).await?;
    assert_eq!(
        stored
            .headers
            .get(nats::MSG_ID_HEADER)
            .map(|v| v.as_str().to_owned()),
        Some(id)
    );
    Ok(())
}

/// A server that is gone is transient: the message waits in the outbox,
/// never dead-lettered, however many passes fail.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_that_is_gone_never_dead_letters() -> TestResult {
    let Some(_) = nats_url() else { return Ok(()) };
    let bin = std::env::var("IDEMPOTENCY_TEST_NATS_BIN")?;
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let store = tempfile::tempdir()?;
    let mut server = std::process::Command::new(&bin)
        .args(["-js", "-a", "127.0.0.1", "-p", &port.to_string(), "-sd"])
        .arg(store.path())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()?;
    let url = format!("nats://127.0.0.1:{port}");
    let result = async {
        let client = nats::connect(&url, Backoff::default(), Duration::from_secs(10)).await?;
        let mut js = jetstream::new(client);
        js.set_timeout(Duration::from_millis(300));
        js.create_stream(stream::Config {
            name: "GONE".to_owned(),
            subjects: vec!["gone.>".to_owned()],
            ..Default::default()
        })
        .await?;
        let dir = tempfile::tempdir()?;
        let engine = engine(&dir)?;
        enqueue(&engine, vec![OutgoingMessage::new("gone.ev", "x")])?;
        server.kill()?;
        server.wait()?;
        let relay = Relay::new(Arc::clone(&engine), js).give_up_after(1);
        for _ in 0..3 {
            let e = match relay.relay_once().await {
                Err(e) => e,
                Ok(pass) => return Err(format!("a pass with the server gone: {pass:?}").into()),
            };
            assert!(matches!(e, NatsError::Publish { .. }), "{e:?}");
        }
        assert_eq!(engine.outbox().len()?, 1);
        assert!(engine.dead_letters(10)?.is_empty());
        Ok::<_, BoxError>(())
    }
    .await;
    let _ = server.kill();
    let _ = server.wait();
    result
}
