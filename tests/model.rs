//! Model-based test: random sequences of operations run against the engine
//! and against a plain in-memory model written from the documented contract
//! (`outcome.rs`, `ops.rs` `classify`, `engine.rs`, `claim.rs`,
//! `recovery.rs`); every answer and every stored record must agree.
//!
//! It guards against the failures the crate exists to prevent: a key's work
//! running twice, a replay of the wrong response, a claim that outlives its
//! fencing, an expiry or lease boundary off by one, state lost across a
//! reopen. Independently of the model, an execution tracker checks from the
//! engine's answers alone that a second `Claimed` for a key only follows a
//! retryable release, an expiry (under `Forget`, or after the tombstone ran
//! out), a `NotExecuted` resolution or a purge.
//!
//! Operations: `begin` (3 keys × 2 fingerprints, default or longer lease),
//! `complete`, `fail` of each kind, dropping a claim, `Claim::extend`, moving
//! the `ManualClock` by amounts around the lease and TTL or to a record's
//! exact boundary ±1 ms, `sweep_now`, dropping and reopening the engine on the
//! same file, `resolve`, `recover_in_doubt` with a scripted resolver, and
//! `purge`. Both expiry policies, with and without a resolver consulted by
//! `begin`. proptest shrinks a failing sequence to a minimal one.
//!
//! With faults on (`engine_survives_storage_faults`), the database lives on a
//! `CrashBackend` (`tests/common/storage_faults.rs`) and two more operations
//! run: arming a failure of the Nth `write` or `sync_data` from now, and a
//! crash (reopen from only what was synced). When an armed fault fires, the
//! operation's caller must have heard `Error::Poisoned` (never `Ok`), later
//! calls too; the test then crashes and reopens (from the durable image, or
//! the live one: a failed sync may or may not have reached the disk) and
//! every record must be exactly as the model had it before the failed
//! operation or exactly as after it. So nothing acknowledged is lost, and
//! nothing unacknowledged is visible unless its write really committed, and
//! then with its exact bytes.
//!
//! Effect steps have a model of their own, on one key
//! (`steps_agree_with_the_model`, `tests/model/steps.rs`): reserve,
//! confirm, reject, complete, failures in doubt, dropped claims, provider
//! answers and operator settlements, with a provider ledger that catches a
//! step's call made twice.
//!
//! The same model runs against the PostgreSQL backend
//! (`engine_agrees_with_the_model_on_postgres`, fewer cases: every write is
//! a round trip and a commit on a real server; skipped without
//! `IDEMPOTENCY_TEST_PG`, see `tests/common/backends.rs`) and the Redis
//! backend (`…_on_redis`, skipped without `IDEMPOTENCY_TEST_REDIS`). Faults are
//! injected through redb's `StorageBackend`, so they run on redb only.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use idempotency::{
    Begin, Claim, Engine, Envelope, Error, ExpiryPolicy, Failure, Fingerprint, IdempotencyKey,
    InDoubt, ManualClock, PurgeMode, RecordInfo, ReplayKind, Resolution, State, Stats, SweepCounts,
};
use proptest::prelude::*;
use proptest::test_runner::TestCaseError;

#[path = "common/storage_faults.rs"]
mod storage_faults;

// Declared once at the test binary's root (tests/services/main.rs): its
// table and key prefixes are unique through one counter per process.
use crate::harness as backends;

#[path = "model/steps.rs"]
mod steps;

use backends::Backend;

use storage_faults::{CrashBackend, FailedSync};

const KEYS: usize = 3;
const SCOPE: &str = "tenant:pay";
const LEASE_MS: u64 = 1_000;
const LONG_LEASE_MS: u64 = 2_500;
const EXTEND_MS: u64 = 1_500;
const TTL_MS: u64 = 5_000;
const KEEP_MS: u64 = 3_000;
const MAX_RESPONSE_BYTES: usize = 256;
const START_MS: u64 = 1_700_000_000_000;

/// Body number whose response is over `MAX_RESPONSE_BYTES`.
const BIG: u8 = 3;
const STATUS_COMPLETED: u16 = 200;
const STATUS_RESOLVED: u16 = 203;
const STATUS_FINAL: u16 = 402;

fn body(n: u8) -> Vec<u8> {
    if n == BIG {
        vec![b'x'; MAX_RESPONSE_BYTES + 36]
    } else {
        format!("body-{n}").into_bytes()
    }
}

fn envelope(status: u16, n: u8) -> Envelope {
    Envelope::new(1, status, body(n))
}

fn key(k: usize) -> IdempotencyKey {
    // Valid by construction: short, printable.
    IdempotencyKey::new(SCOPE, format!("k{k}")).expect("valid key")
}

fn fingerprint(fp: usize) -> Fingerprint {
    Fingerprint::of_json(format!(r#"{{"amount": {fp}}}"#).as_bytes(), &[]).expect("valid JSON")
}

// ---------------------------------------------------------------------------
// Operations.

/// What a scripted resolver answers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Answer {
    Completed(u8),
    NotExecuted,
    StillInDoubt,
}

impl Answer {
    fn resolution(self) -> Resolution {
        match self {
            Answer::Completed(n) => Resolution::Completed(envelope(STATUS_RESOLVED, n)),
            Answer::NotExecuted => Resolution::NotExecuted,
            Answer::StillInDoubt => Resolution::StillInDoubt,
        }
    }
}

#[derive(Clone, Copy, Debug)]
enum How {
    Retryable,
    Final(u8),
    InDoubt,
}

#[derive(Clone, Copy, Debug)]
enum Boundary {
    /// A PROCESSING record's lease end.
    Lease,
    /// A COMPLETED / FINAL_FAILURE record's expiry, or a tombstone's end.
    Expiry,
    /// When an expired record's tombstone would run out.
    Reusable,
}

#[derive(Clone, Debug)]
enum Op {
    Begin {
        key: usize,
        fp: usize,
        long_lease: bool,
        /// What `begin`'s resolver answers, if it is consulted.
        answer: Answer,
    },
    Complete {
        claim: usize,
        body: u8,
    },
    Fail {
        claim: usize,
        how: How,
    },
    DropClaim {
        claim: usize,
    },
    Extend {
        claim: usize,
    },
    Advance {
        ms: u64,
    },
    AdvanceTo {
        key: usize,
        to: Boundary,
        delta: i8,
    },
    /// The clock steps backwards (`Clock` says the engine tolerates it).
    StepBack {
        ms: u64,
    },
    Sweep,
    Reopen,
    Resolve {
        key: usize,
        answer: Answer,
    },
    Recover {
        answers: [Answer; KEYS],
        limit: usize,
    },
    Purge {
        key: usize,
        force: bool,
    },
    /// Faults on only: the `n`th `write` (or `sync_data`) from now fails; a
    /// failed sync leaves its data durable or not. After it fires, the
    /// crash keeps the durable image or the live one.
    Fault {
        sync: bool,
        n: u8,
        persisted: bool,
        live_image: bool,
    },
    /// Faults on only: the machine dies; reopen from what was synced.
    Crash,
}

fn answer_strategy() -> impl Strategy<Value = Answer> {
    prop_oneof![
        3 => (0u8..3).prop_map(Answer::Completed),
        1 => Just(Answer::Completed(BIG)),
        4 => Just(Answer::NotExecuted),
        4 => Just(Answer::StillInDoubt),
    ]
}

fn body_strategy() -> impl Strategy<Value = u8> {
    prop_oneof![9 => 0u8..3, 1 => Just(BIG)]
}

fn op_strategy() -> impl Strategy<Value = Op> {
    let k = 0..KEYS;
    prop_oneof![
        10 => (k.clone(), prop_oneof![4 => Just(0usize), 1 => Just(1usize)], prop::bool::weighted(0.2), answer_strategy()).prop_map(
            |(key, fp, long_lease, answer)| Op::Begin { key, fp, long_lease, answer }
        ),
        4 => (any::<usize>(), body_strategy()).prop_map(|(claim, body)| Op::Complete { claim, body }),
        4 => (any::<usize>(), prop_oneof![
            Just(How::Retryable),
            body_strategy().prop_map(How::Final),
            Just(How::InDoubt),
        ]).prop_map(|(claim, how)| Op::Fail { claim, how }),
        2 => any::<usize>().prop_map(|claim| Op::DropClaim { claim }),
        1 => any::<usize>().prop_map(|claim| Op::Extend { claim }),
        6 => prop_oneof![
            Just(1),
            Just(LEASE_MS - 1),
            Just(LEASE_MS),
            Just(LEASE_MS + 1),
            Just(TTL_MS - 1),
            Just(TTL_MS),
            Just(TTL_MS + 1),
            Just(KEEP_MS),
            0..3 * TTL_MS,
        ].prop_map(|ms| Op::Advance { ms }),
        3 => (k.clone(), prop_oneof![
            Just(Boundary::Lease),
            Just(Boundary::Expiry),
            Just(Boundary::Reusable),
        ], -1i8..=1).prop_map(|(key, to, delta)| Op::AdvanceTo { key, to, delta }),
        1 => (1..2 * LEASE_MS).prop_map(|ms| Op::StepBack { ms }),
        2 => Just(Op::Sweep),
        1 => Just(Op::Reopen),
        2 => (k.clone(), answer_strategy()).prop_map(|(key, answer)| Op::Resolve { key, answer }),
        2 => (prop::array::uniform3(answer_strategy()), 1usize..=KEYS)
            .prop_map(|(answers, limit)| Op::Recover { answers, limit }),
        1 => (k, any::<bool>()).prop_map(|(key, force)| Op::Purge { key, force }),
    ]
}

/// The operations with faults on: mostly the usual ones, then arming a
/// fault (a commit is a handful of writes and one sync) and crashes.
fn faulty_op_strategy() -> impl Strategy<Value = Op> {
    prop_oneof![
        12 => op_strategy(),
        2 => (1u8..=8, any::<bool>()).prop_map(|(n, live_image)| Op::Fault {
            sync: false,
            n,
            persisted: false,
            live_image,
        }),
        1 => (1u8..=2, any::<bool>(), any::<bool>()).prop_map(|(n, persisted, live_image)| {
            Op::Fault {
                sync: true,
                n,
                persisted,
                live_image,
            }
        }),
        1 => Just(Op::Crash),
    ]
}

// ---------------------------------------------------------------------------
// What the engine answers, in comparable form.

/// A [`InDoubt`], with the key as its index.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Seen {
    key: usize,
    reference: String,
    token: u64,
    attempts: u32,
    claimed_at: u64,
    unknown_since: u64,
    resolvable_at: u64,
    age: u64,
    reason: String,
}

