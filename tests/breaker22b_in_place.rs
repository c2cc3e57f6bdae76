//! Breaker 22B, PostgreSQL writes in place (`store/postgres/in_place.rs`): a
//! fresh claim's step writes go as one autocommitted statement against the
//! rows this engine remembers; a claim that extended its lease writes through
//! the full transaction. Each scenario here runs twice on a schema of its own,
//! once in place and once on the full path (`extend` first), and the two
//! transcripts (each call's answer, by variant) and the rows left (record
//! state, steps, evidence log) must be the same. Scenarios: bad input
//! (evidence over 4096 bytes, invalid step names, a 17th step, a full log),
//! a lease that ends between steps (no one else, another engine's sweep, or
//! another engine taking the key over), and another engine purging the key
//! with `PurgeMode::Force` between the claim's writes. Guards against the
//! in-place path answering or writing differently from the full path: a
//! step written twice, a lost log entry, a purged key resurrected, a write
//! of an ended lease accepted.
#![cfg(unix)]

#[path = "common/pg_chaos.rs"]
mod pg_chaos;

use std::error::Error;
use std::fmt::Debug;
use std::time::Duration;

use idempotency::{
    Begin, Claim, Engine, Envelope, Fingerprint, IdempotencyKey, ManualClock, PurgeMode,
};

type TestResult<T = ()> = Result<T, Box<dyn Error + Send + Sync>>;

const T0: u64 = 1_700_000_000_000;
const LEASE: Duration = Duration::from_secs(10);

/// Two engines on one schema and one clock: `a` claims, `b` is the other
/// process.
struct Ctx {
    a: Engine,
    b: Engine,
    clock: ManualClock,
    key: IdempotencyKey,
}

/// A call's answer by variant only (references and tokens differ between
/// runs).
fn kind<T: Debug, E: Debug>(r: &Result<T, E>) -> String {
    let text = match r {
        Ok(v) => format!("Ok({v:?})"),
        Err(e) => format!("Err({e:?})"),
    };
    let cut = text.find([' ', '{']).unwrap_or(text.len());
    text[..cut].to_owned()
}

type Scenario = fn(&Ctx, Claim, &mut Vec<String>) -> TestResult;

