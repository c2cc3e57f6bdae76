//! One function per subcommand. Each takes an open [`Engine`] and writes its
//! report to a generic writer, so tests can run it against a buffer.
//!
//! Durations mean one thing in every view (cli/README.md, "Reading the
//! views"): AGE and `age_ms` are the time since the record's claim was
//! taken (`claimed_at_ms`); IN DOUBT, `in_doubt_ms` and `stats`' "max in
//! doubt" are the time since a record became in doubt (UNKNOWN, or its
//! lease ended).

use std::error::Error as StdError;
use std::fmt;
use std::io::Write;

use idempotency::{
    Actor, Corrupted, Damage, Engine, Envelope, HistoryEntry, IdempotencyKey, InDoubt, PurgeMode,
    RecordFilter, RecordInfo, Resolution, State, StepInfo, StepResolution, StepState,
};
use serde_json::{json, Value};

use crate::envelope_json;
use crate::render::{
    self, bytes_for_line, bytes_for_terminal, escape_controls, evidence, human_ms, relative, when,
};

/// What a command returns: any error, printed by `main` on one line.
pub type CliResult<T = ()> = Result<T, Box<dyn StdError>>;

/// A failure the CLI itself decided on (a refusal, a missing record).
#[derive(Debug)]
pub struct CliError(pub String);

impl fmt::Display for CliError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl StdError for CliError {}

fn print_json<W: Write>(out: &mut W, value: &Value) -> CliResult {
    serde_json::to_writer_pretty(&mut *out, value)?;
    writeln!(out)?;
    Ok(())
}

/// A note for records whose stored state is not what a `begin` would see
/// now (records are listed as stored; expiry and leases are decided at read
/// time).
fn read_time_note(info: &RecordInfo, now: u64) -> Option<&'static str> {
    match (info.state, info.lease_until_ms, info.expires_at_ms) {
        (State::Processing, Some(lease), _) if lease <= now => {
            Some("lease ran out: counts as UNKNOWN")
        }
        (State::Completed | State::FinalFailure | State::Tombstone, _, Some(exp)) if exp <= now => {
            Some("expired, not yet swept")
        }
        _ => None,
    }
}

/// `idem inspect`: records in key order, corrupt ones included as rows.
pub fn inspect<W: Write>(
    engine: &Engine,
    filter: &RecordFilter,
    json: bool,
    out: &mut W,
) -> CliResult {
    let now = engine.clock().now_ms();
    let rows = engine.records(filter)?;
    if json {
        let items: Vec<Value> = rows
            .iter()
            .map(|row| match row {
                Ok(info) => json!({
                    "scope": info.key.scope(),
                    "key": info.key.key(),
                    "state": info.state.as_str(),
                    "fingerprint": info.fingerprint.to_hex(),
                    "fencing_token": info.fencing_token,
                    "claimed_at_ms": info.claimed_at_ms,
                    "updated_at_ms": info.updated_at_ms,
                    "age_ms": now.saturating_sub(info.claimed_at_ms),
                    "status": info.response.as_ref().map(|r| r.status),
                    "note": read_time_note(info, now),
                }),
                Err(e) => corrupt_json(e),
            })
            .collect();
        return print_json(out, &Value::Array(items));
    }
    if rows.is_empty() {
        writeln!(out, "no records")?;
        return Ok(());
    }
    let table: Vec<Vec<String>> = rows
        .iter()
        .map(|row| match row {
            Ok(info) => {
                let mut state = info.state.to_string();
                if let Some(note) = read_time_note(info, now) {
                    state = format!("{state} ({note})");
                }
                vec![
                    escape_controls(info.key.scope()),
                    escape_controls(info.key.key()),
                    state,
                    human_ms(now.saturating_sub(info.claimed_at_ms)),
                    human_ms(now.saturating_sub(info.updated_at_ms)),
                    info.fingerprint.to_hex()[..12].to_string(),
                    info.response
                        .as_ref()
                        .map_or_else(|| "-".to_string(), |r| r.status.to_string()),
                ]
            }
            Err(e) => {
                let (key, _) = corrupt_parts(e);
                vec![
                    "?".into(),
                    escape_controls(&key),
                    "CORRUPT".into(),
                    "-".into(),
                    "-".into(),
                    "-".into(),
                    escape_controls(&e.to_string()),
                ]
            }
        })
        .collect();
    let header = [
        "SCOPE",
        "KEY",
        "STATE",
        "AGE",
        "UPDATED",
        "FINGERPRINT",
        "STATUS",
    ];
    render::table(out, &header, &table)?;
    Ok(())
}

