//! Settling UNKNOWN records from the shell: `idem unknown`, `idem resolve`
//! and `idem purge`. Guards against a resolve that leaves the key unusable
//! or replays something other than the operator's envelope, and against a
//! purge that deletes in-doubt work without `--force` (a retry would then
//! execute it a second time).

mod common;

use std::ffi::OsString;
use std::path::{Path, PathBuf};

use common::*;
use idempotency::{Begin, Failure};
use serde_json::Value;

const SCOPE: &str = "tenant-1:create_payment";
const BODY: &str = r#"{"amount":10}"#;

/// A database holding one UNKNOWN record for `SCOPE`/`key`; returns its path
/// and the claim's provider reference.
fn with_unknown(dir: &Path, key_name: &str) -> TestResult<(PathBuf, String)> {
    let path = db_path(dir);
    let engine = engine(&path)?;
    let claim = claim(&engine, &key(SCOPE, key_name)?, fp(BODY)?)?;
    let reference = claim.reference().to_string();
    let reason = "provider timed out after 30 s".to_string();
    engine.fail(claim, Failure::InDoubt { reason })?;
    Ok((path, reference))
}

fn args(parts: &[&str], db: &Path) -> Vec<OsString> {
    let mut v: Vec<OsString> = vec![parts[0].into(), db.into()];
    v.extend(parts[1..].iter().map(OsString::from));
    v
}

#[test]
fn unknown_lists_the_record_with_reference_attempts_and_reason() -> TestResult {
    let dir = tempfile::tempdir()?;
    let (db, reference) = with_unknown(dir.path(), "k1")?;
    let out = idem_ok(args(&["unknown"], &db))?;
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 2, "{out}");
    assert!(
        lines[0].starts_with("SCOPE") && lines[0].contains("REFERENCE"),
        "{out}"
    );
    for want in [
        SCOPE,
        "k1",
        reference.as_str(),
        "provider timed out after 30 s",
    ] {
        assert!(lines[1].contains(want), "missing {want:?} in {out}");
    }

    let rows: Vec<Value> = serde_json::from_str(&idem_ok(args(&["unknown", "--json"], &db))?)?;
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0]["reference"], reference.as_str());
    assert_eq!(rows[0]["attempts"], 0);
    assert_eq!(rows[0]["reason"], "provider timed out after 30 s");
    assert!(rows[0]["age_ms"].is_u64());
    Ok(())
}

#[test]
fn unknown_with_none_says_so() -> TestResult {
    let dir = tempfile::tempdir()?;
    let db = db_path(dir.path());
    drop(engine(&db)?);
    assert_eq!(idem_ok(args(&["unknown"], &db))?, "no UNKNOWN records\n");
    let rows: Vec<Value> = serde_json::from_str(&idem_ok(args(&["unknown", "--json"], &db))?)?;
    assert!(rows.is_empty());
    Ok(())
}

#[test]
fn resolve_not_executed_lets_the_next_begin_claim_afresh() -> TestResult {
    let dir = tempfile::tempdir()?;
    let (db, _) = with_unknown(dir.path(), "k2")?;
    let out = idem_ok(args(
        &[
            "resolve",
            SCOPE,
            "k2",
            "--not-executed",
            "--reason",
            "no charge at the provider",
        ],
        &db,
    ))?;
    assert!(out.contains("not executed"), "{out}");

    let engine = engine(&db)?;
    let claim = claim(&engine, &key(SCOPE, "k2")?, fp(BODY)?)?;
    engine.fail(claim, Failure::Retryable)?;
    Ok(())
}

