//! Guards `Engine::salvage` (issue 28, point 2) against the two ways a
//! salvage can betray an operator: copying a state that is not the one
//! stored (a damaged value, an older copy of a page, a guess), and losing
//! a key without listing it, so that its work would silently run again.
//!
//! A database is built through the public API (records in every state,
//! inbox marks, outbox messages, entities) and closed cleanly. Each trial
//! flips one byte at a random offset of a fresh copy and salvages it in a
//! child process (redb may panic, or abort while unwinding, on damaged
//! bytes). Then, read with redb directly:
//!
//! - every record, outbox message and entity in the new file is the
//!   original's, byte for byte; every one missing is listed (by key, or in
//!   a listed range, or as a journal that could not be read); an entity
//!   or outbox message whose stored name or number took the flip is
//!   listed under the damaged one (no index names the original);
//! - a flip inside one record's value loses that record only;
//! - the new file passes `verify`, and the damaged file is unchanged.
//!
//! The same flips run on a format-3 file (partitioned records): the new
//! file is then of format 3, read back by record key.
//!
//! Other tests: a sound file is copied whole (and its answers replay the
//! same), frames the journal holds beyond the last checkpoint are copied,
//! and an existing new file is refused.
//!
//! `IDEMPOTENCY_SALVAGE_TRIALS` sets the number of trials (default 250)
//! and `IDEMPOTENCY_SALVAGE_SEED` the seed; `IDEMPOTENCY_SALVAGE_FIXTURES`
//! a directory that keeps the sound files, so that two builds flip the
//! same bytes. The byte-flip experiment of
//! issue 28 (100 flips of a ~270 KB file, 30 of its journal, with open and
//! verify too) is `byte_flip_experiment`, ignored by default:
//! `cargo test --release --test suite salvage::byte_flip_experiment -- --ignored
//! --nocapture`.

mod common;
#[path = "common/db_files.rs"]
mod db_files;
#[path = "common/fixture_engine.rs"]
mod fixture_engine;
#[path = "common/hex.rs"]
mod hex;
#[path = "common/mixed_workload.rs"]
mod mixed_workload;

use std::collections::BTreeMap;
use std::error::Error;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use db_files::{copy_db, journal_of};
use fixture_engine::builder;
use hex::{hex, unhex};
use idempotency::{Engine, Fingerprint, Lost, ManualClock, OpenError};
use mixed_workload::{key, payment_body, Kind, Workload};
use redb::{ReadableDatabase, ReadableTable, TableDefinition};

#[path = "common/split_mix.rs"]
mod split_mix;
use split_mix::SplitMix64;

type TestResult = Result<(), Box<dyn Error>>;

const RECORDS: TableDefinition<&[u8], &[u8]> = TableDefinition::new("idempotency.records");
/// Format 3's records, keyed `[partition u64 BE][record key]`.
const RECORDS3: TableDefinition<&[u8], &[u8]> =
    TableDefinition::new("idempotency.partitioned.records");
const OUTBOX: TableDefinition<u64, &[u8]> = TableDefinition::new("idempotency.outbox");
const ENTITIES: TableDefinition<&str, &[u8]> = TableDefinition::new("idempotency.entities");

const T0: u64 = 1_790_000_000_000;
const DEFAULT_SEED: u64 = 0x5a1_7a6e;
const TRIAL_TIMEOUT: Duration = Duration::from_secs(60);
/// Set for the child process: the directory of its trial.
const CHILD_ENV: &str = "IDEMPOTENCY_SALVAGE_CHILD_DIR";
/// Set for the child process: also try a writable open and `verify`.
const CHILD_ALL_ENV: &str = "IDEMPOTENCY_SALVAGE_CHILD_ALL";
const MARK: &str = "@@salvage ";