/// The key and reason of a row that did not decode.
fn corrupt_parts(e: &idempotency::Error) -> (String, String) {
    match e {
        idempotency::Error::Corrupt {
            what: Corrupted::Record(key),
            reason,
        } => (key.to_string(), reason.clone()),
        idempotency::Error::Corrupt {
            what: Corrupted::RecordKey(key_hex),
            reason,
        } => (key_hex.clone(), reason.clone()),
        other => ("?".into(), other.to_string()),
    }
}

fn corrupt_json(e: &idempotency::Error) -> Value {
    let (key, reason) = corrupt_parts(e);
    json!({ "key": key, "state": "CORRUPT", "error": reason })
}

/// `idem show`: one record with every field and its stored response.
pub fn show<W: Write>(engine: &Engine, key: &IdempotencyKey, json: bool, out: &mut W) -> CliResult {
    let now = engine.clock().now_ms();
    let record = engine.record(key)?;
    let steps = engine.steps(key)?;
    let history = engine.history(key)?;
    let Some(info) = record else {
        if steps.is_empty() && history.is_empty() {
            return Err(CliError(format!("no record for {key}")).into());
        }
        // Only a store written before a released resume kept its record
        // (see `purge_record_less`) holds steps without one.
        return Err(CliError(format!(
            "no record for {key}, but {} effect step(s) and {} log entries left without one \
             by an older version; `idem purge --force` deletes them",
            steps.len(),
            history.len()
        ))
        .into());
    };
    if json {
        let mut value = record_json(&info, now);
        value["steps"] = Value::Array(steps.iter().map(step_json).collect());
        value["history"] = Value::Array(history.iter().map(history_json).collect());
        return print_json(out, &value);
    }
    let opt_when = |t: Option<u64>| t.map_or_else(|| "-".to_string(), |t| when(t, now));
    let or_dash = |s: &str| {
        if s.is_empty() {
            "-".to_string()
        } else {
            escape_controls(s)
        }
    };
    let mut fields: Vec<(&str, String)> = vec![
        ("scope", escape_controls(info.key.scope())),
        ("key", escape_controls(info.key.key())),
        ("state", info.state.to_string()),
        (
            "fingerprint",
            format!(
                "{} (algorithm v{})",
                info.fingerprint.to_hex(),
                info.fingerprint_version
            ),
        ),
        ("fencing token", info.fencing_token.to_string()),
        ("reference", or_dash(&info.reference)),
        ("claimed at", when(info.claimed_at_ms, now)),
        ("updated at", when(info.updated_at_ms, now)),
        ("lease until", opt_when(info.lease_until_ms)),
        ("expires at", opt_when(info.expires_at_ms)),
        ("unknown since", opt_when(info.unknown_since_ms)),
        ("attempts", info.attempts.to_string()),
        ("reason", or_dash(current_reason(&info).unwrap_or(""))),
        ("resource", or_dash(info.resource.as_deref().unwrap_or(""))),
    ];
    if let Some(reason) = earlier_reason(&info) {
        fields.push(("was in doubt", escape_controls(reason)));
    }
    if let Some(note) = read_time_note(&info, now) {
        fields.push(("note", note.to_string()));
    }
    for (name, value) in fields {
        writeln!(out, "{:<15}{value}", format!("{name}:"))?;
    }
    match &info.response {
        None => writeln!(out, "{:<15}-", "response:")?,
        Some(env) => write_envelope(out, env)?,
    }
    write_steps(out, &steps)?;
    write_history(out, &history, now)?;
    Ok(())
}

/// Whether a step still waits for its provider's answer (the key cannot
/// settle before it has).
fn unsettled(step: &StepInfo) -> bool {
    !step.state.is_settled()
}

/// Who made a history entry: `claim #7`, `resolver`, `operator (REASON)`,
/// `sweeper`.
fn actor_text(actor: &Actor) -> String {
    match actor {
        Actor::Claim { fencing_token } => format!("claim #{fencing_token}"),
        Actor::Resolver => "resolver".to_string(),
        Actor::Operator { reason } => format!("operator ({})", escape_controls(reason)),
        Actor::Sweeper => "sweeper".to_string(),
        other => escape_controls(&other.to_string()),
    }
}

fn actor_json(actor: &Actor) -> Value {
    match actor {
        Actor::Claim { fencing_token } => json!({"kind": "claim", "fencing_token": fencing_token}),
        Actor::Resolver => json!({"kind": "resolver"}),
        Actor::Operator { reason } => json!({"kind": "operator", "reason": reason}),
        Actor::Sweeper => json!({"kind": "sweeper"}),
        other => json!({"kind": other.to_string()}),
    }
}