fn key_index(key: &IdempotencyKey) -> usize {
    key.key()
        .strip_prefix('k')
        .and_then(|n| n.parse().ok())
        .unwrap_or(usize::MAX)
}

fn seen(p: &InDoubt) -> Seen {
    Seen {
        key: key_index(&p.key),
        reference: p.reference.clone(),
        token: p.fencing_token,
        attempts: p.attempts,
        claimed_at: p.claimed_at_ms,
        unknown_since: p.unknown_since_ms,
        resolvable_at: p.resolvable_at_ms,
        age: p.age.as_millis() as u64,
        reason: p.reason.clone(),
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Answered {
    Claimed {
        token: u64,
        claimed_at: u64,
        lease_until: u64,
    },
    Replay {
        status: u16,
        body: Vec<u8>,
        kind: ReplayKind,
        completed_at: u64,
        reference: String,
    },
    InProgress {
        retry_after_ms: u64,
    },
    Mismatch,
    InDoubt(Seen),
    Expired {
        expired_at: u64,
        reusable_at: u64,
    },
}

/// An error, by kind.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Failed {
    Fenced { token: u64 },
    ForeignClaim,
    Closed,
    NotFound,
    InvalidState(State),
    TooLarge { size: usize },
    Other(String),
}

fn failed(e: &Error) -> Failed {
    match e {
        Error::Fenced { token, .. } => Failed::Fenced { token: *token },
        Error::ForeignClaim { .. } => Failed::ForeignClaim,
        Error::Closed => Failed::Closed,
        Error::NotFound { .. } => Failed::NotFound,
        Error::InvalidState { state, .. } => Failed::InvalidState(*state),
        Error::ResponseTooLarge { size, .. } => Failed::TooLarge { size: *size },
        other => Failed::Other(other.to_string()),
    }
}

// ---------------------------------------------------------------------------
// The model.

#[derive(Clone, Debug)]
struct Rec {
    state: State,
    fp: usize,
    token: u64,
    reference: String,
    claimed_at: u64,
    updated_at: u64,
    lease_until: u64,
    expires_at: u64,
    expired_at: u64,
    unknown_since: u64,
    attempts: u32,
    reason: String,
    response: Option<(u16, Vec<u8>)>,
}

/// What a record means for a `begin` (the contract of `ops::classify`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Class {
    Absent,
    Mismatch,
    Live { retry_after_ms: u64 },
    Stale,
    Done,
    Unknown,
    Tombstoned { expired_at: u64, reusable_at: u64 },
}

#[derive(Clone)]
struct Model {
    recs: [Option<Rec>; KEYS],
    next_token: u64,
    /// Whether fencing tokens are dense (redb: one counter, +1 per claim).
    /// PostgreSQL draws them from a sequence: they grow, with gaps (a
    /// claim that meets a row, or a rolled-back one, still used a value).
    dense_tokens: bool,
    policy: ExpiryPolicy,
    resolver_in_begin: bool,
    /// redb: an open marks the claims the engine before left PROCESSING
    /// (lease still running) UNKNOWN, keeping their lease end.
    ended_process_at_open: bool,
    /// When `begin` may next ask the resolver about a dropped claim whose
    /// lease still runs, per key and token (the engine forgets it at a
    /// reopen).
    asked: HashMap<(usize, u64), u64>,
}

/// The shortest time between two resolver questions about one dropped
/// claim (the engine's default `resolver_interval`).
const RESOLVER_INTERVAL_MS: u64 = 1_000;

/// The reason of a claim found PROCESSING when redb was opened.
const ENDED_PROCESS: &str =
    "the process holding the claim ended (found PROCESSING when the database was opened)";

/// The engine's reason for a stale claim: its lease (from the claim to the
/// lease end) ran out.
fn lease_ran_out(claimed_at: u64, lease_until: u64) -> String {
    let lease_ms = lease_until.saturating_sub(claimed_at);
    format!("its lease ({lease_ms} ms) ran out without an outcome")
}

impl Model {
    /// What an open does before anything else: on redb, every PROCESSING
    /// record whose lease still runs is a dead engine's claim.
    fn opened(&mut self, now: u64) {
        self.asked.clear();
        if !self.ended_process_at_open {
            return;
        }
        for k in 0..KEYS {
            if self.recs[k]
                .as_ref()
                .is_some_and(|r| r.state == State::Processing && r.lease_until > now)
            {
                self.mark_unknown_at(k, ENDED_PROCESS.to_owned(), now, false);
            }
        }
    }

    fn keep_ms(&self) -> Option<u64> {
        match self.policy {
            ExpiryPolicy::Forget => None,
            ExpiryPolicy::Tombstone { keep } => Some(keep.as_millis() as u64),
        }
    }

    /// Read-time truth: expiry first (an expired record is absent, or
    /// tombstoned), then the fingerprint (a different request is always a
    /// mismatch), then the state.
    fn class(&self, k: usize, fp: usize, now: u64) -> Class {
        let Some(rec) = &self.recs[k] else {
            return Class::Absent;
        };
        let tombstoned = |expired_at: u64, reusable_at: u64| {
            (now < reusable_at).then_some(Class::Tombstoned {
                expired_at,
                reusable_at,
            })
        };
        let by_expiry = match rec.state {
            State::Completed | State::FinalFailure if now >= rec.expires_at => {
                match self.keep_ms() {
                    None => None,
                    Some(keep) => tombstoned(rec.expires_at, rec.expires_at + keep),
                }
            }
            State::Tombstone => tombstoned(rec.expired_at, rec.expires_at),
            _ => Some(Class::Done),
        };
        let Some(class) = by_expiry else {
            return Class::Absent;
        };
        if rec.fp != fp {
            return Class::Mismatch;
        }
        match rec.state {
            State::Processing if rec.lease_until > now => Class::Live {
                retry_after_ms: rec.lease_until - now,
            },
            State::Processing => Class::Stale,
            State::Unknown => Class::Unknown,
            _ => class,
        }
    }

    fn in_doubt(&self, k: usize, now: u64) -> Seen {
        let rec = self.recs[k].as_ref().expect("an in-doubt record");
        // A PROCESSING record whose lease ended is in doubt since its
        // lease end, before any sweep moves it.
        let (since, reason) = if rec.state == State::Unknown {
            (rec.unknown_since, rec.reason.clone())
        } else {
            (
                rec.lease_until,
                lease_ran_out(rec.claimed_at, rec.lease_until),
            )
        };
        Seen {
            key: k,
            reference: rec.reference.clone(),
            token: rec.token,
            attempts: rec.attempts,
            claimed_at: rec.claimed_at,
            unknown_since: since,
            resolvable_at: rec.lease_until,
            age: now.saturating_sub(since),
            reason,
        }
    }

