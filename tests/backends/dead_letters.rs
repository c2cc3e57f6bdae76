//! Dead letters that know about UNKNOWN, on every backend: a message whose
//! handler fails cleanly on its last allowed delivery goes to the
//! dead-letter list (and its inbox record to FINAL_FAILURE, so a
//! redelivery is a duplicate), one whose handler died mid-effect is in
//! doubt and is never dead-lettered, bad messages (no id, an id over the
//! key limit, control characters) are dead-lettered with a reason instead
//! of panicking, and a redrive moves a letter to the outbox exactly once.
//! A backend that loses a letter, lists one twice, dead-letters an in-doubt
//! message or redrives one twice fails here.

use std::time::Duration;

use idempotency::{AfterFailure, Delivery, ManualClock, Processed, Receive, State};

use super::support::*;

fn delivery<'a>(id: &'a str, attempt: u32) -> Delivery<'a> {
    Delivery {
        message_id: id,
        topic: "payments.succeeded",
        payload: b"{\"payment\":\"p-1\"}",
        attempt,
    }
}

both_backends! {
    /// Three clean failures with `dead_letter_after(3)`: two redeliveries,
    /// then one dead letter with the payload, reason and attempt count;
    /// later deliveries are duplicates; a redrive moves it to the outbox
    /// under a new id once, and that id is processed afresh.
    fn clean_failures_go_to_dead_letters(h: &Harness) -> TestResult {
        let engine = h.open(h.builder().dead_letter_after(3))?;
        let inbox = engine.inbox("ledger")?;
        for attempt in 1..=3 {
            let Receive::Fresh(ticket) = inbox.receive("m-1")? else {
                return Err(format!("attempt {attempt}: expected a fresh delivery").into());
            };
            let after = ticket.fail_cleanly(&delivery("m-1", attempt), "ledger closed")?;
            match (attempt, &after) {
                (1 | 2, AfterFailure::Redeliver) | (3, AfterFailure::DeadLettered { .. }) => {}
                _ => return Err(format!("attempt {attempt}: got {after:?}").into()),
            }
        }
        let letters = engine.dead_letters(10)?;
        assert_eq!(letters.len(), 1, "{letters:?}");
        let letter = &letters[0];
        assert_eq!(
            (letter.consumer.as_str(), letter.message_id.as_str(), letter.topic.as_str()),
            ("ledger", "m-1", "payments.succeeded")
        );
        assert_eq!((letter.attempts, letter.reason.as_str()), (3, "ledger closed"));
        assert_eq!(letter.payload, b"{\"payment\":\"p-1\"}");
        let inbox_key = idempotency::IdempotencyKey::inbox("ledger", "m-1")?;
        assert_eq!(engine.record(&inbox_key)?.ok_or("no inbox record")?.state, State::FinalFailure);
        let again = inbox.receive("m-1")?;
        assert!(matches!(again, Receive::Duplicate), "a redelivery after the dead letter: {again:?}");
        assert!(engine.outbox().is_empty()?);

        // Redrive: out of the list, into the outbox, once.
        let id = engine.redrive(letter.seq)?.ok_or("the letter was not there")?;
        assert!(id.starts_with("m-1~redrive"), "{id}");
        assert!(engine.dead_letters(10)?.is_empty());
        assert_eq!(engine.redrive(letter.seq)?, None, "redriven twice");
        let out = engine.outbox().take(10)?;
        assert_eq!(out.len(), 1);
        assert_eq!((out[0].id.as_str(), out[0].topic.as_str()), (id.as_str(), "payments.succeeded"));
        assert_eq!(out[0].payload, letter.payload);
        let redriven = inbox.receive(&id)?;
        let Receive::Fresh(ticket) = redriven else {
            return Err(format!("the redriven id: {redriven:?}").into());
        };
        ticket.ack()?;
        let original = inbox.receive("m-1")?;
        assert!(matches!(original, Receive::Duplicate), "{original:?}");
        Ok(())
    }
}

both_backends! {
    /// A handler that died mid-effect leaves its message in doubt: even
    /// past the delivery limit, `fail_cleanly` does not dead-letter it (it
    /// is the resolver's), and it is listed in doubt, not in dead letters.
    fn in_doubt_is_never_dead_lettered(h: &Harness) -> TestResult {
        let clock = ManualClock::new(T0);
        let engine = h.open(
            h.builder()
                .clock(clock.clone())
                .lease(Duration::from_secs(5))
                .dead_letter_after(2),
        )?;
        let inbox = engine.inbox("ledger")?;
        let Receive::Fresh(ticket) = inbox.receive("m-2")? else {
            return Err("expected a fresh delivery".into());
        };
        // The handler's process dies mid-effect: the ticket is never
        // answered (forgotten, as a killed process forgets it).
        std::mem::forget(ticket);
        clock.advance(Duration::from_secs(6));
        let after = inbox.fail_cleanly(&delivery("m-2", 5), "timeout")?;
        assert!(
            matches!(after, AfterFailure::NotFree(Processed::InDoubt(_))),
            "got {after:?}"
        );
        let redelivered = inbox.receive("m-2")?;
        assert!(matches!(redelivered, Receive::InDoubt(_)), "{redelivered:?}");
        assert!(engine.dead_letters(10)?.is_empty(), "an in-doubt message was dead-lettered");
        let in_doubt = engine.in_doubt(10)?;
        assert_eq!(in_doubt.len(), 1);
        assert_eq!(in_doubt[0].key.key(), "m-2");
        Ok(())
    }
}

