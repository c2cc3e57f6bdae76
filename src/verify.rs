//! What a scrub of the database found (see [`crate::Engine::verify`]).

use std::fmt;

/// The result of [`crate::Engine::verify`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct VerifyReport {
    /// How many records were checked.
    pub records: u64,
    /// Everything found wrong; empty when the file is sound as far as the
    /// engine can check.
    pub damage: Vec<Damage>,
}

impl VerifyReport {
    /// Whether nothing was found wrong.
    pub fn is_sound(&self) -> bool {
        self.damage.is_empty()
    }
}

/// One piece of damage a scrub found ([`crate::Engine::verify`]). Keys are kept as the stored record key
/// bytes in lower-case hex (`[scope length][scope][key]`), since a damaged
/// key may not be a valid key any more; `Display` shows `scope/key` where
/// the bytes still are one.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Damage {
    /// A record's stored key bytes are not a valid scope and key.
    BadKey {
        /// The stored key bytes, in hex.
        key_hex: String,
    },
    /// A record's value does not decode, or fails its checksum: its bytes
    /// or its key bytes were damaged (the reason says which check failed).
    /// A request for its key gets an error naming the key
    /// ([`crate::Error::Corrupt`]), never a replay.
    Undecodable {
        /// The stored key bytes, in hex.
        key_hex: String,
        /// What the decoder found.
        reason: String,
    },
    /// An index entry (lease, recovery or expiry) names a record that does
    /// not exist, or that its state and instants put elsewhere. A record
    /// whose key bytes were damaged shows up this way: its index entry
    /// still names the old key.
    StrayIndexEntry {
        /// `"leases"`, `"recovery"` or `"expiry"` (on Redis also
        /// `"listing"`, the list of every record, at 0 ms).
        index: &'static str,
        /// The entry's instant (ms since the Unix epoch).
        at_ms: u64,
        /// The record key it names, in hex.
        key_hex: String,
    },
    /// A record is missing from the index its state names: sweeps and the
    /// recovery queue would never find it.
    MissingIndexEntry {
        /// `"leases"`, `"recovery"` or `"expiry"` (on Redis also
        /// `"listing"`, the list of every record, at 0 ms).
        index: &'static str,
        /// The instant the record expects (ms since the Unix epoch).
        at_ms: u64,
        /// The record's key, in hex.
        key_hex: String,
    },
    /// A record a walk of the records table meets is not found by a lookup
    /// of its key: a page of the table's tree is damaged, so a request for
    /// this key (and maybe for others near it) would find no record and
    /// run the work again. Restore the file from a backup.
    UnreachableRecord {
        /// The stored key bytes, in hex.
        key_hex: String,
    },
    /// An outbox message does not decode or fails its checksum.
    UndecodableOutboxMessage {
        /// Its sequence number.
        seq: u64,
        /// What the decoder found.
        reason: String,
    },
    /// A dead letter does not decode or fails its checksum.
    UndecodableDeadLetter {
        /// Its sequence number.
        seq: u64,
        /// What the decoder found.
        reason: String,
    },
    /// An entity's state does not decode or fails its checksum.
    UndecodableEntity {
        /// The entity id.
        entity: String,
        /// What the decoder found.
        reason: String,
    },
    /// An effect step's value does not decode or fails its checksum.
    UndecodableStep {
        /// The key's stored bytes, in hex.
        key_hex: String,
        /// The step name as stored.
        step: String,
        /// What the decoder found.
        reason: String,
    },
    /// An entry of a key's evidence log does not decode or fails its
    /// checksum.
    UndecodableHistory {
        /// The key's stored bytes, in hex.
        key_hex: String,
        /// The entry's sequence number.
        seq: u32,
        /// What the decoder found.
        reason: String,
    },
    /// Effect steps or evidence-log entries are stored for a key that has
    /// no record where they are kept: no record of the key at all (redb
    /// format 2, PostgreSQL, Redis), or, in a format-3 redb file, none in
    /// the partition whose slot key holds them (a read finds a key's steps
    /// and log beside its record only). No build writes this: steps and
    /// log are deleted with their record (a tombstone is a record, and
    /// keeps one summary entry). The record was lost (look for other
    /// damage naming the key: a record whose key bytes changed is reported
    /// under its new key) or deleted by a bug; a format-2 file written by
    /// a development build from 2026-12-01 until a released resume kept
    /// its record (`Engine::purge`) can hold them too.
    ///
    /// Where a claim of the key reads them (redb format 2, PostgreSQL,
    /// Redis, and a format-3 file's hot partition, the one taking new
    /// keys), the key's next claim takes them over as its own and skips
    /// every call a confirmed step records, whatever request it carries.
    /// Elsewhere nothing reads them, and nothing deletes them. Ask the
    /// provider about the steps named. In redb format 2, PostgreSQL and
    /// Redis, `idem show` lists them and `idem purge --force` deletes them;
    /// `idem salvage` writes a copy of a redb file without them (listing
    /// them as lost).
    /// Entries in a format-3 partition a merge is dropping are not
    /// reported: its drop step deletes them, with a record or not.
    StepsWithoutRecord {
        /// The record key they are stored under, in hex.
        key_hex: String,
        /// Format-3 redb file: the partition whose slot key holds them;
        /// `None` elsewhere.
        partition: Option<u64>,
        /// Format-3 redb file: the partition that holds the key's record,
        /// if another one does (a read of the key sees that record's steps
        /// and log, never these); `None` if the key has no record.
        record_in: Option<u64>,
        /// The steps' names, as stored, in name order (empty: log entries
        /// only).
        steps: Vec<String>,
        /// How many evidence-log entries.
        log_entries: u64,
    },
    /// A key under the engine's Redis key prefix that the engine never
    /// writes (feature `redis`): something else writes under the prefix,
    /// and may overwrite the engine's keys too. Give that writer another
    /// prefix (or the engine one of its own).
    ForeignKey {
        /// The key, as stored (invalid UTF-8 shown lossily).
        key: String,
    },
    /// An entity a walk of the entities table meets is not found by a
    /// lookup of its id (a damaged page of the table's tree).
    UnreachableEntity {
        /// The entity id.
        entity: String,
    },
    /// A value of the meta table (redb: the format version, the next
    /// fencing token or outbox sequence number, the journal's id and
    /// position, the stored expiry settings) fails its checksum, has the
    /// wrong length for its key, or is missing where it must be; or the
    /// table holds a key the engine does not know (a damaged key). A
    /// writable open refuses such a file ([`crate::OpenError::Corrupt`]):
    /// restore it from a backup.
    BadMetaValue {
        /// The meta key, as stored.
        key: String,
        /// What is wrong with it.
        reason: String,
    },
    /// redb's page check fails: the check a writable open runs
    /// ([`crate::EngineBuilder::open`]), which verifies the checksum of
    /// every page of the file's trees. A writable open refuses this file
    /// ([`crate::OpenError::Corrupt`]); `idem salvage DAMAGED NEW` copies
    /// what still reads into a new file. redb stops at the first page that
    /// fails, so others may be damaged too.
    FailedPageCheck {
        /// redb's message.
        reason: String,
        /// The first page that fails, as `(offset, length)` in bytes of the
        /// file: the last page redb read before it refused. Offset 0 is
        /// redb's header (its commit slots). `None` if redb read no page.
        page: Option<(u64, u64)>,
        /// The engine tables with entries on that page, or reached through
        /// it (see [`Damage::EntriesOnDamagedPage`]); empty if none is
        /// (the page belongs to redb's own bookkeeping, or is the header);
        /// `None` if the file could not be walked to tell (it was not
        /// closed cleanly, or the walk itself failed).
        tables: Option<Vec<&'static str>>,
    },
    /// The journal beside the file (`<file>.journal`) cannot serve it:
    /// its header is damaged, it is another database's, or (after a
    /// crash) it lacks the frames the file needs. A writable open refuses
    /// the file ([`crate::OpenError::Journal`]), even one closed cleanly.
    /// Put back the journal the file was last used with; after a clean
    /// close, `idem salvage DAMAGED NEW` copies every record into a file
    /// with a fresh journal.
    UnusableJournal {
        /// What the open found wrong (its error message).
        detail: String,
    },
    /// Entries of an engine table lie on the page a
    /// [`Damage::FailedPageCheck`] names, or a lookup of their key passes
    /// through it: their stored bytes cannot be trusted. Entries on other
    /// pages read and pass their own checksums.
    EntriesOnDamagedPage {
        /// The table: `"records"`, `"leases"`, `"recovery"`, `"expiry"`,
        /// `"outbox"`, `"entities"`, `"meta"`, `"steps"` or `"history"`;
        /// in a format-3 file also `"partitions"` or `"filters"` (its
        /// records, steps and log entries shown as `p<partition> scope/key`).
        table: &'static str,
        /// The damaged page's offset in the file, in bytes.
        page_offset: u64,
        /// Every entry of the table is affected: the page is the table's
        /// root, or on the path to its definition.
        whole_table: bool,
        /// The keys a walk of the table met there (records as `scope/key`,
        /// index entries as `instant_ms scope/key`, outbox messages as
        /// `#seq`, entities and meta keys quoted), as read: a damaged key
        /// is shown as it reads now. Capped at 1,000. Entries a walk cannot
        /// read at all are not listed: `after` and `before` bound them.
        keys: Vec<String>,
        /// More keys were met than `keys` holds.
        more: u64,
        /// The last key before the damaged ones that reads cleanly, if
        /// any: entries at or before it are not affected.
        after: Option<String>,
        /// The first key after the damaged ones that reads cleanly, if any:
        /// entries at or after it are not affected.
        before: Option<String>,
    },
    /// A record key is stored in more than one partition of a format-3
    /// redb file (time-partitioned records): a lookup answers from the
    /// newest and never sees the others, so they are stale copies.
    DuplicateRecord {
        /// The record key, in hex.
        key_hex: String,
        /// The partitions holding it, ascending.
        partitions: Vec<u64>,
    },
    /// A partition of a format-3 redb file is damaged: its row does not
    /// decode, records lie in a partition without a row, two partitions
    /// take new keys, or a sealed partition's key filter is missing,
    /// damaged, counts other keys than its records, or says "absent" for
    /// one of them. A lookup never trusts a filter it cannot check (it
    /// reads the partition instead), and the next writable open rebuilds
    /// a filter that fails its checks; a filter that passes them but
    /// misses a key would hide that key's record, which this reports.
    BadPartition {
        /// The partition number.
        partition: u64,
        /// What is wrong.
        reason: String,
    },
}

