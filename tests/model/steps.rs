//! The model learns effect steps: random sequences of `begin`, `effect`,
//! `confirm`, `reject`, `complete`, failures in doubt and retryable ones
//! (a resumed claim's must leave the key UNKNOWN), dropped claims,
//! clock moves, provider answers and operator settlements run on one key
//! against a plain model of the step rules (`docs/design.md`, "Effect
//! steps"). Every answer and the key's steps after every operation must
//! agree. Independently of the model, a provider ledger checks that no step
//! reference is handed out as `Run` again unless its provider answered "not
//! executed" in between (a double call), and that no key with an unsettled
//! step is ever `Claimed`.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use idempotency::{
    Begin, Claim, Clock, EffectStep, Engine, Envelope, Error, Failure, InDoubt, InDoubtStep,
    ManualClock, Resolution, State, StepResolution, StepState,
};
use proptest::prelude::*;
use proptest::test_runner::TestCaseError;

use super::backends::{Backend, Harness};

const NAMES: [&str; 3] = ["charge", "receipt", "notify"];
const STEP_LEASE_MS: u64 = 1_000;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Says {
    Executed,
    NotExecuted,
    StillUnknown,
}

impl Says {
    fn resolution(self) -> StepResolution {
        match self {
            Says::Executed => StepResolution::Executed(b"provider-evidence".to_vec()),
            Says::NotExecuted => StepResolution::NotExecuted,
            Says::StillUnknown => StepResolution::StillUnknown,
        }
    }
}

#[derive(Clone, Debug)]
pub(crate) enum StepOp {
    Begin,
    Effect(usize),
    Confirm(usize),
    Reject(usize),
    Complete,
    FailInDoubt,
    /// `fail(Failure::Retryable)`: refused while a call may have happened.
    FailRetryable,
    Drop,
    Advance(u64),
    /// What the step's provider answers from now on.
    Provider(usize, Says),
    /// An operator settles the step by hand.
    Operator(usize, Says),
}

fn says() -> impl Strategy<Value = Says> {
    prop_oneof![
        Just(Says::Executed),
        Just(Says::NotExecuted),
        Just(Says::StillUnknown)
    ]
}

pub(crate) fn step_op() -> impl Strategy<Value = StepOp> {
    let n = 0..NAMES.len();
    prop_oneof![
        4 => Just(StepOp::Begin),
        5 => n.clone().prop_map(StepOp::Effect),
        3 => n.clone().prop_map(StepOp::Confirm),
        1 => n.clone().prop_map(StepOp::Reject),
        2 => Just(StepOp::Complete),
        2 => Just(StepOp::FailInDoubt),
        2 => Just(StepOp::FailRetryable),
        1 => Just(StepOp::Drop),
        2 => prop_oneof![Just(1u64), Just(STEP_LEASE_MS), Just(STEP_LEASE_MS + 1)].prop_map(StepOp::Advance),
        2 => (n.clone(), says()).prop_map(|(i, s)| StepOp::Provider(i, s)),
        1 => (n, says()).prop_map(|(i, s)| StepOp::Operator(i, s)),
    ]
}

/// A stored step as the model keeps it (the raw stored state: read-time
/// truth is applied when compared).
#[derive(Clone, Debug, PartialEq, Eq)]
struct MStep {
    state: StepState,
    token: u64,
    reference: String,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum MRec {
    Free,
    Processing { token: u64, lease_until: u64 },
    Unknown { token: u64, lease_until: u64 },
    Completed,
}

struct StepModel {
    rec: MRec,
    steps: BTreeMap<&'static str, MStep>,
    /// The claim the test holds, with its reference.
    held: Option<(u64, String)>,
    last_token: u64,
}

impl StepModel {
    fn seen(&self, now: u64) -> BTreeMap<&'static str, (StepState, String)> {
        let live = match self.rec {
            MRec::Processing { token, lease_until } if lease_until > now => Some(token),
            _ => None,
        };
        self.steps
            .iter()
            .map(|(name, s)| {
                let state = if s.state == StepState::Reserved && live != Some(s.token) {
                    StepState::Unknown
                } else {
                    s.state
                };
                (*name, (state, s.reference.clone()))
            })
            .collect()
    }

