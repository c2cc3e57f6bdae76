//! The meta table (`idempotency.meta`): its keys, what each holds, the
//! rules between them, and the only code that reads or writes its values.
//! The byte layout is specified in `store/codec.rs` ("The meta table"),
//! which frames and checksums each value; this module owns the payloads.
//!
//! The file's format decides how the other values are read, so it is
//! learnt first, from `format_version` alone ([`read_format`]); every
//! other read takes that [`Format`]. This build writes format 2 only.

use std::path::Path;

use redb::{ReadOnlyTable, ReadableDatabase, ReadableTable, Table, TableError};

use crate::error::{Corrupted, OpenError};
use crate::policy::ExpiryPolicy;
use crate::store::codec::{self, DecodeError, FORMAT_VERSION, FORMAT_VERSION_1, FORMAT_VERSION_3};

use super::tables::META;

/// A key of the meta table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Key {
    /// The format of the whole file.
    FormatVersion,
    /// The next fencing token (u64).
    NextToken,
    /// The next outbox sequence number (u64).
    NextOutboxSeq,
    /// The TTL (u64 ms) of the last app that opened the database, for
    /// operator tools.
    TtlMs,
    /// That app's expiry policy.
    ExpiryPolicy,
    /// The id (16 bytes) of the database's journal: a journal carrying
    /// another id belongs to another database.
    JournalId,
    /// The LSN (u64) of the last journal frame the database's state
    /// includes.
    JournalLsn,
    /// Whether the last engine closed cleanly (its last checkpoint holds
    /// everything; the journal may be gone), or an engine has the file
    /// open.
    JournalClean,
    /// Format 3: the 16 random bytes the partition filters' key hash is
    /// seeded from (`partition/filter.rs`).
    FilterSeed,
}

impl Key {
    /// Every key this build knows.
    pub(super) const ALL: [Key; 9] = [
        Key::FormatVersion,
        Key::NextToken,
        Key::NextOutboxSeq,
        Key::TtlMs,
        Key::ExpiryPolicy,
        Key::JournalId,
        Key::JournalLsn,
        Key::JournalClean,
        Key::FilterSeed,
    ];

    /// The key as stored.
    pub(super) const fn name(self) -> &'static str {
        match self {
            Key::FormatVersion => "format_version",
            Key::NextToken => "next_token",
            Key::NextOutboxSeq => "next_outbox_seq",
            Key::TtlMs => "ttl_ms",
            Key::ExpiryPolicy => "expiry_policy",
            Key::JournalId => "journal_id",
            Key::JournalLsn => "journal_lsn",
            Key::JournalClean => "journal_clean",
            Key::FilterSeed => "filter_seed",
        }
    }

    fn named(name: &str) -> Option<Key> {
        Key::ALL.into_iter().find(|k| k.name() == name)
    }

    /// Why `payload` is not what this key holds (`None`: it is).
    fn misshapen(self, payload: &[u8]) -> Option<String> {
        let ok = match self {
            Key::FormatVersion => payload.is_empty(),
            Key::NextToken | Key::NextOutboxSeq | Key::TtlMs | Key::JournalLsn => {
                payload.len() == 8
            }
            Key::JournalId | Key::FilterSeed => payload.len() == 16,
            Key::JournalClean => matches!(payload, [0 | 1]),
            Key::ExpiryPolicy => decode_policy(payload).is_some(),
        };
        (!ok).then(|| {
            let holds = match self {
                Key::FormatVersion => "no payload",
                Key::JournalId | Key::FilterSeed => "16 bytes",
                Key::JournalClean => "one byte, 0 or 1",
                Key::ExpiryPolicy => "[0], or [1] and 8 bytes",
                _ => "8 bytes",
            };
            format!(
                "a payload of {} bytes ({}) where {} holds {holds}",
                payload.len(),
                crate::store::record::hex(payload),
                self.name()
            )
        })
    }
}

/// A counter kept in the meta table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Counter {
    NextToken,
    NextOutboxSeq,
    JournalLsn,
}

impl Counter {
    fn key(self) -> Key {
        match self {
            Counter::NextToken => Key::NextToken,
            Counter::NextOutboxSeq => Key::NextOutboxSeq,
            Counter::JournalLsn => Key::JournalLsn,
        }
    }
}

/// A format this build reads: it decides how meta values are encoded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Format {
    /// Bare payloads, no checksum (read, never written).
    V1,
    /// Checksummed (`codec::encode_meta`).
    V2,
    /// Format 2's values, records in partitions (`partition/`), a
    /// `filter_seed`; `format_version` is `codec::format_3_marker`.
    V3,
}

impl Format {
    /// The format's number, as the docs name it.
    pub(super) fn number(self) -> u32 {
        match self {
            Format::V1 => 1,
            Format::V2 => 2,
            Format::V3 => 3,
        }
    }
}

/// What `format_version` says (see `codec.rs`, "How an open learns the
/// format").
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Found {
    Format(Format),
    /// `[2]` without a checksum: a pre-release build of format 2.
    PreRelease,
    /// A format this build does not know.
    Unknown(u8),
}

/// A meta value could not be read.
#[derive(Debug)]
pub(super) enum MetaError {
    Storage(redb::Error),
    /// The value under `key` is damaged, or missing where it must be.
    Damaged {
        key: Key,
        reason: String,
    },
}

impl<E: Into<redb::Error>> From<E> for MetaError {
    fn from(e: E) -> MetaError {
        MetaError::Storage(e.into())
    }
}