/// Runs `scenario` on a fresh schema, in place (`full == false`) or on the
/// full path; its transcript and the rows it left.
fn run(url: &str, name: &str, full: bool, scenario: Scenario) -> TestResult<Vec<String>> {
    let clock = ManualClock::new(T0);
    let prefix = pg_chaos::unique_prefix("b22b");
    let builder = || {
        Engine::builder()
            .table_prefix(prefix.as_str())
            .pool_size(2)
            .database_clock(false)
            .clock(clock.clone())
            .lease(LEASE)
            .sweep_interval(None)
    };
    let a = builder().open_postgres(url)?;
    let b = builder().open_postgres(url)?;
    let key = IdempotencyKey::new("shop:pay", format!("{name}-1"))?;
    let ctx = Ctx {
        a,
        b,
        clock: clock.clone(),
        key: key.clone(),
    };
    let Begin::Claimed(mut c) = ctx
        .a
        .begin(&key, Fingerprint::of_json(br#"{"a":1}"#, &[])?)?
    else {
        return Err(format!("{key}: not claimed").into());
    };
    if full {
        c.extend(LEASE)?;
    }
    let mut out = Vec::new();
    scenario(&ctx, c, &mut out)?;
    // A claim the scenario dropped sends its PROCESSING -> UNKNOWN notice
    // without waiting: wait for both engines' notices, or the record read
    // below races them (seen once in CI: UNKNOWN on one path, PROCESSING
    // on the other, in purged-then-reclaimed).
    ctx.a.flush()?;
    ctx.b.flush()?;
    let record = ctx.b.record(&key)?.map(|r| format!("{:?}", r.state));
    out.push(format!("record {record:?}"));
    let steps: Vec<String> = ctx
        .b
        .steps(&key)?
        .into_iter()
        .map(|s| format!("{}={:?}/{:?}", s.name, s.state, s.evidence.map(|e| e.len())))
        .collect();
    out.push(format!("steps {steps:?}"));
    let log: Vec<String> = ctx
        .b
        .history(&key)?
        .into_iter()
        .map(|e| format!("{}:{:?}:{}->{}", e.seq, e.step, e.from, e.to))
        .collect();
    out.push(format!("log {log:?}"));
    drop(ctx);
    let mut client = pg_chaos::connect(url)?;
    pg_chaos::drop_prefix(&mut client, &prefix)?;
    Ok(out)
}

fn complete(ctx: &Ctx, c: Claim, out: &mut Vec<String>) {
    let r = ctx.a.complete(c, Envelope::new(1, 201, "paid"));
    out.push(format!("complete {}", kind(&r)));
}

fn big_evidence(ctx: &Ctx, c: Claim, out: &mut Vec<String>) -> TestResult {
    out.push(format!("effect {}", kind(&c.effect("charge"))));
    let big = vec![b'x'; idempotency::MAX_EVIDENCE_BYTES + 1];
    out.push(format!("confirm big {}", kind(&c.confirm("charge", &big))));
    out.push(format!("reject big {}", kind(&c.reject("charge", &big))));
    out.push(format!("confirm {}", kind(&c.confirm("charge", b"ok"))));
    out.push(format!("effect r {}", kind(&c.effect("receipt"))));
    out.push(format!(
        "deferred big {}",
        kind(&c.confirm_deferred("receipt", &big))
    ));
    complete(ctx, c, out);
    Ok(())
}

fn bad_names(ctx: &Ctx, c: Claim, out: &mut Vec<String>) -> TestResult {
    let long = "x".repeat(idempotency::MAX_STEP_NAME_BYTES + 1);
    for name in ["", " ", "a\nb", "a b", long.as_str(), "ok"] {
        out.push(format!("effect {name:?} {}", kind(&c.effect(name))));
    }
    out.push(format!("confirm bad {}", kind(&c.confirm("a b", b"e"))));
    out.push(format!(
        "confirm missing {}",
        kind(&c.confirm("nope", b"e"))
    ));
    complete(ctx, c, out);
    Ok(())
}

fn too_many_steps(ctx: &Ctx, c: Claim, out: &mut Vec<String>) -> TestResult {
    for i in 0..=idempotency::MAX_STEPS_PER_KEY {
        let name = format!("s{i:02}");
        out.push(format!("effect {name} {}", kind(&c.effect(&name))));
    }
    complete(ctx, c, out);
    Ok(())
}

fn full_log(ctx: &Ctx, c: Claim, out: &mut Vec<String>) -> TestResult {
    // Reserve and reject the same step until the log refuses (or 300
    // rounds): only the first refusal and the round it came in are kept.
    for round in 0..300 {
        let e = c.effect("retry");
        let r = if e.is_ok() {
            c.reject("retry", b"declined")
        } else {
            Ok(())
        };
        if e.is_err() || r.is_err() {
            out.push(format!(
                "round {round}: effect {} reject {}",
                kind(&e),
                kind(&r)
            ));
            break;
        }
    }
    complete(ctx, c, out);
    Ok(())
}

fn lease_ends(ctx: &Ctx, c: Claim, out: &mut Vec<String>) -> TestResult {
    out.push(format!("effect {}", kind(&c.effect("charge"))));
    ctx.clock.advance(LEASE + Duration::from_millis(1));
    out.push(format!("confirm {}", kind(&c.confirm("charge", b"ch_1"))));
    out.push(format!("effect r {}", kind(&c.effect("receipt"))));
    complete(ctx, c, out);
    Ok(())
}

fn lease_ends_swept(ctx: &Ctx, c: Claim, out: &mut Vec<String>) -> TestResult {
    out.push(format!("effect {}", kind(&c.effect("charge"))));
    ctx.clock.advance(LEASE + Duration::from_millis(1));
    out.push(format!("b sweep {}", kind(&ctx.b.sweep_now().map(|_| ()))));
    out.push(format!("confirm {}", kind(&c.confirm("charge", b"ch_1"))));
    complete(ctx, c, out);
    Ok(())
}

fn taken_over(ctx: &Ctx, c: Claim, out: &mut Vec<String>) -> TestResult {
    out.push(format!("effect {}", kind(&c.effect("charge"))));
    ctx.clock.advance(LEASE + Duration::from_millis(1));
    let fp = Fingerprint::of_json(br#"{"a":1}"#, &[])?;
    let taken = ctx.b.begin(&ctx.key, fp);
    out.push(format!("b begin {}", kind(&taken)));
    out.push(format!("confirm {}", kind(&c.confirm("charge", b"ch_1"))));
    out.push(format!(
        "deferred {}",
        kind(&c.confirm_deferred("charge", b"ch_1"))
    ));
    out.push(format!("effect r {}", kind(&c.effect("receipt"))));
    complete(ctx, c, out);
    drop(taken);
    Ok(())
}

fn purged_then_deferred(ctx: &Ctx, c: Claim, out: &mut Vec<String>) -> TestResult {
    out.push(format!("effect {}", kind(&c.effect("charge"))));
    out.push(format!("confirm {}", kind(&c.confirm("charge", b"ch_1"))));
    out.push(format!("effect r {}", kind(&c.effect("receipt"))));
    let purged = ctx.b.purge(&ctx.key, PurgeMode::Force);
    out.push(format!("b purge {}", kind(&purged)));
    out.push(format!(
        "deferred {}",
        kind(&c.confirm_deferred("receipt", b"r_1"))
    ));
    complete(ctx, c, out);
    Ok(())
}

fn purged_then_confirm(ctx: &Ctx, c: Claim, out: &mut Vec<String>) -> TestResult {
    out.push(format!("effect {}", kind(&c.effect("charge"))));
    let purged = ctx.b.purge(&ctx.key, PurgeMode::Force);
    out.push(format!("b purge {}", kind(&purged)));
    out.push(format!("confirm {}", kind(&c.confirm("charge", b"ch_1"))));
    out.push(format!("effect r {}", kind(&c.effect("receipt"))));
    complete(ctx, c, out);
    Ok(())
}

fn purged_then_reclaimed(ctx: &Ctx, c: Claim, out: &mut Vec<String>) -> TestResult {
    out.push(format!("effect {}", kind(&c.effect("charge"))));
    let purged = ctx.b.purge(&ctx.key, PurgeMode::Force);
    out.push(format!("b purge {}", kind(&purged)));
    let fp = Fingerprint::of_json(br#"{"a":1}"#, &[])?;
    let again = ctx.b.begin(&ctx.key, fp);
    out.push(format!("b begin {}", kind(&again)));
    out.push(format!("confirm {}", kind(&c.confirm("charge", b"ch_1"))));
    out.push(format!("effect r {}", kind(&c.effect("receipt"))));
    complete(ctx, c, out);
    drop(again);
    Ok(())
}

/// Every scenario answers and writes the same in place as on the full path.
#[test]
fn in_place_answers_and_writes_as_the_full_path() -> TestResult {
    let Some(url) = pg_chaos::pg_url() else {
        return Ok(());
    };
    let scenarios: [(&str, Scenario); 10] = [
        ("big-evidence", big_evidence),
        ("bad-names", bad_names),
        ("too-many-steps", too_many_steps),
        ("full-log", full_log),
        ("lease-ends", lease_ends),
        ("lease-ends-swept", lease_ends_swept),
        ("taken-over", taken_over),
        ("purged-then-deferred", purged_then_deferred),
        ("purged-then-confirm", purged_then_confirm),
        ("purged-then-reclaimed", purged_then_reclaimed),
    ];
    let mut differ = Vec::new();
    for (name, scenario) in scenarios {
        let in_place = run(&url, name, false, scenario)?;
        let full = run(&url, name, true, scenario)?;
        eprintln!("{name}\n  in place: {in_place:?}\n  full:     {full:?}");
        if in_place != full {
            differ.push(format!(
                "{name}:\n  in place: {in_place:?}\n  full:     {full:?}"
            ));
        }
    }
    assert!(differ.is_empty(), "{}", differ.join("\n"));
    Ok(())
}
