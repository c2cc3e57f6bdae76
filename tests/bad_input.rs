//! Guards against bad input turning into a vague error, a poisoned engine, or
//! a second execution: a malformed key, an unparseable or ambiguous request
//! body, an oversized response and a stale fencing token must each be refused
//! with their own error (saying what and where), and the engine must go on
//! serving other keys afterwards.

mod common;

use std::error::Error;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use common::claimed;
use idempotency::canonical::CanonicalError;
use idempotency::{
    Begin, Engine, Envelope, Fingerprint, FingerprintError, IdempotencyKey, ManualClock,
    Resolution, State,
};

type TestResult = Result<(), Box<dyn Error>>;

const T0: u64 = 1_700_000_000_000;
const SCOPE: &str = "tenant-1:create_payment";

fn key(k: &str) -> Result<IdempotencyKey, idempotency::Error> {
    IdempotencyKey::new(SCOPE, k)
}

fn fp() -> Result<Fingerprint, FingerprintError> {
    Fingerprint::of_json(br#"{"amount": 10}"#, &[])
}

/// Another key still claims, completes and replays.
fn still_serves(engine: &Engine, name: &str) -> TestResult {
    let k = key(name)?;
    let c = claimed(engine.begin(&k, fp()?)?)?;
    engine.complete(c, Envelope::new(1, 201, name))?;
    match engine.begin(&k, fp()?)? {
        Begin::Replay(r) => assert_eq!(r.envelope.body, name.as_bytes()),
        other => return Err(format!("{name}: expected Replay, got {other:?}").into()),
    }
    Ok(())
}

fn engine() -> Result<(Engine, ManualClock), idempotency::Error> {
    let clock = ManualClock::new(T0);
    let engine = Engine::builder()
        .clock(clock.clone())
        .lease(Duration::from_secs(1))
        .max_response_bytes(1024)
        .sweep_interval(None)
        .in_memory()?;
    Ok((engine, clock))
}

#[test]
fn invalid_keys_say_which_part_and_why() -> TestResult {
    let (engine, _) = engine()?;
    let long = "k".repeat(300);
    let cases: [(&str, &str, &str, &str); 6] = [
        (SCOPE, "", "key", "must not be empty"),
        ("", "k", "scope", "must not be empty"),
        (SCOPE, &long, "key", "longer than 255 bytes"),
        (&long, "k", "scope", "longer than 255 bytes"),
        (SCOPE, "line\nbreak", "key", "contains a control character"),
        (SCOPE, "nul\0byte", "key", "contains a control character"),
    ];
    for (i, (scope, k, want_what, want_reason)) in cases.into_iter().enumerate() {
        let err = IdempotencyKey::new(scope, k)
            .err()
            .ok_or("accepted a bad key")?;
        assert!(
            matches!(&err, idempotency::Error::InvalidKey { what, reason, .. }
                if *what == want_what && *reason == want_reason),
            "{scope:?}/{k:?}: {err:?}"
        );
        let shown = err.to_string();
        assert!(shown.contains(want_reason), "{shown}");
        assert!(
            !shown.contains('\n'),
            "a newline leaked into the message: {shown}"
        );
        still_serves(&engine, &format!("after-bad-key-{i}"))?;
    }
    // The limits are inclusive: 255 bytes is fine.
    assert!(IdempotencyKey::new(SCOPE, "k".repeat(255)).is_ok());
    let err = IdempotencyKey::from_bytes(SCOPE.as_bytes(), &[0x66, 0xff])
        .err()
        .ok_or("accepted")?;
    assert!(
        matches!(
            err,
            idempotency::Error::InvalidKey {
                reason: "not valid UTF-8",
                ..
            }
        ),
        "{err:?}"
    );
    // A huge non-UTF-8 value (an HTTP header, a message id) is shown cut
    // short, like an over-long valid one, not copied whole into the error.
    let err = IdempotencyKey::from_bytes(SCOPE.as_bytes(), &vec![0xff; 100_000])
        .err()
        .ok_or("accepted")?;
    let shown = err.to_string();
    assert!(shown.len() < 1024, "{} bytes of message", shown.len());
    Ok(())
}

#[test]
fn bad_json_is_a_fingerprint_error_with_position() -> TestResult {
    let (engine, _) = engine()?;

    let invalid = Fingerprint::of_json(b"{\n  \"amount\": ,\n}", &[])
        .err()
        .ok_or("parsed")?;
    let position = match &invalid {
        FingerprintError::Json(CanonicalError::Syntax { position, .. }) => *position,
        other => return Err(format!("expected a syntax error, got {other:?}").into()),
    };
    assert_eq!((position.line, position.column), (2, 13), "{invalid}");
    assert_eq!(position.offset, 14);
    assert!(invalid.to_string().contains("line 2"), "{invalid}");
    let as_engine_error = idempotency::Error::from(invalid);
    assert!(
        matches!(as_engine_error, idempotency::Error::Fingerprint(_)),
        "{as_engine_error:?}"
    );
    still_serves(&engine, "after-invalid-json")?;

    let dup = Fingerprint::of_json(br#"{"to": {"iban": "A", "iban": "B"}}"#, &[])
        .err()
        .ok_or("accepted a duplicate member")?;
    match &dup {
        FingerprintError::Json(CanonicalError::DuplicateMember {
            object,
            name,
            position,
        }) => {
            assert_eq!(object, "/to");
            assert_eq!(name, "iban");
            assert_eq!(position.offset, 21, "where the second \"iban\" starts");
        }
        other => return Err(format!("expected a duplicate member, got {other:?}").into()),
    }
    assert!(dup.to_string().contains("iban"), "{dup}");
    still_serves(&engine, "after-duplicate-member")?;

    // The error flows through `?` into the crate's error type.
    fn begin_with(engine: &Engine, body: &[u8]) -> Result<Begin, idempotency::Error> {
        engine.begin(
            &IdempotencyKey::new(SCOPE, "via-question-mark")?,
            Fingerprint::of_json(body, &[])?,
        )
    }
    let err = begin_with(&engine, b"[1, 2,]")
        .err()
        .ok_or("accepted a trailing comma")?;
    assert!(matches!(err, idempotency::Error::Fingerprint(_)), "{err:?}");
    assert!(
        engine.record(&key("via-question-mark")?)?.is_none(),
        "a record was written"
    );
    still_serves(&engine, "after-trailing-comma")?;
    Ok(())
}

#[test]
fn oversized_response_hands_the_claim_back_and_never_reruns() -> TestResult {
    let (engine, _) = engine()?;
    let k = key("big")?;
    let work = AtomicUsize::new(0);

    let c = claimed(engine.begin(&k, fp()?)?)?;
    work.fetch_add(1, Ordering::SeqCst);
    let big = Envelope::new(1, 200, vec![b'x'; 1000]).with_header("x-pad", vec![b'y'; 25]);
    // 1000 body bytes, 5 + 25 for the header's name and value, 32 for the
    // header itself (RFC 7541, section 4.1).
    assert_eq!(big.size_bytes(), 1062);
    let err = engine
        .complete(c, big)
        .err()
        .ok_or("stored an oversized response")?;
    assert!(
        err.to_string().contains("1062") && err.to_string().contains("1024"),
        "{err}"
    );
    // The outcome is known: the claim comes back unused, the record is
    // still PROCESSING (never UNKNOWN), and a retry meanwhile never runs.
    let idempotency::Error::ResponseTooLarge {
        size: 1062,
        limit: 1024,
        key: refused,
        claim: Some(claim),
    } = err
    else {
        return Err(format!("{err:?}").into());
    };
    assert_eq!(refused, k);
    let info = engine.record(&k)?.ok_or("record missing")?;
    assert_eq!(info.state, State::Processing);
    assert!(matches!(engine.begin(&k, fp()?)?, Begin::Processing { .. }));
    // A smaller answer with the same claim is stored and replayed.
    let claim = claim.into_claim().ok_or("no claim inside")?;
    engine.complete(claim, Envelope::new(1, 200, "summary"))?;
    for _ in 0..3 {
        match engine.begin(&k, fp()?)? {
            Begin::Replay(r) => assert_eq!(r.envelope.body, b"summary"),
            Begin::Claimed(_) => {
                work.fetch_add(1, Ordering::SeqCst);
                return Err("an oversized response led to a second execution".into());
            }
            other => return Err(format!("expected a replay, got {other:?}").into()),
        }
    }
    assert_eq!(work.load(Ordering::SeqCst), 1);

    // Exactly at the limit is accepted.
    let k2 = key("exactly-at-limit")?;
    let c = claimed(engine.begin(&k2, fp()?)?)?;
    engine.complete(c, Envelope::new(1, 200, vec![b'z'; 1024]))?;
    still_serves(&engine, "after-oversized")?;
    Ok(())
}

#[test]
fn empty_headers_count_against_the_response_limit() -> TestResult {
    let (engine, _) = engine()?;
    // Empty names and values once counted nothing: a million of them
    // passed a 1 KiB limit and took megabytes of file and journal.
    let mut many = Envelope::new(1, 200, "");
    many.headers = vec![(String::new(), Vec::new()); 1_000_000];
    assert_eq!(many.size_bytes(), 32_000_000);
    let k = key("many-empty-headers")?;
    let c = claimed(engine.begin(&k, fp()?)?)?;
    let err = engine
        .complete(c, many)
        .err()
        .ok_or("stored a million headers")?;
    assert!(
        matches!(
            err,
            idempotency::Error::ResponseTooLarge {
                size: 32_000_000,
                limit: 1024,
                ..
            }
        ),
        "{err:?}"
    );
    // 32 headers of nothing fill the limit exactly; one more does not fit.
    let mut full = Envelope::new(1, 200, "");
    full.headers = vec![(String::new(), Vec::new()); 32];
    assert_eq!(full.size_bytes(), 1024);
    let k2 = key("headers-at-limit")?;
    let c = claimed(engine.begin(&k2, fp()?)?)?;
    engine.complete(c, full)?;
    still_serves(&engine, "after-many-headers")?;
    Ok(())
}

#[test]
fn stale_fencing_token_is_refused_and_record_untouched() -> TestResult {
    let (engine, clock) = engine()?;
    let k = key("fenced")?;

    let a = claimed(engine.begin(&k, fp()?)?)?;
    clock.advance(Duration::from_millis(1001));
    let pending = match engine.begin(&k, fp()?)? {
        Begin::InDoubt(p) => p,
        other => return Err(format!("expected InDoubt, got {other:?}").into()),
    };
    assert_eq!(pending.fencing_token, a.fencing_token());
    engine.resolve(&k, Resolution::NotExecuted, "provider has nothing")?;
    let b = claimed(engine.begin(&k, fp()?)?)?;
    assert!(b.fencing_token() > a.fencing_token());
    let (a_token, b_token) = (a.fencing_token(), b.fencing_token());

    let before = engine.record(&k)?.ok_or("record missing")?;
    let err = engine
        .complete(a, Envelope::new(1, 201, "from A"))
        .err()
        .ok_or("A's late complete was accepted")?;
    assert!(
        matches!(&err, idempotency::Error::Fenced { token, key, .. } if *token == a_token && *key == k),
        "{err:?}"
    );
    assert!(
        err.to_string().contains(&b_token.to_string()),
        "names the owner: {err}"
    );
    assert_eq!(
        engine.record(&k)?.as_ref(),
        Some(&before),
        "fenced op changed the record"
    );

    engine.complete(b, Envelope::new(1, 201, "from B"))?;
    match engine.begin(&k, fp()?)? {
        Begin::Replay(r) => assert_eq!(r.envelope.body, b"from B"),
        other => return Err(format!("expected Replay, got {other:?}").into()),
    }
    still_serves(&engine, "after-fenced")?;
    Ok(())
}

/// Entity ids and inbox consumers are validated like keys: `entity_state`
/// refuses what `transition` refuses, control characters are refused, and
/// an empty consumer name is refused.
#[test]
fn entity_ids_and_consumers_are_validated() -> TestResult {
    let (engine, _) = engine()?;
    for bad in ["", "a\u{0}b", "tab\there"] {
        let err = engine
            .transition(bad, &[], "created")
            .err()
            .ok_or("accepted a bad entity id")?;
        assert!(
            matches!(err, idempotency::Error::InvalidEntity { .. }),
            "{err:?}"
        );
        let err = engine
            .entity_state(bad)
            .err()
            .ok_or("entity_state accepted a bad id")?;
        assert!(
            matches!(err, idempotency::Error::InvalidEntity { .. }),
            "{err:?}"
        );
    }
    let long = "x".repeat(256);
    assert!(engine.entity_state(&long).is_err());
    let err = engine.inbox("").err().ok_or("accepted an empty consumer")?;
    assert!(
        matches!(err, idempotency::Error::InvalidKey { .. }),
        "{err:?}"
    );
    still_serves(&engine, "after-bad-entities")?;
    Ok(())
}

#[test]
fn response_limit_is_clamped_between_its_bounds() -> TestResult {
    // Larger limits would let one completion outgrow a journal frame
    // (4 GiB) beside a full group; smaller ones would not hold the HTTP
    // layer's not-retained marker.
    for (asked, kept) in [
        (
            usize::MAX,
            idempotency::EngineBuilder::MAX_RESPONSE_BYTES_LIMIT,
        ),
        (0, idempotency::EngineBuilder::MIN_RESPONSE_BYTES),
    ] {
        let engine = Engine::builder()
            .max_response_bytes(asked)
            .sweep_interval(None)
            .in_memory()?;
        assert_eq!(engine.max_response_bytes(), kept, "asked for {asked}");
    }
    assert_eq!(
        idempotency::EngineBuilder::MAX_RESPONSE_BYTES_LIMIT,
        1 << 30
    );
    assert_eq!(idempotency::EngineBuilder::MIN_RESPONSE_BYTES, 256);
    Ok(())
}

#[test]
fn outbox_messages_count_against_the_response_limit() -> TestResult {
    let (engine, _) = engine()?;
    let k = key("big-messages")?;
    let c = claimed(engine.begin(&k, fp()?)?)?;
    // 2 bytes of body, 5 + 2000 of message: over the 1 KiB limit.
    let err = engine
        .complete_with_messages(
            c,
            Envelope::new(1, 200, "ok"),
            vec![idempotency::OutgoingMessage::new("email", vec![b'm'; 2000])],
        )
        .err()
        .ok_or("stored 2 KB of messages under a 1 KiB limit")?;
    let idempotency::Error::ResponseTooLarge {
        size: 2007,
        limit: 1024,
        claim: Some(claim),
        ..
    } = err
    else {
        return Err(format!("{err:?}").into());
    };
    // The claim comes back unused: smaller messages go through with it.
    let claim = claim.into_claim().ok_or("no claim inside")?;
    engine.complete_with_messages(
        claim,
        Envelope::new(1, 200, "ok"),
        vec![idempotency::OutgoingMessage::new("email", "hello")],
    )?;
    assert_eq!(engine.outbox().len()?, 1);
    still_serves(&engine, "after-big-messages")?;
    Ok(())
}
