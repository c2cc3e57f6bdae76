//! The effect-step rules of `step_ops.rs` and `ops.rs`, over the redb
//! backend with a manual clock: reserve / confirm / reject, the lifecycle
//! of a key with steps (complete, release, in doubt, settle, resume,
//! sweep, tombstone), the evidence log and its bound, and bad input that
//! must write nothing. Every test runs on redb, and on PostgreSQL when
//! `IDEMPOTENCY_TEST_PG` names a server (`scripts/with-postgres`; a table
//! prefix of its own per test), else that half is skipped with a note.

use std::sync::Arc;

use crate::clock::{Clock, ManualClock};
use crate::envelope::Envelope;
use crate::error::Error;
use crate::fingerprint::Fingerprint;
use crate::key::IdempotencyKey;
use crate::policy::ExpiryPolicy;
use crate::store::config::StoreConfig;
use crate::store::record::StoredResponse;
use crate::store::redb::{prepare, Opened, RedbStore, Sizes};
use crate::store::step::{StepAnswer, StepStatus};
use crate::store::step::{MAX_EVIDENCE_BYTES, MAX_HISTORY_ENTRIES, MAX_STEPS_PER_KEY};
use crate::store::{
    Abandon, Actor, Backend, ClaimRequest, ClaimResult, Claimed, CompleteRequest, Completion,
    FinishStepRequest, InDoubtRequest, SettleRequest, SettleStepRequest, Settled, Settlement,
    StepRecord, StepRequest,
};

type TestResult = Result<(), Box<dyn std::error::Error + Send + Sync>>;
type R<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

const T0: u64 = 1_700_000_000_000;
const LEASE_MS: u64 = 10_000;
const TTL_MS: u64 = 60_000;

struct Fixture {
    _dir: Option<tempfile::TempDir>,
    clock: ManualClock,
    store: Box<dyn Backend>,
    key: IdempotencyKey,
}

/// Which backend a fixture runs on.
#[derive(Clone, Copy, Debug)]
enum On {
    Redb,
    #[cfg(feature = "postgres")]
    Postgres,
    #[cfg(feature = "redis")]
    Redis,
}

/// Runs `test` on every backend there is (PostgreSQL only with
/// `IDEMPOTENCY_TEST_PG`).
fn on_every_backend(
    name: &str,
    test: impl Fn(&dyn Fn(ExpiryPolicy) -> R<Fixture>) -> TestResult,
) -> TestResult {
    test(&|expiry| fixture_on(On::Redb, name, expiry))?;
    #[cfg(feature = "postgres")]
    {
        if std::env::var(PG_ENV).is_ok() {
            test(&|expiry| fixture_on(On::Postgres, name, expiry))?;
        } else {
            eprintln!(
                "{name}: PostgreSQL half skipped ({PG_ENV} is not set; see scripts/with-postgres)"
            );
        }
    }
    #[cfg(feature = "redis")]
    {
        if std::env::var(REDIS_ENV).is_ok() {
            test(&|expiry| fixture_on(On::Redis, name, expiry))?;
        } else {
            eprintln!(
                "{name}: Redis part skipped ({REDIS_ENV} is not set; see scripts/with-redis)"
            );
        }
    }
    Ok(())
}

#[cfg(feature = "redis")]
const REDIS_ENV: &str = "IDEMPOTENCY_TEST_REDIS";

