//! Recovery of in-doubt records: `begin` consults the engine's resolver
//! (replay of the provider's answer, a fresh claim with a larger token, or
//! still unknown with attempts counted), `recover_in_doubt` drains the
//! queue oldest first, and a holder that still owns its record may record
//! its late result.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use idempotency::{
    Begin, Claim, Engine, Envelope, Failure, InDoubt, ManualClock, RecoveryReport, ReplayKind,
    Resolution, State,
};

use super::support::*;

const LEASE_MS: u64 = 1_000;

/// A resolver that answers whatever `answer` holds and logs what it was
/// asked (also used by `early.rs`).
#[derive(Clone)]
pub(super) struct Scripted {
    answer: Arc<Mutex<Resolution>>,
    asked: Arc<Mutex<Vec<InDoubt>>>,
}

impl Scripted {
    fn new() -> Scripted {
        Scripted::answering(Resolution::StillInDoubt)
    }
    pub(super) fn answering(answer: Resolution) -> Scripted {
        Scripted {
            answer: Arc::new(Mutex::new(answer)),
            asked: Arc::default(),
        }
    }
    pub(super) fn set(&self, r: Resolution) {
        *self.answer.lock().unwrap_or_else(PoisonError::into_inner) = r;
    }
    pub(super) fn asked(&self) -> Vec<InDoubt> {
        self.asked
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
    /// The resolver to register: logs the question, gives the answer.
    pub(super) fn resolver(&self) -> impl Fn(&InDoubt) -> Resolution + Send + Sync + 'static {
        let s = self.clone();
        move |p: &InDoubt| {
            s.asked
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push(p.clone());
            s.answer
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .clone()
        }
    }
}

/// An engine whose `begin` consults `script`.
fn scripted(
    h: &Harness,
    clock: &ManualClock,
    script: &Scripted,
) -> Result<Engine, idempotency::OpenError> {
    h.open(
        h.builder()
            .clock(clock.clone())
            .lease(Duration::from_millis(LEASE_MS))
            .resolver(script.resolver()),
    )
}

/// Claims `k` and lets the lease run out (the record is stale PROCESSING).
fn stale_claim(
    engine: &Engine,
    clock: &ManualClock,
    k: &idempotency::IdempotencyKey,
) -> Result<Claim, Box<dyn std::error::Error + Send + Sync>> {
    let c = claimed(engine.begin(k, fp(1)?)?)?;
    clock.advance(Duration::from_millis(LEASE_MS + 1));
    Ok(c)
}

fn fenced(result: idempotency::Result<()>) -> TestResult {
    let err = result.err().ok_or("a fenced holder was accepted")?;
    assert!(matches!(err, idempotency::Error::Fenced { .. }), "{err:?}");
    Ok(())
}