/// Evidence bytes in JSON: `text` when they are valid UTF-8, else `hex`;
/// always the whole value (the text views truncate).
fn evidence_json(bytes: &[u8]) -> Value {
    match std::str::from_utf8(bytes) {
        Ok(text) => json!({"bytes": bytes.len(), "text": text}),
        Err(_) => json!({"bytes": bytes.len(), "hex": render::hex(bytes)}),
    }
}

fn step_json(step: &StepInfo) -> Value {
    json!({
        "name": step.name,
        "reference": step.reference,
        "state": step.state.as_str(),
        "attempts": step.attempts,
        "reserved_at_ms": step.reserved_at_ms,
        "settled_at_ms": step.settled_at_ms,
        "age_ms": duration_ms(step.age),
        "evidence": step.evidence.as_deref().map(evidence_json),
    })
}

fn history_json(entry: &HistoryEntry) -> Value {
    json!({
        "seq": entry.seq,
        "at_ms": entry.at_ms,
        "actor": actor_json(&entry.actor),
        "step": entry.step,
        "from": entry.from,
        "to": entry.to,
        "evidence": evidence_json(&entry.evidence),
    })
}

/// `show`'s steps: name, reference, state, attempts, age, evidence.
fn write_steps<W: Write>(out: &mut W, steps: &[StepInfo]) -> CliResult {
    if steps.is_empty() {
        writeln!(out, "{:<15}-", "steps:")?;
        return Ok(());
    }
    writeln!(out, "steps:")?;
    let rows: Vec<Vec<String>> = steps
        .iter()
        .map(|s| {
            vec![
                format!("  {}", escape_controls(&s.name)),
                escape_controls(&s.reference),
                s.state.as_str().to_string(),
                s.attempts.to_string(),
                human_ms(duration_ms(s.age)),
                s.evidence
                    .as_deref()
                    .map_or_else(|| "-".to_string(), evidence),
            ]
        })
        .collect();
    let header = [
        "  NAME",
        "REFERENCE",
        "STATE",
        "ATTEMPTS",
        "AGE",
        "EVIDENCE",
    ];
    render::table(out, &header, &rows)?;
    Ok(())
}

/// `show`'s history, oldest first: when, who, what (`charge: RESERVED ->
/// CONFIRMED`, or the operation's own move), evidence.
fn write_history<W: Write>(out: &mut W, history: &[HistoryEntry], now: u64) -> CliResult {
    if history.is_empty() {
        writeln!(out, "{:<15}-", "history:")?;
        return Ok(());
    }
    writeln!(out, "history:")?;
    let rows: Vec<Vec<String>> = history
        .iter()
        .map(|h| {
            let what = format!(
                "{}: {} -> {}",
                h.step
                    .as_deref()
                    .map_or_else(|| "operation".to_string(), escape_controls),
                // A new step's first entry has no state before it.
                if h.from.is_empty() {
                    "new".to_string()
                } else {
                    escape_controls(&h.from)
                },
                escape_controls(&h.to)
            );
            vec![
                format!("  {}", when(h.at_ms, now)),
                actor_text(&h.actor),
                what,
                if h.evidence.is_empty() {
                    "-".to_string()
                } else {
                    evidence(&h.evidence)
                },
            ]
        })
        .collect();
    render::table(out, &["  WHEN", "WHO", "WHAT", "EVIDENCE"], &rows)?;
    Ok(())
}

/// Why the record is in doubt, for an UNKNOWN record only.
fn current_reason(info: &RecordInfo) -> Option<&str> {
    (info.state == State::Unknown).then_some(info.reason.as_str())
}

/// Why a record that is no longer UNKNOWN was in doubt before it was
/// settled. The library keeps an UNKNOWN record's reason when the record
/// is settled (resolved as completed, or completed late by its holder), and
/// [`RecordInfo::reason`] reports it in every state: it is history there,
/// not the record's current condition.
fn earlier_reason(info: &RecordInfo) -> Option<&str> {
    (info.state != State::Unknown && !info.reason.is_empty()).then_some(info.reason.as_str())
}

fn write_envelope<W: Write>(out: &mut W, env: &Envelope) -> CliResult {
    writeln!(out, "response:")?;
    writeln!(out, "  {:<13}{}", "schema:", env.schema_version)?;
    writeln!(out, "  {:<13}{}", "status:", env.status)?;
    if env.headers.is_empty() {
        writeln!(out, "  {:<13}-", "headers:")?;
    } else {
        writeln!(out, "  headers:")?;
        for (name, value) in &env.headers {
            writeln!(
                out,
                "    {}: {}",
                escape_controls(name),
                bytes_for_line(value)
            )?;
        }
    }
    writeln!(out, "  {:<13}{}", "body:", bytes_for_terminal(&env.body))?;
    Ok(())
}

