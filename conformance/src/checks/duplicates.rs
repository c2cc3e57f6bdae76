//! Duplicates: at once, with a different payload, and while the first is
//! still in flight.

use std::collections::BTreeSet;
use std::time::Duration;

use crate::checks::{count_note, fresh_key, row, show};
use crate::client::{Answer, KeyLines, Req, Target};
use crate::report::{Check, Verdict};

/// How long after the slow request its duplicate is sent: well inside the
/// second a slow request stays in flight.
const PROBE_DELAY: Duration = Duration::from_millis(300);

/// N identical requests at once: one execution, identical 2xx answers,
/// the rest told 409 (in flight); a retry afterwards is the same answer.
pub(crate) async fn concurrent(t: &Target) -> Check {
    const ID: &str = "dup.concurrent";
    const SOURCE: &str = "draft 2.6 SHOULD; ours MUST (one run)";
    let key = fresh_key("dup");
    let n = t.config().concurrency.max(2);
    let req = Req::new(KeyLines::quoted(&key), &t.config().body);
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..n {
        let (t, req) = (t.clone(), req.clone());
        tasks.spawn(async move { t.send(&req).await });
    }
    let mut answers = Vec::new();
    while let Some(joined) = tasks.join_next().await {
        answers.push(joined.unwrap_or_else(|e| Err(format!("task failed: {e}"))));
    }
    let later = t.send(&req).await;
    let pointer = &t.config().id_pointer;
    let ok: Vec<&Answer> = answers.iter().flatten().filter(|a| a.success()).collect();
    let ids: BTreeSet<String> = ok.iter().filter_map(|a| a.id(pointer)).collect();
    let in_flight = answers.iter().flatten().filter(|a| a.status == 409).count();
    let other: Vec<String> = answers
        .iter()
        .filter(|a| !matches!(a, Ok(a) if a.success() || a.status == 409))
        .map(|a| show(t, a))
        .collect();
    let bodies: BTreeSet<&[u8]> = ok.iter().map(|a| a.body.as_slice()).collect();
    let later_id = later
        .as_ref()
        .ok()
        .filter(|a| a.success())
        .and_then(|a| a.id(pointer));
    let mut problems = Vec::new();
    if ids.len() != 1 {
        problems.push(format!("{} execution ids among the 2xx answers", ids.len()));
    }
    if bodies.len() > 1 {
        problems.push(format!("{} different 2xx bodies", bodies.len()));
    }
    if !other.is_empty() {
        problems.push(format!("other answers: {}", other.join(", ")));
    }
    if later_id.is_none() || later_id.as_ref() != ids.iter().next() {
        problems.push(format!("the retry afterwards got {}", show(t, &later)));
    }
    let mut verdict = if problems.is_empty() {
        Verdict::Pass
    } else {
        Verdict::Fail
    };
    let note = count_note(t, &key, 1, &mut verdict).await;
    let mut detail = format!(
        "{n} at once: {} answered 2xx ({} id), {in_flight} answered 409; retry after: {}{note}",
        ok.len(),
        ids.len(),
        show(t, &later)
    );
    if !problems.is_empty() {
        detail = format!("{}: {detail}", problems.join("; "));
    }
    row(ID, SOURCE, verdict, detail)
}

/// The same key with a different payload is refused (the draft: 422) and
/// does not run.
pub(crate) async fn mismatch(t: &Target) -> Check {
    const ID: &str = "dup.mismatch";
    const SOURCE: &str = "draft 2.7 SHOULD (422)";
    let Some(other) = t.config().different_body() else {
        return row(
            ID,
            SOURCE,
            Verdict::Skip,
            "no different body: give --other-body".into(),
        );
    };
    let key = fresh_key("mismatch");
    let first = t
        .send(&Req::new(KeyLines::quoted(&key), &t.config().body))
        .await;
    if !matches!(&first, Ok(a) if a.success()) {
        return row(
            ID,
            SOURCE,
            Verdict::Fail,
            format!("the first request did not succeed: {}", show(t, &first)),
        );
    }
    let second = t.send(&Req::new(KeyLines::quoted(&key), &other)).await;
    let seen = format!(
        "first {}; different body {}",
        show(t, &first),
        show(t, &second)
    );
    let mut verdict = match &second {
        Ok(a) if a.status == 422 => Verdict::Pass,
        Ok(a) if (400..500).contains(&a.status) => Verdict::Warn,
        _ => Verdict::Fail,
    };
    let mut detail = match verdict {
        Verdict::Pass => seen,
        Verdict::Warn => format!("{seen}: refused, but the draft's status is 422"),
        _ => format!("{seen}: a different payload must be refused"),
    };
    detail.push_str(&count_note(t, &key, 1, &mut verdict).await);
    row(ID, SOURCE, verdict, detail)
}

/// A duplicate sent while the first request is still running gets 409
/// with `Retry-After`, and the work runs once.
pub(crate) async fn in_flight(t: &Target) -> Check {
    const ID: &str = "inflight.conflict";
    const SOURCE: &str = "draft 2.7 SHOULD (409); ours: Retry-After";
    if !t.config().has_slow() {
        return row(
            ID,
            SOURCE,
            Verdict::Skip,
            "needs a slow request: --slow-header or --slow-path".into(),
        );
    }
    let key = fresh_key("inflight");
    let req = Req::new(KeyLines::quoted(&key), &t.config().body).slow();
    let first = {
        let (t, req) = (t.clone(), req.clone());
        tokio::spawn(async move { t.send(&req).await })
    };
    tokio::time::sleep(PROBE_DELAY).await;
    let second = t.send(&req).await;
    let first = first
        .await
        .unwrap_or_else(|e| Err(format!("task failed: {e}")));
    let pointer = &t.config().id_pointer;
    let seen = format!("first {}; duplicate {}", show(t, &first), show(t, &second));
    let pair = (first.as_ref().ok(), second.as_ref().ok());
    let (mut verdict, why) = match pair {
        (Some(a), Some(b)) => {
            let (done, other) = if a.success() { (a, b) } else { (b, a) };
            if !done.success() {
                (Verdict::Fail, ": neither answered 2xx")
            } else if other.status == 409 && other.retry_after().is_some() {
                (Verdict::Pass, "")
            } else if other.status == 409 {
                (Verdict::Warn, ": 409 without Retry-After")
            } else if other.success() && other.id(pointer) == done.id(pointer) {
                (
                    Verdict::Warn,
                    ": the duplicate got the outcome, not 409 (it waited, or the first had finished)",
                )
            } else {
                (Verdict::Fail, ": expected 409 for the duplicate")
            }
        }
        _ => (Verdict::Fail, ": a request failed"),
    };
    let note = count_note(t, &key, 1, &mut verdict).await;
    row(ID, SOURCE, verdict, format!("{seen}{why}{note}"))
}
