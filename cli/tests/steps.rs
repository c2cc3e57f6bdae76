//! Effect steps and the evidence log from the shell: `idem show` lists a
//! key's steps and history, `idem unknown` the steps still waiting for
//! their provider, `idem resolve` demands a reason and records it, and
//! `idem resolve --step` settles one step. Guards against an operator
//! settlement without a written reason, a step settled on the wrong key or
//! name, evidence printed raw to the terminal, and an in-doubt key whose
//! unsettled calls do not show.

mod common;

use std::ffi::OsString;
use std::path::{Path, PathBuf};

use common::*;
use idempotency::{Begin, EffectStep, Engine, Failure, IdempotencyKey, StepState};
use serde_json::Value;

const SCOPE: &str = "shop:pay";
const BODY: &str = r#"{"amount":10}"#;

fn args(parts: &[&str], db: &Path) -> Vec<OsString> {
    let mut v: Vec<OsString> = vec![parts[0].into(), db.into()];
    v.extend(parts[1..].iter().map(OsString::from));
    v
}

/// A database where `key_name` charged (step "charge" confirmed with
/// `charge_evidence`), reserved "receipt" and then failed in doubt: the
/// key is UNKNOWN, "receipt" is unknown. Returns the path and the charge
/// step's reference.
fn with_steps(dir: &Path, key_name: &str, charge_evidence: &[u8]) -> TestResult<(PathBuf, String)> {
    let path = db_path(dir);
    let engine = engine(&path)?;
    let reference = in_doubt_between_steps(&engine, key_name, charge_evidence)?;
    Ok((path, reference))
}

fn in_doubt_between_steps(
    engine: &Engine,
    key_name: &str,
    charge_evidence: &[u8],
) -> TestResult<String> {
    let claim = claim(engine, &key(SCOPE, key_name)?, fp(BODY)?)?;
    let EffectStep::Run { reference } = claim.effect("charge")? else {
        return Err("a new step must run".into());
    };
    claim.confirm("charge", charge_evidence)?;
    let EffectStep::Run { .. } = claim.effect("receipt")? else {
        return Err("a new step must run".into());
    };
    let reason = "receipt provider timed out".to_string();
    engine.fail(claim, Failure::InDoubt { reason })?;
    Ok(reference)
}

/// The exit code and stderr of a failed run.
fn failure(a: Vec<OsString>) -> TestResult<(Option<i32>, String)> {
    let out = idem(a)?;
    assert!(!out.status.success());
    assert!(out.stdout.is_empty());
    Ok((out.status.code(), String::from_utf8(out.stderr)?))
}

#[test]
fn show_lists_steps_and_history() -> TestResult {
    let dir = tempfile::tempdir()?;
    let (db, reference) = with_steps(dir.path(), "k1", b"ch_42")?;
    let text = idem_ok(args(&["show", SCOPE, "k1"], &db))?;
    let steps = text.find("\nsteps:\n").ok_or(text.clone())?;
    let history = text.find("\nhistory:\n").ok_or(text.clone())?;
    assert!(steps < history, "{text}");
    let charge = text
        .lines()
        .find(|l| l.trim_start().starts_with("charge "))
        .ok_or(text.clone())?;
    for want in [reference.as_str(), "confirmed", "ch_42"] {
        assert!(charge.contains(want), "{want:?} not in {charge:?}");
    }
    let receipt = text
        .lines()
        .find(|l| l.trim_start().starts_with("receipt "))
        .ok_or(text.clone())?;
    assert!(receipt.contains("unknown"), "{receipt}");
    // Who, from -> to, evidence: the claim reserved and confirmed the
    // charge.
    assert!(
        text.lines().any(|l| l.contains("claim #")
            && l.contains("charge: reserved -> confirmed")
            && l.ends_with("ch_42")),
        "{text}"
    );
    assert!(
        text.lines()
            .any(|l| l.contains("receipt: reserved -> unknown")),
        "{text}"
    );
    // A step's first entry: no state before it.
    assert!(
        text.lines().any(|l| l.contains("charge: new -> reserved")),
        "{text}"
    );

    let v: Value = serde_json::from_str(&idem_ok(args(&["show", SCOPE, "k1", "--json"], &db))?)?;
    let steps = v["steps"].as_array().ok_or("no steps")?;
    assert_eq!(steps.len(), 2, "{v}");
    let charge = steps
        .iter()
        .find(|s| s["name"] == "charge")
        .ok_or("no charge")?;
    assert_eq!(charge["reference"], reference.as_str());
    assert_eq!(charge["state"], "confirmed");
    assert_eq!(charge["evidence"]["text"], "ch_42");
    assert!(
        charge["age_ms"].is_u64() && charge["attempts"] == 0,
        "{charge}"
    );
    let history = v["history"].as_array().ok_or("no history")?;
    assert!(
        history.iter().any(|h| h["step"] == "charge"
            && h["from"] == "reserved"
            && h["to"] == "confirmed"
            && h["actor"]["kind"] == "claim"
            && h["evidence"]["text"] == "ch_42"),
        "{v}"
    );
    Ok(())
}