fn record_json(info: &RecordInfo, now: u64) -> Value {
    json!({
        "scope": info.key.scope(),
        "key": info.key.key(),
        "state": info.state.as_str(),
        "fingerprint": info.fingerprint.to_hex(),
        "fingerprint_version": info.fingerprint_version,
        "fencing_token": info.fencing_token,
        "reference": info.reference,
        "claimed_at_ms": info.claimed_at_ms,
        "updated_at_ms": info.updated_at_ms,
        "lease_until_ms": info.lease_until_ms,
        "expires_at_ms": info.expires_at_ms,
        "unknown_since_ms": info.unknown_since_ms,
        "attempts": info.attempts,
        "reason": current_reason(info),
        "was_in_doubt": earlier_reason(info),
        "resource": info.resource,
        "response": info.response.as_ref().map(envelope_json::to_json),
        "note": read_time_note(info, now),
    })
}

/// `idem unknown`: records in doubt awaiting recovery, oldest first: UNKNOWN
/// ones and PROCESSING ones whose lease has ended.
pub fn unknown<W: Write>(engine: &Engine, limit: usize, json: bool, out: &mut W) -> CliResult {
    let now = engine.clock().now_ms();
    let pending = engine.in_doubt(limit)?;
    if json {
        let items: Vec<Value> = pending
            .iter()
            .map(|p| {
                json!({
                    "scope": p.key.scope(),
                    "key": p.key.key(),
                    "reference": p.reference,
                    "fencing_token": p.fencing_token,
                    "attempts": p.attempts,
                    "claimed_at_ms": p.claimed_at_ms,
                    "unknown_since_ms": p.unknown_since_ms,
                    "age_ms": now.saturating_sub(p.claimed_at_ms),
                    "in_doubt_ms": duration_ms(p.age),
                    "reason": p.reason,
                    "steps": p.steps.iter().filter(|s| unsettled(s)).map(step_json).collect::<Vec<_>>(),
                    "resumable": p.is_resumable(),
                })
            })
            .collect();
        return print_json(out, &Value::Array(items));
    }
    if pending.is_empty() {
        writeln!(out, "no UNKNOWN records")?;
        return Ok(());
    }
    let rows: Vec<Vec<String>> = pending
        .iter()
        .map(|p| {
            vec![
                escape_controls(p.key.scope()),
                escape_controls(p.key.key()),
                escape_controls(&p.reference),
                p.attempts.to_string(),
                human_ms(now.saturating_sub(p.claimed_at_ms)),
                human_ms(duration_ms(p.age)),
                unsettled_steps(p),
                escape_controls(&p.reason),
            ]
        })
        .collect();
    let header = [
        "SCOPE",
        "KEY",
        "REFERENCE",
        "ATTEMPTS",
        "AGE",
        "IN DOUBT",
        "UNSETTLED STEPS",
        "REASON",
    ];
    render::table(out, &header, &rows)?;
    Ok(())
}

/// The UNSETTLED STEPS cell: `charge (UNKNOWN, 3 attempts, 42s)` for each
/// step still waiting for its provider's answer; `none: resumable` for a
/// key whose steps are all settled (it waits for its client's retry), `-`
/// for a key without steps.
fn unsettled_steps(p: &InDoubt) -> String {
    if p.is_resumable() {
        return "none: resumable".to_string();
    }
    let cells: Vec<String> = p
        .steps
        .iter()
        .filter(|s| unsettled(s))
        .map(|s| {
            format!(
                "{} ({}, {} attempt{}, {})",
                escape_controls(&s.name),
                s.state.as_str(),
                s.attempts,
                if s.attempts == 1 { "" } else { "s" },
                human_ms(duration_ms(s.age))
            )
        })
        .collect();
    if cells.is_empty() {
        "-".to_string()
    } else {
        cells.join("; ")
    }
}

/// `idem resolve`: settles one UNKNOWN record by hand.
pub fn resolve<W: Write>(
    engine: &Engine,
    key: &IdempotencyKey,
    resolution: Resolution,
    reason: &str,
    out: &mut W,
) -> CliResult {
    let what = match &resolution {
        Resolution::Completed(env) => format!(
            "completed (status {}, {} body bytes): later requests with this key replay it",
            env.status,
            env.body.len()
        ),
        Resolution::NotExecuted => {
            "not executed: the next request with this key executes afresh".to_string()
        }
        Resolution::StillInDoubt => "still unknown".to_string(),
    };
    engine.resolve(key, resolution, reason)?;
    writeln!(out, "resolved {key} as {what}")?;
    Ok(())
}

