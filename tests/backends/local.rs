//! Local exactly-once: the app's own row and the key's completion commit in
//! one transaction (redb: a table in the engine's file through
//! `LocalTx::redb`; PostgreSQL: a table of the test's own through
//! `LocalTx::postgres`), or neither does. A failing or panicking closure
//! leaves no row, no completion and no outbox message, and the key free.

use idempotency::{Begin, Envelope, LocalRun, OutgoingMessage, Processed, State};

use super::support::*;

both_backends! {
    /// `execute_local` runs the write once per key: a retry is skipped
    /// with a replay, a tampered retry with a mismatch; the app row, the
    /// record and the outbox message all exist.
    fn execute_local_writes_once(h: &Harness) -> TestResult {
        let ledger = h.ledger()?;
        let engine = h.engine()?;
        let k = key("transfer-1")?;
        for attempt in 0..3 {
            let l = ledger.clone();
            let run = engine.execute_local(&k, fp(500)?, move |tx| {
                l.insert(tx, "transfer-1", 500)?;
                tx.send(OutgoingMessage::new("email", "transfer-1 booked"));
                Ok(Envelope::new(1, 201, "booked"))
            })?;
            match (attempt, run) {
                (0, LocalRun::Executed) => {}
                (_, LocalRun::Skipped(Begin::Replay(r))) if attempt > 0 => assert_eq!(r.envelope.body, b"booked"),
                (_, other) => return Err(format!("attempt {attempt}: {other:?}").into()),
            }
        }
        let l = ledger.clone();
        let run = engine.execute_local(&k, fp(501)?, move |tx| {
            l.insert(tx, "transfer-1-tampered", 501)?;
            Ok(Envelope::new(1, 201, "booked"))
        })?;
        assert!(matches!(run, LocalRun::Skipped(Begin::Mismatch)), "got {run:?}");
        assert_eq!(engine.record(&k)?.ok_or("no record")?.state, State::Completed);
        let messages = engine.outbox().take(10)?;
        assert_eq!(messages.len(), 1);
        assert_eq!(messages[0].payload, b"transfer-1 booked");
        drop(engine);
        assert_eq!(h.ledger_rows(&ledger)?, [("transfer-1".to_owned(), 500)]);
        Ok(())
    }
}

both_backends! {
    /// A closure that fails, or panics, rolls everything back: no app row,
    /// no record, no outbox message; the next attempt executes.
    fn failing_local_write_leaves_nothing(h: &Harness) -> TestResult {
        let ledger = h.ledger()?;
        let engine = h.engine()?;
        let k = key("transfer-2")?;
        let l = ledger.clone();
        let err = engine
            .execute_local(&k, fp(7)?, move |tx| {
                l.insert(tx, "transfer-2", 7)?;
                tx.send(OutgoingMessage::new("email", "never"));
                Err("ledger rule violated".into())
            })
            .err()
            .ok_or("a failing write must be an error")?;
        assert!(matches!(err, idempotency::Error::LocalWrite { .. }), "{err:?}");
        assert!(err.to_string().contains("ledger rule violated") || format!("{err:?}").contains("ledger rule violated"), "{err:?}");
        assert_eq!(engine.record(&k)?, None, "a failed local write left a record");
        assert!(engine.outbox().is_empty()?, "a failed local write left a message");

        let l = ledger.clone();
        let err = engine
            .execute_local(&k, fp(7)?, move |tx| {
                l.insert(tx, "transfer-2", 7)?;
                panic!("the app's write panicked");
            })
            .err()
            .ok_or("a panicking write must be an error")?;
        assert!(matches!(err, idempotency::Error::LocalWrite { .. }), "{err:?}");
        assert_eq!(engine.record(&k)?, None);

        // The key is free: the next attempt runs and commits.
        let l = ledger.clone();
        let run = engine.execute_local(&k, fp(7)?, move |tx| {
            l.insert(tx, "transfer-2", 8)?;
            Ok(Envelope::new(1, 201, "booked"))
        })?;
        assert!(matches!(run, LocalRun::Executed), "got {run:?}");
        drop(engine);
        assert_eq!(h.ledger_rows(&ledger)?, [("transfer-2".to_owned(), 8)]);
        Ok(())
    }
}

