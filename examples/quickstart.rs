//! An app using the engine directly: a `transfer` command that must run at
//! most once per idempotency key, whatever the client retries.
//!
//! Run: `cargo run --release --example quickstart`

use std::sync::atomic::{AtomicU32, Ordering};

use idempotency::{Begin, Engine, Envelope, Failure, Fingerprint, IdempotencyKey};
use serde::Serialize;

/// The business fields of the request, after defaults are applied. This is
/// what gets fingerprinted: not the raw JSON bytes.
#[derive(Serialize, Clone, Copy)]
struct Transfer<'a> {
    from: &'a str,
    to: &'a str,
    amount_cents: u64,
    currency: &'a str,
}

static EXECUTED: AtomicU32 = AtomicU32::new(0);

/// Handles one (possibly repeated) request; returns (status, body).
fn transfer(
    engine: &Engine,
    tenant: &str,
    key: &str,
    cmd: &Transfer<'_>,
) -> Result<(u16, String), Box<dyn std::error::Error>> {
    let key = IdempotencyKey::new(format!("{tenant}:transfer"), key)?;
    let fingerprint = Fingerprint::of_serialize(cmd)?;
    Ok(match engine.begin(&key, fingerprint)? {
        Begin::Claimed(claim) => {
            if cmd.amount_cents > 100_000 {
                let body = r#"{"error":"insufficient funds"}"#;
                engine.fail(claim, Failure::Final(Envelope::new(1, 402, body)))?;
                return Ok((402, body.into()));
            }
            // The side effect runs here, exactly once per key. A real app
            // passes claim.reference() to its payment provider.
            EXECUTED.fetch_add(1, Ordering::SeqCst);
            let body = format!(r#"{{"transfer":"{}","status":"done"}}"#, claim.reference());
            let envelope =
                Envelope::new(1, 201, body.clone()).with_header("content-type", "application/json");
            engine.complete(claim, envelope)?;
            (201, body)
        }
        Begin::Replay(replay) => (
            replay.envelope.status,
            String::from_utf8_lossy(&replay.envelope.body).into_owned(),
        ),
        Begin::Processing { retry_after } => {
            (409, format!("in progress, retry after {retry_after:?}"))
        }
        Begin::Mismatch => (
            409,
            "idempotency key reused with a different request".into(),
        ),
        Begin::InDoubt(in_doubt) => (503, format!("outcome unknown ({})", in_doubt.reference)),
        Begin::Tombstoned { .. } => (409, "idempotency key expired".into()),
    })
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = tempfile::tempdir()?;
    let engine = Engine::builder().open(dir.path().join("quickstart.redb"))?;
    let cmd = Transfer {
        from: "acct-1",
        to: "acct-2",
        amount_cents: 2_500,
        currency: "EUR",
    };
    let tampered = Transfer {
        amount_cents: 250_000,
        ..cmd
    };
    for (label, c) in [("first", &cmd), ("retry", &cmd), ("tampered", &tampered)] {
        let (status, body) = transfer(&engine, "tenant-1", "key-123", c)?;
        println!("{label:>9}: {status} {body}");
    }
    let (status, body) = transfer(&engine, "tenant-1", "key-456", &tampered)?;
    println!("{:>9}: {status} {body}", "too big");
    let (status, body) = transfer(&engine, "tenant-1", "key-456", &tampered)?;
    println!("{:>9}: {status} {body}", "retried");
    println!("transfers executed: {}", EXECUTED.load(Ordering::SeqCst));
    assert_eq!(EXECUTED.load(Ordering::SeqCst), 1);
    Ok(())
}