    /// Whether record `k` is in doubt at `now`: UNKNOWN, or PROCESSING with
    /// its lease ended.
    fn is_in_doubt(&self, k: usize, now: u64) -> bool {
        self.recs[k].as_ref().is_some_and(|r| {
            r.state == State::Unknown || (r.state == State::Processing && r.lease_until <= now)
        })
    }

    fn claim(&mut self, k: usize, fp: usize, lease_ms: u64, now: u64) -> Answered {
        let token = self.next_token;
        self.next_token += 1;
        let lease_until = now + lease_ms.max(1);
        self.recs[k] = Some(Rec {
            state: State::Processing,
            fp,
            token,
            // Learned from the engine's claim (the model does not derive it).
            reference: String::new(),
            claimed_at: now,
            updated_at: now,
            lease_until,
            expires_at: 0,
            expired_at: 0,
            unknown_since: 0,
            attempts: 0,
            reason: String::new(),
            response: None,
        });
        Answered::Claimed {
            token,
            claimed_at: now,
            lease_until,
        }
    }

    /// PROCESSING → UNKNOWN. The lease end stays as the instant from which
    /// a resolver may settle the record, cut to now when the holder said it
    /// stopped (an explicit `fail`): a dropped claim's work may still run.
    fn mark_unknown_at(&mut self, k: usize, reason: String, now: u64, holder_done: bool) {
        let rec = self.recs[k].as_mut().expect("a record");
        if holder_done {
            rec.lease_until = rec.lease_until.min(now);
        }
        rec.state = State::Unknown;
        rec.unknown_since = now;
        rec.updated_at = now;
        rec.reason = reason;
    }

    fn set_outcome(&mut self, k: usize, state: State, response: (u16, Vec<u8>), now: u64) {
        let rec = self.recs[k].as_mut().expect("a record");
        rec.state = state;
        rec.updated_at = now;
        rec.expires_at = now + TTL_MS;
        rec.response = Some(response);
    }

    fn replay(&self, k: usize) -> Answered {
        let rec = self.recs[k].as_ref().expect("a record");
        let (status, body) = rec.response.clone().expect("a stored response");
        Answered::Replay {
            status,
            body,
            kind: if rec.state == State::FinalFailure {
                ReplayKind::FinalFailure
            } else {
                ReplayKind::Completed
            },
            completed_at: rec.updated_at,
            reference: rec.reference.clone(),
        }
    }

    /// Applies a settlement to an UNKNOWN record (`Engine::resolve`,
    /// `recover_in_doubt`): the resolver's envelope is checked against the
    /// size limit first.
    fn settle(&mut self, k: usize, answer: Answer, now: u64) -> Result<(), Failed> {
        match answer {
            Answer::Completed(n) => {
                let b = body(n);
                if b.len() > MAX_RESPONSE_BYTES {
                    return Err(Failed::TooLarge { size: b.len() });
                }
                self.set_outcome(k, State::Completed, (STATUS_RESOLVED, b), now);
            }
            Answer::NotExecuted => self.recs[k] = None,
            Answer::StillInDoubt => {
                // A PROCESSING record whose lease ended moves to UNKNOWN in
                // the same write (read-time truth).
                if let Some((claimed_at, lease_until)) = self.recs[k]
                    .as_ref()
                    .filter(|r| r.state == State::Processing)
                    .map(|r| (r.claimed_at, r.lease_until))
                {
                    self.mark_unknown_at(k, lease_ran_out(claimed_at, lease_until), now, false);
                }
                let rec = self.recs[k].as_mut().expect("a record");
                rec.attempts += 1;
                rec.updated_at = now;
            }
        }
        Ok(())
    }

    /// `begin`; `calls` collects what the resolver is asked.
    fn begin(
        &mut self,
        k: usize,
        fp: usize,
        lease_ms: u64,
        answer: Answer,
        now: u64,
        calls: &mut Vec<Seen>,
    ) -> Result<Answered, Failed> {
        match self.class(k, fp, now) {
            Class::Absent => return Ok(self.claim(k, fp, lease_ms, now)),
            Class::Mismatch => return Ok(Answered::Mismatch),
            Class::Live { retry_after_ms } => {
                return Ok(Answered::InProgress {
                    retry_after_ms: retry_after_ms.max(1),
                })
            }
            Class::Done => return Ok(self.replay(k)),
            Class::Tombstoned {
                expired_at,
                reusable_at,
            } => {
                return Ok(Answered::Expired {
                    expired_at,
                    reusable_at,
                })
            }
            Class::Stale => {
                let (claimed_at, lease_until) = self.recs[k]
                    .as_ref()
                    .map_or((0, 0), |r| (r.claimed_at, r.lease_until));
                self.mark_unknown_at(k, lease_ran_out(claimed_at, lease_until), now, false);
            }
            Class::Unknown => {}
        }
        // One rule with or without a resolver: a dropped claim's work may
        // still run until its lease ends, so until then the key is in
        // progress; after that it is in doubt.
        // A record that went UNKNOWN because its lease ran out never counts
        // as running again, even if the clock steps back.
        let dropped_running = self.recs[k]
            .as_ref()
            .filter(|r| r.unknown_since < r.lease_until && now < r.lease_until)
            .map(|r| r.lease_until);
        if let Some(lease_end) = dropped_running {
            if !self.resolver_in_begin {
                return Ok(Answered::InProgress {
                    retry_after_ms: lease_end - now,
                });
            }
            // Early settlement: one question per interval; only a
            // positive answer settles before the lease end.
            let in_progress = |until: u64| Answered::InProgress {
                retry_after_ms: until.min(lease_end).saturating_sub(now).max(1),
            };
            let token = self.recs[k].as_ref().map_or(0, |r| r.token);
            let next = now + RESOLVER_INTERVAL_MS;
            match self.asked.get(&(k, token)) {
                Some(&due) if now < due => return Ok(in_progress(due)),
                _ => {}
            }
            self.asked.insert((k, token), next);
            calls.push(self.in_doubt(k, now));
            return match answer {
                Answer::Completed(_) => {
                    self.settle(k, answer, now)?;
                    Ok(self.replay(k))
                }
                Answer::NotExecuted => {
                    self.asked.insert((k, token), lease_end);
                    Ok(in_progress(lease_end))
                }
                Answer::StillInDoubt => Ok(in_progress(next)),
            };
        }
        if !self.resolver_in_begin {
            return Ok(Answered::InDoubt(self.in_doubt(k, now)));
        }
        calls.push(self.in_doubt(k, now));
        match answer {
            Answer::NotExecuted => Ok(self.claim(k, fp, lease_ms, now)),
            Answer::Completed(_) => {
                self.settle(k, answer, now)?;
                Ok(self.replay(k))
            }
            Answer::StillInDoubt => {
                self.settle(k, answer, now)?;
                Ok(Answered::InDoubt(self.in_doubt(k, now)))
            }
        }
    }

    /// Whether `token` owns the record: PROCESSING or UNKNOWN under it.
    fn owned(&self, k: usize, token: u64) -> Result<&Rec, Failed> {
        match &self.recs[k] {
            Some(rec)
                if rec.token == token
                    && matches!(rec.state, State::Processing | State::Unknown) =>
            {
                Ok(rec)
            }
            _ => Err(Failed::Fenced { token }),
        }
    }

    /// `complete` and `fail(Final)`.
    fn finish(
        &mut self,
        k: usize,
        token: u64,
        state: State,
        response: (u16, Vec<u8>),
        now: u64,
    ) -> Result<(), Failed> {
        // The size is checked before the claim is used: the claim comes
        // back unused and the record is untouched.
        let size = response.1.len();
        if size > MAX_RESPONSE_BYTES {
            return Err(Failed::TooLarge { size });
        }
        self.owned(k, token)?;
        self.set_outcome(k, state, response, now);
        Ok(())
    }

    fn mark_unknown(
        &mut self,
        k: usize,
        token: u64,
        reason: &str,
        now: u64,
        holder_done: bool,
    ) -> Result<(), Failed> {
        if self.owned(k, token)?.state == State::Processing {
            self.mark_unknown_at(k, reason.to_owned(), now, holder_done);
        }
        Ok(())
    }