    /// The record moves to UNKNOWN: reserved steps become unknown.
    fn mark_unknown(&mut self, token: u64, lease_until: u64) {
        self.rec = MRec::Unknown { token, lease_until };
        for s in self.steps.values_mut() {
            if s.state == StepState::Reserved {
                s.state = StepState::Unknown;
            }
        }
    }

    fn all_settled(&self) -> bool {
        self.steps.values().all(|s| s.state.is_settled())
    }
}

struct StepRun {
    engine: Engine,
    clock: ManualClock,
    answers: Arc<Mutex<[Says; 3]>>,
    model: StepModel,
    claim: Option<Claim>,
    /// How often each step's call was made (a `Run` answer), and how often
    /// its provider said "not executed" (which allows one more).
    runs: [u32; 3],
    not_executed: [u32; 3],
    /// Keeps the store (a temp dir, or a table prefix) for the run.
    _store: Harness,
}

fn fail(msg: String) -> TestCaseError {
    TestCaseError::fail(msg)
}

fn check<T: std::fmt::Debug>(ok: bool, what: &str, got: &T) -> Result<(), TestCaseError> {
    if ok {
        Ok(())
    } else {
        Err(fail(format!("{what}: got {got:?}")))
    }
}

impl StepRun {
    /// `None` when the backend is skipped (PostgreSQL without a server).
    fn new(backend: Backend) -> Result<Option<StepRun>, TestCaseError> {
        let Some(store) = Harness::new(backend) else {
            return Ok(None);
        };
        let clock = ManualClock::new(super::START_MS);
        let answers = Arc::new(Mutex::new([Says::StillUnknown; 3]));
        let mut builder = store
            .builder()
            .clock(clock.clone())
            .lease(Duration::from_millis(STEP_LEASE_MS))
            // A key without steps: the provider has no trace of it.
            .resolver(|_: &InDoubt| Resolution::NotExecuted);
        for (i, name) in NAMES.iter().enumerate() {
            let answers = answers.clone();
            builder = builder.step_resolver(*name, move |_: &InDoubtStep| {
                answers.lock().unwrap_or_else(PoisonError::into_inner)[i].resolution()
            });
        }
        let engine = store.open(builder).map_err(|e| fail(e.to_string()))?;
        Ok(Some(StepRun {
            engine,
            clock,
            answers,
            model: StepModel {
                rec: MRec::Free,
                steps: BTreeMap::new(),
                held: None,
                last_token: 0,
            },
            claim: None,
            runs: [0; 3],
            not_executed: [0; 3],
            _store: store,
        }))
    }

    fn now(&self) -> u64 {
        self.clock.now_ms()
    }

    fn key(&self) -> idempotency::IdempotencyKey {
        super::key(0)
    }

    /// A provider's (or operator's) answer about a step, in the model.
    fn settle_in_model(&mut self, i: usize, says: Says) {
        let Some(s) = self.model.steps.get_mut(NAMES[i]) else {
            return;
        };
        if s.state != StepState::Unknown {
            return;
        }
        match says {
            Says::Executed => s.state = StepState::Confirmed,
            Says::NotExecuted => {
                s.state = StepState::NotExecuted;
                self.not_executed[i] += 1;
            }
            Says::StillUnknown => {}
        }
    }

