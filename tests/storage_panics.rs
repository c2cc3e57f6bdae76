//! Guards against a panic inside the storage library escaping the engine.
//! A corrupt file can make redb panic (an `unwrap` on bytes it trusted)
//! instead of returning an error. The engine contains such panics at its
//! boundary: opening returns `OpenError::Corrupt`, a read returns a storage
//! error (and other keys keep working), and a panic during a write poisons
//! the engine without any caller being told its write succeeded. The
//! panics here are injected through a `StorageBackend` whose reads or
//! writes panic on command.

#[path = "common/storage_faults.rs"]
mod storage_faults;

use std::error::Error;

use idempotency::{Begin, Corrupted, Engine, Envelope, Fingerprint, IdempotencyKey, OpenError};
use storage_faults::FailingBackend;

type TestResult = Result<(), Box<dyn Error>>;

fn key(k: &str) -> Result<IdempotencyKey, idempotency::Error> {
    IdempotencyKey::new("shop:pay", k)
}

fn fp() -> Result<Fingerprint, idempotency::FingerprintError> {
    Fingerprint::of_json(br#"{"amount":1}"#, &[])
}

fn open(backend: FailingBackend) -> Result<Engine, OpenError> {
    Engine::builder()
        .sweep_interval(None)
        .open_with_backend(backend)
}

fn complete(engine: &Engine, k: &str) -> TestResult {
    match engine.begin(&key(k)?, fp()?)? {
        Begin::Claimed(claim) => Ok(engine.complete(claim, Envelope::new(1, 201, k))?),
        other => Err(format!("{k}: expected a claim, got {other:?}").into()),
    }
}

#[test]
fn a_panic_while_opening_is_a_corrupt_file_error() -> TestResult {
    let backend = FailingBackend::new();
    drop(open(backend.clone())?);
    backend.faults().panic_on_read(true);
    let err = open(backend.clone())
        .err()
        .ok_or("opened although reads panic")?;
    assert!(
        matches!(
            err,
            OpenError::Corrupt {
                what: Corrupted::File,
                ..
            }
        ),
        "{err:?}"
    );
    assert!(err.to_string().contains("corrupt"), "{err}");
    backend.faults().panic_on_read(false);
    let engine = open(backend)?;
    complete(&engine, "after")?;
    Ok(())
}

#[test]
fn a_panic_during_a_write_poisons_and_acknowledges_nothing() -> TestResult {
    let backend = FailingBackend::new();
    let engine = open(backend.clone())?;
    complete(&engine, "before")?;
    backend.faults().panic_on_write(true);
    let answer = engine.begin(&key("during")?, fp()?);
    assert!(
        matches!(answer, Err(idempotency::Error::Poisoned { .. })),
        "a claim whose commit panicked: {answer:?}"
    );
    backend.faults().panic_on_write(false);
    // Sticky: no more writes on this engine; replays (reads) still work.
    let later = engine.begin(&key("later")?, fp()?);
    assert!(
        matches!(later, Err(idempotency::Error::Poisoned { .. })),
        "{later:?}"
    );
    assert!(matches!(
        engine.begin(&key("before")?, fp()?)?,
        Begin::Replay(_)
    ));
    drop(engine);
    // Reopened: the claim that panicked never committed; writes work.
    let engine = open(backend)?;
    assert!(engine.record(&key("during")?)?.is_none());
    complete(&engine, "during")?;
    Ok(())
}