    fn sweep(&mut self, now: u64) -> SweepCounts {
        let mut counts = SweepCounts::default();
        for k in 0..KEYS {
            let Some(rec) = self.recs[k].clone() else {
                continue;
            };
            match rec.state {
                State::Processing if rec.lease_until <= now => {
                    let reason = lease_ran_out(rec.claimed_at, rec.lease_until);
                    self.mark_unknown_at(k, reason, now, false);
                    counts.moved_to_unknown += 1;
                }
                State::Completed | State::FinalFailure | State::Tombstone
                    if rec.expires_at <= now =>
                {
                    let keep = match (rec.state, self.keep_ms()) {
                        (State::Completed | State::FinalFailure, Some(keep)) => {
                            Some(rec.expires_at + keep).filter(|&until| until > now)
                        }
                        _ => None,
                    };
                    match keep {
                        Some(until) => {
                            let rec = self.recs[k].as_mut().expect("a record");
                            rec.state = State::Tombstone;
                            rec.expired_at = rec.expires_at;
                            rec.expires_at = until;
                            rec.response = None;
                            rec.updated_at = now;
                            counts.tombstoned += 1;
                        }
                        None => {
                            self.recs[k] = None;
                            counts.deleted += 1;
                        }
                    }
                }
                _ => {}
            }
        }
        counts
    }

    /// Records in doubt at `now` in recovery order: by when they came into
    /// doubt (UNKNOWN before lease-ended PROCESSING at the same instant),
    /// then by record key (the key index here).
    fn recovery_queue(&self, now: u64) -> Vec<usize> {
        let mut queue: Vec<usize> = (0..KEYS).filter(|&k| self.is_in_doubt(k, now)).collect();
        queue.sort_by_key(|&k| {
            let stale = self.recs[k]
                .as_ref()
                .is_some_and(|r| r.state == State::Processing);
            (self.in_doubt(k, now).unknown_since, stale, k)
        });
        queue
    }

    /// What `Engine::record` should show for key `k`.
    fn info(&self, k: usize) -> Option<Shown> {
        self.recs[k].as_ref().map(|rec| Shown {
            state: rec.state,
            fingerprint: fingerprint(rec.fp),
            token: rec.token,
            reference: rec.reference.clone(),
            claimed_at: rec.claimed_at,
            updated_at: rec.updated_at,
            lease_until: (rec.state == State::Processing).then_some(rec.lease_until),
            expires_at: matches!(
                rec.state,
                State::Completed | State::FinalFailure | State::Tombstone
            )
            .then_some(rec.expires_at),
            unknown_since: (rec.state == State::Unknown).then_some(rec.unknown_since),
            attempts: (rec.state == State::Unknown).then_some(rec.attempts),
            reason: (rec.state == State::Unknown).then(|| rec.reason.clone()),
            response: rec.response.clone(),
        })
    }
}

/// The fields of a stored record that the contract pins down. `attempts`
/// and `reason` are compared only while UNKNOWN ("UNKNOWN: why").
#[derive(Clone, Debug, PartialEq, Eq)]
struct Shown {
    state: State,
    fingerprint: Fingerprint,
    token: u64,
    reference: String,
    claimed_at: u64,
    updated_at: u64,
    lease_until: Option<u64>,
    expires_at: Option<u64>,
    unknown_since: Option<u64>,
    attempts: Option<u32>,
    reason: Option<String>,
    response: Option<(u16, Vec<u8>)>,
}

fn shown(info: &RecordInfo) -> Shown {
    Shown {
        state: info.state,
        fingerprint: info.fingerprint,
        token: info.fencing_token,
        reference: info.reference.clone(),
        claimed_at: info.claimed_at_ms,
        updated_at: info.updated_at_ms,
        lease_until: info.lease_until_ms,
        expires_at: info.expires_at_ms,
        unknown_since: info.unknown_since_ms,
        attempts: (info.state == State::Unknown).then_some(info.attempts),
        reason: (info.state == State::Unknown).then(|| info.reason.clone()),
        response: info.response.as_ref().map(|e| (e.status, e.body.clone())),
    }
}

// ---------------------------------------------------------------------------
// The harness: engine, model and execution tracker side by side.

#[derive(Clone, Copy, Debug)]
struct Config {
    policy: ExpiryPolicy,
    resolver_in_begin: bool,
}

fn config_strategy() -> impl Strategy<Value = Config> {
    (
        prop_oneof![
            Just(ExpiryPolicy::Forget),
            Just(ExpiryPolicy::Tombstone {
                keep: std::time::Duration::from_millis(KEEP_MS)
            })
        ],
        any::<bool>(),
    )
        .prop_map(|(policy, resolver_in_begin)| Config {
            policy,
            resolver_in_begin,
        })
}

/// The resolver `begin` consults: answers what the current op scripted and
/// logs what it was asked.
#[derive(Default)]
struct Script {
    answer: Option<Answer>,
    calls: Vec<Seen>,
}

struct Held {
    claim: Claim,
    key: usize,
    token: u64,
    generation: u32,
}

/// From the engine's answers alone: may key `k`'s work run (again)?
struct Executions {
    /// A release, a `NotExecuted` resolution or a purge allowed a new run.
    allowed: [bool; KEYS],
    /// When the key's outcome was recorded (it may run again once expired).
    outcome_at: [Option<u64>; KEYS],
    keep_ms: u64,
}

impl Executions {
    /// A claim for `k` at `now`. `latest` is the latest clock reading so
    /// far: once the outcome has expired (and may have been deleted), a
    /// clock that steps back does not bring it back.
    fn claimed(&mut self, k: usize, now: u64, latest: u64) -> Result<(), TestCaseError> {
        let expired = self.outcome_at[k].is_some_and(|at| latest >= at + TTL_MS + self.keep_ms);
        prop_assert!(
            self.allowed[k] || expired,
            "key k{k} claimed twice: its work would run again (outcome at {:?}, now {now})",
            self.outcome_at[k]
        );
        self.allowed[k] = false;
        self.outcome_at[k] = None;
        Ok(())
    }

    fn settled(&mut self, k: usize, answer: Answer, now: u64) {
        match answer {
            Answer::NotExecuted => self.allowed[k] = true,
            Answer::Completed(_) => self.outcome_at[k] = Some(now),
            Answer::StillInDoubt => {}
        }
    }
}

/// Where the harness keeps the database.
enum Disk {
    /// A redb file, or a PostgreSQL table prefix.
    Store(backends::Harness),
    /// Faults on: an in-memory disk that can fail and crash.
    Crash {
        backend: CrashBackend,
        /// Whether the crash after the armed fault keeps the live image.
        live_image: bool,
    },
}

struct Harness {
    disk: Disk,
    /// `Faults::fired` at the last reopen.
    fired_seen: u64,
    /// What the current op's caller heard (set by every op that writes).
    heard: Option<Result<(), Failed>>,
    clock: ManualClock,
    cfg: Config,
    engine: Option<Engine>,
    script: Arc<Mutex<Script>>,
    held: Vec<Held>,
    generation: u32,
    model: Model,
    executions: Executions,
    references: HashSet<String>,
    /// The latest clock reading so far (the clock may step back).
    latest: u64,
    /// The counters `Engine::stats` should show (reset by a reopen).
    counters: Stats,
}