fn fp(i: usize) -> Result<Fingerprint, idempotency::FingerprintError> {
    Fingerprint::of_json(
        format!(r#"{{"amount":{},"order":{i}}}"#, 100 + i * 7).as_bytes(),
        &[],
    )
}

/// Payment `i`'s JSON body, about 300 bytes.
fn body(i: usize) -> Vec<u8> {
    payment_body(i, 4)
}

/// What payment `i` becomes: most completed, some failed, UNKNOWN,
/// PROCESSING or tombstoned, or an inbox mark or an entity instead.
fn kind(i: usize) -> Kind {
    match i % 12 {
        3 => Kind::Tombstone,
        0 => Kind::Declined(format!("declined {i}")),
        1 => Kind::Unknown,
        2 => Kind::Processing,
        5 => Kind::CompletedWithReceipt { json: false },
        7 => Kind::InboxMark,
        9 => Kind::Entity { paid: true },
        _ => Kind::CompletedWithResource(format!("pay_{i:04}")),
    }
}

/// The payments, inbox marks, outbox messages and entities written.
const WORKLOAD: Workload = Workload {
    key,
    fp,
    body,
    kind,
};

/// A database of `keys` payments, closed cleanly.
fn build(path: &Path, keys: usize) -> TestResult {
    build_as(path, keys, false)
}

/// [`build`], in format 3 with partitions of 16 keys when `format3`.
fn build_as(path: &Path, keys: usize, format3: bool) -> TestResult {
    let clock = ManualClock::new(T0);
    let mut b = builder(&clock);
    if format3 {
        b = b
            .migrate_to_format_3()
            .partition_limits(16, Duration::from_secs(600));
    }
    let engine = b.open(path)?;
    WORKLOAD.write(&engine, &clock, 0..keys)?;
    drop(engine);
    Ok(())
}

/// The raw contents of the engine's data tables (a format-3 file's
/// records by record key, their partition prefix taken off).
#[derive(Debug, Default, PartialEq, Eq)]
struct Raw {
    records: BTreeMap<Vec<u8>, Vec<u8>>,
    outbox: BTreeMap<u64, Vec<u8>>,
    entities: BTreeMap<String, Vec<u8>>,
}

fn raw(path: &Path) -> Result<Raw, Box<dyn Error>> {
    let db = redb::Builder::new().open_read_only(path)?;
    let txn = db.begin_read()?;
    let mut out = Raw::default();
    match txn.open_table(RECORDS) {
        Ok(t) => {
            for e in t.iter()? {
                let (k, v) = e?;
                out.records.insert(k.value().to_vec(), v.value().to_vec());
            }
        }
        Err(redb::TableError::TableDoesNotExist(_)) => {
            for e in txn.open_table(RECORDS3)?.iter()? {
                let (k, v) = e?;
                let rkey = k.value().get(8..).ok_or("a short slot key")?;
                out.records.insert(rkey.to_vec(), v.value().to_vec());
            }
        }
        Err(e) => return Err(e.into()),
    }
    for e in txn.open_table(OUTBOX)?.iter()? {
        let (k, v) = e?;
        out.outbox.insert(k.value(), v.value().to_vec());
    }
    for e in txn.open_table(ENTITIES)?.iter()? {
        let (k, v) = e?;
        out.entities
            .insert(k.value().to_string(), v.value().to_vec());
    }
    Ok(out)
}

/// One line per lost item: `kind key_hex|- after_hex|- before_hex|- text`.
fn lost_line(lost: &Lost) -> String {
    let dash = |s: Option<&String>| s.map_or_else(|| "-".to_string(), Clone::clone);
    let (kind, a, b, c) = match lost {
        Lost::Record { key_hex, .. } => ("record", Some(key_hex.clone()), None, None),
        Lost::Range {
            table,
            after_hex,
            before_hex,
            ..
        } => (*table, None, after_hex.clone(), before_hex.clone()),
        Lost::OutboxMessage { seq, .. } => ("outbox", seq.map(|s| s.to_string()), None, None),
        Lost::Entity { entity, .. } => ("entity", Some(hex(entity.as_bytes())), None, None),
        Lost::Journal { .. } => ("journal", None, None, None),
        Lost::MetaValue { .. } => ("meta", None, None, None),
        _ => ("other", None, None, None),
    };
    format!(
        "{kind} {} {} {} {}",
        dash(a.as_ref()),
        dash(b.as_ref()),
        dash(c.as_ref()),
        lost.to_string().replace('\n', " ")
    )
}

/// One trial's work, in a child process: salvages `damaged.redb` in the
/// trial's directory into `new.redb` and checks the new file; with
/// `IDEMPOTENCY_SALVAGE_CHILD_ALL`, first tries a writable open and a
/// read-only `verify` on copies. Without `IDEMPOTENCY_SALVAGE_CHILD_DIR`
/// it does nothing.
#[test]
fn salvage_trial_in_child_process() -> TestResult {
    let Ok(dir) = std::env::var(CHILD_ENV) else {
        return Ok(());
    };
    let dir = PathBuf::from(dir);
    let damaged = dir.join("damaged.redb");
    let clock = ManualClock::new(T0 + 1_000);
    if std::env::var_os(CHILD_ALL_ENV).is_some() {
        let copy = copy_db(&damaged, &dir, "open.redb")?;
        match builder(&clock).open(&copy) {
            Ok(engine) => {
                drop(engine);
                println!("{MARK}open ok");
            }
            Err(e) => println!("{MARK}open-error {}", e.to_string().replace('\n', " ")),
        }
        let copy = copy_db(&damaged, &dir, "verify.redb")?;
        match Engine::builder().sweep_interval(None).open_read_only(&copy) {
            Ok(engine) => match engine.verify() {
                Ok(report) if report.is_sound() => println!("{MARK}verify sound"),
                Ok(report) => println!("{MARK}verify damage {}", report.damage.len()),
                Err(e) => println!("{MARK}verify-error {e}"),
            },
            Err(e) => println!("{MARK}verify-error {}", e.to_string().replace('\n', " ")),
        }
    }
    let new = dir.join("new.redb");
    match Engine::salvage(&damaged, &new) {
        Ok(report) => {
            for lost in &report.lost {
                println!("{MARK}lost {}", lost_line(lost));
            }
            println!("{MARK}copied {}", report.records);
            let engine = Engine::builder()
                .sweep_interval(None)
                .open_read_only(&new)?;
            let check = engine.verify()?;
            for problem in &check.damage {
                println!("{MARK}new-problem {problem}");
            }
        }
        Err(e) => println!("{MARK}salvage-error {}", e.to_string().replace('\n', " ")),
    }
    println!("{MARK}end");
    Ok(())
}

/// What a child reported.
#[derive(Debug, Default)]
struct Child {
    open_error: Option<String>,
    verify_sound: Option<bool>,
    salvage_error: Option<String>,
    lost: Vec<String>,
    copied: u64,
    new_problems: Vec<String>,
    /// The child died or hung: its stderr.
    crashed: Option<String>,
}

fn run_child(dir: &Path, all: bool) -> Result<Child, Box<dyn Error>> {
    let out_path = dir.join("child.out");
    let err_path = dir.join("child.err");
    let mut cmd = Command::new(std::env::current_exe()?);
    cmd.args([
        "--exact",
        // `<file>::salvage_trial_in_child_process` where this file is a module of a test binary.
        concat!(module_path!(), "::salvage_trial_in_child_process")
            .split_once("::")
            .map_or("salvage_trial_in_child_process", |(_, t)| t),
        "--nocapture",
        "--test-threads=1",
    ])
    .env(CHILD_ENV, dir)
    .stdout(std::fs::File::create(&out_path)?)
    .stderr(std::fs::File::create(&err_path)?);
    if all {
        cmd.env(CHILD_ALL_ENV, "1");
    }
    let mut child = cmd.spawn()?;
    let started = Instant::now();
    let finished = loop {
        if child.try_wait()?.is_some() {
            break true;
        }
        if started.elapsed() > TRIAL_TIMEOUT {
            // Our own child, by its handle.
            child.kill()?;
            child.wait()?;
            break false;
        }
        std::thread::sleep(Duration::from_millis(2));
    };
    let stdout = std::fs::read_to_string(&out_path)?;
    let mut report = Child::default();
    let mut ended = false;
    // The first line follows the test harness's "test ... " on its line.
    for line in stdout
        .lines()
        .filter_map(|l| l.find(MARK).map(|at| &l[at + MARK.len()..]))
    {
        let (what, rest) = line.split_once(' ').unwrap_or((line, ""));
        match what {
            "open-error" => report.open_error = Some(rest.to_string()),
            "verify" => report.verify_sound = Some(rest == "sound"),
            "verify-error" => report.verify_sound = Some(false),
            "salvage-error" => report.salvage_error = Some(rest.to_string()),
            "lost" => report.lost.push(rest.to_string()),
            "copied" => report.copied = rest.parse()?,
            "new-problem" => report.new_problems.push(rest.to_string()),
            "end" => ended = true,
            _ => {}
        }
    }
    if !finished || !ended {
        report.crashed = Some(std::fs::read_to_string(&err_path)?);
    }
    Ok(report)
}

/// Whether `line` lists an entity whose stored name is `id` with one byte
/// changed: a flip inside an entity's name in its leaf leaves its value
/// failing its checksum (the name is part of it) under the damaged name,
/// which is what the salvage can know and lists. Entities have no index
/// that would name the original.
fn listed_under_flipped_name(line: &str, id: &[u8]) -> bool {
    let parts: Vec<&str> = line.splitn(3, ' ').collect();
    match parts.as_slice() {
        ["entity", name, ..] => {
            let name = unhex(name);
            name.len() == id.len() && name.iter().zip(id).filter(|(a, b)| a != b).count() == 1
        }
        _ => false,
    }
}

/// Whether `line` lists an outbox message whose stored sequence number is
/// `seq` with one byte changed (as [`listed_under_flipped_name`]: the
/// number is part of the checksum, and no index names the original).
fn listed_under_flipped_seq(line: &str, seq: u64) -> bool {
    let parts: Vec<&str> = line.splitn(3, ' ').collect();
    match parts.as_slice() {
        ["outbox", n, ..] => n.parse::<u64>().is_ok_and(|n| {
            let (a, b) = (n.to_be_bytes(), seq.to_be_bytes());
            a.iter().zip(&b).filter(|(x, y)| x != y).count() == 1
        }),
        _ => false,
    }
}

/// Whether the child's list of lost items covers record key `k`.
fn listed_record(lost: &[String], k: &[u8]) -> bool {
    let want = hex(k);
    lost.iter().any(|line| {
        let parts: Vec<&str> = line.splitn(5, ' ').collect();
        match parts.as_slice() {
            ["record", key, ..] => *key == want,
            ["records", _, after, before, ..] => {
                (*after == "-" || unhex(after).as_slice() < k)
                    && (*before == "-" || k < unhex(before).as_slice())
            }
            ["journal", ..] => true,
            _ => false,
        }
    })
}

/// Byte ranges where `needle` occurs in `hay`.
fn occurrences(hay: &[u8], needle: &[u8]) -> Spans {
    if needle.is_empty() || needle.len() > hay.len() {
        return Vec::new();
    }
    hay.windows(needle.len())
        .enumerate()
        .filter(|(_, w)| *w == needle)
        .map(|(i, _)| (i, i + needle.len()))
        .collect()
}

/// Byte ranges `[start, end)` in a file.
type Spans = Vec<(usize, usize)>;

/// The sound file, its contents, and where each record's bytes lie.
struct Fixture {
    _dir: tempfile::TempDir,
    path: PathBuf,
    bytes: Vec<u8>,
    raw: Raw,
    /// Record key → byte ranges of its key's and value's occurrences.
    spans: BTreeMap<Vec<u8>, (Spans, Spans)>,
}

impl Fixture {
    fn build(keys: usize) -> Result<Fixture, Box<dyn Error>> {
        Fixture::build_as(keys, false)
    }

    /// [`Fixture::build`], in format 3 when `format3` ([`build_as`]).
    fn build_as(keys: usize, format3: bool) -> Result<Fixture, Box<dyn Error>> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("sound.redb");
        // `IDEMPOTENCY_SALVAGE_FIXTURES=DIR`: the same file in every run
        // (built there once), so runs of two builds compare flip by flip.
        let kept = std::env::var_os("IDEMPOTENCY_SALVAGE_FIXTURES")
            .map(|d| PathBuf::from(d).join(format!("format{}-{keys}.redb", 2 + u8::from(format3))));
        match &kept {
            Some(kept) if kept.exists() => {
                std::fs::copy(kept, &path)?;
            }
            _ => {
                build_as(&path, keys, format3)?;
                if let Some(kept) = &kept {
                    std::fs::copy(&path, kept)?;
                }
            }
        }
        let bytes = std::fs::read(&path)?;
        let raw = raw(&path)?;
        let spans = raw
            .records
            .iter()
            .map(|(k, v)| (k.clone(), (occurrences(&bytes, k), occurrences(&bytes, v))))
            .collect();
        Ok(Fixture {
            _dir: dir,
            path,
            bytes,
            raw,
            spans,
        })
    }

    /// The record whose value's only occurrence holds `offset`, if any.
    fn value_at(&self, offset: usize) -> Option<&Vec<u8>> {
        self.spans.iter().find_map(|(k, (_, values))| {
            (values.len() == 1 && values[0].0 <= offset && offset < values[0].1).then_some(k)
        })
    }
}

