//! The phases that serve the API inside this process, each on an engine
//! of its own, because they need what a child server does not offer: an
//! engine clock the demo moves (expiry) and a disk the demo fills and
//! frees (a full disk). The providers write to the same ledgers as in the
//! other phases, so the final audit covers them too.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use idempotency::{Clock, Engine, ExpiryPolicy, ManualClock, SystemClock};

use super::audit::{ledger_count, Tally};
use super::{plural, Audit, Client, DemoResult, Row, LEASE_MS};
use crate::disk::BudgetDisk;
use crate::provider::read_ledger;
use crate::server::{with_resolver, InProcess, Providers};

/// The expiry phase's TTL: how long a completed payment is replayed (on a
/// manual clock, so no one waits for it).
const EXPIRY_TTL: Duration = Duration::from_secs(2);

/// How long the expiry phase keeps an expired key as a tombstone (`serve`
/// keeps one for 30 days).
const TOMBSTONE_KEEP: Duration = Duration::from_secs(60);

/// The full-disk phase gives up if this many payments all fit.
const DISK_PAYMENTS_MAX: u32 = 64;

/// Runs a blocking engine call (open, sweep, reopen, close) on the
/// blocking pool, off the runtime's worker threads.
async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> DemoResult<T> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| format!("an engine call on the blocking pool failed: {e}").into())
}

/// With `--nats URL`, publishes the events the phase's payments left in
/// its engine's outbox (no relay runs beside an in-process engine), before
/// the engine closes.
async fn relay_outbox(engine: &Arc<Engine>, nats: Option<&str>) -> DemoResult<()> {
    #[cfg(feature = "nats")]
    if let Some(url) = nats {
        crate::broker::drain(Arc::clone(engine), url)
            .await
            .map_err(|e| format!("relaying the phase's events: {e}"))?;
    }
    #[cfg(not(feature = "nats"))]
    let _ = (engine, nats);
    Ok(())
}

/// A completed payment's key expires. The API runs in this process on an
/// engine of its own whose clock only moves when told (`ManualClock`), so
/// the TTL passes at once: within it a retry replays; after it the key is
/// a tombstone (the demo's policy, as `serve`'s), answered 409 and never
/// charged again, before and after the sweeper has run.
pub(super) async fn expiry(
    audit: &mut Audit,
    ledger: &Path,
    run: &str,
    dir: &Path,
    nats: Option<&str>,
) -> DemoResult<Row> {
    let mut row = Row {
        name: "key expired, retried",
        ..Row::default()
    };
    println!("\n== {}", row.name);
    let before = ledger_count(ledger, run)?;
    let providers = Providers::open(ledger)?;
    let clock = ManualClock::new(SystemClock.now_ms());
    let builder = with_resolver(
        Engine::builder()
            .clock(clock.clone())
            .lease(Duration::from_millis(LEASE_MS))
            .ttl(EXPIRY_TTL)
            .expiry_policy(ExpiryPolicy::Tombstone {
                keep: TOMBSTONE_KEEP,
            })
            .sweep_interval(None),
        providers.clone(),
    );
    let path = dir.join("expiry.redb");
    let engine = Arc::new(blocking(move || builder.open(path)).await??);
    println!(
        "    an engine of its own on a manual clock: TTL {} s, then a tombstone for {} s",
        EXPIRY_TTL.as_secs(),
        TOMBSTONE_KEEP.as_secs()
    );
    let api = InProcess::start(engine.clone(), providers).await?;
    let client = Client::new(api.base.clone(), Duration::from_secs(10))?;
    let key = format!("{run}-expiry");

    let first = client.pay(&key, 2_500, "expiry", None).await;
    let retry = client.pay(&key, 2_500, "expiry (retry)", None).await;
    row.requests += 2;
    audit.expect(first.status == Some(201) && !first.replayed, || {
        format!("{key}: got {:?} {}", first.status, first.body)
    });
    audit.expect(retry.status == Some(201) && retry.replayed, || {
        format!("{key}: retry within the TTL got {:?}", retry.status)
    });
    for answer in [&first, &retry] {
        if answer.status == Some(201) {
            audit.success(&key, answer);
        }
    }
    row.replays += u32::from(retry.replayed);
    println!("    201, then a replayed 201 within the TTL");

    let step = EXPIRY_TTL + Duration::from_secs(1);
    clock.advance(step);
    let late = client.pay(&key, 2_500, "expiry (late retry)", None).await;
    row.requests += 1;
    println!(
        "    the clock moves {} s, past the TTL; the same request: {} {} (decided at read time, \
         before any sweep)",
        step.as_secs(),
        late.status.unwrap_or(0),
        late.problem_type()
    );
    let sweeper = engine.clone();
    let swept = blocking(move || sweeper.sweep_now()).await??;
    audit.expect(swept.tombstoned == 1, || {
        format!("{key}: the sweep tombstoned {} records", swept.tombstoned)
    });
    let again = client
        .pay(&key, 2_500, "expiry (after the sweep)", None)
        .await;
    row.requests += 1;
    println!(
        "    sweep: {} tombstoned; the same request again: {} {}",
        swept.tombstoned,
        again.status.unwrap_or(0),
        again.problem_type()
    );
    for answer in [&late, &again] {
        row.conflicts += u32::from(answer.status == Some(409));
        audit.expect(
            answer.status == Some(409) && answer.problem_type() == "key-expired",
            || {
                format!(
                    "{key}: after the TTL got {:?} {}",
                    answer.status, answer.body
                )
            },
        );
    }
    println!(
        "    why: under ExpiryPolicy::Tombstone an expired key is kept {} s as a tombstone and \
         answered 409, never charged again (ExpiryPolicy::Forget would charge it as a new payment)",
        TOMBSTONE_KEEP.as_secs()
    );
    api.stop().await;
    relay_outbox(&engine, nats).await?;
    blocking(move || drop(engine)).await?;
    row.charges = ledger_count(ledger, run)? - before;
    Tally::print_phase(ledger, &key, audit)?;
    Ok(row)
}

