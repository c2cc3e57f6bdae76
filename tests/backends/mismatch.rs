//! A key reused with a different request (a tampered amount) is `Mismatch`
//! in every state a record can be in, before the state decides anything,
//! and leaves the record as it was; the same request still gets its own
//! answer.

use std::time::Duration;

use idempotency::{Begin, Envelope, ExpiryPolicy, Failure, Fingerprint, ManualClock, State};

use super::support::*;

const TEN: &str = r#"{"amount": 10, "currency": "EUR", "to": {"iban": "DE00", "name": "Ada"}}"#;
const HUNDRED: &str =
    r#"{"amount": 100, "currency": "EUR", "to": {"iban": "DE00", "name": "Ada"}}"#;
/// TEN with members reordered, extra whitespace and `10.0` for `10`.
const TEN_REORDERED: &str =
    "{ \"to\" : {\n\t\"name\":\"Ada\",   \"iban\":\"DE00\"},\r\n  \"currency\":\"EUR\",\n\"amount\" : 10.0 }";

fn json(s: &str) -> Result<Fingerprint, idempotency::FingerprintError> {
    Fingerprint::of_json(s.as_bytes(), &[])
}

both_backends! {
    /// PROCESSING, COMPLETED, FINAL_FAILURE, UNKNOWN, TOMBSTONE, and a
    /// PROCESSING record whose lease ran out: each answers a tampered
    /// request with `Mismatch` and is left untouched.
    fn mismatch_in_every_state(h: &Harness) -> TestResult {
        let clock = ManualClock::new(T0);
        let engine = h.open(
            h.builder()
                .clock(clock.clone())
                .lease(Duration::from_secs(10))
                .ttl(Duration::from_secs(60))
                .expiry_policy(ExpiryPolicy::Tombstone {
                    keep: Duration::from_secs(60),
                }),
        )?;
        let (ten, hundred) = (json(TEN)?, json(HUNDRED)?);
        assert_eq!(ten, json(TEN_REORDERED)?);

        // TOMBSTONE first: it needs the clock moved past its TTL.
        let tomb = key("tombstone")?;
        let c = claimed(engine.begin(&tomb, ten)?)?;
        engine.complete(c, Envelope::new(1, 201, "tomb"))?;
        clock.advance(Duration::from_secs(61));
        assert_eq!(engine.sweep_now()?.tombstoned, 1);

        let processing = key("processing")?;
        let held = claimed(engine.begin(&processing, ten)?)?;

        let completed = key("completed")?;
        let c = claimed(engine.begin(&completed, ten)?)?;
        let original = Envelope::new(1, 201, r#"{"id":"pay_1","amount":10}"#)
            .with_header("content-type", "application/json");
        engine.complete(c, original.clone())?;

        let failed = key("failed-final")?;
        let c = claimed(engine.begin(&failed, ten)?)?;
        engine.fail(c, Failure::Final(Envelope::new(1, 402, "insufficient funds")))?;

        let in_doubt = key("unknown")?;
        let c = claimed(engine.begin(&in_doubt, ten)?)?;
        engine.fail(c, Failure::InDoubt { reason: "provider timed out".into() })?;

        let cases = [
            (&processing, State::Processing),
            (&completed, State::Completed),
            (&failed, State::FinalFailure),
            (&in_doubt, State::Unknown),
            (&tomb, State::Tombstone),
        ];
        for (k, state) in cases {
            let before = engine.record(k)?.ok_or("record missing")?;
            assert_eq!(before.state, state, "{k}");
            for _ in 0..2 {
                let answer = engine.begin(k, hundred)?;
                assert!(matches!(answer, Begin::Mismatch), "{k} in {state}: got {answer:?}");
            }
            assert_eq!(engine.record(k)?.as_ref(), Some(&before), "{k} changed");
        }
        assert_eq!(engine.stats()?.mismatches, 10);

        // The same request, spelled differently, gets each state's own answer.
        let same = json(TEN_REORDERED)?;
        let a = engine.begin(&processing, same)?;
        assert!(matches!(a, Begin::Processing { .. }), "got {a:?}");
        assert_eq!(replay(engine.begin(&completed, same)?)?.envelope, original);
        assert_eq!(replay(engine.begin(&failed, same)?)?.envelope.status, 402);
        let a = engine.begin(&in_doubt, same)?;
        assert!(matches!(a, Begin::InDoubt(_)), "got {a:?}");
        let a = engine.begin(&tomb, same)?;
        assert!(matches!(a, Begin::Tombstoned { .. }), "got {a:?}");

        // A PROCESSING record whose lease ran out (not yet swept) is a
        // mismatch too, and the mismatching begin does not move it.
        clock.advance(Duration::from_secs(11));
        let answer = engine.begin(&processing, hundred)?;
        assert!(matches!(answer, Begin::Mismatch), "got {answer:?}");
        let rec = engine.record(&processing)?.ok_or("record missing")?;
        assert_eq!(rec.state, State::Processing);
        // Its holder may still record the result it has.
        engine.complete(held, Envelope::new(1, 201, "late"))?;
        assert_eq!(replay(engine.begin(&processing, ten)?)?.envelope.body, b"late");
        Ok(())
    }
}

both_backends! {
    /// A tampered retry never runs the work and never sees the stored
    /// response, however often it is sent; a nested field counts.
    fn tampered_retry_changes_nothing(h: &Harness) -> TestResult {
        let engine = h.engine()?;
        let k = key("pay-1")?;
        let c = claimed(engine.begin(&k, json(TEN)?)?)?;
        engine.complete(c, Envelope::new(1, 201, "ok"))?;
        let before = engine.record(&k)?.ok_or("record missing")?;
        let other_name = json(&TEN.replace("Ada", "Bob"))?;
        for tampered in [json(HUNDRED)?, other_name] {
            let answer = engine.begin(&k, tampered)?;
            assert!(matches!(answer, Begin::Mismatch), "got {answer:?}");
        }
        assert_eq!(engine.record(&k)?, Some(before));
        assert_eq!(replay(engine.begin(&k, json(TEN_REORDERED)?)?)?.envelope.body, b"ok");
        let stats = engine.stats()?;
        assert_eq!((stats.claims, stats.mismatches, stats.replays), (1, 2, 1));
        Ok(())
    }
}