#[test]
fn resolve_completed_makes_begin_replay_that_envelope() -> TestResult {
    let dir = tempfile::tempdir()?;
    let (db, _) = with_unknown(dir.path(), "k3")?;
    let file = dir.path().join("envelope.json");
    std::fs::write(
        &file,
        r#"{"schema_version":1,"status":201,
            "headers":[["content-type","application/json"]],
            "body":{"payment":"p_42"}}"#,
    )?;
    let mut a = args(
        &["resolve", SCOPE, "k3", "--reason", "checked", "--completed"],
        &db,
    );
    a.push(file.into());
    let out = idem_ok(a)?;
    assert!(out.contains("status 201"), "{out}");

    let engine = engine(&db)?;
    match engine.begin(&key(SCOPE, "k3")?, fp(BODY)?)? {
        Begin::Replay(replay) => {
            assert_eq!(replay.envelope.status, 201);
            assert_eq!(replay.envelope.body, br#"{"payment":"p_42"}"#);
            assert_eq!(
                replay.envelope.header("content-type"),
                Some(&b"application/json"[..])
            );
        }
        other => panic!("expected a replay, got {other:?}"),
    }
    Ok(())
}

/// After a resolve, `show` must not present the in-doubt reason as the
/// record's current condition (the library keeps it in the settled
/// record): it is shown as history.
#[test]
fn show_after_resolve_reports_the_reason_as_history() -> TestResult {
    let dir = tempfile::tempdir()?;
    let (db, _) = with_unknown(dir.path(), "k7")?;
    let before = idem_ok(args(&["show", SCOPE, "k7"], &db))?;
    assert!(
        before.contains("reason:        provider timed out after 30 s"),
        "{before}"
    );
    assert!(!before.contains("was in doubt"), "{before}");

    let file = dir.path().join("envelope.json");
    std::fs::write(&file, r#"{"schema_version":1,"status":201,"body":"ok"}"#)?;
    let mut a = args(
        &["resolve", SCOPE, "k7", "--reason", "checked", "--completed"],
        &db,
    );
    a.push(file.into());
    idem_ok(a)?;

    let after = idem_ok(args(&["show", SCOPE, "k7"], &db))?;
    assert!(after.contains("state:         COMPLETED"), "{after}");
    assert!(after.contains("reason:        -"), "{after}");
    assert!(
        after.contains("was in doubt:  provider timed out after 30 s"),
        "{after}"
    );
    let v: Value = serde_json::from_str(&idem_ok(args(&["show", SCOPE, "k7", "--json"], &db))?)?;
    assert_eq!(v["reason"], Value::Null, "{v}");
    assert_eq!(v["was_in_doubt"], "provider timed out after 30 s", "{v}");
    Ok(())
}

/// AGE means the time since the claim in every view; how long a record
/// has been in doubt is its own column.
#[test]
fn age_is_the_time_since_the_claim_in_every_view() -> TestResult {
    let dir = tempfile::tempdir()?;
    let path = db_path(dir.path());
    let engine = engine(&path)?;
    let c = claim(&engine, &key(SCOPE, "k8")?, fp(BODY)?)?;
    // In doubt only from the fail on, 300 ms after the claim.
    std::thread::sleep(std::time::Duration::from_millis(300));
    let reason = "provider timed out".to_string();
    engine.fail(c, Failure::InDoubt { reason })?;
    drop(engine);

    let text = idem_ok(args(&["unknown"], &path))?;
    let header = text.lines().next().unwrap_or_default();
    assert!(
        header.contains("  AGE  ") && header.contains("IN DOUBT"),
        "{text}"
    );
    let rows: Vec<Value> = serde_json::from_str(&idem_ok(args(&["unknown", "--json"], &path))?)?;
    let listed: Vec<Value> = serde_json::from_str(&idem_ok(args(&["inspect", "--json"], &path))?)?;
    let (age, in_doubt) = (
        rows[0]["age_ms"].as_u64().ok_or("no age_ms")?,
        rows[0]["in_doubt_ms"].as_u64().ok_or("no in_doubt_ms")?,
    );
    let inspect_age = listed[0]["age_ms"].as_u64().ok_or("no age_ms")?;
    assert!(
        age >= in_doubt + 300,
        "age {age} ms, in doubt {in_doubt} ms"
    );
    // The two commands ran one after the other: their ages differ by how
    // long that took, not by the 300 ms before the record went in doubt.
    assert!(
        inspect_age >= age && inspect_age - age < 300,
        "{age} vs {inspect_age}"
    );
    Ok(())
}

#[test]
fn resolve_refuses_a_bad_envelope_and_leaves_the_record_unknown() -> TestResult {
    let dir = tempfile::tempdir()?;
    let (db, _) = with_unknown(dir.path(), "k4")?;
    let file = dir.path().join("bad.json");
    std::fs::write(&file, r#"{"schema_version":1,"body":"x"}"#)?;
    let mut a = args(
        &["resolve", SCOPE, "k4", "--reason", "checked", "--completed"],
        &db,
    );
    a.push(file.clone().into());
    let err = idem_err(a)?;
    assert!(
        err.contains("bad.json: invalid envelope: missing required member \"status\""),
        "{err}"
    );

    let missing = dir.path().join("absent.json");
    let mut a = args(
        &["resolve", SCOPE, "k4", "--reason", "checked", "--completed"],
        &db,
    );
    a.push(missing.into());
    let err = idem_err(a)?;
    assert!(
        err.contains("absent.json: cannot read envelope file"),
        "{err}"
    );

    let out = idem_ok(args(&["inspect", "--state", "UNKNOWN"], &db))?;
    assert!(out.contains("k4"), "{out}");
    Ok(())
}

#[test]
fn resolve_of_a_record_that_is_not_unknown_is_an_error() -> TestResult {
    let dir = tempfile::tempdir()?;
    let (db, _) = with_unknown(dir.path(), "k5")?;
    idem_ok(args(
        &[
            "resolve",
            SCOPE,
            "k5",
            "--not-executed",
            "--reason",
            "checked",
        ],
        &db,
    ))?;
    let err = idem_err(args(
        &[
            "resolve",
            SCOPE,
            "k5",
            "--not-executed",
            "--reason",
            "checked",
        ],
        &db,
    ))?;
    assert!(err.contains(&format!("{SCOPE}/k5")), "{err}");
    Ok(())
}

#[test]
fn purge_refuses_unknown_without_force_and_deletes_with_it() -> TestResult {
    let dir = tempfile::tempdir()?;
    let (db, reference) = with_unknown(dir.path(), "k6")?;
    let err = idem_err(args(&["purge", SCOPE, "k6"], &db))?;
    assert!(err.contains("refusing to purge"), "{err}");
    assert!(
        err.contains("a second time") && err.contains("--force"),
        "{err}"
    );
    assert!(idem_ok(args(&["inspect"], &db))?.contains("k6"));

    let out = idem(args(&["purge", SCOPE, "k6", "--force"], &db))?;
    assert!(out.status.success());
    let stdout = String::from_utf8(out.stdout)?;
    let stderr = String::from_utf8(out.stderr)?;
    assert_eq!(stdout, format!("purged UNKNOWN record {SCOPE}/k6\n"));
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(
        stderr.starts_with("idem: warning: force-purged UNKNOWN record"),
        "{stderr}"
    );
    assert!(
        stderr.contains(&reference) && stderr.contains("a second time"),
        "{stderr}"
    );
    assert_eq!(idem_ok(args(&["inspect"], &db))?, "no records\n");
    Ok(())
}

#[test]
fn purge_of_a_completed_record_needs_no_force() -> TestResult {
    let dir = tempfile::tempdir()?;
    let db = db_path(dir.path());
    let engine = engine(&db)?;
    let c = claim(&engine, &key(SCOPE, "done")?, fp(BODY)?)?;
    engine.complete(c, idempotency::Envelope::new(1, 200, "ok"))?;
    drop(engine);
    let out = idem(args(&["purge", SCOPE, "done"], &db))?;
    assert!(out.status.success() && out.stderr.is_empty());
    assert_eq!(
        String::from_utf8(out.stdout)?,
        format!("purged COMPLETED record {SCOPE}/done\n")
    );
    let err = idem_err(args(&["purge", SCOPE, "done"], &db))?;
    assert_eq!(err, format!("idem: no record for {SCOPE}/done"));
    Ok(())
}
