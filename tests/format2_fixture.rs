//! Guards against a change of the on-disk format silently breaking
//! databases written by the released format 2. `tests/fixtures/format2.redb`
//! and its journal `format2.redb.journal` were written by a format-2 build
//! and closed cleanly: records in every state (COMPLETED with a stored
//! envelope of headers, binary header bytes, body and resource,
//! FINAL_FAILURE, PROCESSING, UNKNOWN, a tombstone, an inbox mark),
//! outbox messages (one published, two pending), an entity state and every
//! meta value. Every later build must open them and answer exactly as the
//! build that wrote them would: replays byte for byte, each state as
//! written, a different fingerprint refused in every state, `verify`
//! sound, and no stored value rewritten by a writable open.
//!
//! `format2-crashed.redb` and its journal hold the same mix written by an
//! engine that crashed (a child process that aborted) before any
//! checkpoint: the writes are frames of the journal only, which an open
//! must apply.
//!
//! The fixtures are committed; `write_format2_fixture` and
//! `write_format2_crashed_fixture` (ignored) are how they were made:
//! `cargo test --release --test suite -- --ignored --exact
//! format2_fixture::write_format2_fixture` (and `write_format2_crashed_fixture`). Never regenerate it with a newer format (a
//! layout change gets a fixture of its own, and this one stays).

mod common;
#[path = "common/fixture_engine.rs"]
mod fixture_engine;
#[path = "common/meta_table.rs"]
mod meta_table;

use std::collections::BTreeMap;
use std::error::Error;
use std::path::{Path, PathBuf};

use common::{claimed, replay, unknown};
use fixture_engine::{
    builder, copy_with_journal, fixture_file, fp, journal_chain, key, DAY, FRAME_HEADER,
    JOURNAL_HEADER,
};
use idempotency::{
    Begin, Engine, Envelope, Failure, ManualClock, OutgoingMessage, Receive, ReplayKind, State,
};
use meta_table::{meta_values, KEYS};
use redb::{ReadableDatabase, ReadableTable, TableDefinition};

type TestResult = Result<(), Box<dyn Error>>;

/// When the fixture was written (ms since the Unix epoch).
const T0: u64 = 1_795_000_000_000;

fn fixture() -> PathBuf {
    fixture_file("format2.redb")
}

fn fixture_journal() -> PathBuf {
    fixture_file("format2.redb.journal")
}

/// A fresh copy of the fixture and its journal in `dir`.
fn copy_of_fixture(dir: &Path) -> Result<PathBuf, Box<dyn Error>> {
    copy_with_journal("format2.redb", dir)
}

const RECORDS: TableDefinition<&[u8], &[u8]> = TableDefinition::new("idempotency.records");
const OUTBOX: TableDefinition<u64, &[u8]> = TableDefinition::new("idempotency.outbox");
const ENTITIES: TableDefinition<&str, &[u8]> = TableDefinition::new("idempotency.entities");