/// A record key for people: `scope/key` when its bytes still are a valid
/// key, else the hex as stored.
pub(crate) fn shown(key_hex: &str) -> String {
    let bytes: Option<Vec<u8>> = (0..key_hex.len())
        .step_by(2)
        .map(|i| {
            key_hex
                .get(i..i + 2)
                .and_then(|pair| u8::from_str_radix(pair, 16).ok())
        })
        .collect();
    bytes
        .as_deref()
        .and_then(crate::key::IdempotencyKey::from_record_key)
        .map_or_else(|| key_hex.to_string(), |key| key.to_string())
}

/// The `Display` of a value that does not decode outside the records
/// table (outbox, entities, effect steps, the evidence log, dead letters),
/// and of a foreign key under a Redis prefix.
fn fmt_value_damage(d: &Damage, f: &mut fmt::Formatter<'_>) -> fmt::Result {
    match d {
        Damage::UndecodableOutboxMessage { seq, reason } => {
            write!(f, "outbox message #{seq} does not decode: {reason}")
        }
        Damage::UndecodableEntity { entity, reason } => {
            write!(f, "entity {entity:?} does not decode: {reason}")
        }
        Damage::ForeignKey { key } => write!(
            f,
            "key {key:?} under the engine's Redis prefix was not written by the engine"
        ),
        Damage::UndecodableDeadLetter { seq, reason } => {
            write!(f, "dead letter #{seq} does not decode: {reason}")
        }
        Damage::UndecodableStep {
            key_hex,
            step,
            reason,
        } => write!(
            f,
            "effect step {step:?} of {} does not decode: {reason}",
            shown(key_hex)
        ),
        Damage::UndecodableHistory {
            key_hex,
            seq,
            reason,
        } => write!(
            f,
            "evidence log entry #{seq} of {} does not decode: {reason}",
            shown(key_hex)
        ),
        _ => Ok(()),
    }
}