    fn begin(&mut self) -> Result<(), TestCaseError> {
        if self.claim.is_some() {
            // One claim at a time: the test holds it.
            return Ok(());
        }
        let now = self.now();
        let key = self.key();
        let answer = self
            .engine
            .begin(&key, super::fingerprint(0))
            .map_err(|e| fail(format!("begin: {e}")))?;
        // What the model expects.
        let expect_claim = match self.model.rec {
            MRec::Free => true,
            MRec::Completed => {
                check(
                    matches!(answer, Begin::Replay(_)),
                    "a completed key replays",
                    &answer,
                )?;
                return Ok(());
            }
            MRec::Processing { lease_until, .. } | MRec::Unknown { lease_until, .. }
                if lease_until > now =>
            {
                check(
                    matches!(answer, Begin::Processing { .. }),
                    "a running claim is Processing",
                    &answer,
                )?;
                return Ok(());
            }
            MRec::Processing { token, lease_until } | MRec::Unknown { token, lease_until } => {
                self.model.mark_unknown(token, lease_until);
                if self.model.steps.is_empty() {
                    // Whole-key resolver: not executed, the steps-less key
                    // is claimed afresh.
                    true
                } else {
                    let answers = *self.answers.lock().unwrap_or_else(PoisonError::into_inner);
                    for (i, says) in answers.iter().enumerate() {
                        self.settle_in_model(i, *says);
                    }
                    self.model.all_settled()
                }
            }
        };
        match answer {
            Begin::Claimed(claim) if expect_claim => {
                check(
                    claim.fencing_token() > self.model.last_token,
                    "tokens grow",
                    &claim.fencing_token(),
                )?;
                if !self.model.steps.is_empty() && !self.model.all_settled() {
                    return Err(fail("Claimed with an unsettled step".into()));
                }
                if matches!(self.model.rec, MRec::Unknown { .. }) && self.model.steps.is_empty() {
                    // Released as not executed: steps and log went with it.
                    self.model.steps.clear();
                }
                let seen: Vec<(String, StepState)> = claim
                    .steps()
                    .iter()
                    .map(|s| (s.name.clone(), s.state))
                    .collect();
                let want: Vec<(String, StepState)> = self
                    .model
                    .seen(now)
                    .into_iter()
                    .map(|(n, (s, _))| (n.to_string(), s))
                    .collect();
                check(
                    seen == want,
                    &format!("the claim's steps, want {want:?}"),
                    &seen,
                )?;
                let token = claim.fencing_token();
                self.model.last_token = token;
                self.model.rec = MRec::Processing {
                    token,
                    lease_until: now + STEP_LEASE_MS,
                };
                self.model.held = Some((token, claim.reference().to_string()));
                self.claim = Some(claim);
                Ok(())
            }
            Begin::InDoubt(in_doubt) if !expect_claim => {
                let seen: Vec<(String, StepState)> = in_doubt
                    .steps
                    .iter()
                    .map(|s| (s.name.clone(), s.state))
                    .collect();
                check(
                    seen.iter().any(|(_, s)| !s.is_settled()),
                    "in doubt with every step settled",
                    &seen,
                )
            }
            other => Err(fail(format!(
                "begin: expected {}, got {other:?}",
                if expect_claim { "Claimed" } else { "InDoubt" }
            ))),
        }
    }

    /// The held claim still owns a PROCESSING record (lease may have ended).
    fn owns(&self) -> Option<(u64, u64)> {
        let (token, _) = self.model.held.as_ref()?;
        match self.model.rec {
            MRec::Processing {
                token: t,
                lease_until,
            } if t == *token => Some((t, lease_until)),
            _ => None,
        }
    }