/// Every stored value of the records, outbox and entities tables, by
/// table and key bytes, read with redb directly.
type Values = BTreeMap<(&'static str, Vec<u8>), Vec<u8>>;

fn stored_values(path: &Path) -> Result<Values, Box<dyn Error>> {
    let db = redb::Builder::new().open_read_only(path)?;
    let txn = db.begin_read()?;
    let mut out = Values::new();
    for entry in txn.open_table(RECORDS)?.iter()? {
        let (k, v) = entry?;
        out.insert(("records", k.value().to_vec()), v.value().to_vec());
    }
    for entry in txn.open_table(OUTBOX)?.iter()? {
        let (k, v) = entry?;
        out.insert(
            ("outbox", k.value().to_le_bytes().to_vec()),
            v.value().to_vec(),
        );
    }
    for entry in txn.open_table(ENTITIES)?.iter()? {
        let (k, v) = entry?;
        out.insert(
            ("entities", k.value().as_bytes().to_vec()),
            v.value().to_vec(),
        );
    }
    Ok(out)
}

/// The stored envelope of `completed`, as the writer stored it.
fn completed_envelope() -> Envelope {
    Envelope::new(3, 201, br#"{"payment":"pay_1","amount":10}"#.to_vec())
        .with_header("content-type", "application/json")
        .with_header("x-raw", vec![0u8, 255, 7])
        .with_header("x-empty", Vec::new())
}

/// The state each key was written in.
const STATES: [(&str, State); 7] = [
    ("completed", State::Completed),
    ("declined", State::FinalFailure),
    ("timed-out", State::Unknown),
    ("crashed", State::Processing),
    ("expired", State::Tombstone),
    ("with-messages", State::Completed),
    ("empty", State::Completed),
];

/// Every answer the fixture was written to give, a day after it was
/// written, that writes nothing. Holds on a read-only engine too.
fn assert_answers_as_written(engine: &Engine) -> TestResult {
    for (k, state) in STATES {
        let info = engine.record(&key(k)?)?.ok_or(format!("{k} is gone"))?;
        assert_eq!(info.state, state, "{k}");
    }
    let info = engine.record(&key("crashed")?)?.ok_or("crashed is gone")?;
    assert_eq!(info.lease_until_ms, Some(T0 + 30_000));
    let info = engine
        .record(&key("timed-out")?)?
        .ok_or("timed-out is gone")?;
    assert_eq!(info.reason, "provider timed out");

    // Replays, byte for byte.
    let r = replay(engine.begin(&key("completed")?, fp(10)?)?)?;
    assert_eq!(r.envelope, completed_envelope());
    assert_eq!(r.envelope.headers, completed_envelope().headers);
    assert_eq!(r.resource.as_deref(), Some("pay_1"));
    assert_eq!(
        (r.kind, r.stored_schema_version),
        (ReplayKind::Completed, 3)
    );

    let r = replay(engine.begin(&key("declined")?, fp(20)?)?)?;
    assert_eq!(r.envelope, Envelope::new(1, 402, "insufficient funds"));
    assert_eq!((r.kind, r.resource), (ReplayKind::FinalFailure, None));

    let r = replay(engine.begin(&key("with-messages")?, fp(70)?)?)?;
    assert_eq!(r.envelope, Envelope::new(1, 201, "sent"));

    let r = replay(engine.begin(&key("empty")?, fp(80)?)?)?;
    assert_eq!(r.envelope, Envelope::new(0, 204, Vec::new()));

    let u = unknown(engine.begin(&key("timed-out")?, fp(30)?)?)?;
    assert_eq!(u.reason, "provider timed out");

    let tombstone = engine.begin(&key("expired")?, fp(50)?)?;
    assert!(
        matches!(
            tombstone,
            Begin::Tombstoned { expired_at_ms, reusable_at_ms }
                if expired_at_ms < reusable_at_ms
        ),
        "{tombstone:?}"
    );

    // The fingerprint decides first, in every state (PROCESSING is checked
    // by each test: there a matching begin moves the lapsed claim to
    // UNKNOWN, which is a write).
    for (k, other) in [
        ("completed", 11),
        ("declined", 21),
        ("timed-out", 31),
        ("expired", 51),
        ("with-messages", 71),
        ("empty", 81),
    ] {
        let b = engine.begin(&key(k)?, fp(other)?)?;
        assert!(matches!(b, Begin::Mismatch), "{k}: {b:?}");
    }

    // One message was published (removed); two wait.
    let outbox = engine.outbox().take(10)?;
    let ids: Vec<&str> = outbox.iter().map(|m| m.id.as_str()).collect();
    assert_eq!(outbox.len(), 2, "{ids:?}");
    assert!(ids[0].ends_with("/1") && ids[1].ends_with("/2"), "{ids:?}");
    assert_eq!(outbox[0].topic, "email");
    assert_eq!(outbox[0].payload, b"receipt for pay_2");
    assert_eq!(outbox[1].topic, "ledger");
    assert_eq!(outbox[1].payload, [0u8, 1, 2, 255]);
    assert!(outbox.iter().all(|m| m.created_at_ms == T0));
    assert!(outbox[0].seq < outbox[1].seq);
    assert_eq!(
        engine.entity_state("order-1")?,
        Some(("paid".to_string(), 2))
    );
    let inbox = engine.inbox("mailer")?;
    assert!(matches!(inbox.receive("msg-1")?, Receive::Duplicate));
    Ok(())
}

#[test]
fn a_format2_database_opens_and_answers_as_written() -> TestResult {
    let dir = tempfile::tempdir()?;
    let path = copy_of_fixture(dir.path())?;
    let before = stored_values(&path)?;
    // 8 records (7 keys and the inbox mark), 2 outbox messages, 1 entity.
    assert_eq!(before.len(), 11);
    assert!(before.values().all(|v| v.first() == Some(&2)));
    let meta_before = meta_values(&path)?;
    let keys: Vec<&str> = meta_before.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(keys, KEYS);
    assert!(meta_before.iter().all(|(_, v)| v.first() == Some(&2)));

    let clock = ManualClock::new(T0);
    clock.advance(DAY);
    let engine = builder(&clock).open(&path)?;
    assert_answers_as_written(&engine)?;
    let report = engine.verify()?;
    assert!(report.is_sound(), "{:?}", report.damage);
    assert_eq!(report.records, 8);
    drop(engine);
    // A writable open of a format-2 file rewrites no stored value.
    assert_eq!(stored_values(&path)?, before);

    // Writes go on: the lapsed claim moves to UNKNOWN (and still refuses
    // another fingerprint), a fresh key gets a fencing token past every
    // stored one, the pending messages can be published.
    let engine = builder(&clock).open(&path)?;
    assert!(matches!(
        engine.begin(&key("crashed")?, fp(41)?)?,
        Begin::Mismatch
    ));
    let u = unknown(engine.begin(&key("crashed")?, fp(40)?)?)?;
    assert!(
        u.reason.contains("ran out without an outcome"),
        "{}",
        u.reason
    );
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
    let seqs: Vec<u64> = engine.outbox().take(10)?.iter().map(|m| m.seq).collect();
    assert_eq!(engine.outbox().mark_published(&seqs)?, 2);
    let report = engine.verify()?;
    assert!(report.is_sound(), "{:?}", report.damage);
    assert_eq!(report.records, 9);
    drop(engine);
    let engine = builder(&clock).open_read_only(&path)?;
    let r = replay(engine.begin(&key("new")?, fp(60)?)?)?;
    assert_eq!(r.envelope.body, b"ok");
    let r = replay(engine.begin(&key("completed")?, fp(10)?)?)?;
    assert_eq!(r.envelope, completed_envelope());
    assert!(engine.outbox().is_empty()?);
    assert!(engine.verify()?.is_sound());
    Ok(())
}

#[test]
fn a_read_only_open_of_a_format2_database_answers_and_writes_nothing() -> TestResult {
    let dir = tempfile::tempdir()?;
    let path = copy_of_fixture(dir.path())?;
    let journal = dir.path().join("format2.redb.journal");
    let before = (std::fs::read(&path)?, std::fs::read(&journal)?);
    let clock = ManualClock::new(T0);
    clock.advance(DAY);
    let engine = builder(&clock).open_read_only(&path)?;
    assert_answers_as_written(&engine)?;
    // The lapsed claim stays a claim: moving it to UNKNOWN is a write.
    assert!(matches!(
        engine.begin(&key("crashed")?, fp(40)?),
        Err(idempotency::Error::ReadOnly { .. })
    ));
    assert!(matches!(
        engine.begin(&key("crashed")?, fp(41)?)?,
        Begin::Mismatch
    ));
    let report = engine.verify()?;
    assert!(report.is_sound(), "{:?}", report.damage);
    assert_eq!(report.records, 8);
    drop(engine);
    assert!(
        (std::fs::read(&path)?, std::fs::read(&journal)?) == before,
        "a read-only open changed the format-2 files"
    );
    Ok(())
}

/// The committed journal's header is the one `journal.rs` documents
/// (magic, version 2, this database's journal id), so the open above read
/// a real journal rather than making a new one.
#[test]
fn the_fixture_journal_is_a_version2_journal_of_this_database() -> TestResult {
    let journal = std::fs::read(fixture_journal())?;
    assert_eq!(&journal[..16], b"idempotency-jrnl");
    assert_eq!(&journal[16..20], 2u32.to_le_bytes());
    let meta = meta_values(&fixture())?;
    let (_, id) = meta
        .iter()
        .find(|(k, _)| k == "journal_id")
        .ok_or("no journal_id")?;
    // `[2][16-byte id][checksum]`.
    assert_eq!(&journal[24..40], &id[1..17]);
    assert!(journal.len() > JOURNAL_HEADER + FRAME_HEADER);
    Ok(())
}

/// Writes the fixture's mix of values but the inbox mark through `engine`
/// (whose clock is `clock`, at `T0`); returns the claim of `crashed`,
/// which its caller forgets, so the record stays PROCESSING.
fn write_mix(engine: &Engine, clock: &ManualClock) -> Result<idempotency::Claim, Box<dyn Error>> {
    // Expires (under the tombstone policy) before the others are written.
    let c = claimed(engine.begin(&key("expired")?, fp(50)?)?)?;
    engine.complete(c, Envelope::new(1, 200, "old"))?;
    clock.advance(31 * DAY);
    engine.sweep_now()?;
    clock.set(T0);

    let c = claimed(engine.begin(&key("completed")?, fp(10)?)?)?;
    engine.complete_with_resource(c, completed_envelope(), "pay_1")?;
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
    let c = claimed(engine.begin(&key("empty")?, fp(80)?)?)?;
    engine.complete(c, Envelope::new(0, 204, Vec::new()))?;
    let crashed = claimed(engine.begin(&key("crashed")?, fp(40)?)?)?;
    let c = claimed(engine.begin(&key("with-messages")?, fp(70)?)?)?;
    engine.complete_with_messages(
        c,
        Envelope::new(1, 201, "sent"),
        vec![
            OutgoingMessage::new("email", "receipt for pay_1"),
            OutgoingMessage::new("email", "receipt for pay_2"),
            OutgoingMessage::new("ledger", vec![0u8, 1, 2, 255]),
        ],
    )?;
    let first = engine.outbox().take(1)?;
    let first: Vec<u64> = first.iter().map(|m| m.seq).collect();
    assert_eq!(engine.outbox().mark_published(&first)?, 1);
    assert!(matches!(
        engine.transition("order-1", &[], "created")?,
        idempotency::Transition::Applied { version: 1 }
    ));
    assert!(matches!(
        engine.transition("order-1", &["created"], "paid")?,
        idempotency::Transition::Applied { version: 2 }
    ));
    Ok(crashed)
}

/// Marks inbox message `msg-1` of consumer `mailer` processed, with a
/// local write (which commits to the database file durably: a checkpoint).
fn mark_inbox(engine: &Engine) -> TestResult {
    let inbox = engine.inbox("mailer")?;
    assert!(matches!(
        inbox.process_local("msg-1", |_| Ok(()))?,
        idempotency::Processed::Done
    ));
    Ok(())
}

/// Writes `tests/fixtures/format2.redb` and its journal (by hand only;
/// see the module docs).
#[test]
#[ignore = "writes tests/fixtures/format2.redb; run by hand, with format 2 only"]
fn write_format2_fixture() -> TestResult {
    let path = fixture();
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let _ = std::fs::remove_file(&path);
    let _ = std::fs::remove_file(fixture_journal());
    let clock = ManualClock::new(T0);
    let engine = builder(&clock).open(&path)?;
    let crashed = write_mix(&engine, &clock)?;
    mark_inbox(&engine)?;
    // The crashed holder never reports back: its record stays PROCESSING.
    std::mem::forget(crashed);
    drop(engine);

    // Keep the journal's frames, not the megabytes of zeros after them.
    let journal = std::fs::read(fixture_journal())?;
    let kept = journal_chain(&journal)?.to_vec();
    std::fs::write(fixture_journal(), kept)?;
    Ok(())
}

/// The environment variable that makes `crashed_fixture_child` write.
const CHILD_DIR_VAR: &str = "IDEMPOTENCY_FORMAT2_CHILD_DIR";

/// The child process of `write_format2_crashed_fixture`: writes the mix
/// into a fresh database in `$IDEMPOTENCY_FORMAT2_CHILD_DIR` and aborts
/// before any checkpoint, so the writes live only in the journal. A no-op
/// without the variable.
#[test]
#[ignore = "the child process of write_format2_crashed_fixture"]
fn crashed_fixture_child() -> TestResult {
    let Ok(dir) = std::env::var(CHILD_DIR_VAR) else {
        return Ok(());
    };
    let clock = ManualClock::new(T0);
    let engine = builder(&clock).open(Path::new(&dir).join("format2-crashed.redb"))?;
    // First: the inbox's local write checkpoints, and the frames are to
    // come after the last checkpoint.
    mark_inbox(&engine)?;
    let crashed = write_mix(&engine, &clock)?;
    std::mem::forget(crashed);
    println!("\nALL WRITTEN");
    std::process::abort()
}

/// Writes `tests/fixtures/format2-crashed.redb` and its journal: a
/// format-2 database whose engine crashed (a child process that aborted),
/// so its writes since the open are frames of the journal only (by hand
/// only; see the module docs).
#[test]
#[ignore = "writes tests/fixtures/format2-crashed.redb; run by hand, with format 2 only"]
fn write_format2_crashed_fixture() -> TestResult {
    let dir = tempfile::tempdir()?;
    let out = std::process::Command::new("/bin/sh")
        .arg("-c")
        .arg(r#"ulimit -c 0 2>/dev/null; exec "$0" "$@""#)
        .arg(std::env::current_exe()?)
        .args([
            "--exact",
            // `<file>::crashed_fixture_child` where this file is a module of a test binary.
            concat!(module_path!(), "::crashed_fixture_child")
                .split_once("::")
                .map_or("crashed_fixture_child", |(_, t)| t),
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_DIR_VAR, dir.path())
        .stdin(std::process::Stdio::null())
        .output()?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    if out.status.success() || !stdout.contains("ALL WRITTEN\n") {
        return Err(format!(
            "the child did not write and abort: {:?}\n{stdout}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        )
        .into());
    }
    std::fs::copy(dir.path().join("format2-crashed.redb"), crashed_fixture())?;
    let journal = std::fs::read(dir.path().join("format2-crashed.redb.journal"))?;
    std::fs::write(crashed_fixture_journal(), journal_chain(&journal)?)?;
    Ok(())
}

fn crashed_fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/format2-crashed.redb")
}

fn crashed_fixture_journal() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/format2-crashed.redb.journal")
}

/// The LSNs of the frames in `journal`'s chain.
fn journal_lsns(journal: &[u8]) -> Result<Vec<u64>, Box<dyn Error>> {
    let chain = journal_chain(journal)?;
    let mut pos = JOURNAL_HEADER;
    let mut out = Vec::new();
    while pos < chain.len() {
        let len = u32::from_le_bytes(chain[pos..pos + 4].try_into()?) as usize;
        out.push(u64::from_le_bytes(chain[pos + 8..pos + 16].try_into()?));
        pos += (FRAME_HEADER + len).div_ceil(8) * 8;
    }
    Ok(out)
}

/// A format-2 database left by a crash: its writes are journal frames
/// (version-2 frames of postcard `Frame`s) that the database file does not
/// hold. A writable open applies them and answers as written; a read-only
/// open refuses (applying them writes) and writes nothing.
#[test]
fn a_crashed_format2_database_recovers_from_its_journal_and_answers_as_written() -> TestResult {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("format2-crashed.redb");
    let journal = dir.path().join("format2-crashed.redb.journal");
    std::fs::copy(crashed_fixture(), &path)?;
    std::fs::copy(crashed_fixture_journal(), &journal)?;

    // The file says it was not closed cleanly, and the journal holds
    // frames past the LSN the file holds. (redb must repair the file
    // before it reads it: a copy is repaired, to read its meta table.)
    let probe = dir.path().join("probe.redb");
    std::fs::copy(&path, &probe)?;
    let (meta, records_held) = {
        let db = redb::Database::open(&probe)?;
        let txn = db.begin_read()?;
        let mut meta = Vec::new();
        for entry in txn.open_table(meta_table::META)?.iter()? {
            let (k, v) = entry?;
            meta.push((k.value().to_string(), v.value().to_vec()));
        }
        (meta, txn.open_table(RECORDS)?.iter()?.count())
    };
    // Only the inbox mark (a local write, durable in the file itself).
    assert_eq!(records_held, 1);
    let payload = |key: &str| -> Result<Vec<u8>, Box<dyn Error>> {
        let (_, v) = meta.iter().find(|(k, _)| k == key).ok_or("missing")?;
        Ok(v[1..v.len() - 8].to_vec())
    };
    assert_eq!(payload("journal_clean")?, [0]);
    let held = u64::from_le_bytes(<[u8; 8]>::try_from(payload("journal_lsn")?.as_slice())?);
    let lsns = journal_lsns(&std::fs::read(&journal)?)?;
    let pending = lsns.iter().filter(|&&l| l > held).count();
    assert!(pending >= 10, "{held} {lsns:?}");

    let clock = ManualClock::new(T0);
    clock.advance(DAY);
    let before = (std::fs::read(&path)?, std::fs::read(&journal)?);
    let refused = builder(&clock).open_read_only(&path);
    assert!(
        matches!(refused, Err(idempotency::OpenError::NeedsRecovery { .. })),
        "{:?}",
        refused.err()
    );
    assert!((std::fs::read(&path)?, std::fs::read(&journal)?) == before);

    let engine = builder(&clock).open(&path)?;
    assert_answers_as_written(&engine)?;
    let report = engine.verify()?;
    assert!(report.is_sound(), "{:?}", report.damage);
    assert_eq!(report.records, 8);
    drop(engine);
    // Applied and checkpointed: the file alone now answers, read-only too.
    let engine = builder(&clock).open_read_only(&path)?;
    assert_answers_as_written(&engine)?;
    Ok(())
}

/// The `format_version` value of the file at `path` (closed), read with
/// redb directly.
fn format_version(path: &Path) -> Result<Vec<u8>, Box<dyn Error>> {
    let db = redb::Builder::new().open_read_only(path)?;
    let txn = db.begin_read()?;
    let table = txn.open_table(meta_table::META)?;
    let v = table.get("format_version")?.ok_or("no format_version")?;
    Ok(v.value().to_vec())
}

/// Whether the closed file at `path` still has format 2's records table.
fn has_format2_records(path: &Path) -> Result<bool, Box<dyn Error>> {
    let db = redb::Builder::new().open_read_only(path)?;
    let txn = db.begin_read()?;
    match txn.open_table(RECORDS) {
        Ok(_) => Ok(true),
        Err(redb::TableError::TableDoesNotExist(_)) => Ok(false),
        Err(e) => Err(e.into()),
    }
}

/// Opens the format-2 file at `path` asking for format 3, which migrates
/// it, and checks it answers as written and verifies sound.
fn migrated(path: &Path, clock: &ManualClock) -> Result<Engine, Box<dyn Error>> {
    let engine = builder(clock).migrate_to_format_3().open(path)?;
    assert_answers_as_written(&engine)?;
    let report = engine.verify()?;
    assert!(report.is_sound(), "{:?}", report.damage);
    assert_eq!(report.records, 8);
    Ok(engine)
}

/// An open that asks for format 3
/// (`EngineBuilder::migrate_to_format_3`) migrates the format-2 file: it then
/// answers exactly as written, `verify` finds it sound, writes go on, and
/// later opens (writable without asking, read-only) read it as format 3.
#[test]
fn a_format2_database_migrated_to_format3_answers_as_written() -> TestResult {
    let dir = tempfile::tempdir()?;
    let path = copy_of_fixture(dir.path())?;
    let clock = ManualClock::new(T0);
    clock.advance(DAY);
    let engine = migrated(&path, &clock)?;
    let fresh = claimed(engine.begin(&key("new")?, fp(60)?)?)?;
    engine.complete(fresh, Envelope::new(1, 201, "ok"))?;
    drop(engine);
    assert_eq!(format_version(&path)?.first(), Some(&3));
    assert!(
        !has_format2_records(&path)?,
        "format 2's records table is gone"
    );

    let engine = builder(&clock).open(&path)?;
    assert_answers_as_written(&engine)?;
    let r = replay(engine.begin(&key("new")?, fp(60)?)?)?;
    assert_eq!(r.envelope.body, b"ok");
    assert!(engine.verify()?.is_sound());
    drop(engine);
    let engine = builder(&clock).open_read_only(&path)?;
    assert_answers_as_written(&engine)?;
    assert_eq!(engine.verify()?.records, 9);
    Ok(())
}

/// A crashed format-2 file is recovered from its journal first, then
/// migrated: nothing its journal held is lost.
#[test]
fn a_crashed_format2_database_is_recovered_then_migrated_to_format3() -> TestResult {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("format2-crashed.redb");
    std::fs::copy(crashed_fixture(), &path)?;
    std::fs::copy(
        crashed_fixture_journal(),
        dir.path().join("format2-crashed.redb.journal"),
    )?;
    let clock = ManualClock::new(T0);
    clock.advance(DAY);
    let engine = migrated(&path, &clock)?;
    drop(engine);
    assert_eq!(format_version(&path)?.first(), Some(&3));
    let engine = builder(&clock).open_read_only(&path)?;
    assert_answers_as_written(&engine)?;
    Ok(())
}
