//! Guards against a change of the on-disk format silently breaking
//! databases written by an earlier build. `tests/fixtures/format1.redb` was
//! written by record format 1 (the format of the crate's first release
//! round) with records in every state, outbox messages, an entity and an
//! inbox mark. Every later build must open it and answer exactly as the
//! build that wrote it would.
//!
//! A writable open migrates it to format 2 (every value re-encoded with
//! its checksum, the meta table's values too, in one transaction); a
//! read-only open reads it as it is (meta values without checksums) and
//! leaves the file byte-identical.
//!
//! The fixture is committed; `write_format1_fixture` (ignored) is how it was
//! made: `cargo test --release --test suite -- --ignored --exact
//! format1_fixture::write_format1_fixture`. Never regenerate it with a newer format.

mod common;
#[path = "common/fixture_engine.rs"]
mod fixture_engine;
#[path = "common/meta_table.rs"]
mod meta_table;

use std::error::Error;
use std::path::{Path, PathBuf};

use common::{claimed, replay, unknown};
use fixture_engine::{builder, fp, key, DAY};
use idempotency::{
    Begin, Engine, Envelope, Failure, ManualClock, OutgoingMessage, Receive, ReplayKind,
};
use meta_table::{meta_values, KEYS, META};
use redb::{ReadableDatabase, ReadableTable, TableDefinition};

type TestResult = Result<(), Box<dyn Error>>;

/// When the fixture was written (ms since the Unix epoch).
const T0: u64 = 1_790_000_000_000;

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/format1.redb")
}

/// A fresh copy of the fixture in `dir`.
fn copy_of_fixture(dir: &Path) -> Result<PathBuf, Box<dyn Error>> {
    let path = dir.join("format1.redb");
    std::fs::copy(fixture(), &path)?;
    Ok(path)
}

/// The engine's meta table (see `src/store/redb/tables.rs`).
/// The engine's records table: record key → encoded record.
const RECORDS: TableDefinition<&[u8], &[u8]> = TableDefinition::new("idempotency.records");

/// The file's `format_version`, and the first byte (the value's format
/// version) of every stored record, read without the engine.
fn stored_formats(path: &Path) -> Result<(Vec<u8>, Vec<u8>), Box<dyn Error>> {
    let db = redb::Builder::new().open_read_only(path)?;
    let txn = db.begin_read()?;
    let meta = txn.open_table(META)?;
    let version = meta
        .get("format_version")?
        .ok_or("no format_version")?
        .value()
        .to_vec();
    let mut values = Vec::new();
    for entry in txn.open_table(RECORDS)?.iter()? {
        let (_, v) = entry?;
        values.push(*v.value().first().ok_or("empty record")?);
    }
    Ok((version, values))
}

/// A format-2 meta value as `src/store/codec.rs` specifies it, computed
/// here from the specification (one-shot rapidhash v3 over the
/// concatenations it names), not with the engine's code:
/// `[2][payload][checksum]`.
fn meta_value_per_spec(key: &str, payload: &[u8]) -> Vec<u8> {
    let secrets = rapidhash::v3::RapidSecrets::seed(0x6964_656d_706f_7465);
    let mut seed_input = b"idempotency.meta\0".to_vec();
    seed_input.extend_from_slice(&(key.len() as u64).to_le_bytes());
    seed_input.extend_from_slice(key.as_bytes());
    let keyed = rapidhash::v3::RapidSecrets {
        seed: rapidhash::v3::rapidhash_v3_seeded(&seed_input, &secrets),
        secrets: secrets.secrets,
    };
    let mut value = vec![2];
    value.extend_from_slice(payload);
    let sum = rapidhash::v3::rapidhash_v3_seeded(&value, &keyed);
    value.extend_from_slice(&sum.to_le_bytes());
    value
}