/// A Redis store under a key prefix of its own, with the manual clock.
#[cfg(feature = "redis")]
fn redis_fixture(name: &str, expiry: ExpiryPolicy) -> R<Fixture> {
    use crate::store::redis::{RedisOptions, RedisStore};
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .subsec_nanos();
    let opts = RedisOptions {
        url: std::env::var(REDIS_ENV)?,
        prefix: format!(
            "st:{}:{}:{}:{}:",
            name.chars().take(16).collect::<String>(),
            std::process::id(),
            nanos % 100_000,
            N.fetch_add(1, Ordering::Relaxed)
        ),
        pool_size: 2,
        connect_timeout: std::time::Duration::from_secs(5),
        command_timeout: std::time::Duration::from_secs(10),
        allow_volatile: false,
        durability_attested: false,
        mode: crate::store::redis::Mode::Create,
        wait_replicas: None,
        tls: Default::default(),
        password: None,
    };
    let clock = ManualClock::new(T0);
    let cfg = StoreConfig {
        ttl_ms: TTL_MS,
        expiry,
        max_response_bytes: 1 << 20,
    };
    let (store, _) = RedisStore::open(&opts, cfg, false, Arc::new(clock.clone()))?;
    Ok(Fixture {
        _dir: None,
        clock,
        store: Box::new(store),
        key: IdempotencyKey::new("shop", "pay-1")?,
    })
}

#[cfg(feature = "postgres")]
const PG_ENV: &str = "IDEMPOTENCY_TEST_PG";

fn fixture_on(on: On, name: &str, expiry: ExpiryPolicy) -> R<Fixture> {
    match on {
        On::Redb => fixture(expiry),
        #[cfg(feature = "postgres")]
        On::Postgres => pg_fixture(name, expiry),
        #[cfg(feature = "redis")]
        On::Redis => redis_fixture(name, expiry),
    }
    .map_err(|e| format!("{name} on {on:?}: {e}").into())
}

/// A PostgreSQL store on tables of a prefix of its own (made fresh from
/// the test's name, the expiry and the time), with the manual clock.
#[cfg(feature = "postgres")]
fn pg_fixture(name: &str, expiry: ExpiryPolicy) -> R<Fixture> {
    use crate::store::postgres::{Mode, PgOptions, PgStore};
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    let url = std::env::var(PG_ENV)?;
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .subsec_nanos();
    let short: String = name
        .chars()
        .filter(char::is_ascii_lowercase)
        .take(12)
        .collect();
    let prefix = format!(
        "st_{short}_{}_{}_{}_",
        std::process::id(),
        nanos % 100_000,
        N.fetch_add(1, Ordering::Relaxed)
    );
    let clock = ManualClock::new(T0);
    let opts = PgOptions {
        url,
        prefix,
        pool_size: 2,
        connect_timeout: std::time::Duration::from_secs(5),
        statement_timeout: std::time::Duration::from_secs(10),
        pool_idle_timeout: None,
        pool_max_lifetime: None,
        database_clock: false,
        mode: Mode::Create,
    };
    let cfg = StoreConfig {
        ttl_ms: TTL_MS,
        expiry,
        max_response_bytes: 1 << 20,
    };
    let (store, _, _) = PgStore::open(&opts, cfg, false, Arc::new(clock.clone()))?;
    Ok(Fixture {
        _dir: None,
        clock,
        store: Box::new(store),
        key: IdempotencyKey::new("shop", "pay-1")?,
    })
}

fn fixture(expiry: ExpiryPolicy) -> R<Fixture> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("steps.redb");
    let clock = ManualClock::new(T0);
    let cfg = StoreConfig {
        ttl_ms: TTL_MS,
        expiry,
        max_response_bytes: 1 << 20,
    };
    let opened = Opened::path(&path, None)?;
    let cfg = prepare(&opened.db, &path, cfg, false)?;
    let store = RedbStore::start(
        opened,
        cfg,
        Arc::new(clock.clone()),
        Sizes {
            max_batch: 16,
            max_group_bytes: 1 << 20,
            queue_capacity: 64,
            recovery_reserve: 0,
            seal_rule: crate::store::redb::PartitionSealRule::DEFAULT,
            migration: None,
        },
        None,
    )?;
    Ok(Fixture {
        _dir: Some(dir),
        clock,
        store: Box::new(store),
        key: IdempotencyKey::new("shop", "pay-1")?,
    })
}