/// The disk fills up under the API. It runs in this process on an engine
/// of its own whose database is on an in-memory disk with a byte budget
/// (`BudgetDisk`): once the file may not grow, a write fails as `ENOSPC`
/// does. Payments go through until one is refused with a 503 (nothing
/// acknowledged yet for it); the engine is then poisoned and refuses every
/// write. Space is freed, the engine reopens the database by itself, the
/// refused payment's retry is answered from the provider's record
/// (replayed, not charged again) or, if it never reached the provider,
/// runs once; every payment acknowledged before the disk filled still
/// replays its charge. The engine's clock is manual, so waiting out a
/// lease or the reopen check takes no time.
pub(super) async fn disk_full(
    audit: &mut Audit,
    ledger: &Path,
    run: &str,
    nats: Option<&str>,
) -> DemoResult<Row> {
    let mut row = Row {
        name: "disk full, space freed",
        ..Row::default()
    };
    println!("\n== {}", row.name);
    let before = ledger_count(ledger, run)?;
    let providers = Providers::open(ledger)?;
    let clock = ManualClock::new(SystemClock.now_ms());
    let disk = BudgetDisk::new(u64::MAX);
    let builder = with_resolver(
        Engine::builder()
            .clock(clock.clone())
            .lease(Duration::from_millis(LEASE_MS))
            .sweep_interval(None),
        providers.clone(),
    );
    let (device, probe) = (disk.clone(), disk.clone());
    let engine = Arc::new(
        blocking(move || {
            builder
                .open_with_backend_factory(move || Ok(device.clone()), move || probe.check_space())
        })
        .await??,
    );
    let api = InProcess::start(engine.clone(), providers).await?;
    let client = Client::new(api.base.clone(), Duration::from_secs(10))?;
    let prefix = format!("{run}-disk");
    let amount = |i: u32| 500 + 10 * u64::from(i);

    // Payments until one is refused. The first one goes through with room
    // to spare (it creates the step and history tables, made on first
    // use); the disk is full from then on: the database may not grow.
    let mut acknowledged = Vec::new();
    let mut refused = None;
    for i in 0..DISK_PAYMENTS_MAX {
        if i == 1 {
            disk.set_budget(disk.used_bytes());
            println!(
                "    an engine of its own on an in-memory disk: after its first payment the \
                 database has {} KiB and no room to grow",
                disk.used_bytes() / 1024
            );
        }
        let key = format!("{prefix}-{i}");
        let answer = client.pay(&key, amount(i), "disk", None).await;
        row.requests += 1;
        match answer.status {
            Some(201) if !answer.replayed => {
                audit.success(&key, &answer);
                acknowledged.push((key, amount(i)));
            }
            Some(503) => {
                refused = Some((key, amount(i), answer));
                break;
            }
            other => {
                audit.fail(format!("{key}: unexpected {other:?} {}", answer.body));
                break;
            }
        }
    }
    let Some((key, key_amount, refusal)) = refused else {
        audit.fail(format!(
            "{prefix}: no write failed within {} payments",
            acknowledged.len()
        ));
        api.stop().await;
        relay_outbox(&engine, nats).await?;
        blocking(move || drop(engine)).await?;
        row.charges = ledger_count(ledger, run)? - before;
        return Ok(row);
    };
    let charged = provider_has(ledger, &key)?;
    println!(
        "    {} charged and recorded; payment {}: {} {} (Retry-After {} s): {}",
        plural(acknowledged.len(), "payment"),
        acknowledged.len() + 1,
        refusal.status.unwrap_or(0),
        refusal.problem_type(),
        refusal.retry_after.unwrap_or(0),
        if charged {
            "the provider charged it, but a later write (its step's confirmation, the receipt \
             step, the outcome) could not be recorded"
        } else {
            "its claim or its charge step could not be recorded, so it was never charged"
        }
    );
    // The layer's answers (its claim or its outcome not written) or the
    // handler's (a step's reservation or confirmation not written).
    audit.expect(
        matches!(
            refusal.problem_type(),
            "outcome-not-recorded" | "engine-error" | "step-not-recorded" | "call-not-recorded"
        ),
        || format!("{key}: 503 {}", refusal.body),
    );
    let watched = engine.clone();
    let cause = blocking(move || watched.poisoned()).await?;
    audit.expect(cause.is_some(), || {
        "the engine is not poisoned after a failed write".into()
    });
    println!(
        "    the engine refuses writes until it is reopened: {}",
        cause.as_deref().unwrap_or("(not poisoned)")
    );

    // While the disk is full: replays are reads and go on (unless redb
    // refuses to read after the failure, then 503: both keep the charge).
    if let Some((first, first_amount)) = acknowledged.first() {
        let answer = client.pay(first, *first_amount, "disk (retry)", None).await;
        row.requests += 1;
        match (answer.status, answer.replayed) {
            (Some(201), true) => {
                audit.success(first, &answer);
                row.replays += 1;
            }
            (Some(503), _) => {}
            other => audit.fail(format!("{first}: while the disk is full got {other:?}")),
        }
        println!(
            "    a retry of payment 1 while the disk is full: {} {}",
            answer.status.unwrap_or(0),
            if answer.replayed {
                "replayed (a read: no write needed)".to_owned()
            } else {
                answer.problem_type().to_owned()
            }
        );
    }

    // While the disk is full: a new payment is refused before it runs.
    let blocked = format!("{prefix}-while-full");
    let blocked_amount = amount(DISK_PAYMENTS_MAX);
    let answer = client.pay(&blocked, blocked_amount, "disk", None).await;
    row.requests += 1;
    audit.expect(
        answer.status == Some(503) && answer.problem_type() == "engine-error",
        || {
            format!(
                "{blocked}: while the disk is full got {:?} {}",
                answer.status, answer.body
            )
        },
    );
    audit.expect(!provider_has(ledger, &blocked)?, || {
        format!("{blocked}: charged while the disk was full")
    });
    println!(
        "    a new payment while the disk is full: {} {}, not run",
        answer.status.unwrap_or(0),
        answer.problem_type()
    );

    // Space is freed; the engine's next check (at most once a second of
    // its clock) finds the disk healthy and reopens the database.
    disk.set_budget(u64::MAX);
    clock.advance(Duration::from_secs(1));
    let watched = engine.clone();
    let cause = blocking(move || watched.poisoned()).await?;
    audit.expect(cause.is_none(), || {
        format!("still poisoned after space was freed: {cause:?}")
    });
    println!(
        "    space freed: {}",
        match &cause {
            None => "the engine reopened the database and takes writes again".to_owned(),
            Some(cause) => format!("still refusing writes: {cause}"),
        }
    );

    // The refused payment's retry: a replay of the provider's charge if it
    // was made (after the claim's lease, on the manual clock), else its
    // first run.
    let mut settled = None;
    for _ in 0..10 {
        let answer = client.pay(&key, key_amount, "disk (retry)", None).await;
        row.requests += 1;
        match answer.status {
            Some(201) => {
                settled = Some(answer);
                break;
            }
            Some(409 | 503) => {
                row.conflicts += u32::from(answer.status == Some(409));
                let wait = answer.retry_after.unwrap_or(1);
                println!(
                    "    retry got {} ({}); the clock moves {wait} s",
                    answer.status.unwrap_or(0),
                    answer.problem_type()
                );
                clock.advance(Duration::from_secs(wait));
            }
            other => {
                audit.fail(format!("{key}: retry got {other:?} {}", answer.body));
                break;
            }
        }
    }
    match settled {
        Some(answer) => {
            // Charged before the failure: the retry replays it (completed
            // from both steps' evidence) or resumes (the charge step
            // confirmed from the provider's answer and skipped). Never
            // charged: its first run. The ledgers' audit checks the charge.
            let recovered = answer.replayed || answer.resumed();
            audit.expect(recovered == charged, || {
                format!(
                    "{key}: charged before the failure: {charged}, retry replayed: {}, steps: {:?}",
                    answer.replayed, answer.steps
                )
            });
            audit.success(&key, &answer);
            row.replays += u32::from(answer.replayed);
            row.recovered += u32::from(recovered);
            println!(
                "    retry: 201 replayed={} ({} {})",
                answer.replayed,
                if answer.replayed {
                    "the resolver found charge".to_owned()
                } else if recovered {
                    format!(
                        "resumed, {}: charge",
                        answer.steps.as_deref().unwrap_or_default()
                    )
                } else {
                    "charged once now:".to_owned()
                },
                answer.payment_id().unwrap_or_default()
            );
        }
        None => audit.fail(format!("{key}: not settled after 10 retries")),
    }

    // Nothing acknowledged was lost: every earlier payment replays its
    // charge; the payment refused while the disk was full now runs once.
    let mut replayed = 0;
    for (key, amount) in &acknowledged {
        let answer = client.pay(key, *amount, "disk (retry)", None).await;
        row.requests += 1;
        audit.expect(answer.status == Some(201) && answer.replayed, || {
            format!("{key}: after the reopen got {:?}", answer.status)
        });
        if answer.status == Some(201) {
            audit.success(key, &answer);
            replayed += u32::from(answer.replayed);
        }
    }
    row.replays += replayed;
    let answer = client
        .pay(&blocked, blocked_amount, "disk (retry)", None)
        .await;
    row.requests += 1;
    audit.expect(answer.status == Some(201) && !answer.replayed, || {
        format!(
            "{blocked}: after the reopen got {:?} {}",
            answer.status, answer.body
        )
    });
    if answer.status == Some(201) {
        audit.success(&blocked, &answer);
    }
    println!(
        "    retries of the {} acknowledged before: {replayed} replayed their charge; the new \
         payment refused while full: {}{}",
        plural(acknowledged.len(), "payment"),
        answer.status.unwrap_or(0),
        if answer.status == Some(201) && !answer.replayed {
            ", its first run"
        } else {
            ""
        }
    );
    api.stop().await;
    relay_outbox(&engine, nats).await?;
    blocking(move || drop(engine)).await?;
    row.charges = ledger_count(ledger, run)? - before;
    Tally::print_phase(ledger, &prefix, audit)?;
    Ok(row)
}

/// Whether the provider's ledger has a charge for client key `key`.
fn provider_has(ledger: &Path, key: &str) -> DemoResult<bool> {
    Ok(read_ledger(ledger)?
        .entries
        .iter()
        .any(|c| c.client_key == key))
}
