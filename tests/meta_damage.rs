//! Guards against a damaged value of the meta table (`idempotency.meta`)
//! silently doing harm: a `next_token` gone backwards would hand out
//! fencing tokens again, a flipped `journal_clean` or `journal_lsn` could
//! skip journal frames, a flipped `format_version` would misread every
//! value. Every meta value carries a checksum bound to its key (format 2,
//! `src/store/codec.rs`).
//!
//! A real database file is written through the public API and closed
//! cleanly, so every meta key is there. The values are then damaged with
//! redb directly (so redb's own page checksums still pass, as they do for
//! damage that arises above the disk), and:
//!
//! - a writable open refuses the file with `OpenError::Corrupt` naming
//!   the key (`Corrupted::Meta`) and the file, and writes nothing;
//! - a read-only open refuses it the same way when it uses the value (the
//!   format, the journal's position; the expiry settings when taken from
//!   the database), and otherwise opens, and `verify` names the key;
//! - a missing value (a damaged key) is damage too, never a default;
//! - a format-1 file with a damaged meta value is refused before it is
//!   migrated;
//! - a file written by a pre-release build of format 2 (meta values
//!   without checksums, value checksums in BLAKE3) is refused with
//!   `OpenError::PreReleaseFormat`, not reported as corrupt record by
//!   record.

mod common;
#[path = "common/meta_table.rs"]
mod meta_table;

use std::error::Error;
use std::path::{Path, PathBuf};
use std::time::Duration;

use common::claimed;
use idempotency::{
    Corrupted, Damage, Engine, EngineBuilder, Envelope, ExpiryPolicy, Fingerprint, IdempotencyKey,
    OpenError, OutgoingMessage,
};
use meta_table::{keys_format_3, meta_values, Meta, KEYS, META};
use redb::{ReadableTable, TableDefinition};

type TestResult = Result<(), Box<dyn Error>>;

/// The engine's tables (see `src/store/redb/tables.rs`).
const RECORDS: TableDefinition<&[u8], &[u8]> = TableDefinition::new("idempotency.records");
const OUTBOX: TableDefinition<u64, &[u8]> = TableDefinition::new("idempotency.outbox");
const ENTITIES: TableDefinition<&str, &[u8]> = TableDefinition::new("idempotency.entities");

/// The keys a read-only open uses (without `expiry_settings_from_database`):
/// format 3's `filter_seed` too (the stored filters are checked with it).
const USED_READ_ONLY: [&str; 5] = [
    "filter_seed",
    "format_version",
    "journal_clean",
    "journal_id",
    "journal_lsn",
];

fn builder() -> EngineBuilder {
    Engine::builder()
        .sweep_interval(None)
        .ttl(Duration::from_secs(3600))
        .expiry_policy(ExpiryPolicy::Tombstone {
            keep: Duration::from_secs(60),
        })
}

fn key(k: &str) -> Result<IdempotencyKey, idempotency::Error> {
    IdempotencyKey::new("meta", k)
}