impl Fixture {
    fn claim(&self) -> R<Claimed> {
        match self.store.claim(ClaimRequest {
            key: self.key.clone(),
            fingerprint: Fingerprint::from_bytes([1; 32]),
            lease_ms: LEASE_MS,
        })? {
            ClaimResult::Claimed(c) => Ok(c),
            ClaimResult::Held(found) => Err(format!("held: {:?}", found.held).into()),
        }
    }

    fn reserve(&self, token: u64, name: &str) -> crate::error::Result<StepRecord> {
        self.store.reserve_step(StepRequest {
            key: self.key.clone(),
            token,
            name: name.into(),
            finished: Vec::new(),
        })
    }

    fn finish(
        &self,
        token: u64,
        name: &str,
        confirmed: bool,
        evidence: &[u8],
    ) -> crate::error::Result<StepRecord> {
        self.store.finish_step(FinishStepRequest {
            key: self.key.clone(),
            token,
            name: name.into(),
            confirmed,
            evidence: evidence.to_vec(),
        })
    }

    fn complete(&self, token: u64) -> crate::error::Result<()> {
        self.store.complete(CompleteRequest {
            key: self.key.clone(),
            token,
            completion: Completion::Success,
            response: StoredResponse::new(Envelope::new(1, 201, b"ok".to_vec()), None),
            messages: Vec::new(),
            finished: Vec::new(),
        })
    }

    fn in_doubt(&self, token: u64) -> crate::error::Result<()> {
        self.store.mark_in_doubt(InDoubtRequest {
            key: self.key.clone(),
            token,
            reason: "crashed".into(),
            by: Abandon::Explicit,
        })
    }

    fn settle_step(
        &self,
        token: u64,
        name: &str,
        answer: StepAnswer,
    ) -> crate::error::Result<StepRecord> {
        self.store.settle_step(SettleStepRequest {
            key: self.key.clone(),
            token,
            name: name.into(),
            answer,
            actor: Actor::Resolver,
        })
    }

    fn settle(&self, token: u64, settlement: Settlement) -> crate::error::Result<Settled<()>> {
        self.store.settle(SettleRequest {
            key: self.key.clone(),
            token,
            settlement,
            actor: Actor::Operator {
                reason: "ledger checked".into(),
            },
        })
    }

    /// Resumes the key for a fresh claim (the only way: in one write).
    fn resume(&self, token: u64) -> crate::error::Result<Claimed> {
        let settled = self.store.settle_then_claim(
            SettleRequest {
                key: self.key.clone(),
                token,
                settlement: Settlement::Resume,
                actor: Actor::Operator {
                    reason: "ledger checked".into(),
                },
            },
            ClaimRequest {
                key: self.key.clone(),
                fingerprint: Fingerprint::from_bytes([1; 32]),
                lease_ms: LEASE_MS,
            },
        )?;
        match settled {
            Settled::NotExecuted(claimed) => Ok(claimed),
            other => Err(Error::InvalidState {
                key: self.key.clone(),
                action: "resume (test: unexpected answer)",
                state: match other {
                    Settled::Completed(_) => crate::state::State::Completed,
                    _ => crate::state::State::Unknown,
                },
            }),
        }
    }

    fn step(&self, name: &str) -> R<StepRecord> {
        self.store
            .steps(&self.key)?
            .into_iter()
            .find(|s| s.name == name)
            .ok_or_else(|| format!("no step {name}").into())
    }

    fn log_len(&self) -> R<usize> {
        Ok(self.store.history(&self.key)?.len())
    }
}