both_backends! {
    /// `complete_local` completes a claim with the app's row; a failing
    /// closure rolls back and releases the key (the next begin claims
    /// afresh with a larger token); a fenced claim commits nothing.
    fn complete_local_with_a_claim(h: &Harness) -> TestResult {
        let ledger = h.ledger()?;
        let engine = h.engine()?;

        let k = key("order-1")?;
        let c = claimed(engine.begin(&k, fp(1)?)?)?;
        let l = ledger.clone();
        engine.complete_local(c, move |tx| {
            l.insert(tx, "order-1", 100)?;
            Ok(Envelope::new(1, 201, "paid"))
        })?;
        assert_eq!(replay(engine.begin(&k, fp(1)?)?)?.envelope.body, b"paid");

        let k = key("order-2")?;
        let c = claimed(engine.begin(&k, fp(1)?)?)?;
        let first = c.fencing_token();
        let l = ledger.clone();
        let err = engine
            .complete_local(c, move |tx| {
                l.insert(tx, "order-2", 200)?;
                Err("card declined by the ledger".into())
            })
            .err()
            .ok_or("a failing write must be an error")?;
        assert!(matches!(err, idempotency::Error::LocalWrite { .. }), "{err:?}");
        assert_eq!(engine.record(&k)?, None, "the failed write's key was not released");
        let c = claimed(engine.begin(&k, fp(1)?)?)?;
        assert!(c.fencing_token() > first);

        // Fenced: the key was force-purged and claimed again meanwhile.
        engine.purge(&k, idempotency::PurgeMode::Force)?;
        let winner = claimed(engine.begin(&k, fp(1)?)?)?;
        let l = ledger.clone();
        let err = engine
            .complete_local(c, move |tx| {
                l.insert(tx, "order-2-fenced", 1)?;
                Ok(Envelope::new(1, 201, "fenced"))
            })
            .err()
            .ok_or("a fenced local write committed")?;
        assert!(matches!(err, idempotency::Error::Fenced { .. }), "{err:?}");
        let l = ledger.clone();
        engine.complete_local(winner, move |tx| {
            l.insert(tx, "order-2", 201)?;
            Ok(Envelope::new(1, 201, "paid"))
        })?;
        drop(engine);
        assert_eq!(
            h.ledger_rows(&ledger)?,
            [("order-1".to_owned(), 100), ("order-2".to_owned(), 201)]
        );
        Ok(())
    }
}

both_backends! {
    /// An inbox consumer's local processing: the ledger row, an outbox
    /// message and the processed mark commit together, once per message.
    fn inbox_process_local_once(h: &Harness) -> TestResult {
        let ledger = h.ledger()?;
        let engine = h.engine()?;
        let consume = |msg: &str| {
            let (l, id) = (ledger.clone(), msg.to_owned());
            engine.inbox("billing")?.process_local(msg, move |tx| {
                l.insert(tx, &id, 500)?;
                tx.send(OutgoingMessage::new("email", format!("receipt for {id}")));
                Ok(())
            })
        };
        for msg in ["m1", "m2"] {
            assert!(matches!(consume(msg)?, Processed::Done));
            for _ in 0..2 {
                let again = consume(msg)?;
                assert!(matches!(again, Processed::Duplicate), "got {again:?}");
            }
        }
        let l = ledger.clone();
        let err = engine
            .inbox("billing")?
            .process_local("m3", move |tx| {
                l.insert(tx, "m3", 1)?;
                Err("rejected".into())
            })
            .err()
            .ok_or("a failing write must be an error")?;
        assert!(matches!(err, idempotency::Error::LocalWrite { .. }), "{err:?}");
        assert!(matches!(consume("m3")?, Processed::Done));
        assert_eq!(engine.outbox().len()?, 3);
        drop(engine);
        let rows: Vec<String> = h.ledger_rows(&ledger)?.into_iter().map(|(id, _)| id).collect();
        assert_eq!(rows, ["m1", "m2", "m3"]);
        Ok(())
    }
}