impl MetaError {
    /// As an open error about the database file at `path`.
    pub(super) fn open_error(self, path: &Path, context: &'static str) -> OpenError {
        match self {
            MetaError::Storage(e) => OpenError::Storage {
                context,
                source: Box::new(e),
            },
            MetaError::Damaged { key, reason } => OpenError::Corrupt {
                path: path.to_path_buf(),
                what: Corrupted::Meta(key.name()),
                reason,
            },
        }
    }
}

fn damaged(key: Key, reason: impl Into<String>) -> MetaError {
    MetaError::Damaged {
        key,
        reason: reason.into(),
    }
}

/// A decode error, said of a meta value.
fn describe(e: &DecodeError) -> String {
    match e {
        DecodeError::UnknownVersion(v) => {
            format!("version byte {v}, where a format-{FORMAT_VERSION} value has {FORMAT_VERSION}")
        }
        other => other.to_string(),
    }
}

/// Where a meta table is read from: a read-only table, or a table in a
/// write transaction.
pub(super) trait Readable: ReadableTable<&'static str, &'static [u8]> {}
impl<T: ReadableTable<&'static str, &'static [u8]>> Readable for T {}

/// A meta table in a write transaction.
pub(super) type Writable<'t> = Table<'t, &'static str, &'static [u8]>;

/// The payload under `key` in a file of `format`, checked; `None` if the
/// key is absent.
fn payload(t: &impl Readable, key: Key, format: Format) -> Result<Option<Vec<u8>>, MetaError> {
    let Some(value) = t.get(key.name())? else {
        return Ok(None);
    };
    let payload = match format {
        Format::V1 => value.value().to_vec(),
        Format::V2 | Format::V3 => codec::decode_meta(key.name(), value.value())
            .map_err(|e| damaged(key, describe(&e)))?
            .to_vec(),
    };
    match key.misshapen(&payload) {
        Some(reason) => Err(damaged(key, reason)),
        None => Ok(Some(payload)),
    }
}

fn put(t: &mut Writable<'_>, key: Key, payload: &[u8]) -> Result<(), redb::StorageError> {
    t.insert(
        key.name(),
        codec::encode_meta(key.name(), payload).as_slice(),
    )?;
    Ok(())
}

fn u64_of(payload: &[u8]) -> Option<u64> {
    <[u8; 8]>::try_from(payload).ok().map(u64::from_le_bytes)
}

/// What the file's `format_version` says (`None`: absent, in a meta table
/// with nothing else: a new file, or one without the engine's tables).
///
/// # Errors
///
/// [`MetaError::Damaged`] when the value is damaged (see `codec.rs`), or
/// absent while the table holds other values (its key was damaged).
pub(super) fn read_format(t: &impl Readable) -> Result<Option<Found>, MetaError> {
    let key = Key::FormatVersion;
    let Some(value) = t.get(key.name())? else {
        if t.iter()?.next().is_some() {
            return Err(damaged(
                key,
                "missing, while the meta table holds other values",
            ));
        }
        return Ok(None);
    };
    let bytes = value.value();
    let found = match bytes {
        [] => return Err(damaged(key, "empty value")),
        [FORMAT_VERSION_1] => Found::Format(Format::V1),
        // A pre-release build stored every meta value bare; a format-2
        // file whose `format_version` alone was cut to its first byte
        // still has values that verify, and is damaged, not to be
        // re-created.
        [FORMAT_VERSION] => match verified_partner(t)? {
            None => Found::PreRelease,
            Some(other) => {
                return Err(damaged(
                    key,
                    format!(
                        "02 (1 byte), a pre-release build's format 2, while {other} is a checksummed format-2 value"
                    ),
                ))
            }
        },
        [FORMAT_VERSION, ..] => {
            payload(t, key, Format::V2)?;
            Found::Format(Format::V2)
        }
        _ if bytes == codec::format_3_marker().as_slice() => Found::Format(Format::V3),
        [FORMAT_VERSION_3, ..] => {
            return Err(damaged(
                key,
                format!(
                    "{} ({} bytes) starts as format 3's marker but is not it",
                    crate::store::record::hex(bytes),
                    bytes.len()
                ),
            ))
        }
        [first, rest @ ..] => {
            // A format-2 value whose version byte alone was damaged still
            // verifies once it is put back.
            let mut restored = vec![FORMAT_VERSION];
            restored.extend_from_slice(rest);
            let verifies = codec::decode_meta(key.name(), &restored).is_ok_and(<[u8]>::is_empty);
            if verifies || *first == FORMAT_VERSION_1 {
                return Err(damaged(
                    key,
                    format!(
                        "{} ({} bytes) is not a format version this build wrote",
                        crate::store::record::hex(bytes),
                        bytes.len()
                    ),
                ));
            }
            Found::Unknown(*first)
        }
    };
    Ok(Some(found))
}

/// The name of a meta value other than `format_version` that verifies as
/// a format-2 value (checksum and shape), if any: what no pre-release
/// build wrote.
fn verified_partner(t: &impl Readable) -> Result<Option<&'static str>, MetaError> {
    for key in Key::ALL {
        if key == Key::FormatVersion {
            continue;
        }
        if let Some(value) = t.get(key.name())? {
            let verifies = codec::decode_meta(key.name(), value.value())
                .is_ok_and(|payload| key.misshapen(payload).is_none());
            if verifies {
                return Ok(Some(key.name()));
            }
        }
    }
    Ok(None)
}

