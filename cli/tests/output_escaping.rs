//! Text the app stored (a reason, a header) or a client chose (a key) is
//! shown on one line: a newline in it cannot add a row to `idem unknown`
//! or a field to `idem show`, and a bidirectional override cannot reorder
//! what the operator reads.

mod common;

use common::*;
use idempotency::{Envelope, Failure};

#[test]
fn stored_text_cannot_forge_rows_or_fields() -> TestResult {
    let dir = tempfile::tempdir()?;
    let db = db_path(dir.path());
    let engine = engine(&db)?;
    let forged = "timeout\nshop:pay  forged  idem_9_000000000000  0  1s  1s  fake";
    let c = claim(&engine, &key("shop:pay", "k\u{202e}1")?, fp("{}")?)?;
    engine.fail(
        c,
        Failure::InDoubt {
            reason: forged.into(),
        },
    )?;
    let c = claim(&engine, &key("shop:pay", "hdr")?, fp("{}")?)?;
    engine.complete(
        c,
        Envelope::new(1, 200, "line 1\nline 2").with_header("x-a\nstate", b"v\nCOMPLETED".to_vec()),
    )?;
    drop(engine);

    let unknown = idem_ok(["unknown".as_ref(), db.as_os_str()])?;
    assert_eq!(unknown.lines().count(), 2, "header and one row:\n{unknown}");
    assert!(unknown.contains("timeout\\nshop:pay"), "{unknown}");
    assert!(!unknown.contains('\u{202e}'), "{unknown}");
    assert!(unknown.contains("k\\u{202e}1"), "{unknown}");

    let show = idem_ok([
        "show".as_ref(),
        db.as_os_str(),
        "shop:pay".as_ref(),
        "k\u{202e}1".as_ref(),
    ])?;
    let reason: Vec<&str> = show.lines().filter(|l| l.contains("timeout")).collect();
    assert_eq!(reason.len(), 1, "{show}");
    assert!(
        reason[0].starts_with("reason:") && reason[0].contains("\\n"),
        "{show}"
    );

    let show = idem_ok([
        "show".as_ref(),
        db.as_os_str(),
        "shop:pay".as_ref(),
        "hdr".as_ref(),
    ])?;
    assert!(show.contains("    x-a\\nstate: v\\nCOMPLETED\n"), "{show}");
    // A body is shown as text, its newlines kept.
    assert!(show.contains("line 1\nline 2"), "{show}");
    Ok(())
}
