//! Scrubbing a PostgreSQL store: every record decodes under a valid key,
//! and the columns the partial indexes order by agree with the record, so
//! sweeps and the recovery queue find it; every effect step and log entry
//! decodes, and its key has a record.

use std::collections::BTreeMap;

use crate::error::Result;
use crate::key::IdempotencyKey;
use crate::store::codec;
use crate::store::record::hex;
use crate::verify::Damage;

use super::client::{PgError, Transaction};
use super::schema::Names;
use super::shared::Shared;
use super::txn::{sql_i64, sql_u64, state_code, with_token};
use crate::key::record_key;

/// Rows fetched at a time: the scrub holds one page of records in memory,
/// never the whole table.
const PAGE_ROWS: i32 = 1_000;

impl Shared {
    /// Checks every record in one snapshot (a read-only `REPEATABLE READ`
    /// transaction), streamed through a cursor [`PAGE_ROWS`] rows at a
    /// time. Returns the problems found and the number of records checked.
    pub(super) fn verify(&self) -> Result<(Vec<Damage>, u64)> {
        let what = "verifying the database";
        let sql = format!(
            "SELECT scope, key, state, token, lease_until_ms, unknown_since_ms, expires_at_ms, record
             FROM {} ORDER BY scope, key",
            self.names.records
        );
        let declare = format!("DECLARE idempotency_verify NO SCROLL CURSOR FOR {sql}");
        let fetch = format!("FETCH {PAGE_ROWS} FROM idempotency_verify");
        let steps_table = self.names.steps.clone();
        let history_table = self.names.history.clone();
        let letters_table = self.names.dead_letters.clone();
        let select_letters = format!("SELECT seq, letter FROM {letters_table} ORDER BY seq");
        let declare_steps = format!(
            "DECLARE idempotency_verify_steps NO SCROLL CURSOR FOR
             SELECT scope, key, name, step FROM {steps_table} ORDER BY scope, key, name"
        );
        let fetch_steps = format!("FETCH {PAGE_ROWS} FROM idempotency_verify_steps");
        let declare_history = format!(
            "DECLARE idempotency_verify_history NO SCROLL CURSOR FOR
             SELECT scope, key, seq, entry FROM {history_table} ORDER BY scope, key, seq"
        );
        let fetch_history = format!("FETCH {PAGE_ROWS} FROM idempotency_verify_history");
        self.read(what, |conn| {
            let mut tx =
                conn.transaction_with("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")?;
            tx.batch_execute(&declare)?;
            let fetch = tx.prepare(&fetch)?;
            let mut problems = Vec::new();
            let mut checked = 0;
            loop {
                let rows = tx.query(&fetch, &[])?;
                if rows.is_empty() {
                    break;
                }
                for row in &rows {
                    checked += 1;
                    check_row(row, &mut problems);
                }
            }
            // Effect steps and log entries, in the same snapshot (tables
            // a schema no writable open of this build touched may lack).
            if table_exists(&mut tx, &steps_table)? {
                tx.batch_execute(&declare_steps)?;
                let fetch = tx.prepare(&fetch_steps)?;
                loop {
                    let rows = tx.query(&fetch, &[])?;
                    if rows.is_empty() {
                        break;
                    }
                    for row in &rows {
                        let (scope, key, name): (&str, &str, &str) =
                            (row.get(0), row.get(1), row.get(2));
                        let rkey = record_key(scope, key);
                        if let Err(e) = codec::decode_step(&rkey, name, row.get::<_, &[u8]>(3)) {
                            problems.push(Damage::UndecodableStep {
                                key_hex: hex(&rkey),
                                step: name.to_owned(),
                                reason: e.to_string(),
                            });
                        }
                    }
                }
            }
            if table_exists(&mut tx, &history_table)? {
                tx.batch_execute(&declare_history)?;
                let fetch = tx.prepare(&fetch_history)?;
                loop {
                    let rows = tx.query(&fetch, &[])?;
                    if rows.is_empty() {
                        break;
                    }
                    for row in &rows {
                        let (scope, key): (&str, &str) = (row.get(0), row.get(1));
                        let seq = u32::try_from(row.get::<_, i64>(2)).unwrap_or(u32::MAX);
                        let rkey = record_key(scope, key);
                        if let Err(e) = codec::decode_history(&rkey, seq, row.get::<_, &[u8]>(3)) {
                            problems.push(Damage::UndecodableHistory {
                                key_hex: hex(&rkey),
                                seq,
                                reason: e.to_string(),
                            });
                        }
                    }
                }
            }
            problems.extend(steps_without_record(&mut tx, &self.names)?);
            // Dead letters: an operator's short list, read whole.
            if table_exists(&mut tx, &letters_table)? {
                problems.extend(
                    tx.query(&select_letters, &[])?
                        .iter()
                        .filter_map(letter_damage),
                );
            }
            tx.commit()?;
            Ok((problems, checked))
        })
    }
}