#[test]
fn reserve_confirm_complete_keeps_steps_and_log_with_the_record() -> TestResult {
    on_every_backend(
        "reserve_confirm_complete_keeps_steps_and_log_with_the_record",
        |fixture| {
            let f = fixture(ExpiryPolicy::Forget)?;
            let c = f.claim()?;
            assert!(c.steps.is_empty());
            let charge = f.reserve(c.token, "charge")?;
            assert_eq!(charge.status, StepStatus::Reserved);
            assert_eq!(charge.reference, format!("{}/charge", c.reference));
            assert!(matches!(
                f.reserve(c.token, "charge"),
                Err(Error::StepReused { .. })
            ));
            let done = f.finish(c.token, "charge", true, b"ch_1")?;
            assert_eq!(done.status, StepStatus::Confirmed);
            assert_eq!(done.evidence, b"ch_1");
            assert!(matches!(
                f.finish(c.token, "charge", true, b"x"),
                Err(Error::StepReused { .. })
            ));
            f.reserve(c.token, "receipt")?;
            f.finish(c.token, "receipt", false, b"bounced")?;
            f.complete(c.token)?;
            let steps = f.store.steps(&f.key)?;
            assert_eq!(
                steps
                    .iter()
                    .map(|s| (s.name.as_str(), s.status))
                    .collect::<Vec<_>>(),
                [
                    ("charge", StepStatus::Confirmed),
                    ("receipt", StepStatus::Failed)
                ]
            );
            let log = f.store.history(&f.key)?;
            let seen: Vec<_> = log
                .iter()
                .map(|e| (e.seq, e.step.as_deref(), e.from.as_str(), e.to.as_str()))
                .collect();
            assert_eq!(
                seen,
                [
                    (0, Some("charge"), "", "reserved"),
                    (1, Some("charge"), "reserved", "confirmed"),
                    (2, Some("receipt"), "", "reserved"),
                    (3, Some("receipt"), "reserved", "failed"),
                    (4, None, "PROCESSING", "COMPLETED"),
                ]
            );
            assert_eq!(log[1].evidence, b"ch_1");
            assert_eq!(log[1].actor, Actor::Claim { token: c.token });
            // After complete, no step may be reserved or confirmed.
            assert!(matches!(
                f.reserve(c.token, "late"),
                Err(Error::Fenced { .. })
            ));
            assert!(matches!(
                f.finish(c.token, "charge", true, b""),
                Err(Error::Fenced { .. })
            ));
            assert_eq!(f.log_len()?, 5);
            Ok(())
        },
    )
}

#[test]
fn complete_and_release_are_refused_while_work_may_have_happened() -> TestResult {
    on_every_backend(
        "complete_and_release_are_refused_while_work_may_have_happened",
        |fixture| {
            let f = fixture(ExpiryPolicy::Forget)?;
            let c = f.claim()?;
            f.reserve(c.token, "charge")?;
            let before = f.log_len()?;
            assert!(matches!(
                f.complete(c.token),
                Err(Error::InvalidState { .. })
            ));
            assert!(matches!(
                f.store.release(f.key.clone(), c.token),
                Err(Error::InvalidState { .. })
            ));
            assert_eq!(f.log_len()?, before, "a refusal writes nothing");
            f.finish(c.token, "charge", true, b"ch")?;
            assert!(matches!(
                f.store.release(f.key.clone(), c.token),
                Err(Error::InvalidState { .. })
            ));
            // Rejected steps only: the release takes them with the record.
            let g = fixture(ExpiryPolicy::Forget)?;
            let c = g.claim()?;
            g.reserve(c.token, "charge")?;
            g.finish(c.token, "charge", false, b"declined")?;
            g.store.release(g.key.clone(), c.token)?;
            assert!(g.store.steps(&g.key)?.is_empty());
            assert_eq!(g.log_len()?, 0);
            assert!(g.claim()?.steps.is_empty());
            Ok(())
        },
    )
}