/// Checks one trial's salvage against the sound file; returns how many
/// records it lost that were intact (their bytes unchanged).
fn judge(fx: &Fixture, dir: &Path, child: &Child, offset: usize) -> Result<usize, Box<dyn Error>> {
    let at = format!("offset {offset}");
    if let Some(stderr) = &child.crashed {
        return Err(format!("{at}: the salvage child crashed or hung: {stderr}").into());
    }
    if let Some(e) = &child.salvage_error {
        // Only a file redb cannot open at all is refused.
        if !e.contains("corrupt") && !e.contains("not a") && !e.contains("damaged") {
            return Err(format!("{at}: salvage failed: {e}").into());
        }
        return Ok(0);
    }
    assert!(
        child.new_problems.is_empty(),
        "{at}: {:?}",
        child.new_problems
    );
    let new = raw(&dir.join("new.redb"))?;
    let mut intact_lost = 0;
    for (k, v) in &new.records {
        assert_eq!(
            fx.raw.records.get(k),
            Some(v),
            "{at}: record {} differs",
            hex(k)
        );
    }
    for (k, v) in &fx.raw.records {
        if new.records.contains_key(k) {
            continue;
        }
        assert!(
            listed_record(&child.lost, k),
            "{at}: record {} neither copied nor listed: {:?} (child copied {} of {})",
            hex(k),
            child.lost,
            child.copied,
            fx.raw.records.len()
        );
        let (keys, values) = &fx.spans[k];
        let hit =
            |spans: &Vec<(usize, usize)>| spans.iter().any(|&(s, e)| s <= offset && offset < e);
        if !hit(keys) && !hit(values) && !v.is_empty() {
            intact_lost += 1;
        }
    }
    for (seq, v) in &new.outbox {
        assert_eq!(
            fx.raw.outbox.get(seq),
            Some(v),
            "{at}: outbox #{seq} differs"
        );
    }
    for seq in fx.raw.outbox.keys().filter(|s| !new.outbox.contains_key(s)) {
        let listed = child.lost.iter().any(|l| {
            l.starts_with(&format!("outbox {seq} "))
                || listed_under_flipped_seq(l, *seq)
                || l.starts_with("outbox - ")
                || l.starts_with("journal")
        });
        assert!(
            listed,
            "{at}: outbox #{seq} neither copied nor listed: {:?}",
            child.lost
        );
    }
    for (id, v) in &new.entities {
        assert_eq!(
            fx.raw.entities.get(id),
            Some(v),
            "{at}: entity {id} differs"
        );
    }
    for id in fx
        .raw
        .entities
        .keys()
        .filter(|e| !new.entities.contains_key(*e))
    {
        let listed = child.lost.iter().any(|l| {
            l.starts_with(&format!("entity {} ", hex(id.as_bytes())))
                || listed_under_flipped_name(l, id.as_bytes())
                || l.starts_with("entities ")
                || l.starts_with("journal")
        });
        assert!(
            listed,
            "{at}: entity {id} neither copied nor listed: {:?}",
            child.lost
        );
    }
    // A flip inside one record's value loses that record alone.
    if let Some(hit) = fx.value_at(offset) {
        let lost: Vec<_> = fx
            .raw
            .records
            .keys()
            .filter(|k| !new.records.contains_key(*k))
            .map(|k| hex(k))
            .collect();
        assert_eq!(lost, vec![hex(hit)], "{at}: a flip in one value");
    }
    Ok(intact_lost)
}

