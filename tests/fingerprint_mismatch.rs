//! Guards against a key reused with a *different* request being replayed (or
//! executed) as if it were the original: the fingerprint must be compared
//! before anything else, in every state a record can be in, and must ignore
//! only what does not change the request's meaning (member order, whitespace,
//! number spelling).

mod common;

use std::error::Error;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use common::{claimed, replay};
use idempotency::{
    Begin, Engine, Envelope, ExpiryPolicy, Failure, Fingerprint, IdempotencyKey, ManualClock, State,
};

type TestResult = Result<(), Box<dyn Error>>;

const T0: u64 = 1_700_000_000_000;

fn key(k: &str) -> Result<IdempotencyKey, idempotency::Error> {
    IdempotencyKey::new("tenant-1:create_payment", k)
}

fn fp(json: &str) -> Result<Fingerprint, idempotency::FingerprintError> {
    Fingerprint::of_json(json.as_bytes(), &[])
}

const TEN: &str = r#"{"amount": 10, "currency": "EUR", "to": {"iban": "DE00", "name": "Ada"}}"#;
const HUNDRED: &str =
    r#"{"amount": 100, "currency": "EUR", "to": {"iban": "DE00", "name": "Ada"}}"#;
/// TEN with members reordered, extra whitespace and `10.0` for `10`.
const TEN_REORDERED: &str =
    "{ \"to\" : {\n\t\"name\":\"Ada\",   \"iban\":\"DE00\"},\r\n  \"currency\":\"EUR\",\n\"amount\" : 10.0 }";

#[test]
fn different_amount_is_mismatch_and_changes_nothing() -> TestResult {
    let dir = tempfile::tempdir()?;
    let engine = Engine::builder()
        .sweep_interval(None)
        .open(dir.path().join("idem.redb"))?;
    let k = key("pay-1")?;
    let work = AtomicUsize::new(0);

    let claim = claimed(engine.begin(&k, fp(TEN)?)?)?;
    work.fetch_add(1, Ordering::SeqCst);
    let original = Envelope::new(1, 201, r#"{"id":"pay_1","amount":10}"#)
        .with_header("content-type", "application/json");
    engine.complete(claim, original.clone())?;
    let before = engine.record(&k)?.ok_or("record missing")?;

    for _ in 0..3 {
        let answer = engine.begin(&k, fp(HUNDRED)?)?;
        assert!(matches!(answer, Begin::Mismatch), "got {answer:?}");
    }
    assert_eq!(work.load(Ordering::SeqCst), 1, "the work ran again");
    let after = engine.record(&k)?.ok_or("record missing")?;
    assert_eq!(before, after, "a mismatch changed the stored record");
    assert_eq!(after.response.as_ref(), Some(&original));

    // The original request, spelled differently, still replays.
    let r = replay(engine.begin(&k, fp(TEN_REORDERED)?)?)?;
    assert_eq!(r.envelope, original);
    assert_eq!(engine.stats()?.mismatches, 3);
    Ok(())
}

#[test]
fn reordered_members_and_whitespace_replay() -> TestResult {
    let engine = Engine::builder().sweep_interval(None).in_memory()?;
    let k = key("pay-2")?;
    assert_eq!(fp(TEN)?, fp(TEN_REORDERED)?);
    let claim = claimed(engine.begin(&k, fp(TEN)?)?)?;
    engine.complete(claim, Envelope::new(1, 201, "ok"))?;
    let r = replay(engine.begin(&k, fp(TEN_REORDERED)?)?)?;
    assert_eq!(r.envelope.body, b"ok");
    // A nested value that differs is not the same request.
    let other_name = TEN.replace("Ada", "Bob");
    let answer = engine.begin(&k, fp(&other_name)?)?;
    assert!(matches!(answer, Begin::Mismatch), "got {answer:?}");
    Ok(())
}

/// One record per state; a different request is answered `Mismatch` in each,
/// and the record is left as it was.
#[test]
fn mismatch_in_every_state() -> TestResult {
    let clock = ManualClock::new(T0);
    let engine = Engine::builder()
        .clock(clock.clone())
        .lease(Duration::from_secs(10))
        .ttl(Duration::from_secs(60))
        .expiry_policy(ExpiryPolicy::Tombstone {
            keep: std::time::Duration::from_millis(60_000),
        })
        .sweep_interval(None)
        .in_memory()?;
    let (ten, hundred) = (fp(TEN)?, fp(HUNDRED)?);

    // TOMBSTONE first: it needs the clock moved past its TTL.
    let tomb = key("tombstone")?;
    let c = claimed(engine.begin(&tomb, ten)?)?;
    engine.complete(c, Envelope::new(1, 201, "tomb"))?;
    clock.advance(Duration::from_secs(61));
    let swept = engine.sweep_now()?;
    assert_eq!(swept.tombstoned, 1);

    let processing = key("processing")?;
    let held = claimed(engine.begin(&processing, ten)?)?;

    let completed = key("completed")?;
    let c = claimed(engine.begin(&completed, ten)?)?;
    engine.complete(c, Envelope::new(1, 201, "done"))?;

    let failed = key("failed-final")?;
    let c = claimed(engine.begin(&failed, ten)?)?;
    engine.fail(
        c,
        Failure::Final(Envelope::new(1, 402, "insufficient funds")),
    )?;

    let unknown = key("unknown")?;
    let c = claimed(engine.begin(&unknown, ten)?)?;
    engine.fail(
        c,
        Failure::Unknown {
            reason: "provider timed out".into(),
        },
    )?;

    let cases = [
        (&processing, State::Processing),
        (&completed, State::Completed),
        (&failed, State::FinalFailure),
        (&unknown, State::Unknown),
        (&tomb, State::Tombstone),
    ];
    for (k, state) in cases {
        let before = engine.record(k)?.ok_or("record missing")?;
        assert_eq!(before.state, state, "{k}");
        let answer = engine.begin(k, hundred)?;
        assert!(
            matches!(answer, Begin::Mismatch),
            "{k} in {state}: got {answer:?}"
        );
        assert_eq!(engine.record(k)?.as_ref(), Some(&before), "{k} changed");
    }

    // The same request gets each state's own answer.
    let a = engine.begin(&processing, ten)?;
    assert!(matches!(a, Begin::Processing { .. }), "got {a:?}");
    assert_eq!(
        replay(engine.begin(&completed, ten)?)?.envelope.body,
        b"done"
    );
    assert_eq!(replay(engine.begin(&failed, ten)?)?.envelope.status, 402);
    let a = engine.begin(&unknown, ten)?;
    assert!(matches!(a, Begin::Unknown(_)), "got {a:?}");
    let a = engine.begin(&tomb, ten)?;
    assert!(matches!(a, Begin::Tombstoned { .. }), "got {a:?}");

    // A PROCESSING record whose lease ran out (not yet swept) is a mismatch
    // too, and the mismatching begin does not move it to UNKNOWN.
    clock.advance(Duration::from_secs(11));
    let answer = engine.begin(&processing, hundred)?;
    assert!(matches!(answer, Begin::Mismatch), "got {answer:?}");
    let rec = engine.record(&processing)?.ok_or("record missing")?;
    assert_eq!(rec.state, State::Processing);
    engine.complete(held, Envelope::new(1, 201, "late"))?;
    Ok(())
}