/// The `Display` of [`Damage::StepsWithoutRecord`].
fn fmt_steps_without_record(d: &Damage, f: &mut fmt::Formatter<'_>) -> fmt::Result {
    let Damage::StepsWithoutRecord {
        key_hex,
        partition,
        record_in,
        steps,
        log_entries,
    } = d
    else {
        return Ok(());
    };
    let entries = match log_entries {
        1 => "1 evidence log entry".to_string(),
        n => format!("{n} evidence log entries"),
    };
    match (steps.as_slice(), log_entries) {
        ([], _) => f.write_str(&entries)?,
        ([one], 0) => write!(f, "effect step {one:?}")?,
        (names, 0) => write!(f, "effect steps {names:?}")?,
        ([one], _) => write!(f, "effect step {one:?} and {entries}")?,
        (names, _) => write!(f, "effect steps {names:?} and {entries}")?,
    }
    write!(f, " of {} ", shown(key_hex))?;
    match (partition, record_in) {
        (None, _) => f.write_str("are stored without a record of the key"),
        (Some(p), None) => write!(
            f,
            "are stored in partition {p}, and the key has no record"
        ),
        (Some(p), Some(q)) => write!(
            f,
            "are stored in partition {p}, its record in partition {q}: a read of the key never sees them"
        ),
    }
}