fn env_u64(name: &str) -> Result<Option<u64>, Box<dyn Error>> {
    match std::env::var(name) {
        Ok(v) => Ok(Some(v.parse().map_err(|e| format!("{name}={v}: {e}"))?)),
        Err(_) => Ok(None),
    }
}

#[test]
fn every_intact_record_survives_salvage_at_many_offsets() -> TestResult {
    flips(false, 250)
}

/// The same flips of a format-3 file (partitions of 16 keys, so a flip
/// lands in one of many partitions, its rows or its filters): fewer by
/// default, the format-2 run above covers the shared machinery.
#[test]
fn every_intact_record_of_a_format3_file_survives_salvage_at_many_offsets() -> TestResult {
    flips(true, 120)
}

/// Random one-byte flips of a file of format 3 (`format3`) or 2, each
/// salvaged in a child process and judged (`judge`); `default_trials`
/// unless `IDEMPOTENCY_SALVAGE_TRIALS` says.
fn flips(format3: bool, default_trials: u64) -> TestResult {
    let trials = env_u64("IDEMPOTENCY_SALVAGE_TRIALS")?.unwrap_or(default_trials);
    let seed = env_u64("IDEMPOTENCY_SALVAGE_SEED")?.unwrap_or(DEFAULT_SEED);
    let fx = Fixture::build_as(240, format3)?;
    let mut rng = SplitMix64(seed);
    let (mut complete, mut refused, mut in_values, mut intact_lost) = (0, 0, 0, 0);
    for _ in 0..trials {
        let dir = tempfile::tempdir()?;
        let offset = usize::try_from(rng.below(fx.bytes.len() as u64))?;
        let mut bytes = fx.bytes.clone();
        bytes[offset] ^= u8::try_from(rng.below(255) + 1)?;
        let damaged = dir.path().join("damaged.redb");
        std::fs::write(&damaged, &bytes)?;
        let child = run_child(dir.path(), false)?;
        assert_eq!(
            std::fs::read(&damaged)?,
            bytes,
            "salvage wrote to the damaged file"
        );
        let here = judge(&fx, dir.path(), &child, offset)?;
        if here > 0 {
            let first: String = child
                .lost
                .first()
                .map_or("", |l| l.as_str())
                .chars()
                .take(200)
                .collect();
            println!(
                "(offset {offset}: {here} intact records lost, {} items listed, e.g. {first})",
                child.lost.len()
            );
            for l in child.lost.iter().filter(|l| !l.starts_with("record ")) {
                println!("    {}", l.chars().take(300).collect::<String>());
            }
        }
        intact_lost += here;
        complete += usize::from(child.salvage_error.is_none() && child.lost.is_empty());
        refused += usize::from(child.salvage_error.is_some());
        in_values += usize::from(fx.value_at(offset).is_some());
    }
    println!(
        "salvage: {trials} flips (seed {seed}) of a {} byte format-{} file with {} records: {complete} copied \
         everything, {refused} could not be opened at all, {in_values} hit a record's value; \
         {intact_lost} intact records lost in all (each listed)",
        fx.bytes.len(),
        if format3 { 3 } else { 2 },
        fx.raw.records.len()
    );
    Ok(())
}