    fn effect(&mut self, i: usize) -> Result<(), TestCaseError> {
        let Some(claim) = &self.claim else {
            return Ok(());
        };
        let name = NAMES[i];
        let got = claim.effect(name);
        let now = self.now();
        let running = self.owns().filter(|(_, lease_until)| *lease_until > now);
        let Some((token, _)) = running else {
            let err = got.err();
            return check(
                matches!(err, Some(Error::Fenced { .. })),
                "effect without a running claim",
                &err,
            );
        };
        let claim_ref = self
            .model
            .held
            .as_ref()
            .map(|(_, r)| r.clone())
            .unwrap_or_default();
        match self.model.steps.get(name).cloned() {
            Some(s) if s.token == token => {
                let err = got.err();
                check(
                    matches!(err, Some(Error::StepReused { .. })),
                    "a name reused by one claim",
                    &err,
                )
            }
            Some(s) if matches!(s.state, StepState::Confirmed | StepState::Failed) => {
                let ok = match (&got, s.state) {
                    (Ok(EffectStep::Confirmed { reference, .. }), StepState::Confirmed)
                    | (Ok(EffectStep::Failed { reference, .. }), StepState::Failed) => {
                        *reference == s.reference
                    }
                    _ => false,
                };
                check(
                    ok,
                    &format!("an earlier claim's {:?} step is skipped", s.state),
                    &got,
                )
            }
            Some(s) if s.state == StepState::NotExecuted => {
                let ok =
                    matches!(&got, Ok(EffectStep::Run { reference }) if *reference == s.reference);
                check(ok, "a not-executed step runs under its old reference", &got)?;
                self.ran(i)?;
                self.model.steps.insert(
                    name,
                    MStep {
                        state: StepState::Reserved,
                        token,
                        reference: s.reference,
                    },
                );
                Ok(())
            }
            Some(_) => {
                let err = got.err();
                check(
                    matches!(err, Some(Error::InvalidState { .. })),
                    "a step still in doubt",
                    &err,
                )
            }
            None => {
                let reference = format!("{claim_ref}/{name}");
                let ok = matches!(&got, Ok(EffectStep::Run { reference: r }) if *r == reference);
                check(ok, "a new step runs", &got)?;
                self.ran(i)?;
                self.model.steps.insert(
                    name,
                    MStep {
                        state: StepState::Reserved,
                        token,
                        reference,
                    },
                );
                Ok(())
            }
        }
    }

    /// The ledger's check: a step's call is made once, plus once per "not
    /// executed" answer.
    fn ran(&mut self, i: usize) -> Result<(), TestCaseError> {
        self.runs[i] += 1;
        if self.runs[i] > 1 + self.not_executed[i] {
            return Err(fail(format!(
                "step {} called {} times",
                NAMES[i], self.runs[i]
            )));
        }
        Ok(())
    }

    fn finish_step(&mut self, i: usize, confirm: bool) -> Result<(), TestCaseError> {
        let Some(claim) = &self.claim else {
            return Ok(());
        };
        let name = NAMES[i];
        let got = if confirm {
            claim.confirm(name, b"answer")
        } else {
            claim.reject(name, b"declined")
        };
        // The holder may finish its own step while its token still owns
        // the record, PROCESSING or UNKNOWN (a late answer from its
        // provider settles the step from Unknown, as a late `complete`
        // carrying it does).
        let Some(token) = self.owner().and_then(|r| match r {
            MRec::Processing { token, .. } | MRec::Unknown { token, .. } => Some(token),
            _ => None,
        }) else {
            let err = got.err();
            return check(
                matches!(err, Some(Error::Fenced { .. })),
                "finish without owning",
                &err,
            );
        };
        match self.model.steps.get_mut(name) {
            Some(s)
                if s.token == token
                    && matches!(s.state, StepState::Reserved | StepState::Unknown) =>
            {
                check(got.is_ok(), "finishing a reserved or unknown step", &got)?;
                s.state = if confirm {
                    StepState::Confirmed
                } else {
                    StepState::Failed
                };
                Ok(())
            }
            None => {
                let err = got.err();
                check(
                    matches!(err, Some(Error::StepNotFound { .. })),
                    "finishing an unknown step",
                    &err,
                )
            }
            Some(_) => check(
                got.is_err(),
                "finishing a step not reserved by this claim",
                &got,
            ),
        }
    }