/// The `Display` of damage only a format-3 redb file can have.
fn fmt_partition_damage(d: &Damage, f: &mut fmt::Formatter<'_>) -> fmt::Result {
    match d {
        Damage::DuplicateRecord {
            key_hex,
            partitions,
        } => write!(
            f,
            "record {} is stored in partitions {partitions:?}: a lookup sees only the newest",
            shown(key_hex)
        ),
        Damage::BadPartition { partition, reason } => {
            write!(f, "partition {partition} is damaged: {reason}")
        }
        _ => Ok(()),
    }
}

/// The `Display` of [`Damage::FailedPageCheck`].
fn fmt_failed_page_check(d: &Damage, f: &mut fmt::Formatter<'_>) -> fmt::Result {
    let Damage::FailedPageCheck {
        reason,
        page,
        tables,
    } = d
    else {
        return Ok(());
    };
    write!(
        f,
        "redb's page check fails (a writable open refuses the file): {reason}"
    )?;
    match page {
        Some((0, len)) => write!(f, "; first failing page: bytes 0..{len} (redb's header)")?,
        Some((offset, len)) => write!(
            f,
            "; first failing page: bytes {offset}..{} of the file",
            offset.saturating_add(*len)
        )?,
        None => {}
    }
    match tables.as_deref() {
        Some([]) => f.write_str("; no entry of the engine's tables lies on it")?,
        Some(names) => write!(f, "; it holds entries of: {}", names.join(", "))?,
        None => f.write_str("; which entries it holds is not known")?,
    }
    f.write_str("; `idem salvage DAMAGED NEW` copies what still reads")
}

impl fmt::Display for Damage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Damage::BadKey { key_hex } => {
                write!(f, "record key {key_hex} is not a valid scope and key")
            }
            Damage::Undecodable { key_hex, reason } => {
                write!(f, "record {} does not decode: {reason}", shown(key_hex))
            }
            Damage::StrayIndexEntry {
                index,
                at_ms,
                key_hex,
            } => write!(
                f,
                "{index} index entry at {at_ms} ms names record {}, which is missing or belongs elsewhere",
                shown(key_hex)
            ),
            Damage::MissingIndexEntry {
                index,
                at_ms,
                key_hex,
            } => write!(
                f,
                "record {} is missing from the {index} index (expected at {at_ms} ms)",
                shown(key_hex)
            ),
            Damage::UnreachableRecord { key_hex } => write!(
                f,
                "record {} is stored but a lookup of its key does not find it (a damaged page of the records table)",
                shown(key_hex)
            ),
            Damage::DuplicateRecord { .. } | Damage::BadPartition { .. } => {
                fmt_partition_damage(self, f)
            }
            Damage::StepsWithoutRecord { .. } => fmt_steps_without_record(self, f),
            Damage::UnreachableEntity { entity } => write!(
                f,
                "entity {entity:?} is stored but a lookup of its id does not find it (a damaged page of the entities table)"
            ),
            Damage::UndecodableOutboxMessage { .. }
            | Damage::UndecodableEntity { .. }
            | Damage::UndecodableStep { .. }
            | Damage::UndecodableHistory { .. }
            | Damage::ForeignKey { .. }
            | Damage::UndecodableDeadLetter { .. } => fmt_value_damage(self, f),
            Damage::BadMetaValue { key, reason } => {
                write!(f, "meta value {key:?} is damaged: {reason}")
            }
            Damage::UnusableJournal { detail } => write!(
                f,
                "the journal cannot serve the file (a writable open refuses it): {detail}"
            ),
            Damage::FailedPageCheck { .. } => fmt_failed_page_check(self, f),
            Damage::EntriesOnDamagedPage {
                table,
                page_offset,
                whole_table,
                keys,
                more,
                after,
                before,
            } => {
                if *whole_table {
                    write!(f, "every entry of the {table} table is reached through the damaged page at byte {page_offset}:")?;
                } else {
                    write!(f, "{table} entries on the damaged page at byte {page_offset}:")?;
                }
                if !keys.is_empty() {
                    write!(f, " {}", keys.join(", "))?;
                    if *more > 0 {
                        write!(f, " and {more} more")?;
                    }
                }
                match (after, before) {
                    (Some(a), Some(b)) => write!(f, " (keys after {a} and before {b} are in doubt)"),
                    (Some(a), None) => write!(f, " (keys after {a} are in doubt)"),
                    (None, Some(b)) => write!(f, " (keys before {b} are in doubt)"),
                    (None, None) => Ok(()),
                }
            }
        }
    }
}
