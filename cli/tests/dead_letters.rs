//! `idem dead-letters` and `idem redrive`: guards against a dead letter an
//! operator cannot see (a bad message id printed raw, with its control
//! characters, or not at all) or cannot move back (a redrive that leaves
//! it listed, or moves it twice).

mod common;

use common::*;
use idempotency::{Delivery, Engine};

#[test]
fn lists_and_redrives_dead_letters() -> TestResult {
    let dir = tempfile::tempdir()?;
    let db = db_path(dir.path());
    {
        let engine = Engine::builder().sweep_interval(None).open(&db)?;
        let inbox = engine.inbox("ledger")?;
        for (id, reason) in [("", "no message id"), ("m\n1", "control characters")] {
            let delivery = Delivery {
                message_id: id,
                topic: "payment.succeeded",
                payload: b"{}",
                attempt: 0,
            };
            inbox.reject(&delivery, reason)?;
        }
    }
    let out = idem_ok(["dead-letters".as_ref(), db.as_os_str()])?;
    assert!(
        out.contains("SEQ") && out.contains("(none)") && out.contains("no message id"),
        "{out}"
    );
    assert!(
        out.contains("m\\n1"),
        "the control character is not escaped: {out}"
    );
    let json = idem_ok(["dead-letters".as_ref(), db.as_os_str(), "--json".as_ref()])?;
    let rows: serde_json::Value = serde_json::from_str(&json)?;
    let rows = rows.as_array().ok_or("not an array")?;
    assert_eq!(rows.len(), 2);
    assert_eq!(rows[1]["message_id"], "m\n1");
    let seq = rows[0]["seq"].as_u64().ok_or("no seq")?.to_string();

    let out = idem_ok(["redrive".as_ref(), db.as_os_str(), seq.as_ref()])?;
    assert!(
        out.contains("is in the outbox as message dead-letter~redrive"),
        "{out}"
    );
    let err = idem_err(["redrive".as_ref(), db.as_os_str(), seq.as_ref()])?;
    assert!(err.contains("no dead letter #"), "{err}");
    let json = idem_ok(["dead-letters".as_ref(), db.as_os_str(), "--json".as_ref()])?;
    let rows: serde_json::Value = serde_json::from_str(&json)?;
    assert_eq!(rows.as_array().map(Vec::len), Some(1));
    let engine = Engine::builder().sweep_interval(None).open(&db)?;
    assert_eq!(engine.outbox().len()?, 1);
    Ok(())
}
