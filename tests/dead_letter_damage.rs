//! Guards against a damaged dead letter on redb being listed as if sound,
//! redriven with altered bytes, or missed by `verify`: a stored dead letter
//! whose bytes changed (rewritten through redb itself, so the page checksums
//! still pass and only the value's own checksum can tell) must be reported
//! by `verify` as dead letter #seq, refused by `dead_letters` and `redrive`
//! with `Error::Corrupt` naming it, and stay in the list.

use idempotency::{Corrupted, Damage, Delivery, Engine, Error};
use redb::{ReadableDatabase, ReadableTable};

type TestResult = Result<(), Box<dyn std::error::Error + Send + Sync>>;

const DEAD_LETTERS: redb::TableDefinition<u64, &[u8]> =
    redb::TableDefinition::new("idempotency.dead_letters");

#[test]
fn a_damaged_dead_letter_is_reported_and_never_redriven() -> TestResult {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("idem.redb");
    let seq = {
        let engine = Engine::builder().sweep_interval(None).open(&path)?;
        let delivery = Delivery {
            message_id: "m-1",
            topic: "payment.succeeded",
            payload: b"{\"amount\":500}",
            attempt: 0,
        };
        engine.inbox("ledger")?.reject(&delivery, "unparsable")?
    };
    {
        let db = redb::Database::open(&path)?;
        let txn = db.begin_write()?;
        {
            let mut table = txn.open_table(DEAD_LETTERS)?;
            let mut value = table
                .get(seq)?
                .ok_or("no stored dead letter")?
                .value()
                .to_vec();
            // "500" becomes "900": a plausible letter with the wrong payload.
            let at = value
                .windows(3)
                .position(|w| w == b"500")
                .ok_or("payload not found in the value")?;
            value[at] = b'9';
            table.insert(seq, value.as_slice())?;
        }
        txn.commit()?;
    }
    let engine = Engine::builder().sweep_interval(None).open(&path)?;
    let report = engine.verify()?;
    assert!(
        report
            .damage
            .iter()
            .any(|d| matches!(d, Damage::UndecodableDeadLetter { seq: s, .. } if *s == seq)),
        "verify missed it: {report:?}"
    );
    let corrupt = |e: Error| match e {
        Error::Corrupt {
            what: Corrupted::DeadLetter(s),
            ..
        } => s == seq,
        _ => false,
    };
    let listed = engine
        .dead_letters(10)
        .err()
        .ok_or("a damaged letter was listed")?;
    assert!(corrupt(listed), "wrong error");
    let redriven = engine
        .redrive(seq)
        .err()
        .ok_or("a damaged letter was redriven")?;
    assert!(corrupt(redriven), "wrong error");
    assert!(
        engine.outbox().is_empty()?,
        "the redrive wrote to the outbox"
    );
    drop(engine);
    let db = redb::Database::open(&path)?;
    let txn = db.begin_read()?;
    assert!(
        txn.open_table(DEAD_LETTERS)?.get(seq)?.is_some(),
        "the damaged letter left the list"
    );
    Ok(())
}
