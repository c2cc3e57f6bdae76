//! Guards the format-2 tables that the effect steps and dead letters added
//! (created on first use, so a format-2 file may or may not hold them):
//! `idempotency.steps`, `idempotency.history` and
//! `idempotency.dead_letters`. `tests/fixtures/format2-steps.redb` and its
//! journal were written by a format-2 build and closed cleanly:
//!
//! - `two-calls`: COMPLETED after two confirmed steps (`charge`, `receipt`);
//! - `declined`: FINAL_FAILURE after a rejected `charge`;
//! - `in-doubt`: UNKNOWN, its `charge` reserved when the claim failed in
//!   doubt (so the step is `Unknown`);
//! - `by-hand`: UNKNOWN, its `charge` settled by an operator as executed
//!   (resumable: the next `begin` skips the call);
//! - `running`: PROCESSING, `charge` confirmed and `receipt` reserved when
//!   its holder went away;
//! - one dead letter of consumer `ledger`.
//!
//! Every later build must open them and answer as the build that wrote
//! them would (steps, references, evidence, the evidence log, resumption),
//! rewrite no stored value on a writable open, write nothing on a
//! read-only one, and find the file sound with `verify`. A later format
//! migrates this file; its test must keep these answers.
//!
//! `write_format2_steps_fixture` (ignored) is how the fixture was made:
//! `cargo test --release --test suite -- --ignored --exact
//! format2_steps_fixture::write_format2_steps_fixture`. Never regenerate it with a newer format.

mod common;
#[path = "common/fixture_engine.rs"]
mod fixture_engine;
#[path = "common/meta_table.rs"]
mod meta_table;

use std::collections::BTreeMap;
use std::error::Error;
use std::path::{Path, PathBuf};

use common::{claimed, replay, unknown};
use fixture_engine::{builder, copy_with_journal, fixture_file, fp, journal_chain, key, DAY};
use idempotency::{
    Actor, AfterFailure, Begin, Delivery, EffectStep, Engine, Envelope, Failure, ManualClock,
    Receive, State, StepResolution, StepState,
};
use redb::{ReadableDatabase, ReadableTable, TableDefinition};

type TestResult = Result<(), Box<dyn Error>>;

/// When the fixture was written (ms since the Unix epoch).
const T0: u64 = 1_796_000_000_000;

fn fixture() -> PathBuf {
    fixture_file("format2-steps.redb")
}

fn fixture_journal() -> PathBuf {
    fixture_file("format2-steps.redb.journal")
}

/// A fresh copy of the fixture and its journal in `dir`.
fn copy_of_fixture(dir: &Path) -> Result<PathBuf, Box<dyn Error>> {
    copy_with_journal("format2-steps.redb", dir)
}

const RECORDS: TableDefinition<&[u8], &[u8]> = TableDefinition::new("idempotency.records");
const STEPS: TableDefinition<(&[u8], &str), &[u8]> = TableDefinition::new("idempotency.steps");
const HISTORY: TableDefinition<(&[u8], u32), &[u8]> = TableDefinition::new("idempotency.history");
const DEAD_LETTERS: TableDefinition<u64, &[u8]> = TableDefinition::new("idempotency.dead_letters");