fn lock(script: &Mutex<Script>) -> std::sync::MutexGuard<'_, Script> {
    script.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Harness {
    /// `None`: PostgreSQL tests are skipped (no server).
    fn new(cfg: Config, on: On) -> Result<Option<Harness>, TestCaseError> {
        // A networked store outlives the engine (a held claim stays
        // PROCESSING at reopen), and its tokens may skip values (a
        // PostgreSQL sequence on rollback, a Redis counter on a conflict).
        let dense_tokens = !matches!(on, On::Backend(Backend::Postgres | Backend::Redis));
        let disk = match on {
            On::Faults => Disk::Crash {
                backend: CrashBackend::new(),
                live_image: false,
            },
            On::Backend(backend) => match backends::Harness::new(backend) {
                Some(store) => Disk::Store(store),
                None => return Ok(None),
            },
        };
        let mut h = Harness {
            disk,
            fired_seen: 0,
            heard: None,
            clock: ManualClock::new(START_MS),
            cfg,
            engine: None,
            script: Arc::default(),
            held: Vec::new(),
            generation: 0,
            model: Model {
                recs: Default::default(),
                next_token: 1,
                dense_tokens,
                policy: cfg.policy,
                resolver_in_begin: cfg.resolver_in_begin,
                ended_process_at_open: dense_tokens,
                asked: HashMap::new(),
            },
            executions: Executions {
                allowed: [true; KEYS],
                outcome_at: [None; KEYS],
                keep_ms: match cfg.policy {
                    ExpiryPolicy::Forget => 0,
                    ExpiryPolicy::Tombstone { keep } => keep.as_millis() as u64,
                },
            },
            references: HashSet::new(),
            latest: START_MS,
            counters: Stats::default(),
        };
        h.open()?;
        Ok(Some(h))
    }

    fn open(&mut self) -> Result<(), TestCaseError> {
        let base = match &self.disk {
            Disk::Store(store) => store.builder(),
            Disk::Crash { .. } => Engine::builder(),
        };
        let mut builder = base
            .clock(self.clock.clone())
            .sweep_interval(None)
            .lease(Duration::from_millis(LEASE_MS))
            .ttl(Duration::from_millis(TTL_MS))
            .max_response_bytes(MAX_RESPONSE_BYTES)
            .expiry_policy(self.cfg.policy);
        if self.cfg.resolver_in_begin {
            let script = self.script.clone();
            builder = builder.resolver(move |p: &InDoubt| {
                let mut script = lock(&script);
                script.calls.push(seen(p));
                script
                    .answer
                    .map_or(Resolution::StillInDoubt, Answer::resolution)
            });
        }
        let engine = match &self.disk {
            Disk::Store(store) => store.open(builder),
            Disk::Crash { backend, .. } => builder.open_with_backend(backend.clone()),
        }
        .map_err(|e| TestCaseError::fail(format!("open: {e}")))?;
        self.engine = Some(engine);
        let now = self.now();
        self.model.opened(now);
        Ok(())
    }

    fn engine(&self) -> &Engine {
        self.engine
            .as_ref()
            .expect("the engine is open between ops")
    }

    fn now(&self) -> u64 {
        use idempotency::Clock;
        self.clock.now_ms()
    }

    /// An oversized response hands the claim back unused: the app keeps it
    /// (and may complete it later), as a careful app would.
    fn keep_returned_claim(
        &mut self,
        result: Result<(), Error>,
        key: usize,
        token: u64,
        generation: u32,
    ) -> Result<(), Failed> {
        match result {
            Err(Error::ResponseTooLarge {
                size,
                claim: Some(returned),
                ..
            }) => {
                // Always a claim (the engine made it); kept like any other.
                if let Some(claim) = returned.into_claim() {
                    self.held.push(Held {
                        claim,
                        key,
                        token,
                        generation,
                    });
                }
                Err(Failed::TooLarge { size })
            }
            other => other.map_err(|e| failed(&e)),
        }
    }

    fn take_claim(&mut self, index: usize) -> Option<Held> {
        if self.held.is_empty() {
            None
        } else {
            let i = index % self.held.len();
            Some(self.held.swap_remove(i))
        }
    }

    /// Waits until the writer has applied a dropped claim's notice, which
    /// is sent without waiting.
    fn barrier(&mut self) -> Result<(), TestCaseError> {
        let result = self.engine().flush();
        self.heard = Some(result.as_ref().map(drop).map_err(failed));
        prop_assert!(result.is_ok(), "flush: {result:?}");
        Ok(())
    }

    /// Whether an armed fault fired since the last reopen.
    fn fault_fired(&self) -> bool {
        match &self.disk {
            Disk::Store(_) => false,
            Disk::Crash { backend, .. } => backend.faults().fired() > self.fired_seen,
        }
    }

    /// Runs `op` on engine and model, then checks every record. If an armed
    /// fault fired during `op`: its caller heard `Error::Poisoned`, so does
    /// a later call; after a crash and reopen each record is as the model
    /// had it before `op` or as after it.
    fn run(&mut self, op: &Op) -> Result<(), TestCaseError> {
        let before = self.model.clone();
        let now = self.now();
        self.heard = None;
        let result = self.run_op(op);
        if !self.fault_fired() {
            result?;
            return self.check_records();
        }
        // `op`'s own checks assumed its write succeeded: void.
        let heard = self.heard.take();
        // `Closed` is a bug (see `storage_faults.rs`,
        // `a_storage_error_during_apply_is_reported_as_poisoned`): a fault
        // inside the transaction drops the reply before the poison is set.
        prop_assert!(
            matches!(&heard, Some(Err(Failed::Other(e))) if e.contains("poisoned"))
                || matches!(&heard, Some(Err(Failed::Closed))),
            "the fault fired but the caller heard {:?} (op's checks: {:?})",
            heard,
            result.err()
        );
        let later = self.engine().flush();
        prop_assert!(
            matches!(later, Err(Error::Poisoned { .. })),
            "a call after the fault: {later:?}"
        );
        self.crash()?;
        self.reconcile(&before, now)?;
        self.check_records()
    }

    /// The machine dies: drops the engine and reopens from the durable
    /// image (or the live one, if the armed fault said so), faults off.
    fn crash(&mut self) -> Result<(), TestCaseError> {
        let Disk::Crash {
            backend,
            live_image,
        } = &mut self.disk
        else {
            return Err(TestCaseError::fail("a crash needs faults on"));
        };
        let faults = backend.faults();
        faults.heal();
        let image = if *live_image {
            backend.live_image()
        } else {
            backend.crash()
        };
        *backend = CrashBackend::from_image(image, faults.clone());
        self.fired_seen = faults.fired();
        self.engine = None;
        self.generation += 1;
        self.counters = Stats::default();
        self.open()
    }

    /// After a crash that followed a failed op at `now`: each record must
    /// be as `before` the op or as after it (the model now); the model takes
    /// whichever the engine kept. A claim that committed although its
    /// caller heard an error has a reference the model never learned. One
    /// op writes twice: `begin` with a resolver on a stale record first
    /// moves it to UNKNOWN, then settles it; the fault may fall between.
    fn reconcile(&mut self, before: &Model, now: u64) -> Result<(), TestCaseError> {
        // The reopen marked the dead engine's claims (the model's too).
        let mut before = before.clone();
        before.opened(now);
        let before = &before;
        // `Shown` hides an UNKNOWN record's lease end, which the recovery
        // queue shows: a lost `extend` of a claim the reopen then marked
        // differs from the model's "after" only there.
        let resolvable: HashMap<usize, u64> = self
            .engine()
            .in_doubt(KEYS + 1)
            .map_err(|e| TestCaseError::fail(format!("in doubt: {e}")))?
            .iter()
            .map(|d| (key_index(&d.key), d.resolvable_at_ms))
            .collect();
        let mut advanced = false;
        for k in 0..KEYS {
            let found = self
                .engine()
                .record(&key(k))
                .map_err(|e| TestCaseError::fail(format!("record k{k}: {e}")))?
                .as_ref()
                .map(shown);
            let (was, after) = (before.info(k), self.model.info(k));
            let as_after = match (&found, &after) {
                (Some(f), Some(a)) if a.reference.is_empty() => {
                    *f == Shown {
                        reference: f.reference.clone(),
                        ..a.clone()
                    }
                }
                (f, a) => f == a,
            } && self.model.recs[k].as_ref().is_none_or(|r| {
                r.state != State::Unknown || resolvable.get(&k) == Some(&r.lease_until)
            });
            if as_after && was != after {
                advanced = true;
                if let (Some(f), Some(rec)) = (&found, self.model.recs[k].as_mut()) {
                    rec.reference = f.reference.clone();
                    self.references.insert(f.reference.clone());
                }
                let (b, a) = (before.recs[k].as_ref(), self.model.recs[k].as_ref());
                match a {
                    None if b.is_some() => self.executions.allowed[k] = true,
                    Some(a)
                        if matches!(a.state, State::Completed | State::FinalFailure)
                            && b.is_none_or(|b| {
                                (b.state, b.token, b.updated_at) != (a.state, a.token, a.updated_at)
                            }) =>
                    {
                        self.executions.outcome_at[k] = Some(a.updated_at);
                    }
                    _ => {}
                }
            } else if !as_after
                && found != was
                && was.as_ref().is_some_and(|r| {
                    r.state == State::Processing && r.lease_until.is_some_and(|l| l <= now)
                })
            {
                let mut moved = before.clone();
                let lease_until = was.as_ref().and_then(|r| r.lease_until).unwrap_or(0);
                let claimed_at = was.as_ref().map_or(0, |r| r.claimed_at);
                moved.mark_unknown_at(k, lease_ran_out(claimed_at, lease_until), now, false);
                prop_assert_eq!(
                    &found,
                    &moved.info(k),
                    "record k{} after a fault and a crash is neither as before the failed op, nor moved to UNKNOWN, nor as after it ({:?})",
                    k,
                    after
                );
                self.model.recs[k] = moved.recs[k].clone();
            } else if !as_after {
                prop_assert_eq!(
                    &found,
                    &was,
                    "record k{} after a fault and a crash is neither as before the failed op nor as after it ({:?})",
                    k,
                    after
                );
                self.model.recs[k] = before.recs[k].clone();
            }
        }
        if !advanced {
            self.model.next_token = before.next_token;
        }
        Ok(())
    }

    fn run_op(&mut self, op: &Op) -> Result<(), TestCaseError> {
        let now = self.now();
        self.latest = self.latest.max(now);
        match *op {
            Op::Begin {
                key: k,
                fp,
                long_lease,
                answer,
            } => {
                let lease_ms = if long_lease { LONG_LEASE_MS } else { LEASE_MS };
                let mut calls = Vec::new();
                let expected = self.model.begin(k, fp, lease_ms, answer, now, &mut calls);
                lock(&self.script).answer = Some(answer);
                let result = if long_lease {
                    self.engine().begin_with_lease(
                        &key(k),
                        fingerprint(fp),
                        Duration::from_millis(lease_ms),
                    )
                } else {
                    self.engine().begin(&key(k), fingerprint(fp))
                };
                self.heard = Some(result.as_ref().map(drop).map_err(failed));
                let asked = std::mem::take(&mut lock(&self.script).calls);
                prop_assert_eq!(&asked, &calls, "resolver calls in begin");
                let actual = match result {
                    Ok(Begin::Claimed(claim)) => {
                        let answered = Answered::Claimed {
                            token: claim.fencing_token(),
                            claimed_at: claim.claimed_at_ms(),
                            lease_until: claim.lease_until_ms(),
                        };
                        prop_assert_eq!(claim.key(), &key(k));
                        prop_assert!(
                            self.references.insert(claim.reference().to_owned()),
                            "reference {} reused",
                            claim.reference()
                        );
                        if let Some(rec) = self.model.recs[k].as_mut() {
                            rec.reference = claim.reference().to_owned();
                        }
                        if !asked.is_empty() {
                            self.executions.settled(k, answer, now);
                        }
                        self.executions.claimed(k, now, self.latest)?;
                        self.held.push(Held {
                            token: claim.fencing_token(),
                            claim,
                            key: k,
                            generation: self.generation,
                        });
                        Ok(answered)
                    }
                    Ok(Begin::Replay(r)) => {
                        prop_assert!(r.is_current && r.stored_schema_version == 1);
                        prop_assert_eq!(r.resource, None);
                        if !asked.is_empty() {
                            self.executions.settled(k, answer, now);
                        }
                        Ok(Answered::Replay {
                            status: r.envelope.status,
                            body: r.envelope.body,
                            kind: r.kind,
                            completed_at: r.completed_at_ms,
                            reference: r.reference,
                        })
                    }
                    Ok(Begin::Processing { retry_after }) => Ok(Answered::InProgress {
                        retry_after_ms: u64::try_from(retry_after.as_millis()).unwrap_or(u64::MAX),
                    }),
                    Ok(Begin::Mismatch) => Ok(Answered::Mismatch),
                    Ok(Begin::InDoubt(p)) => Ok(Answered::InDoubt(seen(&p))),
                    Ok(Begin::Tombstoned {
                        expired_at_ms,
                        reusable_at_ms,
                    }) => Ok(Answered::Expired {
                        expired_at: expired_at_ms,
                        reusable_at: reusable_at_ms,
                    }),
                    Err(e) => Err(failed(&e)),
                };
                let c = &mut self.counters;
                match &expected {
                    Ok(Answered::Claimed { .. }) => c.claims += 1,
                    Ok(Answered::Replay { .. }) => c.replays += 1,
                    Ok(Answered::InProgress { .. }) => c.processing_answers += 1,
                    Ok(Answered::Mismatch) => c.mismatches += 1,
                    Ok(Answered::InDoubt(_)) => c.in_doubt_answers += 1,
                    Ok(Answered::Expired { .. }) => c.tombstone_answers += 1,
                    Err(_) => {}
                }
                // Settled: replayed or claimed afresh after asking (an
                // early "not executed" settles nothing).
                if !calls.is_empty()
                    && matches!(
                        expected,
                        Ok(Answered::Replay { .. } | Answered::Claimed { .. })
                    )
                {
                    c.resolved += 1;
                }
                let expected = match (&actual, expected) {
                    (
                        Ok(Answered::Claimed { token: got, .. }),
                        Ok(Answered::Claimed {
                            token: want,
                            claimed_at,
                            lease_until,
                        }),
                    ) if !self.model.dense_tokens && *got > want => {
                        // Larger than every earlier token, as fencing needs.
                        self.model.next_token = *got + 1;
                        if let Some(rec) = self.model.recs[k].as_mut() {
                            rec.token = *got;
                        }
                        Ok(Answered::Claimed {
                            token: *got,
                            claimed_at,
                            lease_until,
                        })
                    }
                    (_, expected) => expected,
                };
                prop_assert_eq!(actual, expected, "begin k{} fp{}", k, fp);
            }
            Op::Complete { claim, body: n } => {
                let Some(held) = self.take_claim(claim) else {
                    return Ok(());
                };
                let expected = if held.generation != self.generation {
                    Err(Failed::ForeignClaim)
                } else {
                    self.model.finish(
                        held.key,
                        held.token,
                        State::Completed,
                        (STATUS_COMPLETED, body(n)),
                        now,
                    )
                };
                let (key, token, generation) = (held.key, held.token, held.generation);
                let actual = self
                    .engine()
                    .complete(held.claim, envelope(STATUS_COMPLETED, n));
                let actual = self.keep_returned_claim(actual, key, token, generation);
                self.heard = Some(actual.clone());
                if actual.is_ok() {
                    self.executions.outcome_at[held.key] = Some(now);
                }
                prop_assert_eq!(
                    actual,
                    expected,
                    "complete k{} token {}",
                    held.key,
                    held.token
                );
            }
            Op::Fail { claim, how } => {
                let Some(held) = self.take_claim(claim) else {
                    return Ok(());
                };
                let (k, token) = (held.key, held.token);
                let expected = if held.generation != self.generation {
                    Err(Failed::ForeignClaim)
                } else {
                    match how {
                        How::Retryable => self.model.owned(k, token).map(drop).inspect(|()| {
                            self.model.recs[k] = None;
                        }),
                        How::Final(n) => self.model.finish(
                            k,
                            token,
                            State::FinalFailure,
                            (STATUS_FINAL, body(n)),
                            now,
                        ),
                        How::InDoubt => {
                            self.model
                                .mark_unknown(k, token, "provider timed out", now, true)
                        }
                    }
                };
                let failure = match how {
                    How::Retryable => Failure::Retryable,
                    How::Final(n) => Failure::Final(envelope(STATUS_FINAL, n)),
                    How::InDoubt => Failure::InDoubt {
                        reason: "provider timed out".into(),
                    },
                };
                let generation = held.generation;
                let actual = self.engine().fail(held.claim, failure);
                let actual = self.keep_returned_claim(actual, k, token, generation);
                self.heard = Some(actual.clone());
                if actual.is_ok() {
                    match how {
                        How::Retryable => self.executions.allowed[k] = true,
                        How::Final(_) => self.executions.outcome_at[k] = Some(now),
                        How::InDoubt => {}
                    }
                }
                prop_assert_eq!(actual, expected, "fail {:?} k{} token {}", how, k, token);
            }
            Op::DropClaim { claim } => {
                let Some(held) = self.take_claim(claim) else {
                    return Ok(());
                };
                if held.generation == self.generation {
                    // Refused (fenced) drops change nothing, as in the engine.
                    let _ = self.model.mark_unknown(
                        held.key,
                        held.token,
                        "claim dropped without an outcome",
                        now,
                        false,
                    );
                }
                drop(held.claim);
                self.barrier()?;
            }
            Op::Extend { claim } => {
                if self.held.is_empty() {
                    return Ok(());
                }
                let i = claim % self.held.len();
                let (k, token) = (self.held[i].key, self.held[i].token);
                let expected = if self.held[i].generation != self.generation {
                    Err(Failed::Closed)
                } else {
                    match self.model.owned(k, token).map(|r| r.state) {
                        Ok(State::Processing) => {
                            let rec = self.model.recs[k].as_mut().expect("a record");
                            rec.lease_until = now + EXTEND_MS;
                            rec.updated_at = now;
                            Ok(rec.lease_until)
                        }
                        Ok(_) => Err(Failed::Fenced { token }),
                        Err(e) => Err(e),
                    }
                };
                let held = &mut self.held[i];
                let actual = held
                    .claim
                    .extend(Duration::from_millis(EXTEND_MS))
                    .map(|()| held.claim.lease_until_ms())
                    .map_err(|e| failed(&e));
                self.heard = Some(actual.clone().map(drop));
                prop_assert_eq!(actual, expected, "extend k{} token {}", k, token);
            }
            Op::Advance { ms } => self.clock.advance(Duration::from_millis(ms)),
            Op::AdvanceTo { key: k, to, delta } => {
                let target = self.model.recs[k]
                    .as_ref()
                    .and_then(|rec| match (to, rec.state) {
                        (Boundary::Lease, State::Processing) => Some(rec.lease_until),
                        (
                            Boundary::Expiry,
                            State::Completed | State::FinalFailure | State::Tombstone,
                        ) => Some(rec.expires_at),
                        (Boundary::Reusable, State::Completed | State::FinalFailure) => {
                            Some(rec.expires_at + self.executions.keep_ms)
                        }
                        _ => None,
                    });
                if let Some(target) = target.and_then(|t| t.checked_add_signed(i64::from(delta))) {
                    if target > now {
                        self.clock.set(target);
                    }
                }
            }
            Op::StepBack { ms } => self.clock.set(now.saturating_sub(ms)),
            Op::Sweep => {
                let expected = self.model.sweep(now);
                self.counters.moved_to_unknown += expected.moved_to_unknown;
                self.counters.expired_deleted += expected.deleted;
                self.counters.tombstoned += expected.tombstoned;
                let actual = self.engine().sweep_now().map_err(|e| failed(&e));
                self.heard = Some(actual.clone().map(drop));
                prop_assert_eq!(actual, Ok(expected), "sweep");
            }
            Op::Reopen => {
                // A clean close: an armed fault is not for the shutdown.
                if let Disk::Crash { backend, .. } = &self.disk {
                    backend.faults().heal();
                }
                self.engine = None;
                self.generation += 1;
                self.counters = Stats::default();
                self.open()?;
            }
            Op::Resolve { key: k, answer } => {
                let expected = match &self.model.recs[k] {
                    None => Err(Failed::NotFound),
                    Some(rec) if !self.model.is_in_doubt(k, now) => {
                        Err(Failed::InvalidState(rec.state))
                    }
                    // A dropped claim's work may still run until its lease
                    // ends: "not executed" is refused until then.
                    Some(rec) if answer == Answer::NotExecuted && rec.lease_until > now => {
                        Err(Failed::InvalidState(State::Unknown))
                    }
                    Some(_) => self.model.settle(k, answer, now),
                };
                let actual = self
                    .engine()
                    .resolve(&key(k), answer.resolution(), "model")
                    .map_err(|e| failed(&e));
                self.heard = Some(actual.clone());
                if actual.is_ok() {
                    self.executions.settled(k, answer, now);
                }
                // "UNKNOWN records resolved": a StillInDoubt answer resolves
                // nothing.
                if expected.is_ok() && answer != Answer::StillInDoubt {
                    self.counters.resolved += 1;
                }
                prop_assert_eq!(actual, expected, "resolve k{} {:?}", k, answer);
            }
            Op::Recover { answers, limit } => {
                let mut calls = Vec::new();
                let mut report = idempotency::RecoveryReport::default();
                for k in self.model.recovery_queue(now).into_iter().take(limit) {
                    // Not settled before a dropped claim's lease ends.
                    if self.model.recs[k]
                        .as_ref()
                        .is_some_and(|r| r.lease_until > now)
                    {
                        report.still_in_doubt += 1;
                        continue;
                    }
                    calls.push(self.model.in_doubt(k, now));
                    // A refused answer (an envelope over the size limit)
                    // leaves the record UNKNOWN and recovery goes on.
                    if self.model.settle(k, answers[k], now).is_err() {
                        report.still_in_doubt += 1;
                        continue;
                    }
                    match answers[k] {
                        Answer::Completed(_) => report.completed += 1,
                        Answer::NotExecuted => report.not_executed += 1,
                        Answer::StillInDoubt => report.still_in_doubt += 1,
                    }
                }
                let expected = Ok(report);
                let asked = Mutex::new(Vec::new());
                let resolver = |p: &InDoubt| {
                    lock_vec(&asked).push(seen(p));
                    answers
                        .get(key_index(&p.key))
                        .copied()
                        .unwrap_or(Answer::StillInDoubt)
                        .resolution()
                };
                let actual = self
                    .engine()
                    .recover_in_doubt(&resolver, limit)
                    .map_err(|e| failed(&e));
                self.heard = Some(actual.clone().map(drop));
                let asked = asked.into_inner().unwrap_or_else(PoisonError::into_inner);
                for call in &asked {
                    match answers.get(call.key) {
                        Some(Answer::Completed(BIG)) | None => {}
                        Some(&answer) => self.executions.settled(call.key, answer, now),
                    }
                }
                prop_assert_eq!(&asked, &calls, "resolver calls in recover_in_doubt");
                if let Ok(report) = &expected {
                    self.counters.resolved += report.completed + report.not_executed;
                }
                prop_assert_eq!(actual, expected, "recover_in_doubt");
            }
            Op::Purge { key: k, force } => {
                let expected = match &self.model.recs[k] {
                    None => Err(Failed::NotFound),
                    Some(rec)
                        if !force && matches!(rec.state, State::Processing | State::Unknown) =>
                    {
                        Err(Failed::InvalidState(rec.state))
                    }
                    Some(rec) => Ok(Some(rec.state)),
                };
                if expected.is_ok() {
                    self.model.recs[k] = None;
                }
                let mode = if force {
                    PurgeMode::Force
                } else {
                    PurgeMode::FinishedOnly
                };
                let actual = self.engine().purge(&key(k), mode).map_err(|e| failed(&e));
                if actual.is_ok() {
                    self.executions.allowed[k] = true;
                }
                self.heard = Some(actual.clone().map(drop));
                prop_assert_eq!(actual, expected, "purge k{} force {}", k, force);
            }
            Op::Fault {
                sync,
                n,
                persisted,
                live_image: live,
            } => {
                if let Disk::Crash {
                    backend,
                    live_image,
                } = &mut self.disk
                {
                    *live_image = live;
                    let faults = backend.faults();
                    faults.heal();
                    if sync {
                        faults.on_failed_sync(if persisted {
                            FailedSync::Persisted
                        } else {
                            FailedSync::Lost
                        });
                        faults.fail_sync(u64::from(n));
                    } else {
                        faults.fail_write(u64::from(n));
                    }
                }
            }
            Op::Crash => {
                if let Disk::Crash { live_image, .. } = &mut self.disk {
                    // Nothing failed: what was acknowledged is synced.
                    *live_image = false;
                    self.crash()?;
                }
            }
        }
        Ok(())
    }

    /// Every stored record, and the recovery queue, match the model.
    fn check_records(&self) -> Result<(), TestCaseError> {
        let now = self.now();
        for k in 0..KEYS {
            let actual = self
                .engine()
                .record(&key(k))
                .map_err(|e| TestCaseError::fail(format!("record k{k}: {e}")))?;
            prop_assert_eq!(
                actual.as_ref().map(shown),
                self.model.info(k),
                "record k{}",
                k
            );
        }
        let pending = self
            .engine()
            .in_doubt(KEYS + 1)
            .map_err(|e| TestCaseError::fail(format!("pending: {e}")))?;
        let pending: Vec<Seen> = pending.iter().map(seen).collect();
        let expected: Vec<Seen> = self
            .model
            .recovery_queue(now)
            .into_iter()
            .map(|k| self.model.in_doubt(k, now))
            .collect();
        prop_assert_eq!(pending, expected, "recovery queue");

        // Gauges count states at read time: a PROCESSING record whose
        // lease ended is UNKNOWN, an expired record a tombstone or gone.
        let mut stats = self.counters.clone();
        let keep = self.model.keep_ms();
        for rec in self.model.recs.iter().flatten() {
            let expired = match rec.state {
                State::Completed | State::FinalFailure if now >= rec.expires_at => {
                    Some(keep.is_some_and(|keep| now < rec.expires_at + keep))
                }
                State::Tombstone => Some(now < rec.expires_at),
                _ => None,
            };
            match (rec.state, expired) {
                (_, Some(true)) => stats.tombstones += 1,
                (_, Some(false)) => stats.expired += 1,
                (State::Processing, _) if rec.lease_until > now => stats.processing += 1,
                (State::Processing | State::Unknown, _) => stats.unknown += 1,
                (State::Completed, _) => stats.completed += 1,
                (State::FinalFailure, _) => stats.final_failures += 1,
                (State::Tombstone, _) => stats.tombstones += 1,
            }
        }
        stats.oldest_in_doubt_age = self
            .model
            .recovery_queue(now)
            .first()
            .map(|&k| Duration::from_millis(self.model.in_doubt(k, now).age));
        let actual = self
            .engine()
            .stats()
            .map_err(|e| TestCaseError::fail(format!("stats: {e}")))?;
        prop_assert_eq!(actual, stats, "stats");
        Ok(())
    }
}