#[test]
fn a_sound_file_is_copied_whole_and_answers_the_same() -> TestResult {
    let fx = Fixture::build(60)?;
    let dir = tempfile::tempdir()?;
    let new = dir.path().join("new.redb");
    let report = Engine::salvage(&fx.path, &new)?;
    assert!(report.is_complete(), "{:?}", report.lost);
    assert_eq!(report.records as usize, fx.raw.records.len());
    assert_eq!(raw(&new)?, fx.raw);
    assert_eq!(std::fs::read(&fx.path)?, fx.bytes);
    let clock = ManualClock::new(T0 + 1_000);
    let (a, b) = (
        builder(&clock).open(copy_db(&fx.path, dir.path(), "a.redb")?)?,
        builder(&clock).open(&new)?,
    );
    for i in 0..60 {
        let show = |e: &Engine| -> Result<String, Box<dyn Error>> {
            Ok(format!(
                "{:?}",
                e.begin(&key(i)?, fp(i)?).map(|b| format!("{b:?}"))
            ))
        };
        assert_eq!(show(&a)?, show(&b)?, "key {i}");
    }
    assert!(b.verify()?.is_sound());
    Ok(())
}

#[test]
fn salvage_refuses_an_existing_new_file() -> TestResult {
    let fx = Fixture::build(12)?;
    let dir = tempfile::tempdir()?;
    let new = dir.path().join("new.redb");
    std::fs::write(&new, b"someone's data")?;
    let err = Engine::salvage(&fx.path, &new)
        .err()
        .ok_or("salvage wrote over a file")?;
    assert!(
        matches!(err, OpenError::SalvageTargetExists { ref path } if path == &new),
        "{err}"
    );
    assert_eq!(std::fs::read(&new)?, b"someone's data");
    Ok(())
}

