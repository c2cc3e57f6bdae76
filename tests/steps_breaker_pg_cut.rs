//! Breaker probe of effect steps over a PostgreSQL connection cut at the
//! COMMIT (issue 22, with issue 23's rule: when the server can tell what
//! happened, the call reports it). The engine talks through a proxy that
//! loses a COMMIT's answer (`Forward::Yes`: committed) or the COMMIT itself
//! (`Forward::No`: never happened); a second engine looks directly. Guards
//! against a reservation or confirmation that committed but is reported as
//! failed (the app then fails in doubt and a retried `confirm` is refused
//! as `StepReused`: a confirmation the app believes lost), a step written
//! without its log entry, a refused write that left anything behind, and
//! a `NotCommitted` error for a step write that names neither the key nor
//! the step (the house rule: errors name the key or input; the variant
//! carries both since issue 22's follow-up).
#![cfg(unix)]

#[path = "common/pg_chaos.rs"]
mod pg_chaos;
#[path = "common/pg_proxy.rs"]
mod pg_proxy;

use std::error::Error;
use std::time::Duration;

use idempotency::{Begin, EffectStep, Engine, Fingerprint, IdempotencyKey, ManualClock};
use pg_proxy::{Forward, PgProxy};

type TestResult<T = ()> = Result<T, Box<dyn Error + Send + Sync>>;

const T0: u64 = 1_700_000_000_000;

#[test]
fn step_writes_across_a_cut_commit() -> TestResult {
    let Some(url) = pg_chaos::pg_url() else {
        eprintln!("no PostgreSQL server (IDEMPOTENCY_TEST_PG); skipped");
        return Ok(());
    };
    let proxy = PgProxy::start(&url)?;
    let clock = ManualClock::new(T0);
    let prefix = pg_chaos::unique_prefix("steps_cut");
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
    let k = IdempotencyKey::new("shop:pay", "cut-1")?;
    let Begin::Claimed(mut c) = engine.begin(&k, Fingerprint::of_json(br#"{"a":1}"#, &[])?)? else {
        return Err("not claimed".into());
    };
    // A fresh claim's step writes go in place, one autocommitted statement
    // each, without a COMMIT (`tests/pg_in_place_cut.rs` cuts those).
    // Extending the lease changes the record, so this claim's writes take
    // the full transaction path, whose COMMIT is cut here.
    c.extend(Duration::from_secs(10))?;
    let mut report = Vec::new();

    // 1. The reservation commits, its answer is lost.
    proxy.cut_after_commit(Forward::Yes);
    let reserved = c.effect("charge");
    let fired = proxy.fired();
    proxy.disarm();
    let seen = direct.steps(&k)?;
    let log = direct.history(&k)?;
    report.push(format!(
        "effect(charge) with its COMMIT answer lost (fired {fired}): {reserved:?}; stored steps \
         {:?}; log {:?}",
        seen.iter().map(|s| (&s.name, s.state)).collect::<Vec<_>>(),
        log.iter().map(|e| (&e.step, &e.to)).collect::<Vec<_>>()
    ));
    if seen.len() != log.len() {
        return Err(format!("half-written: {report:#?}").into());
    }
    if fired == 0 {
        return Err(format!("the reservation sent no COMMIT to cut: {report:#?}").into());
    }
    if !matches!(reserved, Ok(EffectStep::Run { .. })) {
        return Err(format!(
            "a reservation the server committed is reported as failed: {report:#?}"
        )
        .into());
    }

    // 2. The confirmation commits, its answer is lost.
    proxy.cut_after_commit(Forward::Yes);
    let confirmed = c.confirm("charge", b"ch_1");
    let fired2 = proxy.fired();
    proxy.disarm();
    report.push(format!(
        "confirm with its COMMIT answer lost (fired {}): {confirmed:?}",
        fired2 - fired
    ));
    if fired2 == fired {
        return Err(format!("the confirmation sent no COMMIT to cut: {report:#?}").into());
    }
    if confirmed.is_err() {
        let again = c.confirm("charge", b"ch_1");
        return Err(format!(
            "a confirmation the server committed is reported as failed; the app's retry of \
             confirm answers {again:?}: {report:#?}"
        )
        .into());
    }

    // 3. The receipt's reservation never reaches the server.
    let before = direct.history(&k)?.len();
    proxy.cut_after_commit(Forward::No);
    let receipt = c.effect("receipt");
    let fired3 = proxy.fired();
    proxy.disarm();
    if fired3 == fired2 {
        return Err("the receipt's reservation sent no COMMIT to cut".into());
    }
    let after = direct.history(&k)?.len();
    let steps = direct.steps(&k)?.len();
    report.push(format!(
        "effect(receipt), COMMIT never sent: {receipt:?}; log {before} -> {after}, steps {steps}"
    ));
    if receipt.is_err() && (after != before || steps != 1) {
        return Err(format!("a refused reservation left writes behind: {report:#?}").into());
    }
    eprintln!("{report:#?}");
    // The house rule: an error names the key or input.
    if let Err(e) = &receipt {
        if let idempotency::Error::NotCommitted { key, step, .. } = e {
            if key.as_ref() != Some(&k) || step.as_deref() != Some("receipt") {
                return Err(format!("NotCommitted names {key:?} / {step:?}").into());
            }
        }
        let text = e.to_string();
        if !text.contains("cut-1") || !text.contains("receipt") {
            return Err(format!(
                "the refused reservation's error does not name the key and the step: {text:?} \
                 ({e:?})"
            )
            .into());
        }
    }
    Ok(())
}
