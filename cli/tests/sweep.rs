//! `idem sweep`: guards against a sweep that ignores the app's expiry policy.
//! The policy is engine configuration, not stored in the file, so a CLI
//! sweep with the default (forget) would delete records the app keeps as
//! tombstones, and their keys could then be reused for a second execution.

mod common;

use std::time::Duration;

use common::*;
use idempotency::{Engine, Envelope, ExpiryPolicy};

const SCOPE: &str = "tenant-1:create_payment";

#[test]
fn sweep_moves_stale_claims_to_unknown() -> TestResult {
    let dir = tempfile::tempdir()?;
    let db = db_path(dir.path());
    let engine = Engine::builder()
        .sweep_interval(None)
        .lease(Duration::from_millis(1))
        .open(&db)?;
    let running = claim(&engine, &key(SCOPE, "stale")?, fp("{}")?)?;
    drop(engine);
    drop(running);
    std::thread::sleep(Duration::from_millis(5));
    let listed = idem_ok(["inspect".as_ref(), db.as_os_str()])?;
    assert!(listed.contains("PROCESSING (lease ran out"), "{listed}");
    let out = idem_ok(["sweep".as_ref(), db.as_os_str()])?;
    assert_eq!(out, "moved to UNKNOWN: 1, deleted: 0, tombstoned: 0\n");
    let out = idem_ok(["unknown".as_ref(), db.as_os_str()])?;
    assert!(
        out.contains("stale") && out.contains("ran out without an outcome"),
        "{out}"
    );
    Ok(())
}

/// A database with one COMPLETED record whose 1 ms TTL has run out.
fn expired(dir: &std::path::Path, policy: ExpiryPolicy) -> TestResult<std::path::PathBuf> {
    let db = db_path(dir);
    let engine = Engine::builder()
        .sweep_interval(None)
        .ttl(Duration::from_millis(1))
        .expiry_policy(policy)
        .open(&db)?;
    let c = claim(&engine, &key(SCOPE, "old")?, fp("{}")?)?;
    engine.complete(c, Envelope::new(1, 200, "ok"))?;
    drop(engine);
    std::thread::sleep(Duration::from_millis(5));
    Ok(db)
}

#[test]
fn sweep_deletes_expired_records_by_default() -> TestResult {
    let dir = tempfile::tempdir()?;
    let db = expired(dir.path(), ExpiryPolicy::Forget)?;
    let out = idem_ok(["sweep".as_ref(), db.as_os_str()])?;
    assert_eq!(out, "moved to UNKNOWN: 0, deleted: 1, tombstoned: 0\n");
    assert_eq!(
        idem_ok(["inspect".as_ref(), db.as_os_str()])?,
        "no records\n"
    );
    Ok(())
}

#[test]
fn sweep_follows_the_apps_stored_tombstone_policy() -> TestResult {
    let dir = tempfile::tempdir()?;
    let db = expired(
        dir.path(),
        ExpiryPolicy::Tombstone {
            keep: std::time::Duration::from_millis(3_600_000),
        },
    )?;
    let listed = idem_ok(["inspect".as_ref(), db.as_os_str()])?;
    assert!(
        listed.contains("COMPLETED (expired, not yet swept)"),
        "{listed}"
    );
    let out = idem_ok(["sweep".as_ref(), db.as_os_str()])?;
    assert_eq!(out, "moved to UNKNOWN: 0, deleted: 0, tombstoned: 1\n");
    let listed = idem_ok([
        "inspect".as_ref(),
        db.as_os_str(),
        "--state".as_ref(),
        "tombstone".as_ref(),
    ])?;
    assert!(
        listed.contains("old") && listed.contains("TOMBSTONE"),
        "{listed}"
    );
    Ok(())
}