/// `idem resolve --step`: settles one effect step of an in-doubt record by
/// hand; the key settles once all its steps have.
pub fn resolve_step<W: Write>(
    engine: &Engine,
    key: &IdempotencyKey,
    step: &str,
    resolution: StepResolution,
    reason: &str,
    out: &mut W,
) -> CliResult {
    let what = match &resolution {
        StepResolution::Executed(evidence) => format!(
            "executed ({} evidence bytes): the next attempt skips the call",
            evidence.len()
        ),
        StepResolution::NotExecuted => {
            "not executed: the next attempt makes the call under the same reference".to_string()
        }
        StepResolution::StillUnknown => "still unknown".to_string(),
    };
    let before = engine.steps(key)?;
    let was = before
        .iter()
        .find(|s| s.name == step)
        .filter(|s| s.state.is_settled());
    if let Some(s) = was {
        // A settled step never changes (the engine answers it as it is):
        // an operator giving the other answer is told, not reassured.
        let same = matches!(
            (&resolution, s.state),
            (StepResolution::Executed(_), StepState::Confirmed)
                | (
                    StepResolution::NotExecuted,
                    StepState::NotExecuted | StepState::Failed
                )
                | (StepResolution::StillUnknown, _)
        );
        if !same {
            return Err(CliError(format!(
                "step {} of {key} is already settled as {}; a settled step never changes",
                escape_controls(step),
                s.state
            ))
            .into());
        }
    }
    engine.resolve_step(key, step, resolution, reason)?;
    match was {
        // The same answer again: the engine changed nothing (another
        // answer is refused with an error above).
        Some(s) => writeln!(
            out,
            "step {} of {key} was already settled as {}; nothing changed",
            escape_controls(step),
            s.state
        )?,
        None => writeln!(
            out,
            "resolved step {} of {key} as {what}",
            escape_controls(step)
        )?,
    }
    // Why the key may still answer "in doubt": the steps left to settle.
    let open: Vec<String> = engine
        .steps(key)?
        .iter()
        .filter(|s| unsettled(s))
        .map(|s| format!("{} ({})", escape_controls(&s.name), s.state))
        .collect();
    if open.is_empty() {
        match engine.record(key)?.map(|r| r.state) {
            Some(State::Unknown) => writeln!(
                out,
                "every step of {key} is settled: the next request with the same fingerprint resumes it"
            )?,
            Some(state) => writeln!(out, "every step of {key} is settled; the key is {state}")?,
            None => writeln!(out, "every step of {key} is settled; the key has no record")?,
        }
    } else {
        writeln!(
            out,
            "{key} stays in doubt until these steps are settled: {}",
            open.join(", ")
        )?;
    }
    Ok(())
}

/// `idem dead-letters`: one row per dead letter, oldest first.
pub fn dead_letters<W: Write>(engine: &Engine, limit: usize, json: bool, out: &mut W) -> CliResult {
    let now = engine.clock().now_ms();
    let letters = engine.dead_letters(limit)?;
    if json {
        let items: Vec<Value> = letters
            .iter()
            .map(|d| {
                json!({
                    "seq": d.seq,
                    "consumer": d.consumer,
                    "message_id": d.message_id,
                    "topic": d.topic,
                    "attempts": d.attempts,
                    "reason": d.reason,
                    "dead_at_ms": d.dead_at_ms,
                    "payload_bytes": d.payload.len(),
                    "payload": String::from_utf8_lossy(&d.payload),
                    "payload_hex": d.payload.iter().map(|b| format!("{b:02x}")).collect::<String>(),
                })
            })
            .collect();
        return print_json(out, &Value::Array(items));
    }
    if letters.is_empty() {
        writeln!(out, "no dead letters")?;
        return Ok(());
    }
    let rows: Vec<Vec<String>> = letters
        .iter()
        .map(|d| {
            vec![
                d.seq.to_string(),
                escape_controls(&d.consumer),
                if d.message_id.is_empty() {
                    "(none)".to_owned()
                } else {
                    escape_controls(&d.message_id)
                },
                escape_controls(&d.topic),
                d.attempts.to_string(),
                human_ms(now.saturating_sub(d.dead_at_ms)),
                format!("{} B", d.payload.len()),
                escape_controls(&d.reason),
            ]
        })
        .collect();
    let header = [
        "SEQ",
        "CONSUMER",
        "MESSAGE ID",
        "TOPIC",
        "ATTEMPTS",
        "AGE",
        "PAYLOAD",
        "REASON",
    ];
    render::table(out, &header, &rows)?;
    Ok(())
}

