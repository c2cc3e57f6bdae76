//! The message paths: an inbox processes each delivery once (duplicates and
//! concurrent deliveries included, scoped per consumer), the outbox carries
//! the messages stored with an outcome until they are marked published, and
//! entity transitions compare-and-set without losing an update.

use std::sync::Barrier;

use idempotency::{Envelope, OutgoingMessage, Receive, Transition};

use super::support::*;

both_backends! {
    /// Duplicate and concurrent deliveries: one Fresh ticket per message,
    /// Duplicate afterwards; a released ticket is delivered afresh; another
    /// consumer's inbox is separate.
    fn inbox_duplicates(h: &Harness) -> TestResult {
        let engine = h.engine()?;
        let inbox = engine.inbox("billing")?;
        match inbox.receive("m1")? {
            Receive::Fresh(ticket) => {
                assert_eq!(ticket.message_id(), "m1");
                ticket.ack()?;
            }
            other => return Err(format!("expected Fresh, got {other:?}").into()),
        }
        for _ in 0..3 {
            let again = inbox.receive("m1")?;
            assert!(matches!(again, Receive::Duplicate), "got {again:?}");
        }

        // 8 deliveries of m2 at once.
        let barrier = Barrier::new(8);
        let fresh: usize = std::thread::scope(|s| {
            let handles: Vec<_> = (0..8)
                .map(|_| {
                    s.spawn(|| -> idempotency::Result<usize> {
                        let inbox = engine.inbox("billing")?;
                        barrier.wait();
                        match inbox.receive("m2")? {
                            Receive::Fresh(ticket) => {
                                ticket.ack_with_messages(vec![OutgoingMessage::new("email", "m2")])?;
                                Ok(1)
                            }
                            Receive::Duplicate | Receive::Processing { .. } => Ok(0),
                            Receive::InDoubt(p) => panic!("unexpected unknown {p:?}"),
                        }
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().expect("delivery thread panicked")).sum::<idempotency::Result<usize>>()
        })?;
        assert_eq!(fresh, 1);
        assert_eq!(engine.outbox().len()?, 1, "one message per processed delivery");

        // Released: nothing happened, the redelivery is fresh.
        match inbox.receive("m3")? {
            Receive::Fresh(ticket) => ticket.release()?,
            other => return Err(format!("expected Fresh, got {other:?}").into()),
        }
        match inbox.receive("m3")? {
            Receive::Fresh(ticket) => ticket.ack()?,
            other => return Err(format!("expected Fresh after release, got {other:?}").into()),
        }
        // Scoped per consumer.
        match engine.inbox("shipping")?.receive("m1")? {
            Receive::Fresh(ticket) => ticket.ack()?,
            other => return Err(format!("expected Fresh in another inbox, got {other:?}").into()),
        }
        let mark = idempotency::IdempotencyKey::inbox("billing", "m1")?;
        assert_eq!(engine.record(&mark)?.ok_or("no inbox record")?.state, idempotency::State::Completed);
        Ok(())
    }
}

both_backends! {
    /// Messages stored with `complete_with_messages` are in the outbox in
    /// commit order, with ids `<claim reference>/<n>`; taking them does not
    /// remove them (a relay may crash); marking them published does, once.
    fn outbox_messages_from_complete(h: &Harness) -> TestResult {
        let engine = h.engine()?;
        assert!(engine.outbox().is_empty()?);
        let mut references = Vec::new();
        for (i, name) in ["order-1", "order-2"].into_iter().enumerate() {
            let c = claimed(engine.begin(&key(name)?, fp(1)?)?)?;
            references.push(c.reference().to_owned());
            let messages = vec![
                OutgoingMessage::new("email", format!("receipt {i}")),
                OutgoingMessage::new("ledger", vec![0u8, 255, i as u8]),
            ];
            engine.complete_with_messages(c, Envelope::new(1, 201, "ok"), messages)?;
        }
        // A released claim's messages never existed.
        let c = claimed(engine.begin(&key("released")?, fp(1)?)?)?;
        engine.fail(c, idempotency::Failure::Retryable)?;

        let taken = engine.outbox().take(10)?;
        let ids: Vec<&str> = taken.iter().map(|m| m.id.as_str()).collect();
        let want: Vec<String> = references.iter().flat_map(|r| [format!("{r}/0"), format!("{r}/1")]).collect();
        assert_eq!(ids, want);
        assert!(taken.windows(2).all(|w| w[0].seq < w[1].seq), "seqs out of commit order");
        assert_eq!((taken[0].topic.as_str(), taken[0].payload.as_slice()), ("email", &b"receipt 0"[..]));
        assert_eq!(taken[3].payload, [0u8, 255, 1]);
        assert_eq!(engine.outbox().take(10)?, taken, "take removed messages");
        assert_eq!(engine.outbox().take(3)?, taken[..3]);
        assert_eq!(engine.outbox().len()?, 4);

        let seqs: Vec<u64> = taken[..3].iter().map(|m| m.seq).collect();
        assert_eq!(engine.outbox().mark_published(&seqs)?, 3);
        assert_eq!(engine.outbox().mark_published(&seqs)?, 0, "marking twice is harmless");
        assert_eq!(engine.outbox().take(10)?, taken[3..]);
        // Later messages come after every earlier one.
        let c = claimed(engine.begin(&key("order-3")?, fp(1)?)?)?;
        engine.complete_with_messages(c, Envelope::new(1, 201, "ok"), vec![OutgoingMessage::new("email", "3")])?;
        let rest = engine.outbox().take(10)?;
        assert_eq!(rest.len(), 2);
        assert!(rest[1].seq > taken[3].seq);
        assert_eq!(engine.outbox().mark_published(&[rest[0].seq, rest[1].seq])?, 2);
        assert!(engine.outbox().is_empty()?);
        Ok(())
    }
}

both_backends! {
    /// Compare-and-set: created from no state, applied from an allowed
    /// state, refused (with the current state) from another, a repeat is
    /// AlreadyInState; racing transitions have exactly one winner.
    fn entity_transitions(h: &Harness) -> TestResult {
        let engine = h.engine()?;
        assert_eq!(engine.entity_state("order-1")?, None);
        assert_eq!(engine.transition("order-1", &["open"], "paid")?, Transition::Conflict { current: None, version: 0 });
        assert_eq!(engine.transition("order-1", &[], "open")?, Transition::Applied { version: 1 });
        assert_eq!(engine.transition("order-1", &[], "open")?, Transition::AlreadyInState { version: 1 });
        assert_eq!(engine.transition("order-1", &["open"], "paid")?, Transition::Applied { version: 2 });
        assert_eq!(engine.transition("order-1", &["open"], "paid")?, Transition::AlreadyInState { version: 2 });
        assert_eq!(
            engine.transition("order-1", &["open"], "cancelled")?,
            Transition::Conflict { current: Some("paid".into()), version: 2 }
        );
        assert_eq!(engine.transition("order-1", &["open", "paid"], "shipped")?, Transition::Applied { version: 3 });
        assert_eq!(engine.entity_state("order-1")?, Some(("shipped".into(), 3)));
        let err = engine.transition("", &[], "open").err().ok_or("empty id accepted")?;
        assert!(matches!(err, idempotency::Error::InvalidEntity { .. }), "{err:?}");

        // Pay and cancel race on each of 50 orders: one winner each.
        for i in 0..50 {
            let order = format!("race-{i}");
            engine.transition(&order, &[], "open")?;
            let barrier = Barrier::new(2);
            let results = std::thread::scope(|s| {
                let racers: Vec<_> = ["paid", "cancelled"]
                    .into_iter()
                    .map(|to| {
                        let (engine, barrier, order) = (&engine, &barrier, &order);
                        s.spawn(move || {
                            barrier.wait();
                            engine.transition(order, &["open"], to).map(|t| (to, t))
                        })
                    })
                    .collect();
                racers.into_iter().map(|r| r.join().expect("racer panicked")).collect::<idempotency::Result<Vec<_>>>()
            })?;
            let winners: Vec<&str> = results
                .iter()
                .filter(|(_, t)| *t == Transition::Applied { version: 2 })
                .map(|(to, _)| *to)
                .collect();
            assert_eq!(winners.len(), 1, "{order}: {results:?}");
            let loser = results.iter().find(|(to, _)| *to != winners[0]).ok_or("no loser")?;
            assert_eq!(loser.1, Transition::Conflict { current: Some(winners[0].to_owned()), version: 2 }, "{order}");
            assert_eq!(engine.entity_state(&order)?, Some((winners[0].to_owned(), 2)));
        }
        Ok(())
    }
}