/// Set for the child that writes and exits without closing the engine.
const CRASH_ENV: &str = "IDEMPOTENCY_SALVAGE_CRASH_FILE";

/// Writes `keys` payments after a clean base of 48, then exits without
/// closing: the later writes are in the journal only. Without
/// `IDEMPOTENCY_SALVAGE_CRASH_FILE` it does nothing.
#[test]
fn write_then_crash_in_child_process() -> TestResult {
    let Ok(path) = std::env::var(CRASH_ENV) else {
        return Ok(());
    };
    let keys: usize = std::env::var("IDEMPOTENCY_SALVAGE_CRASH_KEYS")?.parse()?;
    let clock = ManualClock::new(T0);
    let engine = builder(&clock).open(&path)?;
    WORKLOAD.write(&engine, &clock, 10_000..10_000 + keys)?;
    engine.flush()?;
    // A crash: nothing closed, nothing checkpointed.
    std::process::exit(0);
}

/// A database closed cleanly with `base` payments, then `more` written and
/// not closed (a crash): they are in its journal only.
fn build_crashed(path: &Path, base: usize, more: usize) -> TestResult {
    build(path, base)?;
    let status = Command::new(std::env::current_exe()?)
        .args([
            "--exact",
            // `<file>::write_then_crash_in_child_process` where this file is a module of a test binary.
            concat!(module_path!(), "::write_then_crash_in_child_process")
                .split_once("::")
                .map_or("write_then_crash_in_child_process", |(_, t)| t),
            "--test-threads=1",
        ])
        .env(CRASH_ENV, path)
        .env("IDEMPOTENCY_SALVAGE_CRASH_KEYS", more.to_string())
        .stdout(std::process::Stdio::null())
        .status()?;
    assert!(status.success(), "the writing child failed");
    Ok(())
}