/// `idem redrive`: dead letter `seq` back to the outbox.
pub fn redrive<W: Write>(engine: &Engine, seq: u64, out: &mut W) -> CliResult {
    match engine.redrive(seq)? {
        Some(id) => {
            writeln!(
                out,
                "dead letter #{seq} is in the outbox as message {}",
                escape_controls(&id)
            )?;
            Ok(())
        }
        None => Err(format!("no dead letter #{seq} (list them with `idem dead-letters`)").into()),
    }
}

/// `idem sweep`: one full sweep pass.
pub fn sweep<W: Write>(engine: &Engine, out: &mut W) -> CliResult {
    let c = engine.sweep_now()?;
    writeln!(
        out,
        "moved to UNKNOWN: {}, deleted: {}, tombstoned: {}",
        c.moved_to_unknown, c.deleted, c.tombstoned
    )?;
    if c.more {
        writeln!(out, "more work is left: run sweep again")?;
    }
    Ok(())
}

/// `idem stats`: records by state at read time (a PROCESSING record whose
/// lease ended counts as UNKNOWN; an expired one as a tombstone or as
/// expired), and the longest time a record has been in doubt. The
/// engine's counters (claims,
/// replays, ...) count since *this* process opened the file, so they are
/// always zero here and not shown.
pub fn stats<W: Write>(engine: &Engine, json: bool, out: &mut W) -> CliResult {
    let s = engine.stats()?;
    if json {
        return print_json(
            out,
            &json!({
                "processing": s.processing,
                "completed": s.completed,
                "final_failures": s.final_failures,
                "unknown": s.unknown,
                "tombstones": s.tombstones,
                "expired": s.expired,
                "corrupt": s.corrupt,
                "longest_in_doubt_ms": s.oldest_in_doubt_age.map(duration_ms),
            }),
        );
    }
    let rows = [
        ("PROCESSING", s.processing),
        ("COMPLETED", s.completed),
        ("FINAL_FAILURE", s.final_failures),
        ("UNKNOWN", s.unknown),
        ("TOMBSTONE", s.tombstones),
        ("expired", s.expired),
        ("corrupt", s.corrupt),
    ];
    for (name, n) in rows {
        writeln!(out, "{name:<15}{n}")?;
    }
    let longest = s
        .oldest_in_doubt_age
        .map_or_else(|| "-".to_string(), |d| human_ms(duration_ms(d)));
    writeln!(out, "{:<15}{longest}", "max in doubt")?;
    Ok(())
}

/// `idem purge`: deletes one record; PROCESSING and UNKNOWN only with
/// `force`, with a warning on `warn`.
pub fn purge<W: Write, E: Write>(
    engine: &Engine,
    key: &IdempotencyKey,
    force: bool,
    out: &mut W,
    warn: &mut E,
) -> CliResult {
    let now = engine.clock().now_ms();
    let info = match engine.record(key) {
        Ok(Some(info)) => info,
        Ok(None) => return purge_record_less(engine, key, force, out, warn),
        // A record that does not decode can only be deleted by force.
        Err(idempotency::Error::Corrupt {
            what: Corrupted::Record(_),
            ..
        }) if force => {
            engine.purge(key, PurgeMode::Force)?;
            writeln!(out, "purged corrupt record {key}")?;
            writeln!(
                warn,
                "idem: warning: force-purged a corrupt record {key}: its state was unknown, \
                 so a retry with this key may execute the work a second time"
            )?;
            return Ok(());
        }
        Err(
            e @ idempotency::Error::Corrupt {
                what: Corrupted::Record(_),
                ..
            },
        ) => {
            return Err(Box::new(CliError(format!(
                "{e}; re-run with --force to delete it"
            ))))
        }
        Err(e) => return Err(e.into()),
    };
    let risky = matches!(info.state, State::Processing | State::Unknown);
    if risky && !force {
        let instead = if info.state == State::Processing {
            "wait for its lease to run out (it then becomes UNKNOWN) and settle it with \
             `idem resolve`"
        } else {
            "settle it with `idem resolve` after checking with the provider"
        };
        return Err(Box::new(CliError(format!(
            "refusing to purge {key}: it is {}, so its work may have run or still be running, \
             and after a purge a retry may execute it a second time; {instead}, \
             or re-run with --force",
            info.state
        ))));
    }
    let state = engine
        .purge(
            key,
            if force {
                PurgeMode::Force
            } else {
                PurgeMode::FinishedOnly
            },
        )?
        .unwrap_or(info.state);
    writeln!(out, "purged {state} record {key}")?;
    if risky {
        writeln!(
            warn,
            "idem: warning: force-purged {state} record {key} (reference {}, fencing token {}, \
             claimed {}): a retry with this key may execute the work a second time",
            escape_controls(&info.reference),
            info.fencing_token,
            relative(info.claimed_at_ms, now)
        )?;
    }
    Ok(())
}

