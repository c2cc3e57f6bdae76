//! A stored response survives closing and reopening the store byte for
//! byte (binary body, non-UTF-8 header values, repeated header names in
//! order, resource reference, claim reference), as do every state and the
//! fencing-token counter; upcasters run on replay after an upgrade.

use std::time::Duration;

use idempotency::{
    Begin, Envelope, Failure, IdempotencyKey, ManualClock, RecordFilter, ReplayKind, State,
};

use super::support::*;

/// An envelope with every byte value in its body and awkward headers.
fn awkward_envelope() -> Envelope {
    let body: Vec<u8> = (0..=255u8).chain((0..=255u8).rev()).collect();
    Envelope::new(1, 201, body)
        .with_header("content-type", "application/octet-stream")
        .with_header("x-raw", vec![0xff, 0x00, 0x80])
        .with_header("X-Dup", "a")
        .with_header("x-dup", "b")
        .with_header("x-empty", Vec::new())
}

/// The highest fencing token of any stored record.
fn newest_token(
    engine: &idempotency::Engine,
) -> Result<u64, Box<dyn std::error::Error + Send + Sync>> {
    let tokens = engine
        .records(&RecordFilter::default())?
        .into_iter()
        .map(|r| r.map(|r| r.fencing_token))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(tokens.into_iter().max().ok_or("no records")?)
}

both_backends! {
    fn replay_after_reopen_is_byte_identical(h: &Harness) -> TestResult {
        let k = key("pay-1")?;
        let envelope = awkward_envelope();
        let reference = {
            let engine = h.engine()?;
            let claim = claimed(engine.begin(&k, fp(10)?)?)?;
            let reference = claim.reference().to_string();
            engine.complete_with_resource(claim, envelope.clone(), "pay_123")?;
            reference
        };
        for round in 0..3 {
            let engine = h.engine()?;
            let r = replay(engine.begin(&k, fp(10)?)?)?;
            assert_eq!(r.envelope, envelope, "round {round}");
            assert_eq!(r.envelope.body, envelope.body, "round {round}: body bytes");
            assert_eq!(r.envelope.headers, envelope.headers, "round {round}: header order and bytes");
            assert_eq!((r.envelope.status, r.envelope.schema_version), (201, 1));
            assert_eq!(r.stored_schema_version, 1);
            assert!(r.is_current);
            assert_eq!(r.resource.as_deref(), Some("pay_123"));
            assert_eq!(r.kind, ReplayKind::Completed);
            assert_eq!(r.reference, reference);
            let info = engine.record(&k)?.ok_or("record missing")?;
            assert_eq!(info.response.as_ref(), Some(&envelope));
            assert_eq!(info.resource.as_deref(), Some("pay_123"));
            // A tampered request is still refused after the reopen.
            let answer = engine.begin(&k, fp(11)?)?;
            assert!(matches!(answer, Begin::Mismatch), "got {answer:?}");

            // The fencing-token counter survives: a new claim's token is
            // larger than every stored one.
            let newest = newest_token(&engine)?;
            let c = claimed(engine.begin(&key(&format!("other-{round}"))?, fp(10)?)?)?;
            assert!(c.fencing_token() > newest, "token {} reused (newest {newest})", c.fencing_token());
            engine.complete(c, Envelope::new(1, 200, "x"))?;
        }
        Ok(())
    }
}