#[test]
fn what_the_journal_holds_is_salvaged() -> TestResult {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("crashed.redb");
    build_crashed(&path, 24, 36)?;
    let journal = std::fs::read(journal_of(&path))?;
    let before = std::fs::read(&path)?;
    let new = dir.path().join("new.redb");
    let report = Engine::salvage(&path, &new)?;
    assert!(report.is_complete(), "{:?}", report.lost);
    assert!(report.journal_frames > 0, "no frames beyond the checkpoint");
    // The damaged file and its journal are untouched.
    assert_eq!(std::fs::read(&path)?, before);
    assert_eq!(std::fs::read(journal_of(&path))?, journal);
    // What a writable open recovers is what salvage copied. Both are
    // opened once at the same instant: an open marks the claims a dead
    // process left PROCESSING as UNKNOWN, which salvage (copying states
    // as stored) leaves to the new file's first open.
    let recovered = copy_db(&path, dir.path(), "recovered.redb")?;
    drop(builder(&ManualClock::new(T0)).open(&recovered)?);
    drop(builder(&ManualClock::new(T0)).open(&new)?);
    assert_eq!(raw(&new)?, raw(&recovered)?);
    Ok(())
}

#[test]
fn a_journal_damaged_in_the_middle_gives_up_only_its_damaged_frames() -> TestResult {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("crashed.redb");
    build_crashed(&path, 24, 36)?;
    // What the undamaged file and journal recover to.
    let recovered = copy_db(&path, dir.path(), "recovered.redb")?;
    drop(builder(&ManualClock::new(T0)).open(&recovered)?);
    let whole = raw(&recovered)?;
    // One byte inside the payload of the second frame past the checkpoint:
    // the frames after it still check.
    let journal = journal_of(&path);
    let mut bytes = std::fs::read(&journal)?;
    let written = bytes.iter().rposition(|&b| b != 0).ok_or("empty journal")?;
    let offset = 4096 + (written - 4096) / 3;
    bytes[offset] ^= 0x20;
    std::fs::write(&journal, &bytes)?;
    let new = dir.path().join("new.redb");
    let report = Engine::salvage(&path, &new)?;
    assert!(
        report
            .lost
            .iter()
            .any(|l| matches!(l, Lost::Journal { detail } if detail.contains("unreadable"))),
        "{:?}",
        report.lost
    );
    assert!(report.journal_frames > 0, "no frame taken in");
    // Nothing copied that the undamaged journal would not give (opened
    // once, as the recovered copy was: see the test above).
    drop(builder(&ManualClock::new(T0)).open(&new)?);
    let copied = raw(&new)?;
    for (k, v) in &copied.records {
        assert_eq!(whole.records.get(k), Some(v), "record {}", hex(k));
    }
    Ok(())
}

