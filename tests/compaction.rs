//! Guards `EngineBuilder::compact` (a closed file's free pages given back)
//! against losing or changing what the file holds, against running on a
//! file an app has open, and against a crash part way: a SIGKILL of a
//! child while it compacts (this test binary re-invoked with
//! `IDEM_COMPACT_ROLE` set, running only `child_entry`) must leave a file
//! that opens with every record replaying byte for byte and `verify`
//! finding it sound.
//!
//! The file: 3,000 records whose TTL has run out (swept away, `Forget`),
//! then 1,200 that live, each with a 2 KiB response, so most of the file
//! is free pages below the live ones.
//!
//! Rounds of the kill test: `IDEMPOTENCY_COMPACT_KILL_ROUNDS` (default 6).
//! Unix only (the kill is observed as SIGKILL).
//!
//! Then what a compaction is given that it must refuse without writing a
//! byte (another program's redb file, a directory, text, a damaged page, a
//! damaged journal, a file another process holds), a file a SIGKILLed
//! writer left, a format-2 file, the file's stored expiry settings, and a
//! file system that fills up part way (a real tmpfs, root only).
#![cfg(unix)]

mod common;
#[path = "common/small_fs.rs"]
mod small_fs;

use std::error::Error;
use std::io::{BufRead, BufReader};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use common::claimed;
use idempotency::{
    Begin, Engine, Envelope, ExpiryPolicy, Fingerprint, IdempotencyKey, ManualClock, OpenError,
};
use small_fs::SmallFs;

type TestResult = Result<(), Box<dyn Error + Send + Sync>>;

const T0: u64 = 1_700_000_000_000;
const TTL: Duration = Duration::from_secs(3_600);
/// When the live records are written, and the file is read: two TTLs on.
const LATER: u64 = T0 + 2 * 3_600_000;
const EXPIRED: usize = 3_000;
const LIVE: usize = 1_200;
const ROLE_VAR: &str = "IDEM_COMPACT_ROLE";
const FILE_VAR: &str = "IDEM_COMPACT_FILE";

fn key(i: usize) -> Result<IdempotencyKey, idempotency::Error> {
    IdempotencyKey::new("compact", format!("order-{i:05}"))
}