#[test]
fn binary_evidence_is_shown_as_hex_and_long_text_cut() -> TestResult {
    let dir = tempfile::tempdir()?;
    let path = db_path(dir.path());
    let engine = engine(&path)?;
    in_doubt_between_steps(&engine, "bin", &[0x1b, 0x5b, 0x32, 0x4a, 0xff])?;
    let long = "x".repeat(500);
    in_doubt_between_steps(&engine, "long", long.as_bytes())?;
    drop(engine);

    let text = idem_ok(args(&["show", SCOPE, "bin"], &path))?;
    assert!(text.contains("<5 bytes> 1b5b324aff"), "{text}");
    assert!(!text.contains('\u{1b}'), "raw escape reached the terminal");
    let v: Value = serde_json::from_str(&idem_ok(args(&["show", SCOPE, "bin", "--json"], &path))?)?;
    assert!(
        v["steps"]
            .as_array()
            .ok_or("no steps")?
            .iter()
            .any(|s| s["evidence"]["hex"] == "1b5b324aff"),
        "{v}"
    );

    let text = idem_ok(args(&["show", SCOPE, "long"], &path))?;
    assert!(text.contains("… (500 bytes)"), "{text}");
    assert!(!text.contains(&long), "{text}");
    Ok(())
}

#[test]
fn unknown_shows_each_keys_unsettled_steps() -> TestResult {
    let dir = tempfile::tempdir()?;
    let (db, _) = with_steps(dir.path(), "k2", b"ch_1")?;
    let text = idem_ok(args(&["unknown"], &db))?;
    let mut lines = text.lines();
    let header = lines.next().unwrap_or_default();
    assert!(header.contains("UNSETTLED STEPS"), "{text}");
    let row = lines.next().ok_or(text.clone())?;
    assert!(row.contains("receipt (unknown, 0 attempts, "), "{row}");
    // Settled steps are not listed there.
    assert!(!row.contains("charge ("), "{row}");

    let rows: Vec<Value> = serde_json::from_str(&idem_ok(args(&["unknown", "--json"], &db))?)?;
    let steps = rows[0]["steps"].as_array().ok_or("no steps")?;
    assert_eq!(steps.len(), 1, "{rows:?}");
    assert_eq!(steps[0]["name"], "receipt");
    assert_eq!(steps[0]["state"], "unknown");
    assert_eq!(steps[0]["attempts"], 0);
    assert!(steps[0]["age_ms"].is_u64());
    assert_eq!(rows[0]["resumable"], false);
    Ok(())
}

/// A resumed claim that fails retryable before any call of its own keeps
/// the key's record, UNKNOWN and resumable, with the earlier claim's
/// confirmed charge. `show` must show it as such, and what it says must be
/// true: a different request is a mismatch, the same one skips the charge.
/// Charges (confirmed) and fails in doubt; the retry resumes the key and
/// fails retryable before a call of its own.
fn released_to_resume(db: &Path, k: &IdempotencyKey) -> TestResult {
    let engine = engine(db)?;
    let first = claim(&engine, k, fp(BODY)?)?;
    let EffectStep::Run { .. } = first.effect("charge")? else {
        return Err("a new step must run".into());
    };
    first.confirm("charge", b"ch_7")?;
    let reason = "crashed after the charge".to_string();
    engine.fail(first, Failure::InDoubt { reason })?;
    // Every step settled: the retry resumes the key...
    let resumed = claim(&engine, k, fp(BODY)?)?;
    // ... and gives up before any call of its own.
    engine.fail(resumed, Failure::Retryable)?;
    Ok(())
}

