//! `idem compact`: a redb file's free pages given back, everything it
//! holds kept; the JSON form; a connection string refused as a usage
//! mistake; a file an app holds refused with the open's error.

mod common;

use std::time::Duration;

use common::*;
use idempotency::{Begin, Engine, Envelope, ExpiryPolicy, ManualClock};

const SCOPE: &str = "tenant-1:create_payment";
const T0: u64 = 1_700_000_000_000;
const TTL: Duration = Duration::from_secs(3_600);

fn builder(at: u64) -> idempotency::EngineBuilder {
    Engine::builder()
        .clock(ManualClock::new(at))
        .ttl(TTL)
        .expiry_policy(ExpiryPolicy::Forget)
        .sweep_interval(None)
}

/// 2,000 records of 2 KiB swept away, then `kept-0` … `kept-99`.
fn file_with_free_pages(path: &std::path::Path) -> TestResult {
    {
        let engine = builder(T0).open(path)?;
        for i in 0..2_000 {
            let c = claim(&engine, &key(SCOPE, &format!("old-{i}"))?, fp("{}")?)?;
            engine.complete(c, Envelope::new(1, 201, vec![b'x'; 2_048]))?;
        }
    }
    let engine = builder(T0 + 2 * 3_600_000).open_existing(path)?;
    for i in 0..100 {
        let c = claim(&engine, &key(SCOPE, &format!("kept-{i}"))?, fp("{}")?)?;
        engine.complete(c, Envelope::new(1, 201, format!("receipt {i}")))?;
    }
    assert_eq!(engine.sweep_now()?.deleted, 2_000);
    Ok(())
}

#[test]
fn compact_shrinks_the_file_and_keeps_every_record() -> TestResult {
    let dir = tempfile::tempdir()?;
    let db = db_path(dir.path());
    file_with_free_pages(&db)?;
    let before = std::fs::metadata(&db)?.len();
    let out = idem_ok([std::ffi::OsString::from("compact"), db.clone().into()])?;
    assert!(
        out.contains(" MiB -> ") && out.contains("given back"),
        "{out}"
    );
    let after = std::fs::metadata(&db)?.len();
    assert!(after * 2 < before, "{before} -> {after}: {out}");

    let json = idem_ok([
        std::ffi::OsString::from("compact"),
        db.clone().into(),
        "--json".into(),
    ])?;
    let v: serde_json::Value = serde_json::from_str(&json)?;
    // The open before the compaction (recovery, then a clean close) may
    // have written a page or two since.
    let (b, a) = (v["bytes_before"].as_u64(), v["bytes_after"].as_u64());
    assert!(
        b.is_some_and(|b| b >= after) && a.is_some_and(|a| a * 2 < before),
        "{json}"
    );
    assert_eq!(
        v["bytes_freed"].as_u64(),
        b.zip(a).map(|(b, a)| b - a),
        "{json}"
    );
    assert_eq!(v["file"].as_str(), db.to_str(), "{json}");

    let engine = builder(T0 + 2 * 3_600_000).open_existing(&db)?;
    assert!(engine.verify()?.is_sound());
    for i in 0..100 {
        match engine.begin(&key(SCOPE, &format!("kept-{i}"))?, fp("{}")?)? {
            Begin::Replay(r) => assert_eq!(r.envelope.body, format!("receipt {i}").as_bytes()),
            other => return Err(format!("kept-{i}: {other:?}").into()),
        }
    }
    Ok(())
}

#[test]
fn compact_refuses_a_connection_string_and_a_file_in_use() -> TestResult {
    let out = idem(["compact", "postgres://localhost/db"])?;
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    let stderr = String::from_utf8(out.stderr)?;
    assert!(stderr.contains("compact works on redb files"), "{stderr}");

    let dir = tempfile::tempdir()?;
    let db = db_path(dir.path());
    file_with_free_pages(&db)?;
    let engine = builder(T0 + 2 * 3_600_000).open_existing(&db)?;
    let line = idem_err([std::ffi::OsString::from("compact"), db.clone().into()])?;
    assert!(line.contains("open"), "{line}");
    drop(engine);
    Ok(())
}

/// Another program's redb file, a directory and text: each refused with
/// a message naming it, nothing written to it or beside it.
#[test]
fn compact_refuses_what_is_no_database_of_ours_and_writes_nothing() -> TestResult {
    let dir = tempfile::tempdir()?;
    let other = dir.path().join("other.redb");
    {
        let db = redb::Database::create(&other)?;
        let table: redb::TableDefinition<&str, u64> = redb::TableDefinition::new("inventory");
        let txn = db.begin_write()?;
        txn.open_table(table)?.insert("apples", 3)?;
        txn.commit()?;
    }
    let bytes = std::fs::read(&other)?;
    let line = idem_err([std::ffi::OsString::from("compact"), other.clone().into()])?;
    assert!(
        line.contains("other.redb") && line.contains("without idempotency tables"),
        "{line}"
    );
    assert_eq!(
        std::fs::read(&other)?,
        bytes,
        "another program's file was written"
    );

    let sub = dir.path().join("sub.redb");
    std::fs::create_dir(&sub)?;
    let line = idem_err([std::ffi::OsString::from("compact"), sub.clone().into()])?;
    assert!(line.contains("sub.redb"), "{line}");

    let text = dir.path().join("notes.redb");
    std::fs::write(&text, "not a database\n")?;
    let line = idem_err([std::ffi::OsString::from("compact"), text.clone().into()])?;
    assert!(line.contains("notes.redb"), "{line}");
    assert_eq!(std::fs::read(&text)?, b"not a database\n");

    let mut names: Vec<_> = std::fs::read_dir(dir.path())?
        .map(|e| e.map(|e| e.file_name()))
        .collect::<Result<_, _>>()?;
    names.sort();
    assert_eq!(
        names,
        ["notes.redb", "other.redb", "sub.redb"],
        "files created"
    );
    Ok(())
}
