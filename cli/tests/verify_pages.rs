//! Guards against `idem verify` calling a file sound that the server's
//! writable open refuses (issue 28, point 1). A byte of one record's body
//! is flipped on a page of a file of many pages; `idem verify` must exit 1,
//! name the damaged page and the keys on it, say that the open refuses
//! the file and point to `idem salvage`, and `--json` must carry the same
//! (`open_refuses`, `keys_in_doubt`). `idem sweep` (a writable open)
//! refuses the file with an error that names the page and the keys and
//! points to both commands.

mod common;

use common::*;
use idempotency::Envelope;
use serde_json::Value;

#[test]
fn verify_names_the_damaged_page_and_its_keys() -> TestResult {
    let dir = tempfile::tempdir()?;
    let db = db_path(dir.path());
    {
        let engine = engine(&db)?;
        for i in 0..300 {
            let c = claim(&engine, &key("shop", &format!("order-{i:04}"))?, fp("{}")?)?;
            let body = format!("charge ch_{i:04} {}", "x".repeat(150));
            engine.complete(c, Envelope::new(1, 201, body))?;
        }
    }
    let mut bytes = std::fs::read(&db)?;
    let needle = b"charge ch_0123 ";
    let at = bytes
        .windows(needle.len())
        .position(|w| w == needle)
        .ok_or("the body of order-0123 is not in the file")?;
    bytes[at + 3] ^= 0x20;
    std::fs::write(&db, &bytes)?;

    let out = idem(["verify".as_ref(), db.as_os_str()])?;
    let stdout = String::from_utf8(out.stdout)?;
    let stderr = String::from_utf8(out.stderr)?;
    assert_eq!(out.status.code(), Some(1), "{stdout}\n{stderr}");
    assert!(stdout.contains("redb's page check fails"), "{stdout}");
    assert!(stdout.contains("first failing page: bytes "), "{stdout}");
    let on_page = stdout
        .lines()
        .find(|l| l.starts_with("records entries on the damaged page"))
        .ok_or_else(|| format!("no keys named: {stdout}"))?;
    assert!(on_page.contains("shop/order-0123"), "{on_page}");
    assert!(
        !on_page.contains("shop/order-0000,"),
        "not narrowed: {on_page}"
    );
    assert!(stderr.contains("a writable open refuses it"), "{stderr}");
    assert!(stderr.contains("idem salvage"), "{stderr}");

    let out = idem(["verify".as_ref(), db.as_os_str(), "--json".as_ref()])?;
    assert_eq!(out.status.code(), Some(1));
    let report: Value = serde_json::from_slice(&out.stdout)?;
    assert_eq!(report["sound"], Value::Bool(false));
    assert_eq!(report["open_refuses"], Value::Bool(true));
    let in_doubt: Vec<&str> = report["keys_in_doubt"]
        .as_array()
        .ok_or("no keys_in_doubt")?
        .iter()
        .filter_map(Value::as_str)
        .collect();
    assert!(in_doubt.contains(&"shop/order-0123"), "{in_doubt:?}");
    assert!(in_doubt.len() < 100, "not narrowed: {in_doubt:?}");

    // A writable open refuses it, naming what verify names.
    let line = idem_err(["sweep".as_ref(), db.as_os_str()])?;
    for part in [
        "corrupt",
        "first failing page",
        "records: ",
        " keys, shop/order-01",
        "idem verify",
        "idem salvage",
    ] {
        assert!(line.contains(part), "{part:?} missing: {line}");
    }
    Ok(())
}