#[test]
fn show_a_key_released_to_resume() -> TestResult {
    let dir = tempfile::tempdir()?;
    let db = db_path(dir.path());
    let k = key(SCOPE, "k10")?;
    released_to_resume(&db, &k)?;
    let text = idem_ok(args(&["show", SCOPE, "k10"], &db))?;
    assert!(
        text.contains("UNKNOWN") && text.contains("released to resume"),
        "{text}"
    );
    let charge = text
        .lines()
        .find(|l| l.trim_start().starts_with("charge "))
        .ok_or(text.clone())?;
    assert!(
        charge.contains("confirmed") && charge.contains("ch_7"),
        "{charge}"
    );
    let v: Value = serde_json::from_str(&idem_ok(args(&["show", SCOPE, "k10", "--json"], &db))?)?;
    assert_eq!(v["state"], "UNKNOWN", "{v}");
    assert_eq!(v["steps"][0]["state"], "confirmed", "{v}");

    let engine = engine(&db)?;
    let other = engine.begin(&k, fp(r#"{"amount":99}"#)?)?;
    assert!(matches!(other, Begin::Mismatch), "{other:?}");
    let next = claim(&engine, &k, fp(BODY)?)?;
    let EffectStep::Confirmed { evidence, .. } = next.effect("charge")? else {
        return Err("the next claim must skip the confirmed charge".into());
    };
    assert_eq!(evidence, b"ch_7");
    Ok(())
}

/// A key released to resume is UNKNOWN: `purge` refuses without `--force`
/// (its next claim would call again) and deletes the record, steps and
/// log with it.
#[test]
fn purge_a_key_released_to_resume() -> TestResult {
    let dir = tempfile::tempdir()?;
    let db = db_path(dir.path());
    let k = key(SCOPE, "k11")?;
    released_to_resume(&db, &k)?;
    let err = idem_err(args(&["purge", SCOPE, "k11"], &db))?;
    assert!(err.contains("--force") && err.contains("UNKNOWN"), "{err}");
    let text = idem_ok(args(&["purge", SCOPE, "k11", "--force"], &db))?;
    assert!(text.contains("purged UNKNOWN record"), "{text}");
    let err = idem_err(args(&["show", SCOPE, "k11"], &db))?;
    assert_eq!(err.trim_end(), format!("idem: no record for {k}"), "{err}");
    let engine = engine(&db)?;
    let next = claim(&engine, &k, fp(BODY)?)?;
    assert!(matches!(next.effect("charge")?, EffectStep::Run { .. }));
    Ok(())
}

#[test]
fn unknown_marks_a_key_whose_steps_are_all_settled_resumable() -> TestResult {
    let dir = tempfile::tempdir()?;
    let (db, _) = with_steps(dir.path(), "k9", b"ch_1")?;
    let settle = [
        "resolve",
        SCOPE,
        "k9",
        "--step",
        "receipt",
        "--executed",
        "msg_1",
        "--reason",
        "mailer log shows msg_1",
    ];
    idem_ok(args(&settle, &db))?;
    let text = idem_ok(args(&["unknown"], &db))?;
    let row = text.lines().nth(1).ok_or(text.clone())?;
    assert!(row.contains("none: resumable"), "{text}");
    let rows: Vec<Value> = serde_json::from_str(&idem_ok(args(&["unknown", "--json"], &db))?)?;
    assert_eq!(rows.len(), 1, "{rows:?}");
    assert_eq!(rows[0]["resumable"], true);
    assert_eq!(rows[0]["steps"].as_array().map(Vec::len), Some(0));
    Ok(())
}

#[test]
fn resolve_without_a_reason_is_a_usage_error_and_changes_nothing() -> TestResult {
    let dir = tempfile::tempdir()?;
    let (db, _) = with_steps(dir.path(), "k3", b"ch_1")?;
    let attempts: [&[&str]; 4] = [
        &["resolve", SCOPE, "k3", "--not-executed"],
        &["resolve", SCOPE, "k3", "--not-executed", "--reason", ""],
        &["resolve", SCOPE, "k3", "--not-executed", "--reason", "  "],
        &[
            "resolve",
            SCOPE,
            "k3",
            "--step",
            "receipt",
            "--executed",
            "msg_1",
            "--reason",
            "",
        ],
    ];
    refused_as_usage_and_unchanged(&db, "k3", &attempts, "--reason")
}

/// Each of `attempts` exits 2 with `says` in its error, and `key_name`
/// stays UNKNOWN with no operator entry in its log.
fn refused_as_usage_and_unchanged(
    db: &Path,
    key_name: &str,
    attempts: &[&[&str]],
    says: &str,
) -> TestResult {
    for parts in attempts {
        let (code, stderr) = failure(args(parts, db))?;
        assert_eq!(code, Some(2), "{parts:?}: {stderr}");
        assert!(stderr.contains(says), "{parts:?}: {stderr}");
    }
    let v: Value = serde_json::from_str(&idem_ok(args(&["show", SCOPE, key_name, "--json"], db))?)?;
    assert_eq!(v["state"], "UNKNOWN");
    assert!(
        !v["history"]
            .as_array()
            .ok_or("no history")?
            .iter()
            .any(|h| h["actor"]["kind"] == "operator"),
        "{v}"
    );
    Ok(())
}

#[test]
fn an_overlong_reason_is_a_usage_error_and_changes_nothing() -> TestResult {
    let dir = tempfile::tempdir()?;
    let (db, _) = with_steps(dir.path(), "k5", b"ch_1")?;
    let long = "x".repeat(1025);
    let attempts: [&[&str]; 2] = [
        &["resolve", SCOPE, "k5", "--not-executed", "--reason", &long],
        &[
            "resolve",
            SCOPE,
            "k5",
            "--step",
            "receipt",
            "--executed",
            "msg_1",
            "--reason",
            &long,
        ],
    ];
    refused_as_usage_and_unchanged(&db, "k5", &attempts, "1024 bytes")
}

#[test]
fn step_flags_that_do_not_fit_are_usage_errors() -> TestResult {
    let dir = tempfile::tempdir()?;
    let (db, _) = with_steps(dir.path(), "k4", b"ch_1")?;
    let file = dir.path().join("envelope.json");
    std::fs::write(&file, r#"{"schema_version":1,"status":201,"body":"ok"}"#)?;
    let file = file.to_string_lossy().into_owned();
    let wrong: [&[&str]; 3] = [
        // --executed settles a step: it needs --step.
        &["resolve", SCOPE, "k4", "--executed", "x", "--reason", "r"],
        // A whole envelope is for the key, not for a step.
        &[
            "resolve",
            SCOPE,
            "k4",
            "--step",
            "receipt",
            "--completed",
            &file,
            "--reason",
            "r",
        ],
        // One outcome only.
        &[
            "resolve",
            SCOPE,
            "k4",
            "--step",
            "receipt",
            "--executed",
            "x",
            "--not-executed",
            "--reason",
            "r",
        ],
    ];
    for parts in wrong {
        let (code, stderr) = failure(args(parts, &db))?;
        assert_eq!(code, Some(2), "{parts:?}: {stderr}");
    }
    Ok(())
}

#[test]
fn resolve_step_executed_records_the_operator_reason_and_evidence() -> TestResult {
    let dir = tempfile::tempdir()?;
    let (db, _) = with_steps(dir.path(), "k5", b"ch_1")?;
    let out = idem_ok(args(
        &[
            "resolve",
            SCOPE,
            "k5",
            "--step",
            "receipt",
            "--executed",
            "msg_77",
            "--reason",
            "receipt found in the mail provider's log",
        ],
        &db,
    ))?;
    assert!(
        out.contains("resolved step receipt of") && out.contains("executed"),
        "{out}"
    );

    let engine = engine(&db)?;
    let k = key(SCOPE, "k5")?;
    let receipt = engine
        .steps(&k)?
        .into_iter()
        .find(|s| s.name == "receipt")
        .ok_or("no receipt step")?;
    assert_eq!(receipt.state, StepState::Confirmed);
    assert_eq!(receipt.evidence.as_deref(), Some(&b"msg_77"[..]));
    drop(engine);

    let text = idem_ok(args(&["show", SCOPE, "k5"], &db))?;
    assert!(
        text.lines().any(
            |l| l.contains("operator (receipt found in the mail provider's log)")
                && l.contains("receipt: unknown -> confirmed")
                && l.ends_with("msg_77")
        ),
        "{text}"
    );
    Ok(())
}

#[test]
fn resolve_step_not_executed_lets_the_next_claim_call_under_the_same_reference() -> TestResult {
    let dir = tempfile::tempdir()?;
    let (db, _) = with_steps(dir.path(), "k6", b"ch_1")?;
    let before = {
        let engine = engine(&db)?;
        let steps = engine.steps(&key(SCOPE, "k6")?)?;
        steps
            .into_iter()
            .find(|s| s.name == "receipt")
            .ok_or("no receipt")?
            .reference
    };
    idem_ok(args(
        &[
            "resolve",
            SCOPE,
            "k6",
            "--step",
            "receipt",
            "--not-executed",
            "--reason",
            "no such message at the mail provider",
        ],
        &db,
    ))?;
    let engine = engine(&db)?;
    let claim = claim(&engine, &key(SCOPE, "k6")?, fp(BODY)?)?;
    // The charge is skipped; the receipt runs again, same reference.
    assert!(
        matches!(claim.effect("charge")?, EffectStep::Confirmed { ref evidence, .. } if evidence == b"ch_1"),
        "charge not skipped"
    );
    assert_eq!(
        claim.effect("receipt")?,
        EffectStep::Run { reference: before }
    );
    Ok(())
}

/// Newcomer finding: `--executed` on a step already confirmed printed
/// "resolved" and changed nothing, while the key stayed in doubt on its
/// other step. It now says nothing changed and names the step left; the
/// other answer on a settled step is refused.
#[test]
fn resolve_of_a_settled_step_says_nothing_changed_and_names_the_open_step() -> TestResult {
    let dir = tempfile::tempdir()?;
    let (db, _) = with_steps(dir.path(), "k8", b"ch_1")?;
    let resolve = |answer: &[&str]| {
        let mut parts = vec!["resolve", SCOPE, "k8", "--step", "charge"];
        parts.extend_from_slice(answer);
        parts.extend_from_slice(&["--reason", "checked the provider"]);
        args(&parts, &db)
    };
    let out = idem_ok(resolve(&["--executed", "ch_1"]))?;
    assert!(
        out.contains("step charge of")
            && out.contains("already settled as confirmed; nothing changed"),
        "{out}"
    );
    assert!(
        out.contains("stays in doubt until these steps are settled: receipt (unknown)"),
        "{out}"
    );
    let err = idem_err(resolve(&["--not-executed"]))?;
    assert!(
        err.contains("k8") && err.contains("already settled"),
        "{err}"
    );
    let engine = engine(&db)?;
    let charge = engine
        .steps(&key(SCOPE, "k8")?)?
        .into_iter()
        .find(|s| s.name == "charge")
        .ok_or("no charge step")?;
    assert_eq!(charge.state, StepState::Confirmed);
    assert_eq!(charge.evidence.as_deref(), Some(&b"ch_1"[..]));
    drop(engine);
    // Settling the open step says the key now resumes.
    let out = idem_ok(args(
        &[
            "resolve",
            SCOPE,
            "k8",
            "--step",
            "receipt",
            "--executed",
            "msg_1",
            "--reason",
            "found",
        ],
        &db,
    ))?;
    assert!(
        out.contains("every step of") && out.contains("resumes it"),
        "{out}"
    );
    Ok(())
}

#[test]
fn resolve_of_a_step_the_key_never_had_names_it() -> TestResult {
    let dir = tempfile::tempdir()?;
    let (db, _) = with_steps(dir.path(), "k7", b"ch_1")?;
    let err = idem_err(args(
        &[
            "resolve",
            SCOPE,
            "k7",
            "--step",
            "refund",
            "--not-executed",
            "--reason",
            "checked",
        ],
        &db,
    ))?;
    assert!(err.contains("refund") && err.contains("k7"), "{err}");
    Ok(())
}

#[test]
fn resolve_of_the_whole_key_records_the_reason() -> TestResult {
    let dir = tempfile::tempdir()?;
    let (db, _) = with_steps(dir.path(), "k8", b"ch_1")?;
    let file = dir.path().join("envelope.json");
    std::fs::write(&file, r#"{"schema_version":1,"status":201,"body":"ok"}"#)?;
    let mut a = args(&["resolve", SCOPE, "k8", "--completed"], &db);
    a.push(file.into());
    a.extend(["--reason".into(), "ticket OPS-12: both calls found".into()]);
    idem_ok(a)?;
    let v: Value = serde_json::from_str(&idem_ok(args(&["show", SCOPE, "k8", "--json"], &db))?)?;
    assert_eq!(v["state"], "COMPLETED");
    assert!(
        v["history"]
            .as_array()
            .ok_or("no history")?
            .iter()
            .any(|h| {
                h["step"].is_null()
                    && h["actor"]["kind"] == "operator"
                    && h["actor"]["reason"] == "ticket OPS-12: both calls found"
            }),
        "{v}"
    );
    Ok(())
}
