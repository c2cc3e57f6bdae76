//! A crash mid-request: the server is killed and restarted while a slow
//! request holds its key; retries converge on one outcome and the work
//! never runs twice.

use std::time::{Duration, Instant};

use crate::checks::{count_note, fresh_key, row, show};
use crate::client::{Answer, KeyLines, Req, Target};
use crate::report::{Check, Verdict};

const ID: &str = "crash.restart";
const SOURCE: &str = "ours (at most once across a crash)";

/// How long retries go on after the restart (a lease to run out, a
/// resolver to settle the key).
const SETTLE: Duration = Duration::from_secs(30);

/// The crash check.
pub(crate) async fn run(t: &Target) -> Check {
    let Some(restart) = t.config().restart.clone() else {
        return row(ID, SOURCE, Verdict::Skip, "needs --restart-cmd".into());
    };
    if !t.config().has_slow() {
        return row(
            ID,
            SOURCE,
            Verdict::Skip,
            "needs a slow request (--slow-header or --slow-path) to crash in".into(),
        );
    }
    let key = fresh_key("crash");
    let req = Req::new(KeyLines::quoted(&key), &t.config().body).slow();
    let first = {
        let (t, req) = (t.clone(), req.clone());
        tokio::spawn(async move { t.send(&req).await })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    if let Err(e) = restart.run().await {
        return row(ID, SOURCE, Verdict::Fail, format!("restart failed: {e}"));
    }
    let first = first
        .await
        .unwrap_or_else(|e| Err(format!("task failed: {e}")));
    let (settled, attempts) = settle(t, &req).await;
    let pointer = &t.config().id_pointer;
    let settled = match settled {
        Ok(a) if a.success() => a,
        other => {
            return row(
                ID,
                SOURCE,
                Verdict::Fail,
                format!(
                    "in flight: {}; after {attempts} attempts: {}",
                    show(t, &first),
                    show(t, &other)
                ),
            )
        }
    };
    let again = t.send(&req).await;
    let mut problems = Vec::new();
    if let Ok(f) = &first {
        if f.success() && f.id(pointer) != settled.id(pointer) {
            problems.push("the retry ran again after the first answered");
        }
    }
    if !matches!(&again, Ok(a) if a.success() && a.id(pointer) == settled.id(pointer)) {
        problems.push("a further retry got another answer");
    }
    let mut verdict = if problems.is_empty() {
        Verdict::Pass
    } else {
        Verdict::Fail
    };
    let mut note = count_note(t, &key, 1, &mut verdict).await;
    if note.is_empty() && verdict == Verdict::Pass {
        verdict = Verdict::Warn;
        note = "; retries converge, but at most once is unproven without --count-url".into();
    }
    let why = if problems.is_empty() {
        String::new()
    } else {
        format!(": {}", problems.join("; "))
    };
    row(
        ID,
        SOURCE,
        verdict,
        format!(
            "in flight: {}; settled after {attempts} attempts: {}; again: {}{why}{note}",
            show(t, &first),
            show(t, &Ok(settled.clone())),
            show(t, &again)
        ),
    )
}

/// Retries while the answer is "not yet" (a 409 or 503, or no server),
/// honouring `Retry-After` up to a second, for at most [`SETTLE`].
async fn settle(t: &Target, req: &Req) -> (Result<Answer, String>, u32) {
    let deadline = Instant::now() + SETTLE;
    let mut attempts = 0;
    loop {
        attempts += 1;
        let answer = t.send(req).await;
        let pause = match &answer {
            Ok(a) if a.status == 409 || a.status == 503 => a
                .retry_after()
                .and_then(|s| s.trim().parse::<u64>().ok())
                .map_or(Duration::from_millis(250), |s| {
                    Duration::from_secs(s).min(Duration::from_secs(1))
                }),
            Err(_) => Duration::from_millis(200),
            Ok(_) => return (answer, attempts),
        };
        if Instant::now() + pause > deadline {
            return (answer, attempts);
        }
        tokio::time::sleep(pause).await;
    }
}
