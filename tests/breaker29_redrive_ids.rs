//! Breaker 29: redrive ids must never repeat. A redrive publishes the
//! letter under `<id>~redrive<seq>.<unique>@<dead_at_ms>.<digest>` (or
//! `dead-letter~redrive...` for a message without a usable id); JetStream's
//! dedup window and the inbox both drop a second message under an id they
//! have seen, so two letters redriven under one id lose the second.
//!
//! On redb a letter's seq is the last seq + 1, so once the last letter is
//! redriven the next letter gets its seq again; with the same `dead_at_ms`
//! (the same millisecond, or a clock that stands still) two rejected
//! messages without an id got the same redrive id. A digest of the
//! letter's content told different letters apart, but not two identical
//! ones (the same message rejected twice, e.g. redelivered after a crash
//! between the letter and the ack): the id now also carries a number the
//! store never hands out twice.

use idempotency::{BoxError, Delivery, Engine, ManualClock};

type TestResult = Result<(), BoxError>;

#[test]
fn two_rejected_messages_without_an_id_get_different_redrive_ids() -> TestResult {
    let dir = tempfile::tempdir()?;
    let engine = Engine::builder()
        .sweep_interval(None)
        .clock(ManualClock::new(1_700_000_000_000))
        .open(dir.path().join("idem.redb"))?;
    let inbox = engine.inbox("ledger")?;
    let mut ids = Vec::new();
    for payload in [&b"first"[..], &b"second"[..]] {
        let delivery = Delivery {
            message_id: "",
            topic: "payments.succeeded",
            payload,
            attempt: 0,
        };
        let seq = inbox.reject(&delivery, "no Nats-Msg-Id header")?;
        let id = engine
            .redrive(seq)?
            .ok_or_else(|| format!("no dead letter #{seq}"))?;
        ids.push((seq, id));
    }
    let outbox = engine.outbox().take(10)?;
    assert_eq!(outbox.len(), 2);
    assert_ne!(
        ids[0].1, ids[1].1,
        "two different messages redriven under one id: {ids:?}"
    );
    Ok(())
}

#[test]
fn two_identical_letters_in_one_millisecond_get_different_redrive_ids() -> TestResult {
    let dir = tempfile::tempdir()?;
    let engine = Engine::builder()
        .sweep_interval(None)
        .clock(ManualClock::new(1_700_000_000_000))
        .open(dir.path().join("idem.redb"))?;
    let inbox = engine.inbox("ledger")?;
    let delivery = Delivery {
        message_id: "m-1",
        topic: "payments.succeeded",
        payload: b"same",
        attempt: 0,
    };
    let mut ids = Vec::new();
    for _ in 0..2 {
        let seq = inbox.reject(&delivery, "payload does not parse")?;
        let id = engine
            .redrive(seq)?
            .ok_or_else(|| format!("no dead letter #{seq}"))?;
        ids.push((seq, id));
    }
    assert_eq!(ids[0].0, ids[1].0, "redb gives the seq again: {ids:?}");
    assert_ne!(
        ids[0].1, ids[1].1,
        "two letters redriven under one id: {ids:?}"
    );
    assert_eq!(engine.outbox().take(10)?.len(), 2);
    Ok(())
}