/// Every stored value of the records, steps, history and dead-letter
/// tables, by table and key, read with redb directly.
type Values = BTreeMap<(&'static str, String), Vec<u8>>;

fn stored_values(path: &Path) -> Result<Values, Box<dyn Error>> {
    let db = redb::Builder::new().open_read_only(path)?;
    let txn = db.begin_read()?;
    let mut out = Values::new();
    for entry in txn.open_table(RECORDS)?.iter()? {
        let (k, v) = entry?;
        out.insert(("records", format!("{:?}", k.value())), v.value().to_vec());
    }
    for entry in txn.open_table(STEPS)?.iter()? {
        let (k, v) = entry?;
        out.insert(("steps", format!("{:?}", k.value())), v.value().to_vec());
    }
    for entry in txn.open_table(HISTORY)?.iter()? {
        let (k, v) = entry?;
        out.insert(("history", format!("{:?}", k.value())), v.value().to_vec());
    }
    for entry in txn.open_table(DEAD_LETTERS)?.iter()? {
        let (k, v) = entry?;
        out.insert(("dead_letters", k.value().to_string()), v.value().to_vec());
    }
    Ok(out)
}

/// The state each key was written in.
const STATES: [(&str, State); 5] = [
    ("two-calls", State::Completed),
    ("declined", State::FinalFailure),
    ("in-doubt", State::Unknown),
    ("by-hand", State::Unknown),
    ("running", State::Processing),
];

/// The steps each key holds: (name, state, evidence), by name.
fn steps_as_written(k: &str) -> Vec<(&'static str, StepState, Option<&'static [u8]>)> {
    match k {
        "two-calls" => vec![
            ("charge", StepState::Confirmed, Some(b"ch_1")),
            ("receipt", StepState::Confirmed, Some(b"rc_1")),
        ],
        "declined" => vec![("charge", StepState::Failed, Some(b"card_declined"))],
        "in-doubt" => vec![("charge", StepState::Unknown, None)],
        "by-hand" => vec![("charge", StepState::Confirmed, Some(b"ch_hand"))],
        // A day later the holder's lease has run out: read-time truth
        // reports its reserved step as unknown.
        "running" => vec![
            ("charge", StepState::Confirmed, Some(b"ch_run")),
            ("receipt", StepState::Unknown, None),
        ],
        _ => Vec::new(),
    }
}

/// Every answer the fixture was written to give, a day after it was
/// written, that writes nothing. Holds on a read-only engine too.
fn assert_answers_as_written(engine: &Engine) -> TestResult {
    for (k, state) in STATES {
        let info = engine.record(&key(k)?)?.ok_or(format!("{k} is gone"))?;
        assert_eq!(info.state, state, "{k}");
        let steps = engine.steps(&key(k)?)?;
        let got: Vec<_> = steps
            .iter()
            .map(|s| (s.name.as_str(), s.state, s.evidence.as_deref()))
            .collect();
        assert_eq!(got, steps_as_written(k), "{k}");
        for s in &steps {
            // The stable reference: the first claim's reference and the name.
            assert!(
                s.reference.ends_with(&format!("/{}", s.name)),
                "{k}: {}",
                s.reference
            );
            assert!(s.reserved_at_ms >= T0, "{k}: {s:?}");
        }
    }
    let r = replay(engine.begin(&key("two-calls")?, fp(10)?)?)?;
    assert_eq!(r.envelope, Envelope::new(1, 201, "paid"));
    let r = replay(engine.begin(&key("declined")?, fp(20)?)?)?;
    assert_eq!(r.envelope, Envelope::new(1, 402, "card declined"));
    let u = unknown(engine.begin(&key("in-doubt")?, fp(30)?)?)?;
    assert_eq!(u.reason, "provider timed out");
    for (k, other) in [("two-calls", 11), ("declined", 21), ("in-doubt", 31)] {
        let b = engine.begin(&key(k)?, fp(other)?)?;
        assert!(matches!(b, Begin::Mismatch), "{k}: {b:?}");
    }

    // The evidence log of the key settled by hand: reserve, the failure in
    // doubt, the operator's answer with the reason they gave.
    let log = engine.history(&key("by-hand")?)?;
    let got: Vec<(Option<&str>, &str, &str)> = log
        .iter()
        .map(|e| (e.step.as_deref(), e.from.as_str(), e.to.as_str()))
        .collect();
    assert!(log.iter().enumerate().all(|(i, e)| e.seq as usize == i));
    let last = log.last().ok_or("by-hand: empty evidence log")?;
    assert_eq!(
        (last.step.as_deref(), last.evidence.as_slice()),
        (Some("charge"), b"ch_hand".as_slice()),
        "{got:?}"
    );
    assert_eq!(
        last.actor,
        Actor::Operator {
            reason: "provider dashboard shows ch_hand".into()
        }
    );
    assert_eq!(last.to, StepState::Confirmed.as_str(), "{got:?}");
    assert_eq!(log[0].to, StepState::Reserved.as_str(), "{got:?}");
    let log = engine.history(&key("two-calls")?)?;
    let confirmed: Vec<&[u8]> = log
        .iter()
        .filter(|e| e.to == StepState::Confirmed.as_str())
        .map(|e| e.evidence.as_slice())
        .collect();
    assert_eq!(confirmed, [b"ch_1".as_slice(), b"rc_1".as_slice()]);

    let letters = engine.dead_letters(10)?;
    assert_eq!(letters.len(), 1, "{letters:?}");
    let l = &letters[0];
    assert_eq!(
        (l.consumer.as_str(), l.message_id.as_str(), l.topic.as_str()),
        ("ledger", "m-1", "payments.succeeded")
    );
    assert_eq!((l.attempts, l.reason.as_str()), (2, "ledger closed"));
    assert_eq!(l.payload, b"{\"payment\":\"p-1\"}");
    Ok(())
}

#[test]
fn a_format2_file_with_steps_opens_and_answers_as_written() -> TestResult {
    let dir = tempfile::tempdir()?;
    let path = copy_of_fixture(dir.path())?;
    let before = stored_values(&path)?;
    // 6 records (5 keys and the dead letter's inbox record), 7 steps.
    assert_eq!(before.keys().filter(|(t, _)| *t == "records").count(), 6);
    assert_eq!(before.keys().filter(|(t, _)| *t == "steps").count(), 7);
    assert!(before.keys().any(|(t, _)| *t == "history"));
    assert_eq!(
        before.keys().filter(|(t, _)| *t == "dead_letters").count(),
        1
    );

    let clock = ManualClock::new(T0);
    clock.advance(DAY);
    let engine = builder(&clock).open(&path)?;
    assert_answers_as_written(&engine)?;
    let report = engine.verify()?;
    assert!(report.is_sound(), "{:?}", report.damage);
    drop(engine);
    // A writable open of a format-2 file rewrites no stored value.
    assert_eq!(stored_values(&path)?, before);

    // Work goes on from the stored steps.
    let engine = builder(&clock).open(&path)?;
    // Resumed: the confirmed call is skipped, its evidence given back.
    let c = claimed(engine.begin(&key("by-hand")?, fp(40)?)?)?;
    let charge = c.effect("charge")?;
    assert!(
        matches!(&charge, EffectStep::Confirmed { evidence, .. } if evidence == b"ch_hand"),
        "{charge:?}"
    );
    engine.complete(c, Envelope::new(1, 201, "paid by hand"))?;
    let r = replay(engine.begin(&key("by-hand")?, fp(40)?)?)?;
    assert_eq!(r.envelope.body, b"paid by hand");
    // The step in doubt, settled as never sent: the retry makes the call
    // again under the same reference.
    let reference = engine.steps(&key("in-doubt")?)?[0].reference.clone();
    engine.resolve_step(
        &key("in-doubt")?,
        "charge",
        StepResolution::NotExecuted,
        "provider has no such reference",
    )?;
    let c = claimed(engine.begin(&key("in-doubt")?, fp(30)?)?)?;
    let again = c.effect("charge")?;
    assert_eq!(again, EffectStep::Run { reference });
    c.confirm("charge", b"ch_2")?;
    engine.complete(c, Envelope::new(1, 201, "paid"))?;
    let report = engine.verify()?;
    assert!(report.is_sound(), "{:?}", report.damage);
    drop(engine);
    let engine = builder(&clock).open_read_only(&path)?;
    let steps = engine.steps(&key("in-doubt")?)?;
    assert_eq!(steps[0].state, StepState::Confirmed);
    assert_eq!(steps[0].evidence.as_deref(), Some(b"ch_2".as_slice()));
    assert!(engine.verify()?.is_sound());
    Ok(())
}

#[test]
fn a_read_only_open_of_a_format2_file_with_steps_writes_nothing() -> TestResult {
    let dir = tempfile::tempdir()?;
    let path = copy_of_fixture(dir.path())?;
    let journal = dir.path().join("format2-steps.redb.journal");
    let before = (std::fs::read(&path)?, std::fs::read(&journal)?);
    let clock = ManualClock::new(T0);
    clock.advance(DAY);
    let engine = builder(&clock).open_read_only(&path)?;
    assert_answers_as_written(&engine)?;
    let report = engine.verify()?;
    assert!(report.is_sound(), "{:?}", report.damage);
    drop(engine);
    assert!(
        (std::fs::read(&path)?, std::fs::read(&journal)?) == before,
        "a read-only open changed the format-2 files"
    );
    Ok(())
}

fn delivery(attempt: u32) -> Delivery<'static> {
    Delivery {
        message_id: "m-1",
        topic: "payments.succeeded",
        payload: b"{\"payment\":\"p-1\"}",
        attempt,
    }
}