both_backends! {
    /// Every state, as stored, is the same after a reopen, and answers the
    /// same; except that on redb (one process holds the file) a claim left
    /// PROCESSING by the engine before is marked UNKNOWN at the open,
    /// keeping its lease end, so it still answers Processing until then
    /// (docs/recovery.md, "Sooner settlement after a crash").
    fn every_state_survives_reopen(h: &Harness) -> TestResult {
        let clock = ManualClock::new(T0);
        let builder = || h.builder().clock(clock.clone()).lease(Duration::from_secs(10));
        let keys: Vec<IdempotencyKey> = ["processing", "completed", "final", "unknown"]
            .into_iter()
            .map(key)
            .collect::<Result<_, _>>()?;
        let (held, before) = {
            let engine = h.open(builder())?;
            let held = claimed(engine.begin(&keys[0], fp(1)?)?)?;
            let c = claimed(engine.begin(&keys[1], fp(1)?)?)?;
            engine.complete(c, Envelope::new(1, 201, "done"))?;
            let c = claimed(engine.begin(&keys[2], fp(1)?)?)?;
            engine.fail(c, Failure::Final(Envelope::new(1, 402, "declined")))?;
            let c = claimed(engine.begin(&keys[3], fp(1)?)?)?;
            engine.fail(c, Failure::InDoubt { reason: "timeout".into() })?;
            let before = keys
                .iter()
                .map(|k| engine.record(k))
                .collect::<Result<Vec<_>, _>>()?;
            // The holder outlives its engine: as after a crash, its record
            // stays PROCESSING.
            (held, before)
        };
        let engine = h.open(builder())?;
        let after = keys.iter().map(|k| engine.record(k)).collect::<Result<Vec<_>, _>>()?;
        assert_eq!(after[1..], before[1..]);
        // A shared server outlives the engine: the claim stays PROCESSING.
        let held_state = if h.is_postgres() || h.is_redis() {
            assert_eq!(after[0], before[0]);
            State::Processing
        } else {
            let (was, now) = (before[0].as_ref().ok_or("missing")?, after[0].as_ref().ok_or("missing")?);
            assert_eq!(now.fencing_token, was.fencing_token);
            assert!(now.reason.contains("process holding the claim ended"), "{}", now.reason);
            State::Unknown
        };
        let states: Vec<_> = after.iter().map(|r| r.as_ref().map(|r| r.state)).collect();
        assert_eq!(
            states,
            [Some(held_state), Some(State::Completed), Some(State::FinalFailure), Some(State::Unknown)]
        );
        // Either way the key is processing until the claim's lease ends.
        let a = engine.begin(&keys[0], fp(1)?)?;
        assert!(matches!(a, Begin::Processing { retry_after } if retry_after == Duration::from_secs(10)), "got {a:?}");
        assert_eq!(replay(engine.begin(&keys[1], fp(1)?)?)?.envelope.body, b"done");
        assert_eq!(replay(engine.begin(&keys[2], fp(1)?)?)?.kind, ReplayKind::FinalFailure);
        assert_eq!(unknown(engine.begin(&keys[3], fp(1)?)?)?.reason, "timeout");
        // The old engine's claim is no longer any engine's: refused, not
        // applied.
        let err = engine.complete(held, Envelope::new(1, 201, "x")).err().ok_or("accepted")?;
        assert!(matches!(err, idempotency::Error::ForeignClaim { .. }), "{err:?}");
        assert_eq!(engine.record(&keys[0])?.ok_or("missing")?.state, held_state);
        Ok(())
    }
}

both_backends! {
    /// After an upgrade to response schema 2 an upcaster runs on replay;
    /// without one the replay says it is not current; the stored record
    /// is never rewritten.
    fn upcaster_runs_on_replay_after_reopen(h: &Harness) -> TestResult {
        let k = key("pay-1")?;
        let envelope = awkward_envelope();
        {
            let engine = h.engine()?;
            let c = claimed(engine.begin(&k, fp(10)?)?)?;
            engine.complete(c, envelope.clone())?;
        }
        {
            let engine = h.open(h.builder().response_schema_version(2).upcaster(1, |mut e: Envelope| {
                e.schema_version = 2;
                e.headers.push(("x-upcast".into(), b"1->2".to_vec()));
                Ok(e)
            }))?;
            let r = replay(engine.begin(&k, fp(10)?)?)?;
            assert!(r.is_current);
            assert_eq!((r.stored_schema_version, r.envelope.schema_version), (1, 2));
            assert_eq!(r.envelope.header("x-upcast"), Some(&b"1->2"[..]));
            assert_eq!(r.envelope.body, envelope.body);
            assert_eq!(engine.record(&k)?.ok_or("missing")?.response, Some(envelope.clone()));
        }
        let engine = h.open(h.builder().response_schema_version(2))?;
        let r = replay(engine.begin(&k, fp(10)?)?)?;
        assert!(!r.is_current);
        assert_eq!(r.envelope, envelope);
        Ok(())
    }
}