/// A fresh meta table: format 2, counters at 1.
pub(super) fn create(t: &mut Writable<'_>) -> Result<(), redb::StorageError> {
    put(t, Key::FormatVersion, &[])?;
    write_counter(t, Counter::NextToken, 1)?;
    write_counter(t, Counter::NextOutboxSeq, 1)
}

/// A fresh meta table of format 3: counters at 1, the filters' seed
/// `seed` (16 random bytes), `format_version` last.
pub(super) fn create_format_3(
    t: &mut Writable<'_>,
    seed: &[u8; 16],
) -> Result<(), redb::StorageError> {
    write_counter(t, Counter::NextToken, 1)?;
    write_counter(t, Counter::NextOutboxSeq, 1)?;
    put(t, Key::FilterSeed, seed)?;
    t.insert(
        Key::FormatVersion.name(),
        codec::format_3_marker().as_slice(),
    )?;
    Ok(())
}

/// Turns a format-2 meta table into a format-3 one (the records were
/// moved in the same transaction, `migrate3.rs`): the filters' seed, then
/// `format_version`, last. Every other value stays as it is: format 3
/// frames them as format 2 does.
pub(super) fn migrate_to_format_3(
    t: &mut Writable<'_>,
    seed: &[u8; 16],
) -> Result<(), redb::StorageError> {
    put(t, Key::FilterSeed, seed)?;
    t.insert(
        Key::FormatVersion.name(),
        codec::format_3_marker().as_slice(),
    )?;
    Ok(())
}

/// The filters' seed of a format-3 file.
///
/// # Errors
///
/// [`MetaError::Damaged`] when it is missing or not 16 bytes.
pub(super) fn read_filter_seed(t: &impl Readable) -> Result<[u8; 16], MetaError> {
    let payload = payload(t, Key::FilterSeed, Format::V3)?
        .ok_or_else(|| damaged(Key::FilterSeed, "missing, in a format-3 file"))?;
    <[u8; 16]>::try_from(payload.as_slice()).map_err(|_| damaged(Key::FilterSeed, "not 16 bytes"))
}

/// The counter's stored value (`None`: absent; in format 2 a missing
/// `next_token` or `next_outbox_seq` is damage, see [`check`]).
pub(super) fn read_counter(
    t: &impl Readable,
    counter: Counter,
    format: Format,
) -> Result<Option<u64>, MetaError> {
    Ok(payload(t, counter.key(), format)?.and_then(|p| u64_of(&p)))
}

/// The counter that must be there (format 2).
pub(super) fn required_counter(t: &impl Readable, counter: Counter) -> Result<u64, MetaError> {
    read_counter(t, counter, Format::V2)?.ok_or_else(|| damaged(counter.key(), "missing"))
}

/// Stores a counter. A checksum over a 17-byte value: cheap enough for
/// every commit.
pub(super) fn write_counter(
    t: &mut Writable<'_>,
    counter: Counter,
    value: u64,
) -> Result<(), redb::StorageError> {
    put(t, counter.key(), &value.to_le_bytes())
}

/// What the meta table says about the journal.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct StoredJournal {
    pub(super) id: [u8; 16],
    /// The LSN the database's state includes.
    pub(super) lsn: u64,
    /// The engine closed cleanly: everything is in the database file, and
    /// the journal may be gone.
    pub(super) clean: bool,
}

/// The journal the database was last used with (`None`: it has never had
/// one). Its three values are there together or not at all.
pub(super) fn read_journal(
    t: &impl Readable,
    format: Format,
) -> Result<Option<StoredJournal>, MetaError> {
    let id = payload(t, Key::JournalId, format)?;
    let lsn = payload(t, Key::JournalLsn, format)?;
    let clean = payload(t, Key::JournalClean, format)?;
    match (id, lsn, clean) {
        (None, None, None) => Ok(None),
        (Some(id), Some(lsn), Some(clean)) => Ok(Some(StoredJournal {
            id: <[u8; 16]>::try_from(id.as_slice())
                .map_err(|_| damaged(Key::JournalId, "not 16 bytes"))?,
            lsn: u64_of(&lsn).ok_or_else(|| damaged(Key::JournalLsn, "not 8 bytes"))?,
            clean: clean == [1],
        })),
        (id, lsn, _) => {
            let missing = if id.is_none() {
                Key::JournalId
            } else if lsn.is_none() {
                Key::JournalLsn
            } else {
                Key::JournalClean
            };
            Err(damaged(
                missing,
                "missing, while other journal values are present",
            ))
        }
    }
}

/// Gives the database a journal: its id, at LSN 0, marked clean (nothing
/// is pending yet).
pub(super) fn write_journal(t: &mut Writable<'_>, id: &[u8; 16]) -> Result<(), redb::StorageError> {
    put(t, Key::JournalId, id)?;
    write_counter(t, Counter::JournalLsn, 0)?;
    write_clean(t, true)
}

/// Marks whether the engine closed cleanly.
pub(super) fn write_clean(t: &mut Writable<'_>, clean: bool) -> Result<(), redb::StorageError> {
    put(t, Key::JournalClean, &[u8::from(clean)])
}

fn decode_policy(payload: &[u8]) -> Option<ExpiryPolicy> {
    match payload.split_first() {
        Some((0, [])) => Some(ExpiryPolicy::Forget),
        Some((1, keep)) => u64_of(keep).map(|keep| ExpiryPolicy::Tombstone {
            keep: std::time::Duration::from_millis(keep),
        }),
        _ => None,
    }
}