/// Writes the fixture's keys, steps and dead letter through `engine`
/// (whose clock is `clock`, at `T0`); returns the claim of `running`,
/// which its caller forgets, so the record stays PROCESSING.
fn write_mix(engine: &Engine, clock: &ManualClock) -> Result<idempotency::Claim, Box<dyn Error>> {
    let c = claimed(engine.begin(&key("two-calls")?, fp(10)?)?)?;
    assert!(matches!(c.effect("charge")?, EffectStep::Run { .. }));
    c.confirm("charge", b"ch_1")?;
    assert!(matches!(c.effect("receipt")?, EffectStep::Run { .. }));
    c.confirm("receipt", b"rc_1")?;
    engine.complete(c, Envelope::new(1, 201, "paid"))?;

    let c = claimed(engine.begin(&key("declined")?, fp(20)?)?)?;
    assert!(matches!(c.effect("charge")?, EffectStep::Run { .. }));
    c.reject("charge", b"card_declined")?;
    engine.fail(c, Failure::Final(Envelope::new(1, 402, "card declined")))?;

    let c = claimed(engine.begin(&key("in-doubt")?, fp(30)?)?)?;
    assert!(matches!(c.effect("charge")?, EffectStep::Run { .. }));
    engine.fail(
        c,
        Failure::InDoubt {
            reason: "provider timed out".into(),
        },
    )?;

    let c = claimed(engine.begin(&key("by-hand")?, fp(40)?)?)?;
    assert!(matches!(c.effect("charge")?, EffectStep::Run { .. }));
    engine.fail(
        c,
        Failure::InDoubt {
            reason: "connection reset".into(),
        },
    )?;
    engine.resolve_step(
        &key("by-hand")?,
        "charge",
        StepResolution::Executed(b"ch_hand".to_vec()),
        "provider dashboard shows ch_hand",
    )?;

    let inbox = engine.inbox("ledger")?;
    for attempt in 1..=2 {
        let Receive::Fresh(ticket) = inbox.receive("m-1")? else {
            return Err(format!("attempt {attempt}: expected a fresh delivery").into());
        };
        let after = ticket.fail_cleanly(&delivery(attempt), "ledger closed")?;
        assert_eq!(
            matches!(after, AfterFailure::DeadLettered { .. }),
            attempt == 2
        );
    }

    let running = claimed(engine.begin(&key("running")?, fp(50)?)?)?;
    assert!(matches!(running.effect("charge")?, EffectStep::Run { .. }));
    running.confirm("charge", b"ch_run")?;
    assert!(matches!(running.effect("receipt")?, EffectStep::Run { .. }));
    clock.advance(std::time::Duration::from_millis(5));
    Ok(running)
}

