//! Guards against losing or altering a stored response across a restart, and
//! against the engine damaging a file it should not touch: a replay after
//! reopening must return the byte-identical envelope; the app's upcasters must
//! run (or the replay must say it is not current); and a file that is not a
//! database, a missing file, or a database written by an unknown format
//! version must be refused with its own error and without a byte written.

mod common;

use std::error::Error;
use std::path::Path;

use common::{claimed, replay};
use idempotency::{Engine, Envelope, Fingerprint, IdempotencyKey, ReplayKind};
use redb::{ReadableDatabase, TableDefinition, TableHandle};

type TestResult = Result<(), Box<dyn Error>>;

fn key(k: &str) -> Result<IdempotencyKey, idempotency::Error> {
    IdempotencyKey::new("tenant-1:create_payment", k)
}

fn fp() -> Result<Fingerprint, idempotency::FingerprintError> {
    Fingerprint::of_json(br#"{"amount": 10, "currency": "EUR"}"#, &[])
}

/// Compares file contents without printing kilobytes on failure.
fn assert_same_bytes(now: &[u8], before: &[u8], what: &str) {
    let first_diff = now.iter().zip(before).position(|(a, b)| a != b);
    assert!(
        now.len() == before.len() && first_diff.is_none(),
        "{what} was written to: {} bytes now, {} before, first difference at byte {first_diff:?}",
        now.len(),
        before.len()
    );
}

fn stored_v1(path: &Path) -> Result<(Envelope, String), Box<dyn Error>> {
    let engine = Engine::builder().sweep_interval(None).open(path)?;
    let claim = claimed(engine.begin(&key("pay-1")?, fp()?)?)?;
    let reference = claim.reference().to_string();
    // Binary body with every byte value, non-UTF-8 header value.
    let body: Vec<u8> = (0..=255u8).chain(0..=255u8).collect();
    let envelope = Envelope::new(1, 201, body)
        .with_header("content-type", "application/octet-stream")
        .with_header("x-raw", vec![0xff, 0x00, 0x80])
        .with_header("X-Dup", "a")
        .with_header("x-dup", "b");
    engine.complete_with_resource(claim, envelope.clone(), "pay_123")?;
    Ok((envelope, reference))
}

#[test]
fn replay_after_reopen_is_byte_identical() -> TestResult {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("idem.redb");
    let (envelope, reference) = stored_v1(&path)?;

    for _ in 0..3 {
        let engine = Engine::builder()
            .sweep_interval(None)
            .open_existing(&path)?;
        let r = replay(engine.begin(&key("pay-1")?, fp()?)?)?;
        assert_eq!(r.envelope, envelope);
        assert_eq!(r.envelope.body, envelope.body);
        assert_eq!(
            r.envelope.headers, envelope.headers,
            "header order and bytes"
        );
        assert_eq!(r.envelope.schema_version, 1);
        assert_eq!(r.stored_schema_version, 1);
        assert!(r.is_current);
        assert_eq!(r.resource.as_deref(), Some("pay_123"));
        assert_eq!(r.kind, ReplayKind::Completed);
        assert_eq!(r.reference, reference);
        // Another key still claims after the reopen, with a larger token:
        // the fencing-token counter survives the restart.
        let newest = engine
            .records(&idempotency::RecordFilter::default())?
            .into_iter()
            .map(|r| r.map(|r| r.fencing_token))
            .collect::<Result<Vec<_>, _>>()?
            .into_iter()
            .max()
            .ok_or("no records")?;
        let k2 = key(&format!("other-{newest}"))?;
        let c = claimed(engine.begin(&k2, fp()?)?)?;
        assert!(
            c.fencing_token() > newest,
            "token {} reused",
            c.fencing_token()
        );
        engine.complete(c, Envelope::new(1, 200, "x"))?;
    }
    Ok(())
}

#[test]
fn second_open_of_the_same_file_is_already_open() -> TestResult {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("idem.redb");
    let first = Engine::builder().sweep_interval(None).open(&path)?;
    for _ in 0..2 {
        let err = Engine::builder()
            .sweep_interval(None)
            .open(&path)
            .err()
            .ok_or("opened twice")?;
        assert!(
            matches!(err, idempotency::OpenError::AlreadyOpen { .. }),
            "{err:?}"
        );
    }
    // The first handle is unaffected.
    let c = claimed(first.begin(&key("still-open")?, fp()?)?)?;
    first.complete(c, Envelope::new(1, 200, "ok"))?;
    drop(first);
    let again = Engine::builder()
        .sweep_interval(None)
        .open_existing(&path)?;
    let r = replay(again.begin(&key("still-open")?, fp()?)?)?;
    assert_eq!(r.envelope.body, b"ok");
    Ok(())
}

#[test]
fn upcaster_runs_on_replay_after_upgrade() -> TestResult {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("idem.redb");
    let (envelope, _) = stored_v1(&path)?;

    // Upgraded app: schema 2, with an upcaster from 1.
    {
        let engine = Engine::builder()
            .sweep_interval(None)
            .response_schema_version(2)
            .upcaster(1, |mut e: Envelope| {
                e.schema_version = 2;
                e.headers.push(("x-upcast".into(), b"1->2".to_vec()));
                Ok(e)
            })
            .open_existing(&path)?;
        let r = replay(engine.begin(&key("pay-1")?, fp()?)?)?;
        assert!(r.is_current);
        assert_eq!(r.stored_schema_version, 1);
        assert_eq!(r.envelope.schema_version, 2);
        assert_eq!(r.envelope.header("x-upcast"), Some(&b"1->2"[..]));
        assert_eq!(r.envelope.body, envelope.body);
        // The stored record itself is untouched by upcasting.
        let info = engine.record(&key("pay-1")?)?.ok_or("record missing")?;
        assert_eq!(info.response.as_ref(), Some(&envelope));
    }
    // Upgraded app without an upcaster: the replay says it is old.
    {
        let engine = Engine::builder()
            .sweep_interval(None)
            .response_schema_version(2)
            .open_existing(&path)?;
        let r = replay(engine.begin(&key("pay-1")?, fp()?)?)?;
        assert!(!r.is_current);
        assert_eq!(r.stored_schema_version, 1);
        assert_eq!(r.envelope, envelope);
    }
    // An upcaster that refuses is an error naming the key and version.
    {
        let engine = Engine::builder()
            .sweep_interval(None)
            .response_schema_version(2)
            .upcaster(1, |_| Err("cannot convert".to_string()))
            .open_existing(&path)?;
        let err = engine
            .begin(&key("pay-1")?, fp()?)
            .err()
            .ok_or("expected Upcast")?;
        assert!(
            matches!(&err, idempotency::Error::Upcast { from: 1, reason, .. } if reason == "cannot convert"),
            "{err:?}"
        );
    }
    Ok(())
}

#[test]
fn garbage_file_is_not_a_database_and_untouched() -> TestResult {
    let dir = tempfile::tempdir()?;
    for (name, bytes) in [
        ("small.redb", b"hello, not a database\n".to_vec()),
        (
            "large.redb",
            (0..64 * 1024u32)
                .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
                .collect(),
        ),
    ] {
        let path = dir.path().join(name);
        std::fs::write(&path, &bytes)?;
        let err = Engine::builder()
            .sweep_interval(None)
            .open(&path)
            .err()
            .ok_or("opened garbage")?;
        assert!(
            matches!(err, idempotency::OpenError::NotADatabase { .. }),
            "{name}: {err:?}"
        );
        assert!(
            err.to_string().contains(name),
            "error names the file: {err}"
        );
        assert!(err.source().is_some(), "NotADatabase has a source");
        let err = Engine::builder()
            .sweep_interval(None)
            .open_existing(&path)
            .err()
            .ok_or("opened garbage")?;
        assert!(
            matches!(err, idempotency::OpenError::NotADatabase { .. }),
            "{name}: {err:?}"
        );
        assert_same_bytes(&std::fs::read(&path)?, &bytes, name);
    }
    Ok(())
}

#[test]
fn open_existing_on_missing_path() -> TestResult {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("missing.redb");
    let err = Engine::builder()
        .open_existing(&path)
        .err()
        .ok_or("opened a missing file")?;
    assert!(
        matches!(err, idempotency::OpenError::MissingDatabase { .. }),
        "{err:?}"
    );
    assert!(!path.exists(), "open_existing created the file");
    Ok(())
}

#[test]
fn unknown_format_version_is_refused_without_writing() -> TestResult {
    const META: TableDefinition<&str, &[u8]> = TableDefinition::new("idempotency.meta");
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("future.redb");
    {
        let db = redb::Database::create(&path)?;
        let txn = db.begin_write()?;
        {
            let mut meta = txn.open_table(META)?;
            meta.insert("format_version", [99u8].as_slice())?;
        }
        txn.commit()?;
    }
    let before = std::fs::read(&path)?;
    for _ in 0..2 {
        let err = Engine::builder()
            .sweep_interval(None)
            .open(&path)
            .err()
            .ok_or("opened v99")?;
        assert!(
            matches!(
                err,
                idempotency::OpenError::UnsupportedFormat {
                    found: 99,
                    supported: 2,
                    ..
                }
            ),
            "{err:?}"
        );
        // The message names the file.
        assert!(
            err.to_string().contains(&path.display().to_string()),
            "{err}"
        );
    }
    assert_same_bytes(&std::fs::read(&path)?, &before, "refused database");
    // And the engine did not create its tables in it.
    let db = redb::Database::open(&path)?;
    let txn = db.begin_read()?;
    let tables: Vec<String> = txn.list_tables()?.map(|t| t.name().to_string()).collect();
    assert_eq!(tables, ["idempotency.meta"]);
    Ok(())
}