/// The TTL (ms) and expiry policy the last app stored, if any. The two are
/// there together or not at all.
pub(super) fn read_expiry(
    t: &impl Readable,
    format: Format,
) -> Result<Option<(u64, ExpiryPolicy)>, MetaError> {
    let ttl = payload(t, Key::TtlMs, format)?;
    let policy = payload(t, Key::ExpiryPolicy, format)?;
    match (ttl, policy) {
        (None, None) => Ok(None),
        (Some(ttl), Some(policy)) => Ok(Some((
            u64_of(&ttl).ok_or_else(|| damaged(Key::TtlMs, "not 8 bytes"))?,
            decode_policy(&policy).ok_or_else(|| damaged(Key::ExpiryPolicy, "not a policy"))?,
        ))),
        (None, Some(_)) => Err(damaged(
            Key::TtlMs,
            "missing, while expiry_policy is present",
        )),
        (Some(_), None) => Err(damaged(
            Key::ExpiryPolicy,
            "missing, while ttl_ms is present",
        )),
    }
}

/// Stores the app's TTL and expiry policy, for operator tools.
pub(super) fn write_expiry(
    t: &mut Writable<'_>,
    ttl_ms: u64,
    policy: ExpiryPolicy,
) -> Result<(), redb::StorageError> {
    put(t, Key::TtlMs, &ttl_ms.to_le_bytes())?;
    let mut payload = vec![0];
    if let Some(keep_ms) = policy.keep_ms() {
        payload[0] = 1;
        payload.extend_from_slice(&keep_ms.to_le_bytes());
    }
    put(t, Key::ExpiryPolicy, &payload)
}

/// Rewrites a format-1 meta table in format 2: every value this build
/// knows, with its checksum; the counters (at 1 if a format-1 file never
/// stored them, as format 1 read them); `format_version` last. Keys this
/// build does not know are left as they are, and so is a value already in
/// format 2 (a format-2 value is 9 bytes longer than the same payload in
/// format 1, so the two are never confused).
///
/// # Errors
///
/// [`MetaError::Damaged`] for a value that is not what its key holds:
/// nothing is rewritten from a guess.
pub(super) fn migrate_from_format_1(t: &mut Writable<'_>) -> Result<(), MetaError> {
    for key in Key::ALL {
        if key == Key::FormatVersion || payload(t, key, Format::V2).is_ok() {
            continue;
        }
        if let Some(payload) = payload(t, key, Format::V1)? {
            put(t, key, &payload)?;
        }
    }
    for counter in [Counter::NextToken, Counter::NextOutboxSeq] {
        if read_counter(t, counter, Format::V2)?.is_none() {
            write_counter(t, counter, 1)?;
        }
    }
    put(t, Key::FormatVersion, &[])?;
    Ok(())
}

/// One thing wrong with a meta table: the key as stored, and why.
pub(super) struct MetaDamage {
    /// The key this build knows it as (`None`: a key it does not know).
    pub(super) key: Option<Key>,
    pub(super) name: String,
    pub(super) reason: String,
}

/// Everything wrong with the meta table of a file of `format` (which its
/// `format_version` says: [`read_format`] checks that value): damaged
/// values, missing ones (`next_token` and `next_outbox_seq` in format 2, a
/// partner of a present one), and keys this build does not know (a
/// damaged key, or another program's). One problem per key.
pub(super) fn damage(t: &impl Readable, format: Format) -> Result<Vec<MetaDamage>, redb::Error> {
    let mut found: Vec<MetaDamage> = Vec::new();
    let mut note = |result: Result<(), MetaError>| -> Result<(), redb::Error> {
        match result {
            Ok(()) => Ok(()),
            Err(MetaError::Storage(e)) => Err(e),
            Err(MetaError::Damaged { key, reason }) => {
                if !found.iter().any(|p| p.key == Some(key)) {
                    found.push(MetaDamage {
                        key: Some(key),
                        name: key.name().to_string(),
                        reason,
                    });
                }
                Ok(())
            }
        }
    };
    for key in Key::ALL {
        if key != Key::FormatVersion {
            note(payload(t, key, format).map(drop))?;
        }
    }
    if format != Format::V1 {
        for counter in [Counter::NextToken, Counter::NextOutboxSeq] {
            note(required_counter(t, counter).map(drop))?;
        }
    }
    if format == Format::V3 {
        note(read_filter_seed(t).map(drop))?;
    } else if t.get(Key::FilterSeed.name())?.is_some() {
        note(Err(damaged(
            Key::FilterSeed,
            "present in a file whose format_version is not 3",
        )))?;
    }
    note(read_journal(t, format).map(drop))?;
    note(read_expiry(t, format).map(drop))?;
    for entry in t.iter()? {
        let (name, _) = entry?;
        let name = name.value();
        if Key::named(name).is_none() {
            found.push(MetaDamage {
                key: None,
                name: name.to_string(),
                reason: "a key this build does not know (damaged key bytes, or another program's)"
                    .into(),
            });
        }
    }
    Ok(found)
}

/// Refuses a meta table with a damaged or missing value (keys this build
/// does not know are left to `verify`: they do this build no harm).
pub(super) fn check(t: &impl Readable, format: Format) -> Result<(), MetaError> {
    match damage(t, format)?
        .into_iter()
        .find_map(|p| p.key.map(|k| (k, p.reason)))
    {
        Some((key, reason)) => Err(MetaError::Damaged { key, reason }),
        None => Ok(()),
    }
}