/// Whether the table `name` exists in `tx`'s snapshot (the steps, log and
/// dead-letter tables a schema no writable open of this build touched may
/// lack).
fn table_exists(tx: &mut Transaction<'_>, name: &str) -> std::result::Result<bool, PgError> {
    tx.query_one("SELECT to_regclass($1) IS NOT NULL", &[&name])
        .map(|row| row.get::<_, bool>(0))
}

/// One report per key with effect steps or log entries (where those
/// tables exist) but no record row, from the snapshot of `tx`. No build
/// writes them: every write that deletes a record deletes its steps and
/// log in the same transaction, and a step is written only while its
/// record's row holds the claim (`in_place.rs` too).
fn steps_without_record(
    tx: &mut Transaction<'_>,
    names: &Names,
) -> std::result::Result<Vec<Damage>, PgError> {
    let (steps, history, records) = (&names.steps, &names.history, &names.records);
    // Record key → (step names, log entries).
    let mut without: BTreeMap<Vec<u8>, (Vec<String>, u64)> = BTreeMap::new();
    for (table, agg) in [
        (steps, "array_agg(t.name ORDER BY t.name)"),
        (history, "count(*)"),
    ] {
        if !table_exists(tx, table)? {
            continue;
        }
        let sql = format!(
            "SELECT t.scope, t.key, {agg} FROM {table} t
             WHERE NOT EXISTS (SELECT 1 FROM {records} r WHERE r.scope = t.scope AND r.key = t.key)
             GROUP BY t.scope, t.key"
        );
        for row in tx.query(&sql, &[])? {
            let entry = without
                .entry(record_key(row.get(0), row.get(1)))
                .or_default();
            if table == steps {
                entry.0 = row.get(2);
            } else {
                entry.1 = sql_u64(row.get(2));
            }
        }
    }
    Ok(without
        .into_iter()
        .map(|(rkey, (steps, log_entries))| Damage::StepsWithoutRecord {
            key_hex: hex(&rkey),
            partition: None,
            record_in: None,
            steps,
            log_entries,
        })
        .collect())
}

/// One record row: its key is valid, its record decodes, and the indexed
/// columns agree with the record.
fn check_row(row: &tokio_postgres::Row, problems: &mut Vec<Damage>) {
    let (scope, key): (&str, &str) = (row.get(0), row.get(1));
    let key_hex = hex(&record_key(scope, key));
    if IdempotencyKey::parse_any(scope, key).is_err() {
        problems.push(Damage::BadKey {
            key_hex: key_hex.clone(),
        });
    }
    let token = sql_u64(row.get::<_, i64>(3));
    let decoded = codec::decode(&record_key(scope, key), row.get::<_, &[u8]>(7));
    let rec = match decoded {
        Ok(rec) => match IdempotencyKey::parse_any(scope, key) {
            Ok(k) => with_token(rec, token, &k),
            Err(_) => rec,
        },
        Err(e) => {
            problems.push(Damage::Undecodable {
                key_hex,
                reason: e.to_string(),
            });
            return;
        }
    };
    let columns = (
        row.get::<_, i16>(2),
        row.get::<_, i64>(3),
        row.get::<_, i64>(4),
        row.get::<_, i64>(5),
        row.get::<_, i64>(6),
    );
    let expected = (
        state_code(rec.state),
        sql_i64(rec.token),
        sql_i64(rec.lease_until_ms),
        sql_i64(rec.unknown_since_ms),
        sql_i64(rec.expires_at_ms),
    );
    if columns != expected {
        let (index, at_ms) = rec.index();
        problems.push(Damage::MissingIndexEntry {
            index,
            at_ms,
            key_hex,
        });
    }
}

/// The damage of one dead-letter row (`seq`, `letter`), if it does not
/// decode under its seq.
fn letter_damage(row: &tokio_postgres::Row) -> Option<Damage> {
    let seq = u64::try_from(row.get::<_, i64>(0)).unwrap_or(0);
    codec::decode_dead_letter(seq, row.get::<_, &[u8]>(1))
        .err()
        .map(|e| Damage::UndecodableDeadLetter {
            seq,
            reason: e.to_string(),
        })
}
