//! Golden bytes of every format-2 value type: a fixed value of each is
//! encoded and compared with committed hex, and the committed hex decodes
//! back to the value. Format 2 is released, so these bytes may never
//! change: a reordered, added, removed or retyped field of a wire struct
//! (`wire.rs`), a changed discriminant, tag, seed or checksum fails here.
//! Every field of the same type holds a different value, so swapping two
//! of them changes the bytes. (The meta values' goldens are in
//! `redb/meta.rs`, the journal's in `redb/journal.rs`.)

use super::codec::{
    decode, decode_entity, decode_history, decode_outbox, decode_step, encode, encode_entity,
    encode_history, encode_outbox, encode_step,
};
use super::record::{hex, EntityState, Record, RecordState, StoredResponse};
use super::step::{Actor, HistoryRecord, StepRecord, StepStatus};
use crate::envelope::Envelope;
use crate::message::OutboxEntry;

type TestResult = Result<(), Box<dyn std::error::Error>>;

/// The record key the goldens are stored under: scope "shop", key "pay-1".
const RKEY: &[u8] = b"\x04shoppay-1";

/// Bytes of lower-case hex.
fn unhex(s: &str) -> Result<Vec<u8>, Box<dyn std::error::Error>> {
    if !s.len().is_multiple_of(2) {
        return Err(format!("odd hex length {}", s.len()).into());
    }
    (0..s.len())
        .step_by(2)
        .map(|i| Ok(u8::from_str_radix(&s[i..i + 2], 16)?))
        .collect()
}