/// Writes `tests/fixtures/format2-steps.redb` and its journal (by hand
/// only; see the module docs).
#[test]
#[ignore = "writes tests/fixtures/format2-steps.redb; run by hand, with format 2 only"]
fn write_format2_steps_fixture() -> TestResult {
    let path = fixture();
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let _ = std::fs::remove_file(&path);
    let _ = std::fs::remove_file(fixture_journal());
    let clock = ManualClock::new(T0);
    let engine = builder(&clock).dead_letter_after(2).open(&path)?;
    let running = write_mix(&engine, &clock)?;
    // The holder never reports back: its record stays PROCESSING.
    std::mem::forget(running);
    drop(engine);
    // Keep the journal's frames, not the megabytes of zeros after them.
    let journal = std::fs::read(fixture_journal())?;
    let kept = journal_chain(&journal)?.to_vec();
    std::fs::write(fixture_journal(), kept)?;
    // The disk reserve is made again by any writable open.
    let mut reserve = path.into_os_string();
    reserve.push(".reserve");
    let _ = std::fs::remove_file(reserve);
    Ok(())
}

/// Migrated to format 3 (an open that asks for it:
/// `EngineBuilder::migrate_to_format_3`), the file's steps, evidence logs
/// and dead letter answer as written, and work goes on from them.
#[test]
fn a_format2_file_with_steps_migrated_to_format3_answers_as_written() -> TestResult {
    let dir = tempfile::tempdir()?;
    let path = copy_of_fixture(dir.path())?;
    let clock = ManualClock::new(T0);
    clock.advance(DAY);
    let engine = builder(&clock).migrate_to_format_3().open(&path)?;
    assert_answers_as_written(&engine)?;
    let report = engine.verify()?;
    assert!(report.is_sound(), "{:?}", report.damage);
    let c = claimed(engine.begin(&key("by-hand")?, fp(40)?)?)?;
    let charge = c.effect("charge")?;
    assert!(
        matches!(&charge, EffectStep::Confirmed { evidence, .. } if evidence == b"ch_hand"),
        "{charge:?}"
    );
    engine.complete(c, Envelope::new(1, 201, "paid by hand"))?;
    drop(engine);
    let engine = builder(&clock).open_read_only(&path)?;
    let r = replay(engine.begin(&key("by-hand")?, fp(40)?)?)?;
    assert_eq!(r.envelope.body, b"paid by hand");
    assert!(engine.verify()?.is_sound());
    Ok(())
}