/// `purge` of a key without a record. Only a store written by main from
/// the effect steps' arrival (7534400) to the commit that made a resumed
/// claim's retryable failure keep its UNKNOWN record can hold steps and a
/// log without a record (that release deleted the record); nothing writes
/// them now. Only `--force` deletes them.
fn purge_record_less<W: Write, E: Write>(
    engine: &Engine,
    key: &IdempotencyKey,
    force: bool,
    out: &mut W,
    warn: &mut E,
) -> CliResult {
    let steps = engine.steps(key)?;
    if steps.is_empty() {
        return Err(CliError(format!("no record for {key}")).into());
    }
    if !force {
        return Err(Box::new(CliError(format!(
            "{key} has no record but {} effect step(s) left by an older version; after a \
             purge its next claim calls every provider again; re-run with --force to delete \
             them",
            steps.len()
        ))));
    }
    engine.purge(key, PurgeMode::Force)?;
    writeln!(out, "purged the effect steps and log of {key} (no record)")?;
    let confirmed = steps
        .iter()
        .filter(|s| s.state == StepState::Confirmed)
        .count();
    writeln!(
        warn,
        "idem: warning: force-purged the steps of {key} ({confirmed} confirmed): its next claim \
         calls every provider again"
    )?;
    Ok(())
}