both_backends! {
    /// The provider says it completed: `begin` replays its answer, asks
    /// once, and the old holder is fenced.
    fn resolver_completed(h: &Harness) -> TestResult {
        let clock = ManualClock::new(T0);
        let script = Scripted::new();
        let engine = scripted(h, &clock, &script)?;
        let k = key("resolved-completed")?;
        let old = stale_claim(&engine, &clock, &k)?;
        let provider = Envelope::new(1, 201, r#"{"charge":"ch_1"}"#).with_header("x-source", "provider");
        script.set(Resolution::Completed(provider.clone()));

        let r = replay(engine.begin(&k, fp(1)?)?)?;
        assert_eq!(r.envelope, provider);
        assert_eq!(r.kind, ReplayKind::Completed);
        assert_eq!(r.reference, old.reference());
        let asked = script.asked();
        assert_eq!(asked.len(), 1);
        assert_eq!((asked[0].reference.as_str(), asked[0].fencing_token), (old.reference(), old.fencing_token()));
        assert_eq!(replay(engine.begin(&k, fp(1)?)?)?.envelope, provider);
        assert_eq!(script.asked().len(), 1, "asked again after settling");
        assert_eq!(engine.record(&k)?.ok_or("missing")?.state, State::Completed);
        fenced(engine.complete(old, Envelope::new(1, 500, "x")))?;
        assert_eq!(engine.stats()?.resolved, 1);
        Ok(())
    }
}

both_backends! {
    /// The provider never saw it: exactly one fresh claim with a larger
    /// token, in progress for everyone else; the old holder is fenced.
    fn resolver_not_executed(h: &Harness) -> TestResult {
        let clock = ManualClock::new(T0);
        let script = Scripted::new();
        let engine = scripted(h, &clock, &script)?;
        let k = key("resolved-not-executed")?;
        let old = stale_claim(&engine, &clock, &k)?;
        script.set(Resolution::NotExecuted);

        let fresh = claimed(engine.begin(&k, fp(1)?)?)?;
        assert!(fresh.fencing_token() > old.fencing_token());
        assert_ne!(fresh.reference(), old.reference());
        assert_eq!(script.asked().len(), 1);
        let twin = engine.begin(&k, fp(1)?)?;
        assert!(matches!(twin, Begin::Processing { .. }), "got {twin:?}");
        engine.complete(fresh, Envelope::new(1, 201, "fresh"))?;
        fenced(engine.complete(old, Envelope::new(1, 201, "old")))?;
        assert_eq!(replay(engine.begin(&k, fp(1)?)?)?.envelope.body, b"fresh");
        assert_eq!(script.asked().len(), 1);
        Ok(())
    }
}

both_backends! {
    /// The provider cannot tell yet: Unknown each time, attempts counted
    /// and shown to the resolver; nothing is claimed.
    fn resolver_still_in_doubt(h: &Harness) -> TestResult {
        let clock = ManualClock::new(T0);
        let script = Scripted::new();
        let engine = scripted(h, &clock, &script)?;
        let k = key("resolved-still-unknown")?;
        let old = stale_claim(&engine, &clock, &k)?;
        script.set(Resolution::StillInDoubt);
        for want in 1..=3u32 {
            let p = unknown(engine.begin(&k, fp(1)?)?)?;
            assert_eq!(p.attempts, want);
            assert_eq!((p.reference.as_str(), p.fencing_token), (old.reference(), old.fencing_token()));
        }
        let asked: Vec<u32> = script.asked().iter().map(|p| p.attempts).collect();
        assert_eq!(asked, [0, 1, 2], "the resolver sees earlier attempts");
        let rec = engine.record(&k)?.ok_or("missing")?;
        assert_eq!((rec.state, rec.attempts), (State::Unknown, 3));
        // The holder still owns it: its own late result settles it.
        engine.complete(old, Envelope::new(1, 201, "late"))?;
        assert_eq!(replay(engine.begin(&k, fp(1)?)?)?.envelope.body, b"late");
        assert_eq!(script.asked().len(), 3);
        Ok(())
    }
}

both_backends! {
    /// `recover_in_doubt` settles the queue oldest first, each answer as
    /// given, within `limit`; an oversized provider answer leaves its
    /// record UNKNOWN and recovery goes on.
    fn recover_in_doubt_drains_the_queue(h: &Harness) -> TestResult {
        let clock = ManualClock::new(T0);
        let engine = h.open(
            h.builder()
                .clock(clock.clone())
                .lease(Duration::from_millis(LEASE_MS))
                .max_response_bytes(256),
        )?;
        let names = ["a-completed", "b-not-executed", "c-still", "d-too-large", "e-later"];
        for (i, name) in names.into_iter().enumerate() {
            clock.set(T0 + 10 * i as u64);
            let c = claimed(engine.begin(&key(name)?, fp(1)?)?)?;
            engine.fail(c, Failure::InDoubt { reason: format!("timeout {i}") })?;
        }
        let listed: Vec<String> = engine.in_doubt(10)?.iter().map(|d| d.key.key().to_owned()).collect();
        assert_eq!(listed, names);
        let asked = Mutex::new(Vec::new());
        let resolver = |p: &InDoubt| {
            asked.lock().unwrap_or_else(PoisonError::into_inner).push(p.key.key().to_owned());
            match p.key.key() {
                "a-completed" => Resolution::Completed(Envelope::new(1, 201, "provider")),
                "b-not-executed" => Resolution::NotExecuted,
                "d-too-large" => Resolution::Completed(Envelope::new(1, 200, vec![b'x'; 1000])),
                _ => Resolution::StillInDoubt,
            }
        };
        let report = engine.recover_in_doubt(&resolver, 4)?;
        assert_eq!(
            report,
            RecoveryReport { completed: 1, not_executed: 1, still_in_doubt: 2, ..RecoveryReport::default() }
        );
        assert_eq!(*asked.lock().unwrap_or_else(PoisonError::into_inner), names[..4]);
        assert_eq!(replay(engine.begin(&key("a-completed")?, fp(1)?)?)?.envelope.body, b"provider");
        assert_eq!(engine.record(&key("b-not-executed")?)?, None);
        for name in ["c-still", "d-too-large", "e-later"] {
            assert_eq!(engine.record(&key(name)?)?.ok_or("missing")?.state, State::Unknown, "{name}");
        }
        let left: Vec<String> = engine.in_doubt(10)?.iter().map(|d| d.key.key().to_owned()).collect();
        assert_eq!(left, ["c-still", "d-too-large", "e-later"]);
        Ok(())
    }
}