/// Every read answer the fixture was written to give, a day after it was
/// written. Writes nothing (but the move of a stale claim to UNKNOWN), so
/// it holds on a read-only engine too.
fn assert_answers_as_written(engine: &Engine) -> TestResult {
    let r = replay(engine.begin(&key("completed")?, fp(10)?)?)?;
    assert_eq!(r.envelope.status, 201);
    assert_eq!(r.envelope.body, br#"{"payment":"pay_1","amount":10}"#);
    assert_eq!(
        r.envelope.header("content-type"),
        Some(&b"application/json"[..])
    );
    assert_eq!(r.envelope.header("x-raw"), Some(&[0u8, 255, 7][..]));
    assert_eq!(r.resource.as_deref(), Some("pay_1"));
    assert_eq!(r.kind, ReplayKind::Completed);
    assert_eq!(r.envelope.schema_version, 3);

    let r = replay(engine.begin(&key("declined")?, fp(20)?)?)?;
    assert_eq!((r.envelope.status, r.kind), (402, ReplayKind::FinalFailure));
    assert_eq!(r.envelope.body, b"insufficient funds");

    let u = unknown(engine.begin(&key("timed-out")?, fp(30)?)?)?;
    assert_eq!(u.reason, "provider timed out");
    // A claim whose holder vanished: its lease ran out long ago.
    match engine.begin(&key("crashed")?, fp(40)?) {
        Ok(b) => {
            let u = unknown(b)?;
            assert!(
                u.reason.contains("ran out without an outcome"),
                "{}",
                u.reason
            );
        }
        // A read-only engine refuses `begin` here (moving the stale claim
        // to UNKNOWN is a write); the record is still the lapsed claim.
        Err(idempotency::Error::ReadOnly { .. }) => {
            let info = engine.record(&key("crashed")?)?.ok_or("crashed is gone")?;
            assert_eq!(info.state, idempotency::State::Processing);
            assert!(info
                .lease_until_ms
                .is_some_and(|end| end <= T0 + 1_000 * DAY.as_secs()));
        }
        Err(e) => return Err(e.into()),
    }

    assert!(matches!(
        engine.begin(&key("expired")?, fp(50)?)?,
        Begin::Tombstoned { .. }
    ));
    // The fingerprint still decides first, in every state.
    assert!(matches!(
        engine.begin(&key("completed")?, fp(11)?)?,
        Begin::Mismatch
    ));
    assert!(matches!(
        engine.begin(&key("crashed")?, fp(41)?)?,
        Begin::Mismatch
    ));

    let outbox = engine.outbox().take(10)?;
    let ids: Vec<&str> = outbox.iter().map(|m| m.id.as_str()).collect();
    assert_eq!(outbox.len(), 2, "{ids:?}");
    assert!(ids[0].ends_with("/0") && ids[1].ends_with("/1"), "{ids:?}");
    assert_eq!(outbox[1].payload, b"receipt for pay_2");
    assert_eq!(
        engine.entity_state("order-1")?,
        Some(("paid".to_string(), 2))
    );
    let inbox = engine.inbox("mailer")?;
    assert!(matches!(inbox.receive("msg-1")?, Receive::Duplicate));
    Ok(())
}

#[test]
fn a_format1_database_opens_and_answers_as_written() -> TestResult {
    let dir = tempfile::tempdir()?;
    let path = copy_of_fixture(dir.path())?;
    let (version, values) = stored_formats(&path)?;
    assert_eq!((version.as_slice(), values.len()), (&[1u8][..], 7));
    assert!(values.iter().all(|&v| v == 1), "{values:?}");
    // Format 1's meta values: bare payloads.
    let before = meta_values(&path)?;
    let keys: Vec<&str> = before.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(
        keys,
        [
            "expiry_policy",
            "format_version",
            "next_outbox_seq",
            "next_token",
            "ttl_ms"
        ]
    );

    let clock = ManualClock::new(T0);
    clock.advance(DAY);
    let engine = builder(&clock).open(&path)?;
    // A writable open migrates a format-1 file to format 2, not further.
    assert_eq!(engine.redb_format(), Some(2));
    assert_answers_as_written(&engine)?;
    let report = engine.verify()?;
    assert!(report.is_sound(), "{:?}", report.damage);
    assert_eq!(report.records, 7);

    // Fencing tokens keep growing past every stored one.
    let max_stored = engine
        .records(&Default::default())?
        .into_iter()
        .map(|r| r.map(|r| r.fencing_token))
        .collect::<Result<Vec<_>, _>>()?
        .into_iter()
        .max()
        .ok_or("no records")?;
    let fresh = claimed(engine.begin(&key("new")?, fp(60)?)?)?;
    assert!(fresh.fencing_token() > max_stored);
    engine.complete(fresh, Envelope::new(1, 201, "ok"))?;
    drop(engine);

    // The writable open migrated the file: format 2, every record
    // re-encoded (with its checksum), every meta value framed and
    // checksummed as the specification says, and it still answers as
    // written.
    let (version, values) = stored_formats(&path)?;
    assert_eq!(version.first(), Some(&2));
    assert_eq!(values.len(), 8);
    assert!(values.iter().all(|&v| v == 2), "{values:?}");
    let after = meta_values(&path)?;
    let keys: Vec<&str> = after.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(keys, KEYS);
    for (key, value) in &after {
        let payload = value
            .get(1..value.len().saturating_sub(8))
            .ok_or("meta value too short")?;
        assert_eq!(value, &meta_value_per_spec(key, payload), "{key}");
    }
    let payload = |key: &str| -> Result<Vec<u8>, Box<dyn Error>> {
        let (_, v) = after.iter().find(|(k, _)| k == key).ok_or("missing")?;
        Ok(v[1..v.len() - 8].to_vec())
    };
    assert_eq!(payload("format_version")?, b"");
    assert_eq!(payload("journal_clean")?, [1]);
    assert_eq!(
        payload("ttl_ms")?,
        (30 * DAY.as_millis() as u64).to_le_bytes()
    );
    // Values the migration kept (the counter went on past it since).
    let old = |key: &str| -> Result<Vec<u8>, Box<dyn Error>> {
        let (_, v) = before.iter().find(|(k, _)| k == key).ok_or("missing")?;
        Ok(v.clone())
    };
    assert_eq!(payload("expiry_policy")?, old("expiry_policy")?);
    assert_eq!(payload("next_outbox_seq")?, old("next_outbox_seq")?);
    let token = |v: Vec<u8>| -> Result<u64, Box<dyn Error>> {
        Ok(u64::from_le_bytes(<[u8; 8]>::try_from(v.as_slice())?))
    };
    assert!(token(payload("next_token")?)? > token(old("next_token")?)?);
    let engine = builder(&clock).open(&path)?;
    assert_answers_as_written(&engine)?;
    let r = replay(engine.begin(&key("new")?, fp(60)?)?)?;
    assert_eq!(r.envelope.body, b"ok");
    let report = engine.verify()?;
    assert!(report.is_sound(), "{:?}", report.damage);
    assert_eq!(report.records, 8);
    drop(engine);
    let engine = builder(&clock).open_read_only(&path)?;
    assert_answers_as_written(&engine)?;
    assert!(engine.verify()?.is_sound());
    Ok(())
}

#[test]
fn a_read_only_open_of_a_format1_database_answers_and_writes_nothing() -> TestResult {
    let dir = tempfile::tempdir()?;
    let path = copy_of_fixture(dir.path())?;
    let before = std::fs::read(&path)?;
    let clock = ManualClock::new(T0);
    clock.advance(DAY);
    let engine = builder(&clock).open_read_only(&path)?;
    // Read as it is: still format 1.
    assert_eq!(engine.redb_format(), Some(1));
    assert_answers_as_written(&engine)?;
    let report = engine.verify()?;
    assert!(report.is_sound(), "{:?}", report.damage);
    assert_eq!(report.records, 7);
    drop(engine);
    assert!(
        std::fs::read(&path)? == before,
        "a read-only open changed the format-1 file"
    );
    let entries: Vec<_> = std::fs::read_dir(dir.path())?
        .map(|e| e.map(|e| e.file_name()))
        .collect::<Result<_, _>>()?;
    assert_eq!(entries, ["format1.redb"], "a read-only open wrote a file");
    assert_eq!(stored_formats(&path)?.0, [1]);
    Ok(())
}

/// Writes `tests/fixtures/format1.redb` (by hand only; see the module docs).
#[test]
#[ignore = "writes tests/fixtures/format1.redb; run by hand, with format 1 only"]
fn write_format1_fixture() -> TestResult {
    let path = fixture();
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let _ = std::fs::remove_file(&path);
    let clock = ManualClock::new(T0);
    let engine = builder(&clock).open(&path)?;

    // Expires (under the tombstone policy) before the others are written.
    let c = claimed(engine.begin(&key("expired")?, fp(50)?)?)?;
    engine.complete(c, Envelope::new(1, 200, "old"))?;
    clock.advance(31 * DAY);
    engine.sweep_now()?;
    clock.set(T0);

    let c = claimed(engine.begin(&key("completed")?, fp(10)?)?)?;
    engine.complete_with_resource(
        c,
        Envelope::new(3, 201, br#"{"payment":"pay_1","amount":10}"#.to_vec())
            .with_header("content-type", "application/json")
            .with_header("x-raw", vec![0u8, 255, 7]),
        "pay_1",
    )?;
    let c = claimed(engine.begin(&key("declined")?, fp(20)?)?)?;
    engine.fail(
        c,
        Failure::Final(Envelope::new(1, 402, "insufficient funds")),
    )?;
    let c = claimed(engine.begin(&key("timed-out")?, fp(30)?)?)?;
    engine.fail(
        c,
        Failure::InDoubt {
            reason: "provider timed out".into(),
        },
    )?;
    let crashed = claimed(engine.begin(&key("crashed")?, fp(40)?)?)?;
    let c = claimed(engine.begin(&key("with-messages")?, fp(70)?)?)?;
    engine.complete_with_messages(
        c,
        Envelope::new(1, 201, "sent"),
        vec![
            OutgoingMessage::new("email", "receipt for pay_1"),
            OutgoingMessage::new("email", "receipt for pay_2"),
        ],
    )?;
    assert!(matches!(
        engine.transition("order-1", &[], "created")?,
        idempotency::Transition::Applied { version: 1 }
    ));
    assert!(matches!(
        engine.transition("order-1", &["created"], "paid")?,
        idempotency::Transition::Applied { version: 2 }
    ));
    let inbox = engine.inbox("mailer")?;
    assert!(matches!(
        inbox.process_local("msg-1", |_| Ok(()))?,
        idempotency::Processed::Done
    ));
    // The crashed holder never reports back: its record stays PROCESSING.
    std::mem::forget(crashed);
    drop(engine);
    Ok(())
}