/// Median of a sorted slice.
fn median(v: &[u64]) -> u64 {
    v.get(v.len() / 2).copied().unwrap_or(0)
}

/// The byte-flip experiment of issue 28: 100 single-byte flips of a
/// ~270 KB format-2 payments database closed cleanly, and 30 of the
/// journal of one that crashed with frames beyond its checkpoint. For
/// each: whether a writable open refused it, whether `verify` said sound
/// while open refused, and what salvage copied and lost.
#[test]
#[ignore = "an experiment: run with --ignored --nocapture"]
fn byte_flip_experiment() -> TestResult {
    let seed = env_u64("IDEMPOTENCY_SALVAGE_SEED")?.unwrap_or(DEFAULT_SEED);
    let mut rng = SplitMix64(seed);
    let work = tempfile::tempdir()?;
    let file = work.path().join("payments.redb");
    build(&file, 200)?;
    let crashed = work.path().join("crashed.redb");
    build_crashed(&crashed, 160, 40)?;
    let total = raw(&file)?.records.len() as u64;
    let crashed_total = {
        let probe = work.path().join("probe");
        std::fs::create_dir(&probe)?;
        let copy = copy_db(&crashed, &probe, "c.redb")?;
        drop(builder(&ManualClock::new(T0)).open(&copy)?);
        raw(&copy)?.records.len() as u64
    };
    println!(
        "| run | file bytes | records | trials | refused at open | verify sound, open refused | \
         salvage failed | records salvaged min/median/max | lost items min/median/max | trials with lost items |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|");
    for (name, db, target, trials, records) in [
        ("database file", &file, file.clone(), 100, total),
        ("journal", &crashed, journal_of(&crashed), 30, crashed_total),
    ] {
        let original = std::fs::read(&target)?;
        let (mut refused, mut disagree, mut failed, mut with_lost) = (0, 0, 0, 0);
        let (mut copied, mut lost) = (Vec::new(), Vec::new());
        for _ in 0..trials {
            let dir = tempfile::tempdir()?;
            let damaged = copy_db(db, dir.path(), "damaged.redb")?;
            let damaged_target = if target == *db {
                damaged.clone()
            } else {
                journal_of(&damaged)
            };
            let mut bytes = original.clone();
            // In the journal: its frames, past the 4 KiB header and up to
            // the last byte written (the file is longer: preallocated).
            let (start, end) = if target == *db {
                (0, bytes.len())
            } else {
                let end = bytes
                    .iter()
                    .rposition(|&b| b != 0)
                    .map_or(bytes.len(), |e| e + 1);
                (4096.min(end - 1), end)
            };
            let offset = start + usize::try_from(rng.below(u64::try_from(end - start)?))?;
            bytes[offset] ^= u8::try_from(rng.below(255) + 1)?;
            std::fs::write(&damaged_target, &bytes)?;
            let child = run_child(dir.path(), true)?;
            if let Some(stderr) = &child.crashed {
                return Err(format!("{name} offset {offset}: child crashed: {stderr}").into());
            }
            refused += usize::from(child.open_error.is_some());
            disagree += usize::from(child.open_error.is_some() && child.verify_sound == Some(true));
            if let Some(e) = &child.salvage_error {
                println!("({name}, offset {offset}: salvage failed: {e})");
                failed += 1;
                continue;
            }
            with_lost += usize::from(!child.lost.is_empty());
            if child.lost.len() > 20 {
                let first: String = child.lost[0].chars().take(160).collect();
                println!(
                    "({name}, offset {offset}: {} records copied, {} items lost, e.g. {first})",
                    child.copied,
                    child.lost.len()
                );
            }
            copied.push(child.copied);
            lost.push(child.lost.len() as u64);
        }
        copied.sort_unstable();
        lost.sort_unstable();
        let spread = |v: &[u64]| {
            format!(
                "{}/{}/{}",
                v.first().copied().unwrap_or(0),
                median(v),
                v.last().copied().unwrap_or(0)
            )
        };
        if target != *db {
            let used = original.iter().rposition(|&b| b != 0).map_or(0, |e| e + 1);
            println!("(journal: flips in its first {used} bytes, header and frames)");
        }
        println!(
            "| {name} | {} | {records} | {trials} | {refused} | {disagree} | {failed} | {} | {} | {with_lost} |",
            original.len(),
            spread(&copied),
            spread(&lost)
        );
    }
    Ok(())
}