/// The first byte of `format_version` of the closed file at `path`, and
/// the records format 3's records table holds (`None`: no such table).
fn format_and_copy(path: &Path) -> Result<(u8, Option<u64>), Box<dyn Error>> {
    let db = redb::Builder::new().open_read_only(path)?;
    meta_table::migration_state(&db.begin_read()?).map_err(|e| e as Box<dyn Error>)
}

/// Whether format 3's records table of the closed file at `path` holds
/// a record of key `k` (a slot key ends with its record key, which ends
/// with the key).
fn copy_holds(path: &Path, k: &str) -> Result<bool, Box<dyn Error>> {
    let db = redb::Builder::new().open_read_only(path)?;
    let txn = db.begin_read()?;
    for entry in txn.open_table(meta_table::PARTITIONED_RECORDS)?.iter()? {
        if entry?.0.value().ends_with(k.as_bytes()) {
            return Ok(true);
        }
    }
    Ok(false)
}

/// Opens the file at `path` asking for format 3 in steps of `records`,
/// stopped by the test hook after one step, as a crash between steps
/// would stop it.
fn migrate_one_step(path: &Path, clock: &ManualClock, records: u64) -> TestResult {
    let stopped = builder(clock)
        .unstable_format_3_migration(records, Some(1))
        .open(path);
    match stopped {
        Err(idempotency::OpenError::Storage { .. }) => Ok(()),
        other => Err(format!("the test hook did not stop the open: {other:?}").into()),
    }
}

