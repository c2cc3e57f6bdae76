//! Guards against a key reused with a *different* request being replayed (or
//! executed) as if it were the original: the fingerprint must be compared
//! before anything else, in every state a record can be in, and must ignore
//! only what does not change the request's meaning (member order, whitespace,
//! number spelling). The mismatch in every state, on both backends, is in
//! `tests/backends/mismatch.rs`.

mod common;

use std::error::Error;
use std::sync::atomic::{AtomicUsize, Ordering};

use common::{claimed, replay};
use idempotency::{Begin, Engine, Envelope, Fingerprint, IdempotencyKey};

type TestResult = Result<(), Box<dyn Error>>;

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