fn fp(n: u32) -> Result<Fingerprint, idempotency::FingerprintError> {
    Fingerprint::of_json(format!(r#"{{"n":{n}}}"#).as_bytes(), &[])
}

/// A sound format-2 database in `dir` (records, an outbox message, an
/// entity), closed cleanly; its journal is removed (after a clean close the
/// file alone is enough), so a refused open that created one would show.
fn sound(dir: &Path) -> Result<PathBuf, Box<dyn Error>> {
    sound_from(dir, builder().unstable_create_format_2())
}

/// [`sound`], created by `create` (format 3: the builder's default).
fn sound_from(dir: &Path, create: EngineBuilder) -> Result<PathBuf, Box<dyn Error>> {
    let path = dir.join("sound.redb");
    let engine = create.open(&path)?;
    for i in 0..3 {
        let c = claimed(engine.begin(&key(&format!("k{i}"))?, fp(i)?)?)?;
        engine.complete_with_messages(
            c,
            Envelope::new(1, 201, format!("done {i}")),
            vec![OutgoingMessage::new("email", format!("receipt {i}"))],
        )?;
    }
    engine.transition("order-1", &[], "created")?;
    drop(engine);
    std::fs::remove_file(journal_of(&path))?;
    Ok(path)
}

fn journal_of(path: &Path) -> PathBuf {
    let mut p = path.as_os_str().to_owned();
    p.push(".journal");
    PathBuf::from(p)
}

/// Sets (or with `None` removes) the meta value under `key`, with redb.
fn set_meta(path: &Path, key: &str, value: Option<&[u8]>) -> TestResult {
    let db = redb::Database::open(path)?;
    let txn = db.begin_write()?;
    {
        let mut meta = txn.open_table(META)?;
        match value {
            Some(v) => {
                meta.insert(key, v)?;
            }
            None => {
                meta.remove(key)?;
            }
        }
    }
    txn.commit()?;
    Ok(())
}

/// A fresh copy of `from` in `dir` under `name`.
fn copy(from: &Path, dir: &Path, name: &str) -> Result<PathBuf, Box<dyn Error>> {
    let to = dir.join(name);
    std::fs::copy(from, &to)?;
    Ok(to)
}

/// Asserts that `result` is `OpenError::Corrupt` naming `Corrupted::Meta`
/// for `key` in `path`, and that its message names both.
fn assert_corrupt_meta<T>(result: Result<T, OpenError>, path: &Path, key: &str) -> TestResult {
    let Err(err) = result else {
        return Err(format!("opened {} with a damaged {key}", path.display()).into());
    };
    match &err {
        OpenError::Corrupt {
            path: p,
            what: Corrupted::Meta(k),
            ..
        } if p == path && *k == key => {}
        other => return Err(format!("{key}: expected a corrupt meta value, got {other:?}").into()),
    }
    let text = err.to_string();
    assert!(text.contains(key), "{text}");
    assert!(text.contains(&path.display().to_string()), "{text}");
    Ok(())
}

/// The keys `verify` names in its meta problems.
fn meta_problems(engine: &Engine) -> Result<Vec<String>, Box<dyn Error>> {
    let report = engine.verify()?;
    let mut keys = Vec::new();
    for p in report.damage {
        match p {
            Damage::BadMetaValue { key, .. } => keys.push(key),
            other => return Err(format!("a problem besides the meta table: {other}").into()),
        }
    }
    Ok(keys)
}

/// Checks every way of opening a file whose meta value under `key` is
/// damaged (the file at `path`, which no open may change).
fn assert_refused_or_reported(path: &Path, key: &str) -> TestResult {
    let before = std::fs::read(path)?;
    assert_corrupt_meta(builder().open(path), path, key)?;
    assert!(
        std::fs::read(path)? == before,
        "a refused open changed the file ({key})"
    );
    assert!(
        !journal_of(path).exists(),
        "a refused open created the journal ({key})"
    );
    let read_only = builder().open_read_only(path);
    if USED_READ_ONLY.contains(&key) {
        assert_corrupt_meta(read_only, path, key)?;
    } else {
        assert_eq!(meta_problems(&read_only?)?, [key], "{key}");
        if key == "ttl_ms" || key == "expiry_policy" {
            let from_db = builder()
                .expiry_settings_from_database()
                .open_read_only(path);
            assert_corrupt_meta(from_db, path, key)?;
        }
    }
    assert!(std::fs::read(path)? == before, "a read-only open wrote");
    Ok(())
}

#[test]
fn a_flipped_bit_in_any_meta_value_is_refused_or_reported_naming_its_key() -> TestResult {
    let dir = tempfile::tempdir()?;
    flip_every_meta_bit(dir.path(), &sound(dir.path())?, &KEYS)
}

#[test]
fn a_flipped_bit_in_any_format_3_meta_value_is_refused_or_reported_naming_its_key() -> TestResult {
    let dir = tempfile::tempdir()?;
    let sound = sound_from(dir.path(), builder())?;
    flip_every_meta_bit(dir.path(), &sound, &keys_format_3())
}

/// Flips one bit of each byte of each meta value of `sound` (whose keys
/// must be `expected`), in a copy in `dir` each time: each is refused or
/// reported, naming its key.
fn flip_every_meta_bit(dir: &Path, sound: &Path, expected: &[&str]) -> TestResult {
    let values = meta_values(sound)?;
    let keys: Vec<&str> = values.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(keys, expected);
    // The sound file opens, verifies, and its meta values check.
    let engine = builder().open_read_only(sound)?;
    assert!(engine.verify()?.is_sound());
    drop(engine);
    let mut trials = 0;
    for (key, good) in &values {
        for i in 0..good.len() {
            let path = copy(sound, dir, "trial.redb")?;
            let mut bad = good.clone();
            bad[i] ^= 1 << (i % 8);
            set_meta(&path, key, Some(&bad))?;
            assert_refused_or_reported(&path, key)
                .map_err(|e| format!("byte {i} of {key}: {e}"))?;
            trials += 1;
        }
    }
    // Every byte of every value: version byte, payload and checksum.
    assert!(trials > 8 * 9, "{trials} trials");
    Ok(())
}

#[test]
fn a_value_moved_to_another_key_or_cut_short_is_damage() -> TestResult {
    let dir = tempfile::tempdir()?;
    let sound = sound(dir.path())?;
    let values = meta_values(&sound)?;
    let value = |key: &str| -> Result<Vec<u8>, Box<dyn Error>> {
        let (_, v) = values.iter().find(|(k, _)| k == key).ok_or("missing")?;
        Ok(v.clone())
    };
    // A smaller counter under the token's key: its checksum is the
    // outbox counter's.
    let path = copy(&sound, dir.path(), "moved.redb")?;
    set_meta(&path, "next_token", Some(&value("next_outbox_seq")?))?;
    assert_refused_or_reported(&path, "next_token")?;
    // A bare payload, as format 1 stored it, in a format-2 file.
    let path = copy(&sound, dir.path(), "bare.redb")?;
    let lsn = value("journal_lsn")?;
    set_meta(&path, "journal_lsn", Some(&lsn[1..lsn.len() - 8]))?;
    assert_refused_or_reported(&path, "journal_lsn")?;
    // `format_version` cut to its first byte, `[2]`: what a pre-release
    // build stored, but every other value still verifies. Damage, not a
    // file to re-create.
    let path = copy(&sound, dir.path(), "format-cut.redb")?;
    set_meta(&path, "format_version", Some(&[2]))?;
    assert_refused_or_reported(&path, "format_version")?;
    Ok(())
}

#[test]
fn a_missing_meta_value_is_damage_not_a_default() -> TestResult {
    let dir = tempfile::tempdir()?;
    let sound = sound(dir.path())?;
    for key in KEYS {
        let path = copy(&sound, dir.path(), "missing.redb")?;
        set_meta(&path, key, None)?;
        assert_refused_or_reported(&path, key).map_err(|e| format!("{key} removed: {e}"))?;
    }
    // A damaged key: the value is missing under its own name, and `verify`
    // also lists the name it now has.
    let path = copy(&sound, dir.path(), "renamed.redb")?;
    let (_, token) = meta_values(&path)?
        .into_iter()
        .find(|(k, _)| k == "next_token")
        .ok_or("no next_token")?;
    set_meta(&path, "next_token", None)?;
    set_meta(&path, "next_tokem", Some(&token))?;
    assert_corrupt_meta(builder().open(&path), &path, "next_token")?;
    let engine = builder().open_read_only(&path)?;
    assert_eq!(meta_problems(&engine)?, ["next_token", "next_tokem"]);
    Ok(())
}

#[test]
fn a_format1_file_with_a_damaged_meta_value_is_refused_before_migrating() -> TestResult {
    let dir = tempfile::tempdir()?;
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/format1.redb");
    let path = copy(&fixture, dir.path(), "format1.redb")?;
    // Seven bytes: format 1 has no checksum, but a counter is 8 bytes.
    set_meta(&path, "next_token", Some(&[1; 7]))?;
    let before = std::fs::read(&path)?;
    assert_corrupt_meta(builder().open(&path), &path, "next_token")?;
    assert!(std::fs::read(&path)? == before, "a refused open migrated");
    // A read-only open reads format 1's bare values, and `verify` names the
    // damaged one.
    let engine = builder().open_read_only(&path)?;
    assert_eq!(meta_problems(&engine)?, ["next_token"]);
    Ok(())
}

/// The checksum a pre-release build of format 2 stored after a value:
/// BLAKE3 of the domain tag, the key's length and bytes, and the framed
/// value, cut to 8 bytes (`src/store/codec.rs` before rapidhash).
fn blake3_checksum(tag: &[u8], key: &[u8], framed: &[u8]) -> [u8; 8] {
    let mut h = blake3::Hasher::new();
    h.update(tag);
    h.update(&(key.len() as u64).to_le_bytes());
    h.update(key);
    h.update(framed);
    let mut out = [0; 8];
    out.copy_from_slice(&h.finalize().as_bytes()[..8]);
    out
}

/// `value` (format 2 as this build writes it) with the pre-release
/// build's checksum instead.
fn pre_release(tag: &[u8], key: &[u8], value: &[u8]) -> Vec<u8> {
    let framed = &value[..value.len() - 8];
    let mut out = framed.to_vec();
    out.extend_from_slice(&blake3_checksum(tag, key, framed));
    out
}

/// Rewrites the file at `path` as a pre-release build of format 2 wrote
/// it: bare meta values (`format_version` = `[2]`) and BLAKE3 value
/// checksums.
fn make_pre_release(path: &Path) -> TestResult {
    let db = redb::Database::open(path)?;
    let txn = db.begin_write()?;
    {
        let mut meta = txn.open_table(META)?;
        let values: Meta = meta
            .iter()?
            .map(|e| e.map(|(k, v)| (k.value().to_string(), v.value().to_vec())))
            .collect::<Result<_, _>>()?;
        for (k, v) in values {
            let bare = if k == "format_version" {
                vec![2]
            } else {
                v[1..v.len() - 8].to_vec()
            };
            meta.insert(k.as_str(), bare.as_slice())?;
        }
        let mut records = txn.open_table(RECORDS)?;
        let values: Vec<(Vec<u8>, Vec<u8>)> = records
            .iter()?
            .map(|e| e.map(|(k, v)| (k.value().to_vec(), v.value().to_vec())))
            .collect::<Result<_, _>>()?;
        assert!(!values.is_empty());
        for (k, v) in values {
            let old = pre_release(b"idempotency.record\0", &k, &v);
            records.insert(k.as_slice(), old.as_slice())?;
        }
        let mut outbox = txn.open_table(OUTBOX)?;
        let values: Vec<(u64, Vec<u8>)> = outbox
            .iter()?
            .map(|e| e.map(|(k, v)| (k.value(), v.value().to_vec())))
            .collect::<Result<_, _>>()?;
        assert!(!values.is_empty());
        for (seq, v) in values {
            let old = pre_release(b"idempotency.outbox\0", &seq.to_le_bytes(), &v);
            outbox.insert(seq, old.as_slice())?;
        }
        let mut entities = txn.open_table(ENTITIES)?;
        let values: Meta = entities
            .iter()?
            .map(|e| e.map(|(k, v)| (k.value().to_string(), v.value().to_vec())))
            .collect::<Result<_, _>>()?;
        for (id, v) in values {
            let old = pre_release(b"idempotency.entity\0", id.as_bytes(), &v);
            entities.insert(id.as_str(), old.as_slice())?;
        }
    }
    txn.commit()?;
    Ok(())
}

#[test]
fn a_pre_release_format_2_file_is_refused_with_its_own_error() -> TestResult {
    let dir = tempfile::tempdir()?;
    let sound = sound(dir.path())?;
    let path = copy(&sound, dir.path(), "pre-release.redb")?;
    make_pre_release(&path)?;
    let before = std::fs::read(&path)?;
    for read_only in [false, true] {
        let result = if read_only {
            builder().open_read_only(&path).map(drop)
        } else {
            builder().open(&path).map(drop)
        };
        let err = result.err().ok_or("opened a pre-release file")?;
        assert!(
            matches!(&err, OpenError::PreReleaseFormat { path: p } if p == &path),
            "{err:?}"
        );
        let text = err.to_string();
        assert!(
            text.contains("pre-release build of record format 2"),
            "{text}"
        );
        assert!(text.contains("re-create"), "{text}");
        assert!(text.contains(&path.display().to_string()), "{text}");
    }
    assert!(std::fs::read(&path)? == before, "a refused open wrote");
    assert!(
        !journal_of(&path).exists(),
        "a refused open created a journal"
    );
    Ok(())
}