#[test]
fn a_crash_settled_step_by_step_resumes_with_the_confirmed_calls() -> TestResult {
    on_every_backend(
        "a_crash_settled_step_by_step_resumes_with_the_confirmed_calls",
        |fixture| {
            let f = fixture(ExpiryPolicy::Forget)?;
            let c = f.claim()?;
            f.reserve(c.token, "charge")?;
            f.reserve(c.token, "receipt")?;
            f.finish(c.token, "receipt", true, b"r")?;
            f.reserve(c.token, "notify")?;
            f.in_doubt(c.token)?;
            assert_eq!(f.step("charge")?.status, StepStatus::Unknown);
            assert_eq!(f.step("receipt")?.status, StepStatus::Confirmed);
            // Not all steps settled: no resume, nothing written.
            assert!(matches!(f.resume(c.token), Err(Error::InvalidState { .. })));
            // Never without a claim to hand the key to.
            assert!(matches!(
                f.settle(c.token, Settlement::Resume),
                Err(Error::InvalidState { .. })
            ));
            assert!(matches!(
                f.settle_step(c.token, "nope", StepAnswer::NotExecuted),
                Err(Error::StepNotFound { .. })
            ));
            let asked = f.settle_step(c.token, "charge", StepAnswer::StillUnknown)?;
            assert_eq!((asked.status, asked.attempts), (StepStatus::Unknown, 1));
            f.settle_step(c.token, "charge", StepAnswer::Executed(b"ch_9".to_vec()))?;
            f.settle_step(c.token, "notify", StepAnswer::NotExecuted)?;
            // A settled step answers as it is.
            assert_eq!(
                f.settle_step(c.token, "charge", StepAnswer::NotExecuted)?
                    .status,
                StepStatus::Confirmed
            );
            assert!(matches!(
                f.settle(c.token, Settlement::NotExecuted),
                Err(Error::InvalidState { .. })
            ));
            // All settled, no claim waiting: still refused, the record stays.
            assert!(matches!(
                f.settle(c.token, Settlement::Resume),
                Err(Error::InvalidState { .. })
            ));
            assert!(f.store.record(&f.key)?.is_some());
            let next = f.resume(c.token)?;
            assert!(next.token > c.token);
            let names: Vec<_> = next
                .steps
                .iter()
                .map(|s| (s.name.as_str(), s.status))
                .collect();
            assert_eq!(
                names,
                [
                    ("charge", StepStatus::Confirmed),
                    ("notify", StepStatus::NotExecuted),
                    ("receipt", StepStatus::Confirmed)
                ]
            );
            // The confirmed call is skipped; the one not executed runs again
            // under its first reference.
            let charge = f.reserve(next.token, "charge")?;
            assert_eq!(
                (charge.status, charge.evidence.as_slice()),
                (StepStatus::Confirmed, &b"ch_9"[..])
            );
            let notify = f.reserve(next.token, "notify")?;
            assert_eq!(notify.status, StepStatus::Reserved);
            assert_eq!(notify.reference, format!("{}/notify", c.reference));
            f.finish(next.token, "notify", true, b"n")?;
            f.complete(next.token)?;
            let log = f.store.history(&f.key)?;
            assert!(log.iter().any(|e| e.to == "RESUMED"
                && e.actor
                    == Actor::Operator {
                        reason: "ledger checked".into()
                    }));
            assert!(
                log.windows(2).all(|w| w[1].seq == w[0].seq + 1),
                "entries are contiguous"
            );
            Ok(())
        },
    )
}

#[test]
fn a_released_resume_stays_unknown_and_an_unknown_step_refuses_release() -> TestResult {
    on_every_backend(
        "a_released_resume_stays_unknown_and_an_unknown_step_refuses_release",
        |fixture| {
            let f = fixture(ExpiryPolicy::Forget)?;
            let c = f.claim()?;
            f.reserve(c.token, "charge")?;
            f.finish(c.token, "charge", true, b"ch")?;
            f.in_doubt(c.token)?;
            let next = f.resume(c.token)?;
            f.store.release(f.key.clone(), next.token)?;
            // The record stays (UNKNOWN, the resumed claim's token), so
            // the next claim is checked against its fingerprint.
            let rec = f.store.record(&f.key)?.ok_or("record deleted")?;
            assert_eq!(
                (rec.state, rec.token, rec.lease_until_ms <= f.clock.now_ms()),
                (crate::store::record::RecordState::Unknown, next.token, true)
            );
            assert_eq!(f.step("charge")?.status, StepStatus::Confirmed);
            let log = f.store.history(&f.key)?;
            let last = log.last().ok_or("no log")?;
            assert_eq!(
                (&last.actor, last.from.as_str(), last.to.as_str()),
                (&Actor::Claim { token: next.token }, "PROCESSING", "UNKNOWN")
            );
            let again = f.resume(next.token)?;
            assert_eq!(again.steps.len(), 1);
            assert_eq!(again.steps[0].status, StepStatus::Confirmed);

            // A claim's own step moved to Unknown (its claim went in
            // doubt): the call may have happened, so no release.
            let g = fixture(ExpiryPolicy::Forget)?;
            let c = g.claim()?;
            g.reserve(c.token, "charge")?;
            g.in_doubt(c.token)?;
            assert_eq!(g.step("charge")?.status, StepStatus::Unknown);
            assert!(matches!(
                g.store.release(g.key.clone(), c.token),
                Err(Error::InvalidState { .. })
            ));
            assert_eq!(g.step("charge")?.status, StepStatus::Unknown);
            Ok(())
        },
    )
}

