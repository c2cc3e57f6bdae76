//! SIGKILL at a random moment while every kind of write runs at once on the
//! pipelined journal writer: claims and completions, purges, local writes
//! with an app row (which commit durably and force a checkpoint), entity
//! transitions, completions with outbox messages and a relay marking them
//! published, and abandoned claims. Each child thread appends a line to an
//! ack log after each call returned. After the kill the parent reopens the
//! file and checks every acknowledged event:
//!
//! - a completion replays byte for byte (unless its key was purged after);
//! - a purged key has no record;
//! - a local write's completion replays and its app row exists;
//! - an entity is at least at its last acknowledged version;
//! - a message is in the outbox or was published, and a message marked
//!   published is not in the outbox;
//! - a claim is never claimable again.
//!
//! 4 rounds by default; `IDEMPOTENCY_KILL_MIXED_ROUNDS=100` for a long run.
#![cfg(unix)]

#[path = "common/kill.rs"]
mod kill;

use std::collections::{BTreeMap, BTreeSet};
use std::error::Error;
use std::fs::File;
use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::time::Duration;

use idempotency::{
    Begin, Engine, Envelope, Fingerprint, IdempotencyKey, LocalRun, OutgoingMessage, PurgeMode,
    Transition,
};
use redb::{ReadableDatabase, TableDefinition};

type TestResult = Result<(), Box<dyn Error + Send + Sync>>;

const ROUNDS_VAR: &str = "IDEMPOTENCY_KILL_MIXED_ROUNDS";
const WORKERS: usize = 6;
const LEDGER: TableDefinition<&str, u64> = TableDefinition::new("app.ledger");

fn key(name: &str) -> Result<IdempotencyKey, idempotency::Error> {
    IdempotencyKey::new("mixed", name)
}