both_backends! {
    /// `Inbox::fail_cleanly` after a local write failed (nothing stored):
    /// below the limit nothing is written; on it the message is claimed
    /// and dead-lettered; a processed message is a duplicate, never a dead
    /// letter.
    fn failed_local_writes_count_the_same(h: &Harness) -> TestResult {
        let engine = h.open(h.builder().dead_letter_after(2))?;
        let inbox = engine.inbox("ledger")?;
        let after = inbox.fail_cleanly(&delivery("m-3", 1), "constraint")?;
        assert!(matches!(after, AfterFailure::Redeliver), "{after:?}");
        let key = idempotency::IdempotencyKey::inbox("ledger", "m-3")?;
        assert!(engine.record(&key)?.is_none(), "a redelivery left a record");
        let after = inbox.fail_cleanly(&delivery("m-3", 2), "constraint")?;
        assert!(matches!(after, AfterFailure::DeadLettered { .. }), "{after:?}");
        assert_eq!(engine.dead_letters(10)?.len(), 1);

        let Receive::Fresh(ticket) = inbox.receive("m-4")? else {
            return Err("expected a fresh delivery".into());
        };
        ticket.ack()?;
        let after = inbox.fail_cleanly(&delivery("m-4", 9), "late")?;
        assert!(matches!(after, AfterFailure::NotFree(Processed::Duplicate)), "{after:?}");
        assert_eq!(engine.dead_letters(10)?.len(), 1, "a processed message was dead-lettered");
        Ok(())
    }
}

both_backends! {
    /// Bad messages: no id, an id over the key limit, control characters.
    /// The inbox refuses each with a typed error (no panic), `reject`
    /// dead-letters it with its reason, and a redrive gives it a valid id.
    fn bad_messages_go_to_dead_letters(h: &Harness) -> TestResult {
        let engine = h.engine()?;
        let inbox = engine.inbox("ledger")?;
        let long = "x".repeat(300);
        let bad = ["", long.as_str(), "m\u{0}5", "m\n6"];
        for id in bad {
            let err = inbox.receive(id).err().ok_or_else(|| format!("{id:?} accepted"))?;
            assert!(matches!(err, idempotency::Error::InvalidKey { .. }), "{id:?}: {err:?}");
            let err = inbox.fail_cleanly(&delivery(id, 9), "x").err().ok_or("accepted")?;
            assert!(matches!(err, idempotency::Error::InvalidKey { .. }), "{id:?}: {err:?}");
            inbox.reject(&delivery(id, 0), &format!("bad message id: {err}"))?;
        }
        let letters = engine.dead_letters(10)?;
        assert_eq!(letters.len(), bad.len());
        for (letter, id) in letters.iter().zip(bad) {
            assert_eq!(letter.message_id, id);
            assert!(letter.reason.starts_with("bad message id"), "{}", letter.reason);
            assert_eq!(letter.attempts, 0);
        }
        assert!(letters.windows(2).all(|w| w[0].seq < w[1].seq), "not in order");
        for letter in &letters {
            let id = engine.redrive(letter.seq)?.ok_or("the letter was not there")?;
            assert!(id.starts_with("dead-letter~redrive"), "{id}");
            // The redriven id is a valid inbox key.
            let Receive::Fresh(ticket) = inbox.receive(&id)? else {
                return Err(format!("{id}: expected a fresh delivery").into());
            };
            ticket.ack()?;
        }
        assert_eq!(engine.outbox().len()?, bad.len() as u64);
        Ok(())
    }
}

both_backends! {
    /// Dead letters survive a reopen, and `verify` reads them.
    fn dead_letters_survive_reopen(h: &Harness) -> TestResult {
        {
            let engine = h.engine()?;
            engine.inbox("ledger")?.reject(&delivery("", 0), "no id")?;
        }
        let engine = h.engine()?;
        assert_eq!(engine.dead_letters(10)?.len(), 1);
        let report = engine.verify()?;
        assert!(report.is_sound(), "{report:?}");
        Ok(())
    }
}