    /// The held claim's token still owns the record, PROCESSING or UNKNOWN
    /// (what `complete` and `fail` accept: a late outcome is recorded).
    fn owner(&self) -> Option<MRec> {
        let (token, _) = self.model.held.as_ref()?;
        match self.model.rec {
            r @ (MRec::Processing { token: t, .. } | MRec::Unknown { token: t, .. })
                if t == *token =>
            {
                Some(r)
            }
            _ => None,
        }
    }

    fn complete(&mut self) -> Result<(), TestCaseError> {
        let Some(claim) = self.claim.take() else {
            return Ok(());
        };
        let got = self.engine.complete(claim, Envelope::new(1, 201, "done"));
        let owner = self.owner();
        let token = self.model.held.take().map(|(t, _)| t);
        if owner.is_none() {
            let err = got.err();
            return check(
                matches!(err, Some(Error::Fenced { .. })),
                "complete without owning",
                &err,
            );
        }
        // A step this claim reserved and never finished: refused, the
        // claim is used up, its record waits for its lease.
        if self.model.steps.values().any(|s| {
            matches!(s.state, StepState::Reserved | StepState::Unknown) && Some(s.token) == token
        }) {
            let err = got.err();
            return check(
                matches!(err, Some(Error::InvalidState { .. })),
                "complete with an unfinished step",
                &err,
            );
        }
        check(got.is_ok(), "complete", &got)?;
        self.model.rec = MRec::Completed;
        Ok(())
    }

    fn abandon(&mut self, explicit: bool) -> Result<(), TestCaseError> {
        let Some(claim) = self.claim.take() else {
            return Ok(());
        };
        let owner = self.owner();
        self.model.held = None;
        let now = self.now();
        if explicit {
            let got = self.engine.fail(
                claim,
                Failure::InDoubt {
                    reason: "timeout".into(),
                },
            );
            let Some(owner) = owner else {
                let err = got.err();
                return check(
                    matches!(err, Some(Error::Fenced { .. })),
                    "fail without owning",
                    &err,
                );
            };
            check(got.is_ok(), "fail in doubt", &got)?;
            if let MRec::Processing { token, lease_until } = owner {
                // Settleable at once: nothing of the holder runs any more.
                self.model.mark_unknown(token, lease_until.min(now));
            }
        } else {
            drop(claim);
            self.engine.flush().map_err(|e| fail(e.to_string()))?;
            if let Some(MRec::Processing { token, lease_until }) = owner {
                self.model.mark_unknown(token, lease_until);
            }
        }
        Ok(())
    }

    /// A retryable failure. Refused while a step is Reserved or Unknown, or
    /// confirmed by this claim (a call may have happened). A claim whose
    /// steps are all its own is released with them; one that holds an
    /// earlier claim's steps (a resumed claim) leaves the key UNKNOWN,
    /// resumable at once, never steps without a record.
    fn release(&mut self) -> Result<(), TestCaseError> {
        let Some(claim) = self.claim.take() else {
            return Ok(());
        };
        let owner = self.owner();
        self.model.held = None;
        let now = self.now();
        let got = self.engine.fail(claim, Failure::Retryable);
        let Some(MRec::Processing { token, lease_until } | MRec::Unknown { token, lease_until }) =
            owner
        else {
            let err = got.err();
            return check(
                matches!(err, Some(Error::Fenced { .. })),
                "release without owning",
                &err,
            );
        };
        if self.model.steps.values().any(|s| {
            matches!(s.state, StepState::Reserved | StepState::Unknown)
                || (s.state == StepState::Confirmed && s.token == token)
        }) {
            let err = got.err();
            return check(
                matches!(err, Some(Error::InvalidState { .. })),
                "release while a call may have happened",
                &err,
            );
        }
        check(got.is_ok(), "release", &got)?;
        let want = if self.model.steps.values().all(|s| s.token == token) {
            // The claim's own steps go with it: each was declined (Failed)
            // or never ran (NotExecuted), so the next claim may call again.
            for (name, s) in &self.model.steps {
                if s.state == StepState::Failed {
                    if let Some(i) = NAMES.iter().position(|n| n == name) {
                        self.not_executed[i] += 1;
                    }
                }
            }
            self.model.steps.clear();
            self.model.rec = MRec::Free;
            None
        } else {
            self.model.rec = MRec::Unknown {
                token,
                lease_until: lease_until.min(now),
            };
            Some((State::Unknown, token))
        };
        let record = self
            .engine
            .record(&self.key())
            .map_err(|e| fail(e.to_string()))?
            .map(|r| (r.state, r.fencing_token));
        check(
            record == want,
            &format!("the record after a release, want {want:?}"),
            &record,
        )
    }