fn fp(i: usize) -> Result<Fingerprint, idempotency::FingerprintError> {
    Fingerprint::of_json(format!(r#"{{"order": {i}}}"#).as_bytes(), &[])
}

/// A response of 2 KiB that names its key.
fn body(i: usize) -> Vec<u8> {
    let mut b = format!("receipt {i:05} ").into_bytes();
    b.resize(2_048, b'a' + (i % 26) as u8);
    b
}

fn builder(at: u64) -> idempotency::EngineBuilder {
    Engine::builder()
        .clock(ManualClock::new(at))
        .ttl(TTL)
        .expiry_policy(ExpiryPolicy::Forget)
        .sweep_interval(None)
}

/// The file described above, closed cleanly.
fn write_file(path: &Path) -> TestResult {
    {
        let engine = builder(T0).open(path)?;
        for i in 0..EXPIRED {
            let c = claimed(engine.begin(&key(i)?, fp(i)?)?)?;
            engine.complete(c, Envelope::new(1, 201, body(i)))?;
        }
    }
    let engine = builder(LATER).open_existing(path)?;
    for i in EXPIRED..EXPIRED + LIVE {
        let c = claimed(engine.begin(&key(i)?, fp(i)?)?)?;
        engine.complete(c, Envelope::new(1, 201, body(i)))?;
    }
    let swept = engine.sweep_now()?;
    assert_eq!(swept.deleted, EXPIRED as u64, "{swept:?}");
    Ok(())
}

/// Every live record replays byte for byte, the expired ones are gone,
/// and `verify` finds the file sound.
fn check_file(path: &Path) -> TestResult {
    let engine = builder(LATER).open_existing(path)?;
    let report = engine.verify()?;
    assert!(report.is_sound(), "{path:?}: {:?}", report.damage);
    for i in EXPIRED..EXPIRED + LIVE {
        match engine.begin(&key(i)?, fp(i)?)? {
            Begin::Replay(r) => assert_eq!(r.envelope.body, body(i), "key {i}"),
            other => return Err(format!("key {i}: expected a replay, got {other:?}").into()),
        }
    }
    for i in [0, EXPIRED / 2, EXPIRED - 1] {
        assert!(
            engine.record(&key(i)?)?.is_none(),
            "expired key {i} is back"
        );
    }
    Ok(())
}

#[test]
fn compaction_gives_back_the_free_pages_and_keeps_every_record() -> TestResult {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("idem.redb");
    write_file(&path)?;
    let report = builder(LATER).compact(&path)?;
    let now = std::fs::metadata(&path)?.len();
    assert_eq!(report.bytes_after, now);
    // 4,200 records' worth of pages were written, 1,200 live: the file
    // must come down to well under half.
    assert!(
        report.bytes_after * 2 < report.bytes_before,
        "{report:?}: too little given back"
    );
    assert_eq!(
        report.bytes_freed(),
        report.bytes_before - report.bytes_after
    );
    check_file(&path)?;
    // Compacting again finds nothing more to give.
    let again = builder(LATER).compact(&path)?;
    assert!(again.bytes_after <= report.bytes_after, "{again:?}");
    check_file(&path)
}

#[test]
fn compaction_refuses_a_file_an_engine_has_open() -> TestResult {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("idem.redb");
    write_file(&path)?;
    let engine = builder(LATER).open_existing(&path)?;
    engine.flush()?;
    let before = std::fs::read(&path)?;
    match builder(LATER).compact(&path) {
        Err(OpenError::AlreadyOpen { .. }) => {}
        other => return Err(format!("expected AlreadyOpen, got {other:?}").into()),
    }
    // The refused call wrote nothing: the file is as the open engine
    // holds it.
    assert_eq!(std::fs::read(&path)?, before);
    drop(engine);
    check_file(&path)
}

#[test]
fn compaction_of_a_missing_file_says_so_and_creates_nothing() -> TestResult {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("nothing.redb");
    match builder(T0).compact(&path) {
        Err(OpenError::MissingDatabase { path: named }) => assert_eq!(named, path),
        other => return Err(format!("expected MissingDatabase, got {other:?}").into()),
    }
    assert!(!path.exists());
    Ok(())
}

/// Entry point of the child process; a no-op in the normal test run.
#[test]
fn child_entry() -> TestResult {
    let Ok(role) = std::env::var(ROLE_VAR) else {
        return Ok(());
    };
    let path = PathBuf::from(std::env::var(FILE_VAR)?);
    match role.as_str() {
        "compact" => {
            println!("ready");
            builder(LATER).compact(&path)?;
            println!("done");
            Ok(())
        }
        // Writes live records one by one, saying which were acknowledged,
        // until it is killed.
        "write" => {
            let engine = builder(LATER).open(&path)?;
            println!("ready");
            for i in EXPIRED.. {
                let c = claimed(engine.begin(&key(i)?, fp(i)?)?)?;
                engine.complete(c, Envelope::new(1, 201, body(i)))?;
                println!("acked {i}");
            }
            Ok(())
        }
        // Holds the file open until it is killed.
        "hold" => {
            let _engine = builder(LATER).open_existing(&path)?;
            println!("ready");
            loop {
                std::thread::sleep(Duration::from_secs(60));
            }
        }
        _ => Err(format!("unknown child role {role:?}").into()),
    }
}

/// Starts a child compacting `path`; returns it once it said "ready",
/// with its stdout for the rest.
fn start_child(
    path: &Path,
) -> std::io::Result<(std::process::Child, BufReader<std::process::ChildStdout>)> {
    start_child_as("compact", path)
}

/// Starts a child in `role` on `path`; returns it once it said "ready".
fn start_child_as(
    role: &str,
    path: &Path,
) -> std::io::Result<(std::process::Child, BufReader<std::process::ChildStdout>)> {
    let mut child = common::child_entry_command!()
        .env(ROLE_VAR, role)
        .env(FILE_VAR, path)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()?;
    let mut out = BufReader::new(
        child
            .stdout
            .take()
            .ok_or_else(|| std::io::Error::other("no stdout"))?,
    );
    let mut line = String::new();
    // The harness prints the test's name on the same line first.
    while !line.contains("ready") {
        line.clear();
        if out.read_line(&mut line)? == 0 {
            return Err(std::io::Error::other("the child ended before it was ready"));
        }
    }
    Ok((child, out))
}

#[test]
fn sigkill_during_compaction_loses_nothing() -> TestResult {
    let rounds: u64 = std::env::var("IDEMPOTENCY_COMPACT_KILL_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(6);
    let dir = tempfile::tempdir()?;
    let original = dir.path().join("original.redb");
    write_file(&original)?;
    let copy = |to: &Path| -> std::io::Result<()> {
        for suffix in ["", ".journal"] {
            let from = PathBuf::from(format!("{}{suffix}", original.display()));
            if from.exists() {
                std::fs::copy(&from, format!("{}{suffix}", to.display()))?;
            }
        }
        Ok(())
    };
    // How long a whole compaction takes in a child, from "ready".
    let timed = dir.path().join("timed.redb");
    copy(&timed)?;
    let (mut child, _out) = start_child(&timed)?;
    let started = Instant::now();
    let status = child.wait()?;
    let whole = started.elapsed();
    assert!(status.success(), "the timing child failed: {status:?}");
    check_file(&timed)?;
    let mut killed_mid = 0;
    for round in 0..rounds {
        let path = dir.path().join(format!("round-{round}.redb"));
        copy(&path)?;
        // Spread over the compaction and a little past it.
        let delay = whole.mul_f64((round as f64 + 0.5) / rounds as f64 * 1.1);
        let (mut child, mut out) = start_child(&path)?;
        std::thread::sleep(delay);
        child.kill()?;
        let status = child.wait()?;
        let mut rest = String::new();
        let _ = std::io::Read::read_to_string(&mut out, &mut rest);
        let finished = rest.contains("done");
        if status.signal() == Some(libc_sigkill()) && !finished {
            killed_mid += 1;
        }
        check_file(&path).map_err(|e| format!("round {round}, killed after {delay:?}: {e}"))?;
        // A compaction after the crash completes and keeps everything.
        builder(LATER).compact(&path)?;
        check_file(&path).map_err(|e| format!("round {round}, compacted again: {e}"))?;
    }
    println!(
        "compaction kill test: {killed_mid} of {rounds} kills landed before the child finished (a whole compaction took {whole:?})"
    );
    Ok(())
}

/// SIGKILL's number (9 on every Unix this runs on).
fn libc_sigkill() -> i32 {
    9
}

/// Every file named `<path>*` beside `path`, with its bytes: what a
/// refused compaction must leave as it was.
fn files_beside(path: &Path) -> std::io::Result<Vec<(PathBuf, Vec<u8>)>> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let mut found = Vec::new();
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        if entry.file_name().to_string_lossy().starts_with(&name) && entry.path().is_file() {
            found.push((entry.path(), std::fs::read(entry.path())?));
        }
    }
    found.sort();
    Ok(found)
}

/// Asserts that `files_beside(path)` is still `before`.
fn assert_untouched(path: &Path, before: &[(PathBuf, Vec<u8>)], what: &str) -> TestResult {
    let after = files_beside(path)?;
    let names = |f: &[(PathBuf, Vec<u8>)]| f.iter().map(|(p, _)| p.clone()).collect::<Vec<_>>();
    assert_eq!(
        names(&after),
        names(before),
        "{what}: files were created or removed"
    );
    for ((p, a), (_, b)) in after.iter().zip(before) {
        assert!(a == b, "{what}: {p:?} was written");
    }
    Ok(())
}

/// Compacts `path` with `builder` and asserts the refusal `expected`
/// accepts, with nothing beside `path` (itself, its journal, its reserve)
/// written, created or removed; `what` names the case in failures.
fn assert_refused(
    path: &Path,
    builder: idempotency::EngineBuilder,
    what: &str,
    expected: impl Fn(&OpenError) -> bool,
) -> TestResult {
    let before = files_beside(path)?;
    match builder.compact(path) {
        Err(e) if expected(&e) => {}
        other => return Err(format!("{what}: not the expected refusal: {other:?}").into()),
    }
    assert_untouched(path, &before, what)
}

#[test]
fn compaction_refuses_another_programs_redb_file_and_writes_nothing() -> TestResult {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("other.redb");
    {
        let db = redb::Database::create(&path)?;
        let table: redb::TableDefinition<&str, u64> = redb::TableDefinition::new("inventory");
        let txn = db.begin_write()?;
        {
            let mut t = txn.open_table(table)?;
            for i in 0..500_u64 {
                t.insert(format!("item-{i}").as_str(), i)?;
            }
        }
        txn.commit()?;
    }
    // No engine tables written into it, no journal or reserve beside it.
    assert_refused(
        &path,
        Engine::builder().sweep_interval(None),
        "another program's redb file",
        |e| matches!(e, OpenError::NoEngineTables { path: named } if *named == path),
    )
}

#[test]
fn compaction_refuses_what_is_no_database_naming_it_and_writes_nothing() -> TestResult {
    let dir = tempfile::tempdir()?;
    // A directory.
    let sub = dir.path().join("a-directory.redb");
    std::fs::create_dir(&sub)?;
    match builder(T0).compact(&sub) {
        Err(OpenError::NotADatabase { path: named, .. }) => assert_eq!(named, sub),
        other => return Err(format!("a directory: expected NotADatabase, got {other:?}").into()),
    }
    assert_eq!(
        std::fs::read_dir(&sub)?.count(),
        0,
        "written into the directory"
    );
    assert!(!dir.path().join("a-directory.redb.journal").exists());
    // Text.
    let text = dir.path().join("notes.redb");
    std::fs::write(&text, "not a database\n")?;
    assert_refused(
        &text,
        builder(T0),
        "text",
        |e| matches!(e, OpenError::NotADatabase { path: named, .. } if *named == text),
    )?;
    // Nothing at all.
    let empty = dir.path().join("empty.redb");
    std::fs::write(&empty, "")?;
    match builder(T0).compact(&empty) {
        Err(OpenError::EmptyFile { path: named }) => assert_eq!(named, empty),
        other => return Err(format!("0 bytes: expected EmptyFile, got {other:?}").into()),
    }
    assert_eq!(std::fs::metadata(&empty)?.len(), 0);
    assert!(!dir.path().join("empty.redb.journal").exists());
    Ok(())
}

/// A file whose app tombstones expired keys, compacted by a one-off
/// program whose builder keeps the defaults (`Forget`, 24 h): the file's
/// stored settings, which operator tools follow, must not change.
#[test]
fn compaction_keeps_the_stored_expiry_settings() -> TestResult {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("idem.redb");
    let tombstone = ExpiryPolicy::Tombstone {
        keep: Duration::from_secs(86_400),
    };
    {
        let engine = Engine::builder()
            .clock(ManualClock::new(T0))
            .ttl(TTL)
            .expiry_policy(tombstone)
            .sweep_interval(None)
            .open(&path)?;
        for i in 0..10 {
            let c = claimed(engine.begin(&key(i)?, fp(i)?)?)?;
            engine.complete(c, Envelope::new(1, 201, body(i)))?;
        }
    }
    Engine::builder()
        .clock(ManualClock::new(T0))
        .sweep_interval(None)
        .compact(&path)?;
    // An operator's sweep (as `idem sweep`) two TTLs on.
    let engine = Engine::builder()
        .clock(ManualClock::new(LATER))
        .sweep_interval(None)
        .expiry_settings_from_database()
        .open_existing(&path)?;
    let swept = engine.sweep_now()?;
    assert_eq!(
        (swept.tombstoned, swept.deleted),
        (10, 0),
        "the app's tombstone policy was replaced by the compaction's builder: {swept:?}"
    );
    match engine.begin(&key(0)?, fp(0)?)? {
        Begin::Tombstoned { .. } => Ok(()),
        other => Err(format!("a reused key after expiry: {other:?}").into()),
    }
}

#[test]
fn compaction_after_a_sigkilled_writer_keeps_every_acknowledged_record() -> TestResult {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("idem.redb");
    builder(LATER).open(&path).map(drop)?;
    let (mut child, mut out) = start_child_as("write", &path)?;
    // Kill it after a few hundred acknowledged records, mid-stream.
    let mut acked = Vec::new();
    let mut line = String::new();
    while acked.len() < 300 {
        line.clear();
        if out.read_line(&mut line)? == 0 {
            return Err(format!("the writer ended after {} records", acked.len()).into());
        }
        if let Some(i) = line.trim().strip_prefix("acked ") {
            acked.push(i.parse::<usize>()?);
        }
    }
    child.kill()?;
    let status = child.wait()?;
    assert_eq!(status.signal(), Some(libc_sigkill()), "{status:?}");
    // What it printed before the kill landed was acknowledged too.
    let mut rest = String::new();
    let _ = std::io::Read::read_to_string(&mut out, &mut rest);
    for l in rest.lines() {
        if let Some(i) = l.trim().strip_prefix("acked ") {
            acked.push(i.parse::<usize>()?);
        }
    }
    let report = builder(LATER).compact(&path)?;
    assert_eq!(report.bytes_after, std::fs::metadata(&path)?.len());
    let engine = builder(LATER).open_existing(&path)?;
    let verified = engine.verify()?;
    assert!(verified.is_sound(), "{:?}", verified.damage);
    for &i in &acked {
        match engine.begin(&key(i)?, fp(i)?)? {
            Begin::Replay(r) => assert_eq!(r.envelope.body, body(i), "key {i}"),
            other => return Err(format!("acknowledged key {i}: {other:?}").into()),
        }
    }
    Ok(())
}

/// The offsets of the pages of `file` that hold the body of record `i`,
/// found by its text (the one in use, and any older copy on a free page).
fn pages_with_body(file: &[u8], i: usize) -> Vec<usize> {
    let needle = format!("receipt {i:05} ").into_bytes();
    let mut pages: Vec<usize> = file
        .windows(needle.len())
        .enumerate()
        .filter(|(_, w)| *w == needle.as_slice())
        .map(|(at, _)| at / 4096 * 4096)
        .collect();
    pages.dedup();
    pages
}

#[test]
fn compaction_refuses_a_damaged_page_and_salvage_still_works() -> TestResult {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("idem.redb");
    write_file(&path)?;
    let mut bytes = std::fs::read(&path)?;
    let pages = pages_with_body(&bytes, EXPIRED + LIVE / 2);
    assert!(!pages.is_empty(), "no page holds the live record's body");
    for page in pages {
        for b in &mut bytes[page + 100..page + 164] {
            *b ^= 0xff;
        }
    }
    std::fs::write(&path, &bytes)?;
    // The recovery reserve is given back by any writable open before
    // redb's page check refuses the file (its room is the file system's
    // again, for the salvage's new file): the file and its journal stay.
    let reserve = PathBuf::from(format!("{}.reserve", path.display()));
    std::fs::remove_file(&reserve)?;
    assert_refused(
        &path,
        builder(LATER),
        "a damaged page",
        |e| matches!(e, OpenError::Corrupt { path: named, .. } if *named == path),
    )?;
    // Salvage copies the rest, as it would have before the attempt.
    let new = dir.path().join("salvaged.redb");
    let report = Engine::salvage(&path, &new)?;
    assert!(!report.lost.is_empty(), "nothing lost? {report:?}");
    assert!(
        report.records + report.lost.len() as u64 >= LIVE as u64,
        "{report:?}"
    );
    let engine = builder(LATER).open_existing(&new)?;
    assert!(engine.verify()?.is_sound());
    Ok(())
}

#[test]
fn compaction_refuses_a_damaged_journal_and_writes_nothing() -> TestResult {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("idem.redb");
    builder(LATER).open(&path).map(drop)?;
    let (mut child, mut out) = start_child_as("write", &path)?;
    let mut line = String::new();
    let mut acked = 0;
    while acked < 400 {
        line.clear();
        if out.read_line(&mut line)? == 0 {
            return Err("the writer ended early".into());
        }
        if line.contains("acked ") {
            acked += 1;
        }
    }
    child.kill()?;
    child.wait()?;
    // Damage the journal's frames in the middle of what it holds.
    let journal = PathBuf::from(format!("{}.journal", path.display()));
    let mut bytes = std::fs::read(&journal)?;
    let end = bytes
        .iter()
        .rposition(|&b| b != 0)
        .ok_or("an empty journal")?;
    let at = end / 2;
    for b in &mut bytes[at..at + 64] {
        *b ^= 0xff;
    }
    std::fs::write(&journal, &bytes)?;
    assert_refused(&path, builder(LATER), "a damaged journal", |e| {
        matches!(e, OpenError::Journal { .. } | OpenError::Corrupt { .. })
    })
}

#[test]
fn compaction_refuses_a_file_another_process_holds_and_touches_nothing() -> TestResult {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("idem.redb");
    write_file(&path)?;
    let (mut child, _out) = start_child_as("hold", &path)?;
    let before = files_beside(&path)?;
    let refused = builder(LATER).compact(&path);
    // Its recovery reserve, journal and file are as the holder has them.
    let untouched = assert_untouched(&path, &before, "a file another process holds");
    child.kill()?;
    child.wait()?;
    match refused {
        Err(OpenError::AlreadyOpen { path: named }) => assert_eq!(named, path),
        other => return Err(format!("expected AlreadyOpen, got {other:?}").into()),
    }
    untouched?;
    check_file(&path)
}

#[test]
fn compaction_of_a_format_2_file_keeps_it_format_2() -> TestResult {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("idem.redb");
    {
        let engine = builder(T0).unstable_create_format_2().open(&path)?;
        for i in 0..EXPIRED {
            let c = claimed(engine.begin(&key(i)?, fp(i)?)?)?;
            engine.complete(c, Envelope::new(1, 201, body(i)))?;
        }
    }
    {
        let engine = builder(LATER).open_existing(&path)?;
        assert_eq!(engine.redb_format(), Some(2));
        for i in EXPIRED..EXPIRED + LIVE {
            let c = claimed(engine.begin(&key(i)?, fp(i)?)?)?;
            engine.complete(c, Envelope::new(1, 201, body(i)))?;
        }
        assert_eq!(engine.sweep_now()?.deleted, EXPIRED as u64);
    }
    let report = builder(LATER).compact(&path)?;
    assert!(report.bytes_after * 2 < report.bytes_before, "{report:?}");
    let engine = builder(LATER).open_existing(&path)?;
    assert_eq!(engine.redb_format(), Some(2));
    drop(engine);
    check_file(&path)
}

/// Copies `from` to `to` without writing its pages of zeros (holes), so
/// that a compaction moving pages into them needs new blocks.
fn copy_sparse(from: &[u8], to: &Path) -> std::io::Result<()> {
    use std::io::{Seek, SeekFrom, Write};
    let mut f = std::fs::File::create(to)?;
    for (n, page) in from.chunks(4096).enumerate() {
        if page.iter().any(|&b| b != 0) {
            f.seek(SeekFrom::Start((n * 4096) as u64))?;
            f.write_all(page)?;
        }
    }
    f.set_len(from.len() as u64)?;
    f.sync_all()
}

/// A compaction on a file system that fills up part way: the file's free
/// pages (the expired records', zeroed, which `verify` confirms were
/// free) are holes on a tmpfs with 256 KiB left, so moving the live pages
/// into them fails with ENOSPC. The error is `Storage`; the file then
/// serves every record, and once space is freed a compaction completes.
#[test]
fn compaction_on_a_full_disk_fails_cleanly_and_keeps_every_record() -> TestResult {
    let Some(fs) = SmallFs::mount(48 * 1024)? else {
        return Ok(());
    };
    let dir = tempfile::tempdir()?;
    let original = dir.path().join("idem.redb");
    write_file(&original)?;
    // The expired records' pages, zeroed: only a free page may hold
    // nothing but expired bodies.
    let mut bytes = std::fs::read(&original)?;
    let mut zeroed = 0;
    for page in bytes.chunks_mut(4096) {
        let mut bodies = page
            .windows(8)
            .enumerate()
            .filter(|(_, w)| w == b"receipt ")
            .filter_map(|(at, _)| {
                std::str::from_utf8(page.get(at + 8..at + 13)?)
                    .ok()?
                    .parse::<usize>()
                    .ok()
            })
            .peekable();
        if bodies.peek().is_some() && bodies.all(|i| i < EXPIRED) {
            page.fill(0);
            zeroed += 1;
        }
    }
    assert!(zeroed > EXPIRED / 2, "{zeroed} pages zeroed");
    let path = fs.mnt.join("idem.redb");
    copy_sparse(&bytes, &path)?;
    std::fs::copy(
        format!("{}.journal", original.display()),
        format!("{}.journal", path.display()),
    )?;
    {
        // Only free pages were zeroed.
        let engine = builder(LATER).open_read_only(&path)?;
        let report = engine.verify()?;
        assert!(report.is_sound(), "{:?}", report.damage);
    }
    // Fill the file system up to 256 KiB.
    let filler = fs.mnt.join("filler");
    let free = fs.free_bytes()?;
    std::fs::write(
        &filler,
        vec![1_u8; (free.saturating_sub(256 * 1024)) as usize],
    )?;
    let length = std::fs::metadata(&path)?.len();
    match builder(LATER).compact(&path) {
        Err(OpenError::Storage { .. }) => {}
        other => {
            return Err(format!(
                "expected a storage error on a full disk, got {other:?} ({})",
                fs.listing()
            )
            .into())
        }
    }
    assert!(std::fs::metadata(&path)?.len() <= length);
    check_file(&path).map_err(|e| format!("after the failed compaction, disk full: {e}"))?;
    std::fs::remove_file(&filler)?;
    check_file(&path).map_err(|e| format!("after the failed compaction, space freed: {e}"))?;
    let report = builder(LATER).compact(&path)?;
    assert!(report.bytes_after * 2 < length, "{report:?}");
    check_file(&path)
}

/// SIGKILL landing inside redb's compaction itself, not in the open that
/// comes first: the child is killed as soon as the file's length drops
/// below what it was (a pass has cut the file), before it says it is
/// done. Rounds: `IDEMPOTENCY_COMPACT_KILL_ROUNDS` (default 6).
#[test]
fn sigkill_once_the_file_starts_shrinking_loses_nothing() -> TestResult {
    let rounds: u64 = std::env::var("IDEMPOTENCY_COMPACT_KILL_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(6);
    let dir = tempfile::tempdir()?;
    let original = dir.path().join("original.redb");
    write_file(&original)?;
    // An open and a clean close may trim the file's tail: done once here,
    // so that the compaction's own open leaves the length as it is.
    builder(LATER).open_existing(&original).map(drop)?;
    let length = std::fs::metadata(&original)?.len();
    let mut mid = 0;
    for round in 0..rounds {
        let path = dir.path().join(format!("round-{round}.redb"));
        std::fs::copy(&original, &path)?;
        std::fs::copy(
            format!("{}.journal", original.display()),
            format!("{}.journal", path.display()),
        )?;
        let (mut child, mut out) = start_child(&path)?;
        // Poll the length; kill at the first cut (or when the child ends).
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            if std::fs::metadata(&path)?.len() < length {
                break;
            }
            if child.try_wait()?.is_some() || Instant::now() > deadline {
                break;
            }
            std::thread::yield_now();
        }
        let _ = child.kill();
        let status = child.wait()?;
        let mut rest = String::new();
        let _ = std::io::Read::read_to_string(&mut out, &mut rest);
        if status.signal() == Some(libc_sigkill()) && !rest.contains("done") {
            mid += 1;
        }
        check_file(&path).map_err(|e| format!("round {round}: {e}"))?;
        builder(LATER).compact(&path)?;
        check_file(&path).map_err(|e| format!("round {round}, compacted again: {e}"))?;
    }
    println!("{mid} of {rounds} kills landed after the file started shrinking, before the end");
    Ok(())
}