/// A duration in whole milliseconds, saturating.
fn duration_ms(d: std::time::Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// `idem verify`: scrubs the whole file (read-only). Prints every problem
/// and fails (exit 1) if there is any.
pub fn verify<W: Write>(engine: &Engine, json: bool, out: &mut W) -> CliResult {
    let report = engine.verify()?;
    // redb's page check failed: a writable open (the server) refuses the
    // file. The records on the damaged page are the keys in doubt.
    let page_check_fails = report
        .damage
        .iter()
        .any(|d| matches!(d, Damage::FailedPageCheck { .. }));
    // So does a journal that cannot serve the file, or a damaged meta value.
    let open_refuses = page_check_fails
        || report.damage.iter().any(|d| {
            matches!(
                d,
                Damage::UnusableJournal { .. } | Damage::BadMetaValue { .. }
            )
        });
    let keys_in_doubt: Vec<&String> = report
        .damage
        .iter()
        .filter_map(|d| match d {
            Damage::EntriesOnDamagedPage {
                table: "records",
                keys,
                ..
            } => Some(keys),
            _ => None,
        })
        .flatten()
        .collect();
    if json {
        let problems: Vec<Value> = report
            .damage
            .iter()
            .map(|p| Value::String(p.to_string()))
            .collect();
        print_json(
            out,
            &json!({
                "records": report.records,
                "sound": report.is_sound(),
                "problems": problems,
                "open_refuses": open_refuses,
                "keys_in_doubt": keys_in_doubt,
            }),
        )?;
    } else {
        for problem in &report.damage {
            writeln!(out, "{}", escape_controls(&problem.to_string()))?;
        }
        if report.is_sound() {
            writeln!(
                out,
                "sound: {} records checked, no problems",
                report.records
            )?;
        }
    }
    if report.is_sound() {
        Ok(())
    } else if page_check_fails {
        Err(CliError(format!(
            "{} problems found in {} records; the file fails redb's page check, so a writable \
             open refuses it: `idem salvage DAMAGED NEW` copies every record that still reads \
             ({} keys in doubt listed above)",
            report.damage.len(),
            report.records,
            keys_in_doubt.len()
        ))
        .into())
    } else {
        Err(CliError(format!(
            "{} problems found in {} records",
            report.damage.len(),
            report.records
        ))
        .into())
    }
}

/// `salvage` copied what it could and lost some keys (exit code 3, so a
/// script tells it from a failure, exit 1).
#[derive(Debug)]
pub struct KeysLost(pub String);

impl fmt::Display for KeysLost {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl StdError for KeysLost {}

/// What `idem migrate` did to one file.
pub struct Migrated<'a> {
    /// The file.
    pub path: &'a std::path::Path,
    /// Its format before (after the recovery a crashed file needs; `None`
    /// only if the open could not tell, which a redb file never gives).
    pub before: Option<u32>,
    /// Its format after.
    pub after: Option<u32>,
    /// How long the migrating open took.
    pub took: std::time::Duration,
}

/// `idem migrate`: the format before and after, and what to keep.
pub fn migrated<W: Write>(report: &Migrated<'_>, json: bool, out: &mut W) -> CliResult {
    let changed = report.before != report.after;
    if json {
        return print_json(
            out,
            &json!({
                // Lossy for a path that is not UTF-8 (JSON holds text).
                "file": report.path.to_string_lossy(),
                "format_before": report.before,
                "format_after": report.after,
                "migrated": changed,
                "seconds": report.took.as_secs_f64(),
            }),
        );
    }
    let path = report.path.display();
    let number = |f: Option<u32>| f.map_or_else(|| "unknown".to_string(), |f| f.to_string());
    if changed {
        writeln!(
            out,
            "{path}: format {} -> {} in {:.1} s; `idem verify {path}` checks it. Releases \
             before format 3 refuse the file: keep your copy of the old file and its journal \
             until you no longer need to go back.",
            number(report.before),
            number(report.after),
            report.took.as_secs_f64()
        )?;
    } else {
        writeln!(
            out,
            "{path}: format {} already; nothing to migrate",
            number(report.after)
        )?;
    }
    Ok(())
}

/// Copies what still reads of `damaged` into the new file `new`, listing
/// what could not be copied.
pub fn salvage<W: Write>(
    damaged: &std::path::Path,
    new: &std::path::Path,
    json: bool,
    out: &mut W,
) -> CliResult {
    let report = Engine::salvage(damaged, new)?;
    if json {
        let lost: Vec<Value> = report.lost.iter().map(lost_json).collect();
        print_json(
            out,
            &json!({
                "records": report.records,
                "outbox_messages": report.outbox_messages,
                "entities": report.entities,
                "journal_frames": report.journal_frames,
                "complete": report.is_complete(),
                "lost": lost,
            }),
        )?;
    } else {
        for lost in &report.lost {
            writeln!(out, "lost: {}", escape_controls(&lost.to_string()))?;
        }
        writeln!(
            out,
            "salvaged into {}: {} records, {} outbox messages, {} entities (journal frames applied: {}); not copied: {}",
            new.display(),
            report.records,
            report.outbox_messages,
            report.entities,
            report.journal_frames,
            report.lost.len()
        )?;
    }
    if report.is_complete() {
        Ok(())
    } else {
        Err(KeysLost(format!(
            "{} could not be copied into {}; resolve the listed keys before serving them",
            match report.lost.len() {
                1 => "1 item".to_string(),
                n => format!("{n} items"),
            },
            new.display()
        ))
        .into())
    }
}

/// One lost item as a JSON object: `kind`, what names it, `text`.
fn lost_json(lost: &idempotency::Lost) -> Value {
    use idempotency::Lost;
    let text = lost.to_string();
    match lost {
        Lost::Record { key_hex, reason } => {
            json!({ "kind": "record", "key_hex": key_hex, "reason": reason, "text": text })
        }
        Lost::Range {
            table,
            after_hex,
            before_hex,
            reason,
        } => json!({
            "kind": "range", "table": table, "after_hex": after_hex,
            "before_hex": before_hex, "reason": reason, "text": text
        }),
        Lost::OutboxMessage { seq, reason } => {
            json!({ "kind": "outbox_message", "seq": seq, "reason": reason, "text": text })
        }
        Lost::Entity { entity, reason } => {
            json!({ "kind": "entity", "entity": entity, "reason": reason, "text": text })
        }
        Lost::Journal { detail } => json!({ "kind": "journal", "reason": detail, "text": text }),
        Lost::MetaValue { key, reason } => {
            json!({ "kind": "meta_value", "key": key, "reason": reason, "text": text })
        }
        _ => json!({ "kind": "other", "text": text }),
    }
}

/// `idem compact`: the file's length before and after.
pub fn compacted<W: Write>(
    path: &std::path::Path,
    report: &idempotency::Compaction,
    took: std::time::Duration,
    json: bool,
    out: &mut W,
) -> CliResult {
    if json {
        return print_json(
            out,
            &json!({
                // Lossy for a path that is not UTF-8 (JSON holds text).
                "file": path.to_string_lossy(),
                "bytes_before": report.bytes_before,
                "bytes_after": report.bytes_after,
                "bytes_freed": report.bytes_freed(),
                "seconds": took.as_secs_f64(),
            }),
        );
    }
    let mib = |b: u64| b as f64 / (1024.0 * 1024.0);
    writeln!(
        out,
        "{}: {:.1} MiB -> {:.1} MiB ({:.1} MiB given back) in {:.1} s",
        path.display(),
        mib(report.bytes_before),
        mib(report.bytes_after),
        mib(report.bytes_freed()),
        took.as_secs_f64()
    )?;
    Ok(())
}