    fn operator(&mut self, i: usize, says: Says) -> Result<(), TestCaseError> {
        let key = self.key();
        let now = self.now();
        let got = self
            .engine
            .resolve_step(&key, NAMES[i], says.resolution(), "checked by hand");
        let (token, lease_until) = match self.model.rec {
            MRec::Unknown { token, lease_until } => (token, lease_until),
            MRec::Processing { token, lease_until } if lease_until <= now => (token, lease_until),
            _ => {
                return check(got.is_err(), "settling a step of a key not in doubt", &got);
            }
        };
        if says == Says::NotExecuted && lease_until > now {
            return check(got.is_err(), "not executed before the lease ends", &got);
        }
        if !self.model.steps.contains_key(NAMES[i]) {
            let err = got.err();
            return check(
                matches!(err, Some(Error::StepNotFound { .. })),
                "an unknown step",
                &err,
            );
        }
        check(got.is_ok(), "operator settles a step", &got)?;
        // A step settled already is handed back as it is: nothing written,
        // so a stale PROCESSING record is not moved either.
        let settled_already = self.model.steps[NAMES[i]].state.is_settled();
        if !settled_already {
            self.model.mark_unknown(token, lease_until);
        }
        self.settle_in_model(i, says);
        // All steps settled: the record stays (resumable); the next
        // `begin` resumes it in one write (see `begin`).
        Ok(())
    }

    fn run(&mut self, op: &StepOp) -> Result<(), TestCaseError> {
        match op {
            StepOp::Begin => self.begin()?,
            StepOp::Effect(i) => self.effect(*i)?,
            StepOp::Confirm(i) => self.finish_step(*i, true)?,
            StepOp::Reject(i) => self.finish_step(*i, false)?,
            StepOp::Complete => self.complete()?,
            StepOp::FailInDoubt => self.abandon(true)?,
            StepOp::FailRetryable => self.release()?,
            StepOp::Drop => self.abandon(false)?,
            StepOp::Advance(ms) => self.clock.advance(Duration::from_millis(*ms)),
            StepOp::Provider(i, says) => {
                self.answers.lock().unwrap_or_else(PoisonError::into_inner)[*i] = *says;
            }
            StepOp::Operator(i, says) => self.operator(*i, *says)?,
        }
        self.compare()
    }

    /// The key's steps as the engine shows them equal the model's.
    fn compare(&self) -> Result<(), TestCaseError> {
        let now = self.now();
        let got: BTreeMap<String, (StepState, String)> = self
            .engine
            .steps(&self.key())
            .map_err(|e| fail(e.to_string()))?
            .into_iter()
            .map(|s| (s.name, (s.state, s.reference)))
            .collect();
        let want: BTreeMap<String, (StepState, String)> = self
            .model
            .seen(now)
            .into_iter()
            .map(|(n, v)| (n.to_string(), v))
            .collect();
        check(got == want, &format!("steps, want {want:?}"), &got)
    }
}

pub(crate) fn run_steps(ops: &[StepOp], backend: Backend) -> Result<(), TestCaseError> {
    let Some(mut run) = StepRun::new(backend)? else {
        return Ok(());
    };
    for (n, op) in ops.iter().enumerate() {
        run.run(op)
            .map_err(|e| fail(format!("op {n} {op:?}: {e}")))?;
    }
    Ok(())
}