fn lock_vec(v: &Mutex<Vec<Seen>>) -> std::sync::MutexGuard<'_, Vec<Seen>> {
    v.lock().unwrap_or_else(PoisonError::into_inner)
}

/// What a sequence runs on.
#[derive(Clone, Copy, Debug)]
enum On {
    Backend(Backend),
    /// redb on a `CrashBackend`, with the fault operations.
    Faults,
}

fn run_sequence(cfg: Config, ops: &[Op]) -> Result<(), TestCaseError> {
    run_on(cfg, ops, On::Backend(Backend::Redb))
}

fn run_on(cfg: Config, ops: &[Op], on: On) -> Result<(), TestCaseError> {
    let Some(mut h) = Harness::new(cfg, on)? else {
        return Ok(()); // skipped: no PostgreSQL server
    };
    for (i, op) in ops.iter().enumerate() {
        h.run(op)
            .map_err(|e| TestCaseError::fail(format!("op {i} {op:?}: {e}")))?;
    }
    // Claims still held are dropped before the engine: their records go
    // UNKNOWN, never anything that would run the work again.
    let held = std::mem::take(&mut h.held);
    drop(held);
    Ok(())
}

/// `PROPTEST_CASES` overrides the bounded default, for a longer search.
fn cases(default: u32) -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// The model against Redis: fewer cases, as on PostgreSQL. Skipped (or,
/// under `CI=true`, failed) without a server.
#[test]
fn engine_agrees_with_the_model_on_redis() {
    if backends::redis_url().is_none() {
        return;
    }
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig {
        cases: cases(32),
        max_shrink_iters: 1024,
        ..ProptestConfig::default()
    });
    let strategy = (
        config_strategy(),
        proptest::collection::vec(op_strategy(), 1..64),
    );
    if let Err(e) = runner.run(&strategy, |(cfg, ops)| {
        run_on(cfg, &ops, On::Backend(Backend::Redis))
    }) {
        panic!("Redis disagrees with the model: {e}");
    }
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: cases(256),
        max_shrink_iters: 4096,
        ..ProptestConfig::default()
    })]

    #[test]
    fn engine_agrees_with_the_model(
        cfg in config_strategy(),
        ops in proptest::collection::vec(op_strategy(), 1..64),
    ) {
        run_sequence(cfg, &ops)?;
    }
}