#[test]
fn a_lease_end_moves_reserved_steps_to_unknown_by_the_sweeper() -> TestResult {
    on_every_backend(
        "a_lease_end_moves_reserved_steps_to_unknown_by_the_sweeper",
        |fixture| {
            let f = fixture(ExpiryPolicy::Forget)?;
            let c = f.claim()?;
            f.reserve(c.token, "charge")?;
            f.clock
                .advance(std::time::Duration::from_millis(LEASE_MS + 1));
            // Read-time truth before any sweep.
            assert_eq!(f.step("charge")?.status, StepStatus::Unknown);
            assert!(matches!(
                f.reserve(c.token, "other"),
                Err(Error::Fenced { .. })
            ));
            let swept = f.store.sweep(100)?;
            assert_eq!(swept.moved_to_unknown, 1);
            let last = f.store.history(&f.key)?.pop().ok_or("empty log")?;
            assert_eq!((last.actor, last.to.as_str()), (Actor::Sweeper, "unknown"));
            // A claim now finds the key in doubt, with its steps.
            match f.store.claim(ClaimRequest {
                key: f.key.clone(),
                fingerprint: Fingerprint::from_bytes([1; 32]),
                lease_ms: LEASE_MS,
            })? {
                ClaimResult::Held(found) => {
                    assert_eq!(found.steps.len(), 1);
                    assert_eq!(found.steps[0].status, StepStatus::Unknown);
                }
                ClaimResult::Claimed(_) => {
                    return Err("an UNKNOWN key with steps was claimed".into())
                }
            }
            Ok(())
        },
    )
}

#[test]
fn a_tombstone_keeps_one_summary_entry_and_deletion_takes_everything() -> TestResult {
    on_every_backend(
        "a_tombstone_keeps_one_summary_entry_and_deletion_takes_everything",
        |fixture| {
            let keep = std::time::Duration::from_millis(TTL_MS);
            let f = fixture(ExpiryPolicy::Tombstone { keep })?;
            let c = f.claim()?;
            f.reserve(c.token, "charge")?;
            f.finish(c.token, "charge", true, b"ch")?;
            f.complete(c.token)?;
            f.clock
                .advance(std::time::Duration::from_millis(TTL_MS + 1));
            assert_eq!(f.store.sweep(100)?.tombstoned, 1);
            assert!(f.store.steps(&f.key)?.is_empty());
            let log = f.store.history(&f.key)?;
            assert_eq!(log.len(), 1);
            assert_eq!((log[0].to.as_str(), log[0].seq), ("TOMBSTONE", 3));
            let summary = String::from_utf8(log[0].evidence.clone())?;
            assert!(
                summary.contains("charge: confirmed") && summary.contains("3 log entries dropped"),
                "{summary}"
            );
            f.clock.advance(keep);
            assert_eq!(f.store.sweep(100)?.deleted, 1);
            assert_eq!(f.log_len()?, 0);
            Ok(())
        },
    )
}