/// A migration in steps of two records (six records: the five keys and
/// the inbox's; three steps, then the switch), interrupted after each of
/// the first two: the file stays format 2 with a partial copy of 2, then
/// 4 records, a read-only open answers as written and `verify` (with the
/// page check) finds it sound, the copy not reported; the next migrating
/// open goes on from the last step, and the migrated file answers as
/// written.
#[test]
fn a_format2_file_with_steps_migrated_in_small_steps_resumes_and_answers_as_written() -> TestResult
{
    let dir = tempfile::tempdir()?;
    let path = copy_of_fixture(dir.path())?;
    let clock = ManualClock::new(T0);
    clock.advance(DAY);
    let before = stored_values(&path)?;
    for copied in [2, 4] {
        migrate_one_step(&path, &clock, 2)?;
        assert_eq!(format_and_copy(&path)?, (2, Some(copied)));
        let engine = builder(&clock).open_read_only(&path)?;
        assert_answers_as_written(&engine)?;
        let report = engine.verify()?;
        assert!(report.is_sound(), "{:?}", report.damage);
        assert_eq!(report.records, 6);
    }
    // Format 2's tables are untouched until the switch.
    assert_eq!(stored_values(&path)?, before);
    let engine = builder(&clock)
        .unstable_format_3_migration(2, None)
        .open(&path)?;
    assert_answers_as_written(&engine)?;
    let report = engine.verify()?;
    assert!(report.is_sound(), "{:?}", report.damage);
    assert_eq!(report.records, 6);
    drop(engine);
    assert_eq!(format_and_copy(&path)?, (3, Some(6)));
    let engine = builder(&clock).open_read_only(&path)?;
    assert_answers_as_written(&engine)?;
    Ok(())
}

/// A writable open without format 3 of a half-migrated file deletes the
/// partial copy, whose records its writes would make stale: `by-hand`,
/// copied by the first step while UNKNOWN, is resumed and completed in
/// format 2, and the migration that follows starts over and carries the
/// completion, not the copied record.
#[test]
fn format2_writes_after_a_partial_migration_are_the_ones_migrated() -> TestResult {
    let dir = tempfile::tempdir()?;
    let path = copy_of_fixture(dir.path())?;
    let clock = ManualClock::new(T0);
    clock.advance(DAY);
    // Record keys of one scope sort by key: `by-hand` comes first.
    migrate_one_step(&path, &clock, 3)?;
    assert_eq!(format_and_copy(&path)?, (2, Some(3)));
    assert!(copy_holds(&path, "by-hand")?);

    let engine = builder(&clock).open(&path)?;
    assert_answers_as_written(&engine)?;
    let c = claimed(engine.begin(&key("by-hand")?, fp(40)?)?)?;
    engine.complete(c, Envelope::new(1, 201, "paid by hand"))?;
    assert!(engine.verify()?.is_sound());
    drop(engine);
    assert_eq!(format_and_copy(&path)?, (2, None), "the copy is deleted");

    let engine = builder(&clock)
        .unstable_format_3_migration(2, None)
        .open(&path)?;
    let r = replay(engine.begin(&key("by-hand")?, fp(40)?)?)?;
    assert_eq!(r.envelope.body, b"paid by hand");
    let info = engine.record(&key("by-hand")?)?.ok_or("by-hand is gone")?;
    assert_eq!(info.state, State::Completed);
    let r = replay(engine.begin(&key("two-calls")?, fp(10)?)?)?;
    assert_eq!(r.envelope, Envelope::new(1, 201, "paid"));
    let report = engine.verify()?;
    assert!(report.is_sound(), "{:?}", report.damage);
    assert_eq!(report.records, 6);
    drop(engine);
    assert_eq!(format_and_copy(&path)?.0, 3);
    Ok(())
}