/// The model against PostgreSQL: fewer cases, since every operation is a
/// round trip to the server and every write a commit there. Skipped (or,
/// under `CI=true`, failed) without a server.
#[test]
fn engine_agrees_with_the_model_on_postgres() {
    if backends::pg_url().is_none() {
        return;
    }
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig {
        cases: cases(32),
        max_shrink_iters: 1024,
        ..ProptestConfig::default()
    });
    let strategy = (
        config_strategy(),
        proptest::collection::vec(op_strategy(), 1..64),
    );
    if let Err(e) = runner.run(&strategy, |(cfg, ops)| {
        run_on(cfg, &ops, On::Backend(Backend::Postgres))
    }) {
        panic!("PostgreSQL disagrees with the model: {e}");
    }
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: cases(256),
        max_shrink_iters: 4096,
        ..ProptestConfig::default()
    })]

    /// Faults on: see the module docs.
    #[test]
    fn engine_survives_storage_faults(
        cfg in config_strategy(),
        ops in proptest::collection::vec(faulty_op_strategy(), 1..64),
    ) {
        run_on(cfg, &ops, On::Faults)?;
    }
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: cases(128),
        max_shrink_iters: 2048,
        ..ProptestConfig::default()
    })]

    /// Effect steps on one key: see `tests/model/steps.rs`.
    #[test]
    fn steps_agree_with_the_model(ops in proptest::collection::vec(steps::step_op(), 1..48)) {
        steps::run_steps(&ops, Backend::Redb)?;
    }
}