#[test]
fn bad_input_is_refused_and_writes_nothing() -> TestResult {
    on_every_backend("bad_input_is_refused_and_writes_nothing", |fixture| {
        let f = fixture(ExpiryPolicy::Forget)?;
        let c = f.claim()?;
        for bad in ["", "a/b", "bell\u{7}", &"n".repeat(65)] {
            assert!(
                matches!(f.reserve(c.token, bad), Err(Error::InvalidStepName { .. })),
                "{bad:?}"
            );
        }
        assert!(matches!(
            f.reserve(c.token + 99, "charge"),
            Err(Error::Fenced { .. })
        ));
        f.reserve(c.token, "charge")?;
        let big = vec![0u8; MAX_EVIDENCE_BYTES + 1];
        assert!(matches!(
            f.finish(c.token, "charge", true, &big),
            Err(Error::EvidenceTooLarge { .. })
        ));
        assert_eq!(f.step("charge")?.status, StepStatus::Reserved);
        assert!(matches!(
            f.finish(c.token, "never", true, b""),
            Err(Error::StepNotFound { .. })
        ));
        for n in 1..MAX_STEPS_PER_KEY {
            f.reserve(c.token, &format!("s{n}"))?;
        }
        assert!(matches!(
            f.reserve(c.token, "one-too-many"),
            Err(Error::TooManySteps { .. })
        ));
        assert_eq!(f.store.steps(&f.key)?.len(), MAX_STEPS_PER_KEY);
        assert_eq!(f.log_len()?, MAX_STEPS_PER_KEY);
        Ok(())
    })
}

#[test]
fn a_full_log_refuses_the_transition_and_writes_nothing() -> TestResult {
    on_every_backend(
        "a_full_log_refuses_the_transition_and_writes_nothing",
        |fixture| {
            let f = fixture(ExpiryPolicy::Forget)?;
            // Each round: reserve, in doubt, settled not executed, resumed: four
            // entries.
            let mut round = 0;
            let mut c = f.claim()?;
            loop {
                if f.log_len()? + 1 > MAX_HISTORY_ENTRIES {
                    break;
                }
                match f.reserve(c.token, "charge") {
                    Ok(_) => {}
                    Err(Error::HistoryFull { .. }) => break,
                    Err(e) => return Err(e.into()),
                }
                f.in_doubt(c.token)?;
                f.settle_step(c.token, "charge", StepAnswer::NotExecuted)?;
                match f.resume(c.token) {
                    Ok(next) => c = next,
                    Err(Error::HistoryFull { .. }) => break,
                    Err(e) => return Err(e.into()),
                }
                round += 1;
                if round > MAX_HISTORY_ENTRIES {
                    return Err("the log never filled".into());
                }
            }
            assert!(f.log_len()? <= MAX_HISTORY_ENTRIES);
            let before = f.log_len()?;
            let steps_before = f.store.steps(&f.key)?;
            let c = match f.store.record(&f.key)? {
                Some(rec) if rec.state == crate::store::record::RecordState::Processing => {
                    rec.token
                }
                _ => f.claim()?.token,
            };
            // Fill to the brim, then one more is refused.
            let mut n = 0;
            while f.log_len()? < MAX_HISTORY_ENTRIES {
                n += 1;
                f.reserve(c, &format!("x{n}"))?;
            }
            let steps_full = f.store.steps(&f.key)?;
            assert!(matches!(
                f.reserve(c, "last"),
                Err(Error::HistoryFull { .. })
            ));
            assert_eq!(f.log_len()?, MAX_HISTORY_ENTRIES);
            assert_eq!(f.store.steps(&f.key)?, steps_full, "nothing written");
            assert!(before <= MAX_HISTORY_ENTRIES && steps_before.len() <= steps_full.len());
            // The engine's own moves are never blocked by a full log.
            f.in_doubt(c)?;
            assert_eq!(f.log_len()?, MAX_HISTORY_ENTRIES);
            assert!(f
                .store
                .steps(&f.key)?
                .iter()
                .all(|s| s.status != StepStatus::Reserved));
            Ok(())
        },
    )
}