/// Adds what the engine was doing to a redb error met while opening.
pub(super) trait OpenContext<T> {
    fn open_context(self, what: &'static str) -> Result<T, OpenError>;
}

impl<T, E: Into<redb::Error>> OpenContext<T> for Result<T, E> {
    fn open_context(self, what: &'static str) -> Result<T, OpenError> {
        self.map_err(|e| OpenError::Storage {
            context: what,
            source: Box::new(e.into()),
        })
    }
}

/// Runs `read` on the meta table of `db`'s last commit (`None`: the file
/// has no meta table). A damaged value is an error naming its key and
/// `path`; a panic inside redb on a damaged page is contained and is
/// [`OpenError::Corrupt`] naming `path` (a salvage reads the meta table of
/// a file that opened, whose meta pages may still be damaged).
pub(super) fn read_meta<T>(
    db: &impl ReadableDatabase,
    path: &Path,
    what: &'static str,
    read: impl FnOnce(&ReadOnlyTable<&'static str, &'static [u8]>) -> Result<T, MetaError>,
) -> Result<Option<T>, OpenError> {
    let attempt = || {
        let txn = db.begin_read().open_context(what)?;
        let table = match txn.open_table(META) {
            Ok(table) => table,
            Err(TableError::TableDoesNotExist(_)) => return Ok(None),
            Err(e) => return Err(e).open_context(what),
        };
        read(&table).map(Some).map_err(|e| e.open_error(path, what))
    };
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(attempt)).unwrap_or_else(|panic| {
        Err(OpenError::Corrupt {
            path: path.to_path_buf(),
            what: Corrupted::File,
            reason: format!(
                "the storage library panicked while {what}: {}",
                crate::store::panic_message(panic.as_ref())
            ),
        })
    })
}

/// The format of the database at `path` (`None`: no engine tables yet),
/// learnt from `format_version` before any other value is read (see
/// `codec.rs`).
///
/// # Errors
///
/// [`OpenError::UnsupportedFormat`] for a format this build does not read,
/// [`OpenError::PreReleaseFormat`] for a pre-release build's format 2,
/// [`OpenError::Corrupt`] for a damaged `format_version`.
pub(super) fn file_format(
    db: &impl ReadableDatabase,
    path: &Path,
) -> Result<Option<Format>, OpenError> {
    match read_meta(db, path, "checking the record format", read_format)?.flatten() {
        None => Ok(None),
        Some(Found::Format(format)) => Ok(Some(format)),
        Some(Found::PreRelease) => Err(OpenError::PreReleaseFormat {
            path: path.to_path_buf(),
        }),
        Some(Found::Unknown(found)) => Err(OpenError::UnsupportedFormat {
            path: path.to_path_buf(),
            found,
            supported: FORMAT_VERSION,
        }),
    }
}

/// Refuses a file of `format` with a damaged or missing meta value
/// ([`OpenError::Corrupt`], naming the key).
pub(super) fn check_meta(
    db: &impl ReadableDatabase,
    format: Format,
    path: &Path,
) -> Result<(), OpenError> {
    read_meta(db, path, "checking the meta values", |t| check(t, format)).map(drop)
}