/// The step model on PostgreSQL: fewer cases (every write is a commit on
/// the server); skipped without one, as above.
#[test]
fn steps_agree_with_the_model_on_postgres() {
    if backends::pg_url().is_none() {
        return;
    }
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig {
        cases: cases(16),
        max_shrink_iters: 512,
        ..ProptestConfig::default()
    });
    let strategy = proptest::collection::vec(steps::step_op(), 1..48);
    if let Err(e) = runner.run(&strategy, |ops| steps::run_steps(&ops, Backend::Postgres)) {
        panic!("PostgreSQL disagrees with the step model: {e}");
    }
}

/// The step model on Redis: fewer cases; skipped without a server.
#[test]
fn steps_agree_with_the_model_on_redis() {
    if backends::redis_url().is_none() {
        return;
    }
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig {
        cases: cases(16),
        max_shrink_iters: 512,
        ..ProptestConfig::default()
    });
    let strategy = proptest::collection::vec(steps::step_op(), 1..48);
    if let Err(e) = runner.run(&strategy, |ops| steps::run_steps(&ops, Backend::Redis)) {
        panic!("Redis disagrees with the step model: {e}");
    }
}

/// A resumed claim's retryable failure (rare in random sequences): the
/// key must stay UNKNOWN with the earlier charge, then resume skipping it.
#[test]
fn a_released_resume_agrees_with_the_step_model() -> Result<(), TestCaseError> {
    use steps::StepOp::{Advance, Begin, Confirm, Effect, FailInDoubt, FailRetryable};
    let ops = [
        Begin,
        Effect(0),
        Confirm(0),
        FailInDoubt,
        Advance(1),
        Begin,
        FailRetryable,
        Begin,
        Effect(0),
        Effect(1),
    ];
    steps::run_steps(&ops, Backend::Redb)?;
    steps::run_steps(&ops, Backend::Postgres)?;
    steps::run_steps(&ops, Backend::Redis)
}

/// Sequences that once failed, kept as plain tests.
#[test]
fn regressions() -> Result<(), TestCaseError> {
    regressions_on(Backend::Redb)
}

/// The same sequences on PostgreSQL.
#[test]
fn regressions_on_postgres() -> Result<(), TestCaseError> {
    regressions_on(Backend::Postgres)
}

/// The same sequences on Redis.
#[test]
fn regressions_on_redis() -> Result<(), TestCaseError> {
    regressions_on(Backend::Redis)
}

fn regressions_on(backend: Backend) -> Result<(), TestCaseError> {
    let run_sequence = |cfg, ops: &[Op]| run_on(cfg, ops, On::Backend(backend));
    let forget = Config {
        policy: ExpiryPolicy::Forget,
        resolver_in_begin: false,
    };
    let begin = |key| Op::Begin {
        key,
        fp: 0,
        long_lease: false,
        answer: Answer::StillInDoubt,
    };
    let first = 0;
    // `Engine::resolve` counted a StillInDoubt answer as resolved (fixed in
    // engine.rs: it settles nothing, as in recover_in_doubt and begin).
    run_sequence(
        forget,
        &[
            begin(1),
            Op::Fail {
                claim: first,
                how: How::InDoubt,
            },
            Op::Resolve {
                key: 1,
                answer: Answer::StillInDoubt,
            },
        ],
    )?;
    // recover_in_doubt: a resolver envelope over the size limit leaves the
    // record UNKNOWN, counts it still unknown and goes on.
    run_sequence(
        forget,
        &[
            begin(0),
            begin(1),
            Op::DropClaim { claim: first },
            Op::DropClaim { claim: first },
            // Dropped claims are settleable once their lease has ended.
            Op::Advance { ms: LEASE_MS },
            Op::Recover {
                answers: [
                    Answer::Completed(BIG),
                    Answer::NotExecuted,
                    Answer::StillInDoubt,
                ],
                limit: KEYS,
            },
        ],
    )?;
    // A record swept at its expiry, then the clock steps back: claiming
    // the key again is no second execution of the expired outcome.
    run_sequence(
        forget,
        &[
            begin(2),
            Op::Complete {
                claim: first,
                body: 0,
            },
            Op::AdvanceTo {
                key: 2,
                to: Boundary::Expiry,
                delta: 0,
            },
            Op::Sweep,
            Op::StepBack { ms: 1 },
            begin(2),
        ],
    )
}