fn fp(name: &str) -> Result<Fingerprint, idempotency::FingerprintError> {
    Fingerprint::of_json(format!(r#"{{"k":"{name}"}}"#).as_bytes(), &[])
}

fn body(name: &str) -> Vec<u8> {
    let mut b = format!("body of {name} ").into_bytes();
    b.resize(64 + name.len() * 13 % 900, b'x');
    b
}

fn open(db: &Path) -> Result<Engine, idempotency::OpenError> {
    Engine::builder()
        .lease(Duration::from_secs(3600))
        .sweep_interval(None)
        .open(db)
}

fn append(mut log: &File, line: String) -> std::io::Result<()> {
    log.write_all(format!("{line}\n").as_bytes())
}

#[test]
fn child_entry() -> TestResult {
    let Some(kill::Child { db, round, log }) = kill::child()? else {
        return Ok(());
    };
    let engine = open(&db)?;
    kill::say_ready()?;
    kill::exit_if_never_killed();
    std::thread::scope(|s| {
        for t in 0..WORKERS {
            let (engine, log) = (&engine, &log);
            s.spawn(move || {
                if let Err(e) = worker(engine, log, round, t) {
                    eprintln!("worker {t}: {e}");
                    std::process::exit(3);
                }
            });
        }
        let (engine, log) = (&engine, &log);
        s.spawn(move || {
            if let Err(e) = relay(engine, log) {
                eprintln!("relay: {e}");
                std::process::exit(3);
            }
        });
    });
    Err("the child's workers stopped".into())
}

fn worker(engine: &Engine, log: &File, round: u64, t: usize) -> TestResult {
    let entity = format!("ent-{t}");
    let mut version = engine.entity_state(&entity)?.map_or(0, |(_, v)| v);
    for n in 0.. {
        let name = format!("r{round}-t{t}-{n}");
        let op = n % 6;
        if op == 2 {
            let row = name.clone();
            let run = engine.execute_local(&key(&name)?, fp(&name)?, move |tx| {
                let txn = tx.redb().ok_or("not redb")?;
                txn.open_table(LEDGER)?.insert(row.as_str(), 1)?;
                Ok(Envelope::new(1, 201, body(&row)))
            })?;
            if !matches!(run, LocalRun::Executed) {
                return Err(format!("{name}: {run:?}").into());
            }
            append(log, format!("local {name} -"))?;
            continue;
        }
        if op == 3 {
            let from = format!("s{version}");
            let to = format!("s{}", version + 1);
            let froms: Vec<&str> = if version == 0 { vec![] } else { vec![&from] };
            match engine.transition(&entity, &froms, &to)? {
                Transition::Applied { version: v } if v == version + 1 => version = v,
                other => return Err(format!("{entity} {from}->{to}: {other:?}").into()),
            }
            append(log, format!("moved {entity} {version}"))?;
            continue;
        }
        let Begin::Claimed(claim) = engine.begin(&key(&name)?, fp(&name)?)? else {
            return Err(format!("{name}: fresh key not claimed").into());
        };
        append(log, format!("claimed {name} {}", claim.fencing_token()))?;
        match op {
            0 => {
                engine.complete(claim, Envelope::new(1, 200, body(&name)))?;
                append(log, format!("completed {name} -"))?;
            }
            1 => {
                engine.complete(claim, Envelope::new(1, 200, body(&name)))?;
                append(log, format!("completed {name} -"))?;
                engine.purge(&key(&name)?, PurgeMode::FinishedOnly)?;
                append(log, format!("purged {name} -"))?;
            }
            4 => {
                let msg = OutgoingMessage::new("topic", name.clone().into_bytes());
                engine.complete_with_messages(
                    claim,
                    Envelope::new(1, 200, body(&name)),
                    vec![msg],
                )?;
                append(log, format!("completed {name} -"))?;
                append(log, format!("message {name} -"))?;
            }
            _ => {
                drop(claim);
                if n % 4 == 1 {
                    engine.flush()?;
                }
            }
        }
    }
    Ok(())
}

fn relay(engine: &Engine, log: &File) -> TestResult {
    loop {
        let batch = engine.outbox().take(32)?;
        if batch.is_empty() {
            std::thread::sleep(Duration::from_millis(1));
            continue;
        }
        let seqs: Vec<u64> = batch.iter().map(|e| e.seq).collect();
        // Logged before the call too: a kill between the call's commit
        // and its ack line leaves the messages published, unlogged.
        for e in &batch {
            let payload = String::from_utf8_lossy(&e.payload).into_owned();
            append(log, format!("publishing {payload} {}", e.seq))?;
        }
        engine.outbox().mark_published(&seqs)?;
        for e in &batch {
            let payload = String::from_utf8_lossy(&e.payload).into_owned();
            append(log, format!("published {payload} {}", e.seq))?;
        }
    }
}

#[derive(Default)]
struct Acks {
    claimed: BTreeMap<String, u64>,
    completed: BTreeSet<String>,
    purged: BTreeSet<String>,
    local: BTreeSet<String>,
    moved: BTreeMap<String, u64>,
    messages: BTreeSet<String>,
    /// Payload -> seq: marked published (acknowledged).
    published: BTreeMap<String, u64>,
    /// Payloads whose `mark_published` was called (maybe not returned).
    publishing: BTreeSet<String>,
}

impl Acks {
    fn read(&mut self, path: &Path) -> Result<Vec<String>, Box<dyn Error + Send + Sync>> {
        let mut names = Vec::new();
        let Ok(file) = File::open(path) else {
            return Ok(names);
        };
        let text: Vec<String> = BufReader::new(file).lines().collect::<Result<_, _>>()?;
        let raw = std::fs::read_to_string(path)?;
        // A last line without its newline was torn by the kill: not acked.
        let whole = if raw.ends_with('\n') {
            text.len()
        } else {
            text.len().saturating_sub(1)
        };
        for line in &text[..whole] {
            let f: Vec<&str> = line.split(' ').collect();
            let [event, name, value] = f[..] else {
                return Err(format!("bad line {line:?}").into());
            };
            let name = name.to_string();
            match event {
                "claimed" => {
                    self.claimed.insert(name.clone(), value.parse()?);
                }
                "completed" => {
                    self.completed.insert(name.clone());
                }
                "purged" => {
                    self.purged.insert(name.clone());
                }
                "local" => {
                    self.local.insert(name.clone());
                }
                "moved" => {
                    let v: u64 = value.parse()?;
                    let e = self.moved.entry(name.clone()).or_default();
                    *e = (*e).max(v);
                    continue;
                }
                "message" => {
                    self.messages.insert(name.clone());
                }
                "publishing" => {
                    self.publishing.insert(name.clone());
                    continue;
                }
                "published" => {
                    self.published.insert(name.clone(), value.parse()?);
                    continue;
                }
                _ => return Err(format!("bad line {line:?}").into()),
            }
            names.push(name);
        }
        Ok(names)
    }
}

/// Whether `name` is one the worker purges after completing it (op 1).
fn is_purged_kind(name: &str) -> bool {
    name.rsplit('-')
        .next()
        .and_then(|n| n.parse::<u64>().ok())
        .is_some_and(|n| n % 6 == 1)
}

fn check(
    engine: &Engine,
    acks: &Acks,
    names: &BTreeSet<String>,
    fails: &mut Vec<String>,
) -> TestResult {
    for name in names {
        let k = key(name)?;
        if acks.purged.contains(name) {
            if let Some(r) = engine.record(&k)? {
                fails.push(format!("{name}: purged, record {:?}", r.state));
            }
            continue;
        }
        // A purge called but not acknowledged may have committed.
        if is_purged_kind(name) && engine.record(&k)?.is_none() {
            continue;
        }
        let answer = engine.begin(&k, fp(name)?)?;
        let done = acks.completed.contains(name) || acks.local.contains(name);
        match answer {
            Begin::Replay(r) if r.envelope.body == body(name) => {}
            Begin::Processing { .. } | Begin::InDoubt(_) if !done => {}
            other => fails.push(format!("{name}: {other:?} (completed: {done})")),
        }
    }
    for (entity, &v) in &acks.moved {
        match engine.entity_state(entity)? {
            Some((state, version)) if version >= v && state == format!("s{version}") => {}
            other => fails.push(format!("{entity}: acked version {v}, read {other:?}")),
        }
    }
    let outbox = engine.outbox().take(usize::MAX)?;
    let mut in_outbox = BTreeSet::new();
    for e in &outbox {
        let payload = String::from_utf8_lossy(&e.payload).into_owned();
        if acks.published.get(&payload) == Some(&e.seq) {
            fails.push(format!(
                "{payload}: seq {} published, still in the outbox",
                e.seq
            ));
        }
        in_outbox.insert(payload);
    }
    for m in &acks.messages {
        if !in_outbox.contains(m) && !acks.publishing.contains(m) {
            fails.push(format!(
                "{m}: acked message neither in the outbox nor published"
            ));
        }
    }
    Ok(())
}

#[test]
fn sigkill_amid_every_kind_of_write_loses_nothing_acknowledged() -> TestResult {
    let rounds: u64 = std::env::var(ROUNDS_VAR)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(4);
    let dir = tempfile::tempdir()?;
    let db = dir.path().join("idem.redb");
    let mut acks = Acks::default();
    let mut all = BTreeSet::new();
    let mut fails = Vec::new();
    let mut seed = kill::time_seed()?;
    for round in 0..rounds {
        let log = dir.path().join(format!("acks-{round}.log"));
        let stderr = dir.path().join(format!("child-{round}.stderr"));
        let delay;
        (seed, delay) = kill::next_delay(seed, 50, 400);
        kill::kill_round(round, &db, &log, &stderr, delay)?;
        let names: BTreeSet<String> = acks.read(&log)?.into_iter().collect();
        let engine = Engine::builder().sweep_interval(None).open_existing(&db)?;
        check(&engine, &acks, &names, &mut fails)?;
        drop(engine);
        all.extend(names);
    }
    let engine = Engine::builder().sweep_interval(None).open_existing(&db)?;
    check(&engine, &acks, &all, &mut fails)?;
    let report = engine.verify()?;
    if !report.is_sound() {
        fails.push(format!("verify: {:?}", report.damage));
    }
    drop(engine);
    let file = redb::Database::open(&db)?;
    let txn = file.begin_read()?;
    let ledger = txn.open_table(LEDGER)?;
    for name in &acks.local {
        if ledger.get(name.as_str())?.is_none() {
            fails.push(format!("{name}: local write acked, no app row"));
        }
    }
    println!(
        "kill mixed: {rounds} rounds, {} keys, {} local, {} moved entities, {} messages, {} published",
        all.len(),
        acks.local.len(),
        acks.moved.len(),
        acks.messages.len(),
        acks.published.len()
    );
    assert!(
        fails.is_empty(),
        "{} failures: {:#?}",
        fails.len(),
        &fails[..fails.len().min(10)]
    );
    Ok(())
}