/// The TTL and expiry policy the last app stored, if any.
pub(super) fn stored_expiry(
    db: &impl ReadableDatabase,
    format: Format,
    path: &Path,
) -> Result<Option<(u64, ExpiryPolicy)>, OpenError> {
    read_meta(db, path, "reading the stored expiry settings", |t| {
        read_expiry(t, format)
    })
    .map(Option::flatten)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::redb::tables::META;
    use redb::{Database, ReadableDatabase};

    type TestResult = Result<(), Box<dyn std::error::Error>>;

    /// The keys of a format-2 meta table (all but format 3's seed).
    fn format_2_keys() -> impl Iterator<Item = Key> {
        Key::ALL.into_iter().filter(|k| *k != Key::FilterSeed)
    }

    /// The value stored under `key` in `db`'s meta table.
    fn stored(db: &Database, key: Key) -> Result<Vec<u8>, Box<dyn std::error::Error>> {
        let txn = db.begin_read()?;
        let t = txn.open_table(META)?;
        let v = t.get(key.name())?.ok_or("missing")?;
        Ok(v.value().to_vec())
    }

    fn format_3() -> Result<Database, Box<dyn std::error::Error>> {
        let db = Database::builder().create_with_backend(redb::backends::InMemoryBackend::new())?;
        let txn = db.begin_write()?;
        {
            let mut t = txn.open_table(META)?;
            create_format_3(&mut t, b"0123456789abcdef")?;
            write_journal(&mut t, &[7; 16])?;
        }
        txn.commit()?;
        Ok(db)
    }

    #[test]
    fn a_format_3_table_reads_back_and_every_flip_of_its_own_values_names_its_key() -> TestResult {
        let db = format_3()?;
        {
            let txn = db.begin_read()?;
            let t = txn.open_table(META)?;
            let e = |e: MetaError| format!("{e:?}");
            assert_eq!(read_format(&t).map_err(e)?, Some(Found::Format(Format::V3)));
            assert_eq!(read_filter_seed(&t).map_err(e)?, *b"0123456789abcdef");
            assert!(damage(&t, Format::V3)?.is_empty());
            assert_eq!(required_counter(&t, Counter::NextToken).map_err(e)?, 1);
        }
        let check_v3 = |edit: &dyn Fn(&mut Writable<'_>) -> Result<(), redb::StorageError>| {
            let txn = db.begin_write()?;
            let result = {
                let mut t = txn.open_table(META)?;
                edit(&mut t)?;
                match read_format(&t) {
                    Ok(Some(Found::Format(format))) => check(&t, format),
                    Ok(other) => Err(damaged(Key::FormatVersion, format!("{other:?}"))),
                    Err(e) => Err(e),
                }
            };
            txn.abort()?;
            Ok::<_, Box<dyn std::error::Error>>(result)
        };
        for key in [Key::FormatVersion, Key::FilterSeed] {
            let good = stored(&db, key)?;
            for i in 0..good.len() {
                for bit in 0..8 {
                    let mut bad = good.clone();
                    bad[i] ^= 1 << bit;
                    let result = check_v3(&|t| t.insert(key.name(), bad.as_slice()).map(drop))?;
                    let named = damaged_key(result);
                    // A flip of format_version's first byte can make it
                    // another format's value, which then fails as that.
                    assert!(
                        named == Some(key)
                            || (key == Key::FormatVersion && i == 0 && named.is_some()),
                        "flip of bit {bit} of byte {i} of {}: {named:?}",
                        key.name()
                    );
                }
            }
        }
        // The seed is required in format 3, and refused outside it.
        let result = check_v3(&|t| t.remove(Key::FilterSeed.name()).map(drop))?;
        assert_eq!(damaged_key(result), Some(Key::FilterSeed));
        let db2 = full()?;
        let txn = db2.begin_write()?;
        {
            let mut t = txn.open_table(META)?;
            put(&mut t, Key::FilterSeed, &[0; 16])?;
            assert_eq!(damaged_key(check(&t, Format::V2)), Some(Key::FilterSeed));
        }
        txn.abort()?;
        Ok(())
    }

    fn full() -> Result<Database, Box<dyn std::error::Error>> {
        let db = Database::builder().create_with_backend(redb::backends::InMemoryBackend::new())?;
        let txn = db.begin_write()?;
        {
            let mut t = txn.open_table(META)?;
            create(&mut t)?;
            write_expiry(
                &mut t,
                60_000,
                ExpiryPolicy::Tombstone {
                    keep: std::time::Duration::from_millis(9),
                },
            )?;
            write_journal(&mut t, &[7; 16])?;
            write_counter(&mut t, Counter::JournalLsn, 41)?;
            write_clean(&mut t, false)?;
            write_counter(&mut t, Counter::NextToken, 1 << 40)?;
        }
        txn.commit()?;
        Ok(db)
    }

    /// Runs `edit` on the meta table, then what an open checks: the
    /// format, then every other value.
    fn edited(
        db: &Database,
        edit: impl FnOnce(&mut Writable<'_>) -> std::result::Result<(), redb::StorageError>,
    ) -> Result<Result<(), MetaError>, Box<dyn std::error::Error>> {
        let txn = db.begin_write()?;
        let result = {
            let mut t = txn.open_table(META)?;
            edit(&mut t)?;
            read_format(&t).and_then(|_| check(&t, Format::V2))
        };
        txn.abort()?;
        Ok(result)
    }

    fn damaged_key(result: Result<(), MetaError>) -> Option<Key> {
        match result {
            Err(MetaError::Damaged { key, .. }) => Some(key),
            _ => None,
        }
    }

    #[test]
    fn values_read_back_as_written() -> TestResult {
        let db = full()?;
        let txn = db.begin_read()?;
        let t = txn.open_table(META)?;
        let e = |e: MetaError| format!("{e:?}");
        assert_eq!(read_format(&t).map_err(e)?, Some(Found::Format(Format::V2)));
        assert_eq!(
            required_counter(&t, Counter::NextToken).map_err(e)?,
            1 << 40
        );
        assert_eq!(required_counter(&t, Counter::NextOutboxSeq).map_err(e)?, 1);
        assert_eq!(
            read_journal(&t, Format::V2).map_err(e)?,
            Some(StoredJournal {
                id: [7; 16],
                lsn: 41,
                clean: false
            })
        );
        assert_eq!(
            read_expiry(&t, Format::V2).map_err(e)?,
            Some((
                60_000,
                ExpiryPolicy::Tombstone {
                    keep: std::time::Duration::from_millis(9)
                }
            ))
        );
        assert!(damage(&t, Format::V2)?.is_empty());
        // Every key is stored, under its own name.
        let mut names: Vec<String> = Vec::new();
        for entry in t.iter()? {
            names.push(entry?.0.value().to_string());
        }
        let mut all: Vec<&str> = format_2_keys().map(Key::name).collect();
        all.sort_unstable();
        assert_eq!(names, all);
        Ok(())
    }

    #[test]
    fn every_bit_flip_of_every_value_names_its_key() -> TestResult {
        let db = full()?;
        for key in format_2_keys() {
            let good = stored(&db, key)?;
            for i in 0..good.len() {
                for bit in 0..8 {
                    let mut bad = good.clone();
                    bad[i] ^= 1 << bit;
                    let result = edited(&db, |t| t.insert(key.name(), bad.as_slice()).map(drop))?;
                    assert_eq!(
                        damaged_key(result),
                        Some(key),
                        "flip of bit {bit} of byte {i} of {}",
                        key.name()
                    );
                }
            }
            // Cut short, or longer.
            for len in 0..good.len() {
                let result = edited(&db, |t| t.insert(key.name(), &good[..len]).map(drop))?;
                assert_eq!(
                    damaged_key(result),
                    Some(key),
                    "{} cut to {len}",
                    key.name()
                );
            }
            let mut longer = good.clone();
            longer.push(0);
            let result = edited(&db, |t| t.insert(key.name(), longer.as_slice()).map(drop))?;
            assert_eq!(damaged_key(result), Some(key), "{} extended", key.name());
        }
        Ok(())
    }

    #[test]
    fn a_value_under_another_key_fails_its_checksum() -> TestResult {
        let db = full()?;
        let token = {
            let txn = db.begin_read()?;
            let t = txn.open_table(META)?;
            let v = t.get(Key::NextToken.name())?.ok_or("missing")?;
            v.value().to_vec()
        };
        let result = edited(&db, |t| {
            t.insert(Key::NextOutboxSeq.name(), token.as_slice())
                .map(drop)
        })?;
        assert_eq!(damaged_key(result), Some(Key::NextOutboxSeq));
        Ok(())
    }

    #[test]
    fn missing_values_are_damage_and_unknown_keys_are_listed() -> TestResult {
        let db = full()?;
        for (gone, named) in [
            (Key::NextToken, Key::NextToken),
            (Key::NextOutboxSeq, Key::NextOutboxSeq),
            (Key::JournalId, Key::JournalId),
            (Key::JournalLsn, Key::JournalLsn),
            (Key::JournalClean, Key::JournalClean),
            (Key::TtlMs, Key::TtlMs),
            (Key::ExpiryPolicy, Key::ExpiryPolicy),
        ] {
            let result = edited(&db, |t| t.remove(gone.name()).map(drop))?;
            assert_eq!(damaged_key(result), Some(named), "{} removed", gone.name());
        }
        // A key renamed by damage: its value is missing, and the new name
        // is one this build does not know.
        let txn = db.begin_write()?;
        {
            let mut t = txn.open_table(META)?;
            let v = t
                .remove(Key::NextToken.name())?
                .ok_or("missing")?
                .value()
                .to_vec();
            t.insert("next_tokem", v.as_slice())?;
            let found = damage(&t, Format::V2)?;
            let names: Vec<(&str, Option<Key>)> =
                found.iter().map(|p| (p.name.as_str(), p.key)).collect();
            assert_eq!(
                names,
                [("next_token", Some(Key::NextToken)), ("next_tokem", None)]
            );
            // Alone, a key this build does not know is not refused.
            t.insert(Key::NextToken.name(), v.as_slice())?;
            assert!(check(&t, Format::V2).is_ok());
            assert_eq!(damage(&t, Format::V2)?.len(), 1);
            // Nor is the format's absence taken for a new file.
            t.remove(Key::FormatVersion.name())?;
            assert!(matches!(
                read_format(&t),
                Err(MetaError::Damaged {
                    key: Key::FormatVersion,
                    ..
                })
            ));
        }
        txn.abort()?;
        Ok(())
    }

    #[test]
    fn the_format_is_read_as_codec_rs_says() -> TestResult {
        let db = Database::builder().create_with_backend(redb::backends::InMemoryBackend::new())?;
        let txn = db.begin_write()?;
        let mut t = txn.open_table(META)?;
        assert_eq!(read_format(&t).map_err(|e| format!("{e:?}"))?, None);
        let v2 = codec::encode_meta(Key::FormatVersion.name(), &[]);
        let mut flipped = v2.clone();
        flipped[0] = 3;
        let mut one_long = v2.clone();
        one_long[0] = 1;
        let mut unknown = vec![4];
        unknown.extend_from_slice(&[0; 8]);
        // Format 3's first byte with other bytes than its marker's.
        let mut not_marker = vec![3];
        not_marker.extend_from_slice(&[0; 8]);
        let marker = codec::format_3_marker();
        let cases: [(&[u8], Option<Found>); 10] = [
            (&[1], Some(Found::Format(Format::V1))),
            (&v2, Some(Found::Format(Format::V2))),
            (&marker, Some(Found::Format(Format::V3))),
            (&[2], Some(Found::PreRelease)),
            (&[99], Some(Found::Unknown(99))),
            (&unknown, Some(Found::Unknown(4))),
            (&not_marker, None),
            (&flipped, None),
            (&one_long, None),
            (&[], None),
        ];
        for (value, expected) in cases {
            t.insert(Key::FormatVersion.name(), value)?;
            match (read_format(&t), expected) {
                (Ok(found), Some(expected)) => assert_eq!(found, Some(expected), "{value:?}"),
                (
                    Err(MetaError::Damaged {
                        key: Key::FormatVersion,
                        ..
                    }),
                    None,
                ) => {}
                (other, _) => panic!("{value:?}: {other:?}"),
            }
        }
        // `[2]` beside bare values is a pre-release file; beside a value
        // that verifies, a format-2 file whose `format_version` was cut.
        t.insert(Key::FormatVersion.name(), [2_u8].as_slice())?;
        t.insert(Key::NextToken.name(), 9_u64.to_le_bytes().as_slice())?;
        assert_eq!(
            read_format(&t).map_err(|e| format!("{e:?}"))?,
            Some(Found::PreRelease)
        );
        write_counter(&mut t, Counter::NextToken, 9)?;
        assert!(matches!(
            read_format(&t),
            Err(MetaError::Damaged {
                key: Key::FormatVersion,
                ..
            })
        ));
        Ok(())
    }

    #[test]
    fn format_1_values_are_bare_and_still_checked_for_shape() -> TestResult {
        let db = Database::builder().create_with_backend(redb::backends::InMemoryBackend::new())?;
        let txn = db.begin_write()?;
        let mut t = txn.open_table(META)?;
        t.insert(Key::FormatVersion.name(), [1_u8].as_slice())?;
        t.insert(Key::NextToken.name(), 9_u64.to_le_bytes().as_slice())?;
        t.insert(Key::TtlMs.name(), 5_u64.to_le_bytes().as_slice())?;
        t.insert(Key::ExpiryPolicy.name(), [0_u8].as_slice())?;
        let e = |e: MetaError| format!("{e:?}");
        assert_eq!(read_format(&t).map_err(e)?, Some(Found::Format(Format::V1)));
        assert!(damage(&t, Format::V1)?.is_empty());
        assert_eq!(
            read_counter(&t, Counter::NextToken, Format::V1).map_err(e)?,
            Some(9)
        );
        assert_eq!(
            read_expiry(&t, Format::V1).map_err(e)?,
            Some((5, ExpiryPolicy::Forget))
        );
        // Format 1 never had to store its counters.
        assert_eq!(
            read_counter(&t, Counter::NextOutboxSeq, Format::V1).map_err(e)?,
            None
        );
        t.insert(Key::ExpiryPolicy.name(), [2_u8].as_slice())?;
        assert_eq!(damaged_key(check(&t, Format::V1)), Some(Key::ExpiryPolicy));
        Ok(())
    }

    /// Golden bytes of every meta value (format 2 is released: they may
    /// never change): each value as this build writes it, compared with
    /// committed hex, and the committed hex read back by the readers.
    /// Every value differs from the others, so a swapped key or payload
    /// fails too.
    #[test]
    fn meta_values_have_their_golden_bytes() -> TestResult {
        let golden: [(&str, &str); 8] = GOLDEN_META;
        let db = full()?;
        let txn = db.begin_write()?;
        {
            let mut t = txn.open_table(META)?;
            let mut stored = Vec::new();
            for entry in t.iter()? {
                let (k, v) = entry?;
                stored.push((k.value().to_string(), crate::store::record::hex(v.value())));
            }
            let stored: Vec<(&str, &str)> = stored
                .iter()
                .map(|(k, v)| (k.as_str(), v.as_str()))
                .collect();
            assert_eq!(stored, golden, "a meta value's encoding changed");
            // The other policy and the other clean flag.
            write_expiry(&mut t, 60_000, ExpiryPolicy::Forget)?;
            write_clean(&mut t, true)?;
            for (key, hex) in [
                (Key::ExpiryPolicy, GOLDEN_FORGET),
                (Key::JournalClean, GOLDEN_CLEAN),
            ] {
                let v = t.get(key.name())?.ok_or("missing")?;
                assert_eq!(crate::store::record::hex(v.value()), hex, "{key:?}");
            }
        }
        txn.abort()?;

        // The committed bytes read back.
        let unhex = |s: &str| -> Vec<u8> {
            (0..s.len() / 2)
                .map(|i| u8::from_str_radix(&s[2 * i..2 * i + 2], 16).unwrap_or(0))
                .collect()
        };
        let db = Database::builder().create_with_backend(redb::backends::InMemoryBackend::new())?;
        let txn = db.begin_write()?;
        {
            let mut t = txn.open_table(META)?;
            for (k, v) in golden {
                t.insert(k, unhex(v).as_slice())?;
            }
            let e = |e: MetaError| format!("{e:?}");
            assert_eq!(read_format(&t).map_err(e)?, Some(Found::Format(Format::V2)));
            assert!(damage(&t, Format::V2)?.is_empty());
            assert_eq!(
                required_counter(&t, Counter::NextToken).map_err(e)?,
                1 << 40
            );
            assert_eq!(required_counter(&t, Counter::NextOutboxSeq).map_err(e)?, 1);
            assert_eq!(
                read_journal(&t, Format::V2).map_err(e)?,
                Some(StoredJournal {
                    id: [7; 16],
                    lsn: 41,
                    clean: false
                })
            );
            let keep = std::time::Duration::from_millis(9);
            assert_eq!(
                read_expiry(&t, Format::V2).map_err(e)?,
                Some((60_000, ExpiryPolicy::Tombstone { keep }))
            );
            t.insert(Key::ExpiryPolicy.name(), unhex(GOLDEN_FORGET).as_slice())?;
            t.insert(Key::JournalClean.name(), unhex(GOLDEN_CLEAN).as_slice())?;
            assert_eq!(
                read_expiry(&t, Format::V2).map_err(e)?,
                Some((60_000, ExpiryPolicy::Forget))
            );
            assert!(read_journal(&t, Format::V2)
                .map_err(e)?
                .is_some_and(|j| j.clean));
        }
        txn.abort()?;
        Ok(())
    }

    /// The meta table of [`full`], in key order: (key, value as hex).
    const GOLDEN_META: [(&str, &str); 8] = [
        ("expiry_policy", "02010900000000000000ea32ab8f67a2cbce"),
        ("format_version", "025a75823fdb0ae6b9"),
        ("journal_clean", "0200015db6b188283a68"),
        (
            "journal_id",
            "020707070707070707070707070707070785fa432549e4b96e",
        ),
        ("journal_lsn", "0229000000000000000326db9665941dd0"),
        ("next_outbox_seq", "02010000000000000001ae52b25041ad00"),
        ("next_token", "020000000000010000411c2c2ca6c43c79"),
        ("ttl_ms", "0260ea000000000000ea77327e2208b663"),
    ];
    /// `expiry_policy` = forget, and `journal_clean` = clean.
    const GOLDEN_FORGET: &str = "0200f0cc02c63d5550d5";
    const GOLDEN_CLEAN: &str = "02018ed15df263cdb884";
}
