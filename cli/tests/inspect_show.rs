//! `idem inspect` and `idem show` on a database written by the library:
//! guards against listings that ignore the state or scope filter, a binary
//! body dumped raw to the terminal, and `--json` output that does not parse.

mod common;

use common::*;
use idempotency::{Envelope, Failure};
use serde_json::Value;

/// Builds a database with two COMPLETED records (one UTF-8 body, one
/// binary), one PROCESSING and one UNKNOWN, and closes it.
fn populated(dir: &std::path::Path) -> TestResult<std::path::PathBuf> {
    let path = db_path(dir);
    let engine = engine(&path)?;
    let text = claim(&engine, &key("shop:pay", "a-text")?, fp(r#"{"n":1}"#)?)?;
    let env = Envelope::new(1, 201, r#"{"payment":"p_1"}"#)
        .with_header("content-type", "application/json");
    engine.complete(text, env)?;
    let binary = claim(&engine, &key("shop:pay", "b-binary")?, fp(r#"{"n":2}"#)?)?;
    let bytes: Vec<u8> = (0..40u8).map(|i| 0xc0 ^ i).collect();
    engine.complete(binary, Envelope::new(1, 200, bytes))?;
    let unknown = claim(
        &engine,
        &key("shop:refund", "d-unknown")?,
        fp(r#"{"n":4}"#)?,
    )?;
    let reason = "provider timed out".to_string();
    engine.fail(unknown, Failure::InDoubt { reason })?;
    let running = claim(&engine, &key("shop:pay", "c-running")?, fp(r#"{"n":3}"#)?)?;
    // Closing the engine while the claim lives leaves the record PROCESSING
    // (the claim's drop cannot reach a closed engine).
    drop(engine);
    drop(running);
    Ok(path)
}

#[test]
fn inspect_lists_every_record_and_filters_by_state_and_scope() -> TestResult {
    let dir = tempfile::tempdir()?;
    let db = populated(dir.path())?;
    let all = idem_ok(["inspect".as_ref(), db.as_os_str()])?;
    let lines: Vec<&str> = all.lines().collect();
    assert_eq!(lines.len(), 5, "{all}");
    assert!(lines[0].starts_with("SCOPE"), "{all}");
    for (key, state, status) in [
        ("a-text", "COMPLETED", "201"),
        ("b-binary", "COMPLETED", "200"),
        ("c-running", "PROCESSING", "-"),
        ("d-unknown", "UNKNOWN", "-"),
    ] {
        let line = lines.iter().find(|l| l.contains(key)).ok_or(key)?;
        assert!(line.contains(state), "{line}");
        assert!(line.trim_end().ends_with(status), "{line}");
    }
    let a = fp(r#"{"n":1}"#)?.to_hex();
    assert!(all.contains(&a[..12]) && !all.contains(&a[..13]), "{all}");

    let completed = idem_ok([
        "inspect".as_ref(),
        db.as_os_str(),
        "--state".as_ref(),
        "completed".as_ref(),
    ])?;
    assert_eq!(completed.lines().count(), 3, "{completed}");
    assert!(
        !completed.contains("UNKNOWN") && !completed.contains("PROCESSING"),
        "{completed}"
    );

    let refunds = idem_ok([
        "inspect".as_ref(),
        db.as_os_str(),
        "--scope".as_ref(),
        "shop:refund".as_ref(),
    ])?;
    assert_eq!(refunds.lines().count(), 2, "{refunds}");
    assert!(refunds.contains("d-unknown"), "{refunds}");

    let limited = idem_ok([
        "inspect".as_ref(),
        db.as_os_str(),
        "--limit".as_ref(),
        "1".as_ref(),
    ])?;
    assert_eq!(limited.lines().count(), 2, "{limited}");
    Ok(())
}

#[test]
fn inspect_json_is_one_array_of_objects() -> TestResult {
    let dir = tempfile::tempdir()?;
    let db = populated(dir.path())?;
    let out = idem_ok([
        "inspect".as_ref(),
        db.as_os_str(),
        "--json".as_ref(),
        "--state".as_ref(),
        "UNKNOWN".as_ref(),
    ])?;
    let rows: Vec<Value> = serde_json::from_str(&out)?;
    assert_eq!(rows.len(), 1, "{out}");
    assert_eq!(rows[0]["scope"], "shop:refund");
    assert_eq!(rows[0]["key"], "d-unknown");
    assert_eq!(rows[0]["state"], "UNKNOWN");
    assert_eq!(rows[0]["status"], Value::Null);
    assert_eq!(rows[0]["fingerprint"], fp(r#"{"n":4}"#)?.to_hex());

    let out = idem_ok(["inspect".as_ref(), db.as_os_str(), "--json".as_ref()])?;
    let rows: Vec<Value> = serde_json::from_str(&out)?;
    assert_eq!(rows.len(), 4);
    assert!(rows
        .iter()
        .all(|r| r["age_ms"].is_u64() && r["state"].is_string()));
    Ok(())
}

#[test]
fn inspect_of_an_empty_database_says_so() -> TestResult {
    let dir = tempfile::tempdir()?;
    let db = db_path(dir.path());
    drop(engine(&db)?);
    assert_eq!(
        idem_ok(["inspect".as_ref(), db.as_os_str()])?,
        "no records\n"
    );
    let out = idem_ok(["inspect".as_ref(), db.as_os_str(), "--json".as_ref()])?;
    assert_eq!(
        serde_json::from_str::<Value>(&out)?,
        Value::Array(Vec::new())
    );
    Ok(())
}

#[test]
fn show_prints_a_utf8_body_as_text() -> TestResult {
    let dir = tempfile::tempdir()?;
    let db = populated(dir.path())?;
    let out = idem_ok([
        "show".as_ref(),
        db.as_os_str(),
        "shop:pay".as_ref(),
        "a-text".as_ref(),
    ])?;
    for want in [
        "state:         COMPLETED",
        &format!("fingerprint:   {} (algorithm v", fp(r#"{"n":1}"#)?.to_hex()),
        "status:      201",
        "content-type: application/json",
        r#"body:        {"payment":"p_1"}"#,
        "lease until:   -",
    ] {
        assert!(out.contains(want), "missing {want:?} in\n{out}");
    }
    Ok(())
}

#[test]
fn show_prints_a_binary_body_as_size_and_hex_prefix() -> TestResult {
    let dir = tempfile::tempdir()?;
    let db = populated(dir.path())?;
    let out = idem_ok([
        "show".as_ref(),
        db.as_os_str(),
        "shop:pay".as_ref(),
        "b-binary".as_ref(),
    ])?;
    let bytes: Vec<u8> = (0..32u8).map(|i| 0xc0 ^ i).collect();
    let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    assert!(
        out.contains(&format!("body:        <40 bytes> {hex}…")),
        "{out}"
    );
    Ok(())
}

#[test]
fn show_json_has_every_field_and_an_envelope_resolve_accepts() -> TestResult {
    let dir = tempfile::tempdir()?;
    let db = populated(dir.path())?;
    let args = |k: &str| -> Vec<std::ffi::OsString> {
        vec![
            "show".into(),
            db.clone().into(),
            "shop:pay".into(),
            k.into(),
            "--json".into(),
        ]
    };
    let v: Value = serde_json::from_str(&idem_ok(args("a-text"))?)?;
    for field in [
        "scope",
        "key",
        "state",
        "fingerprint",
        "fingerprint_version",
        "fencing_token",
        "reference",
        "claimed_at_ms",
        "updated_at_ms",
        "lease_until_ms",
        "expires_at_ms",
        "unknown_since_ms",
        "attempts",
        "reason",
        "was_in_doubt",
        "resource",
        "response",
    ] {
        assert!(v.get(field).is_some(), "missing {field} in {v}");
    }
    assert_eq!(v["response"]["body"], r#"{"payment":"p_1"}"#);
    assert_eq!(v["response"]["headers"][0][1], "application/json");
    let v: Value = serde_json::from_str(&idem_ok(args("b-binary"))?)?;
    assert_eq!(v["response"]["body_bytes"], 40);
    assert!(v["response"]["body_base64"].is_string(), "{v}");
    let v: Value = serde_json::from_str(&idem_ok(args("c-running"))?)?;
    assert_eq!(v["state"], "PROCESSING");
    assert!(
        v["lease_until_ms"].is_u64() && v["response"].is_null(),
        "{v}"
    );
    Ok(())
}

#[test]
fn show_of_a_missing_record_is_one_error_line() -> TestResult {
    let dir = tempfile::tempdir()?;
    let db = populated(dir.path())?;
    let err = idem_err([
        "show".as_ref(),
        db.as_os_str(),
        "shop:pay".as_ref(),
        "nope".as_ref(),
    ])?;
    assert_eq!(err, "idem: no record for shop:pay/nope");
    Ok(())
}

#[test]
fn stats_counts_records_by_state() -> TestResult {
    let dir = tempfile::tempdir()?;
    let db = populated(dir.path())?;
    let v: Value = serde_json::from_str(&idem_ok([
        "stats".as_ref(),
        db.as_os_str(),
        "--json".as_ref(),
    ])?)?;
    assert_eq!(v["completed"], 2);
    assert_eq!(v["processing"], 1);
    assert_eq!(v["unknown"], 1);
    assert_eq!(v["corrupt"], 0);
    assert!(v["longest_in_doubt_ms"].is_u64(), "{v}");
    let text = idem_ok(["stats".as_ref(), db.as_os_str()])?;
    assert!(text.contains("COMPLETED      2"), "{text}");
    Ok(())
}