/// A record in `state` whose every field differs from every other of its
/// type, with a stored response (headers, body, resource) or without.
fn record(state: RecordState, response: bool) -> Record {
    let mut fingerprint = [0u8; 32];
    for (i, b) in fingerprint.iter_mut().enumerate() {
        *b = u8::try_from(i).unwrap_or(0) * 7 + 1;
    }
    Record {
        state,
        fingerprint,
        fingerprint_version: 1,
        token: 300,
        reference: "idem_12c_ref".into(),
        claimed_at_ms: 1_790_000_000_001,
        updated_at_ms: 1_790_000_000_002,
        lease_until_ms: 1_790_000_000_003,
        expires_at_ms: 1_790_000_000_004,
        expired_at_ms: 1_790_000_000_005,
        unknown_since_ms: 1_790_000_000_006,
        attempts: 9,
        reason: "provider timed out".into(),
        response: response.then(|| {
            StoredResponse::new(
                Envelope::new(3, 201, br#"{"id":"pay_1"}"#.to_vec())
                    .with_header("content-type", "application/json")
                    .with_header("x-raw", vec![0u8, 255, 7]),
                Some("pay_1".into()),
            )
        }),
    }
}

/// Encodes `value` with `encode`, compares with `golden`, decodes
/// `golden` with `decode` and compares with `value`.
fn check<T: PartialEq + std::fmt::Debug, E: std::fmt::Display>(
    what: &str,
    value: &T,
    encode: impl Fn(&T) -> Vec<u8>,
    decode: impl Fn(&[u8]) -> Result<T, E>,
    golden: &str,
) -> TestResult {
    let bytes = encode(value);
    assert_eq!(hex(&bytes), golden, "{what}: the encoding changed");
    let back = decode(&unhex(golden)?).map_err(|e| format!("{what}: {e}"))?;
    assert_eq!(&back, value, "{what}: the golden bytes decode differently");
    Ok(())
}

#[test]
fn records_in_every_state() -> TestResult {
    let cases = [
        (RecordState::Processing, false, PROCESSING),
        (RecordState::Completed, true, COMPLETED),
        (RecordState::FinalFailure, true, FINAL_FAILURE),
        (RecordState::Unknown, false, UNKNOWN),
        (RecordState::Tombstone, false, TOMBSTONE),
    ];
    for (state, response, golden) in cases {
        check(
            &format!("{state:?}"),
            &record(state, response),
            |r| encode(RKEY, r),
            |b| decode(RKEY, b),
            golden,
        )?;
    }
    Ok(())
}

/// A stored response on its own: the bytes after the record's fields
/// (`Some`, then the response) are the response's encoding, whatever the
/// state.
#[test]
fn stored_response() -> TestResult {
    let with = encode(RKEY, &record(RecordState::Completed, true));
    let without = encode(RKEY, &record(RecordState::Completed, false));
    // Both end in `[Option tag][response…]` / `[Option tag]`, then the
    // 8-byte checksum; the fields before are the same.
    let prefix = without.len() - 8 - 1;
    assert_eq!(with[..prefix], without[..prefix]);
    let response = &with[prefix..with.len() - 8];
    assert_eq!(hex(response), STORED_RESPONSE);
    Ok(())
}

#[test]
fn outbox_entry() -> TestResult {
    let entry = OutboxEntry {
        seq: 7,
        id: "idem_12c_ref/0".into(),
        topic: "email".into(),
        payload: vec![0, 1, 2, 255],
        created_at_ms: 1_790_000_000_009,
    };
    check(
        "outbox entry",
        &entry,
        |e| encode_outbox(7, e),
        |b| decode_outbox(7, b),
        OUTBOX,
    )
}

#[test]
fn entity_state() -> TestResult {
    let entity = EntityState {
        state: "paid".into(),
        version: 2,
        updated_at_ms: 1_790_000_000_010,
    };
    check(
        "entity",
        &entity,
        |e| encode_entity("order-1", e),
        |b| decode_entity("order-1", b),
        ENTITY,
    )
}

/// A step in `status` whose every field differs from every other of its
/// type.
fn step(status: StepStatus) -> StepRecord {
    StepRecord {
        name: "charge".into(),
        reference: "idem_12c_ref/charge".into(),
        status,
        token: 300,
        evidence: vec![0, 9, 255],
        reserved_at_ms: 1_790_000_000_011,
        settled_at_ms: Some(1_790_000_000_012),
        attempts: 4,
        last_asked_ms: Some(1_790_000_000_013),
    }
}

/// Effect steps (`idempotency.steps`, added beside format 2 with the same
/// framing): their bytes are fixed from the build that added them.
#[test]
fn steps_in_every_status() -> TestResult {
    let cases = [
        (StepStatus::Reserved, STEP_RESERVED),
        (StepStatus::Confirmed, STEP_CONFIRMED),
        (StepStatus::Failed, STEP_FAILED),
        (StepStatus::Unknown, STEP_UNKNOWN),
        (StepStatus::NotExecuted, STEP_NOT_EXECUTED),
    ];
    for (status, golden) in cases {
        check(
            &format!("step {status:?}"),
            &step(status),
            |s| encode_step(RKEY, s),
            |b| decode_step(RKEY, "charge", b),
            golden,
        )?;
    }
    let bare = StepRecord {
        settled_at_ms: None,
        last_asked_ms: None,
        evidence: Vec::new(),
        ..step(StepStatus::Reserved)
    };
    check(
        "step without options",
        &bare,
        |s| encode_step(RKEY, s),
        |b| decode_step(RKEY, "charge", b),
        STEP_BARE,
    )
}

/// Evidence log entries (`idempotency.history`), one per actor.
#[test]
fn history_entries_of_every_actor() -> TestResult {
    let entry = |seq: u32, actor: Actor, step: Option<&str>| HistoryRecord {
        seq,
        at_ms: 1_790_000_000_014,
        actor,
        step: step.map(str::to_owned),
        from: "reserved".into(),
        to: "confirmed".into(),
        evidence: vec![7, 0, 200],
    };
    let cases = [
        (
            entry(5, Actor::Claim { token: 301 }, Some("charge")),
            HISTORY_CLAIM,
        ),
        (entry(6, Actor::Resolver, Some("charge")), HISTORY_RESOLVER),
        (
            entry(
                7,
                Actor::Operator {
                    reason: "ledger checked".into(),
                },
                None,
            ),
            HISTORY_OPERATOR,
        ),
        (entry(8, Actor::Sweeper, Some("receipt")), HISTORY_SWEEPER),
    ];
    for (e, golden) in cases {
        let seq = e.seq;
        check(
            &format!("history {:?}", e.actor),
            &e,
            |h| encode_history(RKEY, h),
            |b| decode_history(RKEY, seq, b),
            golden,
        )?;
    }
    Ok(())
}

// The committed golden bytes (hex), written by the released format 2.
const PROCESSING: &str = concat!(
    "020001080f161d242b323940474e555c636a71787f868d949ba2a9b0b7bec5cc",
    "d3da01ac020c6964656d5f3132635f72656681d8c1a28c3482d8c1a28c3483d8",
    "c1a28c3484d8c1a28c3485d8c1a28c3486d8c1a28c34091270726f7669646572",
    "2074696d6564206f757400dc3fd0b49277b337",
);
const COMPLETED: &str = concat!(
    "020101080f161d242b323940474e555c636a71787f868d949ba2a9b0b7bec5cc",
    "d3da01ac020c6964656d5f3132635f72656681d8c1a28c3482d8c1a28c3483d8",
    "c1a28c3484d8c1a28c3485d8c1a28c3486d8c1a28c34091270726f7669646572",
    "2074696d6564206f75740103c901020c636f6e74656e742d7479706510617070",
    "6c69636174696f6e2f6a736f6e05782d7261770300ff070e7b226964223a2270",
    "61795f31227d01057061795f31a9793c60ddd75873",
);
const FINAL_FAILURE: &str = concat!(
    "020201080f161d242b323940474e555c636a71787f868d949ba2a9b0b7bec5cc",
    "d3da01ac020c6964656d5f3132635f72656681d8c1a28c3482d8c1a28c3483d8",
    "c1a28c3484d8c1a28c3485d8c1a28c3486d8c1a28c34091270726f7669646572",
    "2074696d6564206f75740103c901020c636f6e74656e742d7479706510617070",
    "6c69636174696f6e2f6a736f6e05782d7261770300ff070e7b226964223a2270",
    "61795f31227d01057061795f31449d8bb8705cf21e",
);
const UNKNOWN: &str = concat!(
    "020301080f161d242b323940474e555c636a71787f868d949ba2a9b0b7bec5cc",
    "d3da01ac020c6964656d5f3132635f72656681d8c1a28c3482d8c1a28c3483d8",
    "c1a28c3484d8c1a28c3485d8c1a28c3486d8c1a28c34091270726f7669646572",
    "2074696d6564206f757400c946498d2a5c2d3f",
);
const TOMBSTONE: &str = concat!(
    "020401080f161d242b323940474e555c636a71787f868d949ba2a9b0b7bec5cc",
    "d3da01ac020c6964656d5f3132635f72656681d8c1a28c3482d8c1a28c3483d8",
    "c1a28c3484d8c1a28c3485d8c1a28c3486d8c1a28c34091270726f7669646572",
    "2074696d6564206f757400cf05ced38cec78d1",
);
const STORED_RESPONSE: &str = concat!(
    "0103c901020c636f6e74656e742d74797065106170706c69636174696f6e2f6a",
    "736f6e05782d7261770300ff070e7b226964223a227061795f31227d01057061",
    "795f31",
);
const OUTBOX: &str = concat!(
    "02070e6964656d5f3132635f7265662f3005656d61696c04000102ff89d8c1a2",
    "8c3472e4c727dac688ee",
);
const ENTITY: &str = "020470616964028ad8c1a28c348751fb6944c0d600";

// Effect steps and log entries (same framing, tags `idempotency.step` and
// `idempotency.history`), fixed by the build that added them.
const STEP_RESERVED: &str = "0206636861726765136964656d5f3132635f7265662f63686172676500ac02030009ff8bd8c1a28c34018cd8c1a28c3404018dd8c1a28c341c3aa8fa3d899356";
const STEP_CONFIRMED: &str = "0206636861726765136964656d5f3132635f7265662f63686172676501ac02030009ff8bd8c1a28c34018cd8c1a28c3404018dd8c1a28c3468c4ab31d97e4f86";
const STEP_FAILED: &str = "0206636861726765136964656d5f3132635f7265662f63686172676502ac02030009ff8bd8c1a28c34018cd8c1a28c3404018dd8c1a28c348caddb7869dfc478";
const STEP_UNKNOWN: &str = "0206636861726765136964656d5f3132635f7265662f63686172676503ac02030009ff8bd8c1a28c34018cd8c1a28c3404018dd8c1a28c340ced7878df8a1006";
const STEP_NOT_EXECUTED: &str = "0206636861726765136964656d5f3132635f7265662f63686172676504ac02030009ff8bd8c1a28c34018cd8c1a28c3404018dd8c1a28c34b274263aef06864c";
const STEP_BARE: &str = "0206636861726765136964656d5f3132635f7265662f63686172676500ac02008bd8c1a28c34000400c5c46c2937c3d0e5";
const HISTORY_CLAIM: &str = "02058ed8c1a28c3400ad02010663686172676508726573657276656409636f6e6669726d6564030700c8fe195a06e2c22562";
const HISTORY_RESOLVER: &str = "02068ed8c1a28c3401010663686172676508726573657276656409636f6e6669726d6564030700c8ea8181176a64eb25";
const HISTORY_OPERATOR: &str = "02078ed8c1a28c34020e6c656467657220636865636b65640008726573657276656409636f6e6669726d6564030700c8c1338e064ea66568";
const HISTORY_SWEEPER: &str = "02088ed8c1a28c340301077265636569707408726573657276656409636f6e6669726d6564030700c8ae08abe2ad7d6a9e";
