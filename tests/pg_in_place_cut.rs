//! A claim's step writes on PostgreSQL go as one autocommitted statement
//! each (`store/postgres/in_place.rs`); this cuts the connection at that
//! statement, after the server ran it (`Forward::Yes`: its answer is lost)
//! or before (`Forward::No`: it never ran). Guards against an in-place
//! reservation, confirmation or completion with deferred confirmations
//! that landed being reported as failed (the app would fail in doubt, and
//! a retried `confirm` is refused), one that did not land being reported
//! as done, and either being written twice or half (a step without its log
//! entry): the engine settles a lost answer by reading the rows back once
//! the connection's server process is gone, never by guessing.
#![cfg(unix)]

#[path = "common/pg_chaos.rs"]
mod pg_chaos;
#[path = "common/pg_proxy.rs"]
mod pg_proxy;

use std::error::Error;
use std::time::Duration;

use idempotency::{
    Begin, EffectStep, Engine, Envelope, Fingerprint, IdempotencyKey, ManualClock, State, StepState,
};
use pg_proxy::{Forward, PgProxy};

type TestResult<T = ()> = Result<T, Box<dyn Error + Send + Sync>>;

const T0: u64 = 1_700_000_000_000;

/// Runs `call` with the next statement cut (`forward`), and says whether
/// the cut fired.
fn cut<T>(proxy: &PgProxy, forward: Forward, call: impl FnOnce() -> T) -> (T, bool) {
    let fired = proxy.fired();
    proxy.cut_after_statement(forward);
    let out = call();
    proxy.disarm();
    (out, proxy.fired() > fired)
}

#[test]
fn in_place_step_writes_with_a_cut_answer_are_read_back() -> TestResult {
    let Some(url) = pg_chaos::pg_url() else {
        eprintln!("no PostgreSQL server (IDEMPOTENCY_TEST_PG); skipped");
        return Ok(());
    };
    let proxy = PgProxy::start(&url)?;
    let clock = ManualClock::new(T0);
    let prefix = pg_chaos::unique_prefix("in_place_cut");
    let builder = || {
        Engine::builder()
            .table_prefix(prefix.as_str())
            .pool_size(2)
            .database_clock(false)
            .clock(clock.clone())
            .lease(Duration::from_secs(10))
            .sweep_interval(None)
    };
    let engine = builder().open_postgres(&proxy.url("")?)?;
    let direct = builder().open_postgres(&url)?;
    // Each write of a fresh claim goes in place until one falls back, so
    // each is cut on a key of its own, after uncut ones.
    for (n, forward, at) in [Forward::Yes, Forward::No]
        .into_iter()
        .flat_map(|forward| (0..3).map(move |at| (forward, at)))
        .enumerate()
        .map(|(n, (forward, at))| (n, forward, at))
    {
        let k = IdempotencyKey::new("shop:pay", format!("cut-{n}"))?;
        let cut = |step: usize, call: &mut dyn FnMut()| -> bool {
            if step == at {
                cut(&proxy, forward, call).1
            } else {
                call();
                true
            }
        };
        let Begin::Claimed(c) = engine.begin(&k, Fingerprint::of_json(br#"{"a":1}"#, &[])?)? else {
            return Err(format!("{k}: not claimed").into());
        };
        let states = |want: &[(&str, StepState)], entries: usize| -> TestResult {
            let steps: Vec<_> = direct
                .steps(&k)?
                .into_iter()
                .map(|s| (s.name, s.state))
                .collect();
            let want: Vec<_> = want.iter().map(|(n, s)| ((*n).to_owned(), *s)).collect();
            assert_eq!(steps, want, "{forward:?}");
            let log = direct.history(&k)?;
            assert_eq!(log.len(), entries, "{forward:?}: {log:?}");
            Ok(())
        };

        let mut reserved = None;
        let fired = cut(0, &mut || reserved = Some(c.effect("charge")));
        assert!(fired, "{forward:?}: effect sent no statement");
        assert!(
            matches!(reserved, Some(Ok(EffectStep::Run { .. }))),
            "{forward:?}: {reserved:?}"
        );
        states(&[("charge", StepState::Reserved)], 1)?;

        let mut confirmed = None;
        let fired = cut(1, &mut || confirmed = Some(c.confirm("charge", b"ch_1")));
        assert!(fired, "{forward:?}: confirm sent no statement");
        assert!(
            matches!(confirmed, Some(Ok(_))),
            "{forward:?}: {confirmed:?}"
        );
        states(&[("charge", StepState::Confirmed)], 2)?;

        let receipt = c.effect("receipt")?;
        assert!(matches!(receipt, EffectStep::Run { .. }), "{receipt:?}");
        c.confirm_deferred("receipt", b"r_1")?;
        let mut claim = Some(c);
        let mut completed = None;
        let fired = cut(2, &mut || {
            completed = claim
                .take()
                .map(|c| engine.complete(c, Envelope::new(1, 201, "paid")));
        });
        assert!(fired, "{forward:?}: complete sent no statement");
        assert!(
            matches!(completed, Some(Ok(_))),
            "{forward:?}: {completed:?}"
        );
        states(
            &[
                ("charge", StepState::Confirmed),
                ("receipt", StepState::Confirmed),
            ],
            5,
        )?;
        let record = direct.record(&k)?.ok_or("no record")?;
        assert_eq!(record.state, State::Completed, "{forward:?}");
    }
    Ok(())
}
