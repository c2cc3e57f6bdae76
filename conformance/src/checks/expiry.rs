//! Expiry: after the server's TTL a key is new again, or refused as
//! expired (410, or a tombstone's 4xx), never replayed.

use std::time::{Duration, Instant};

use crate::checks::{count_note, fresh_key, row, show};
use crate::client::{Answer, KeyLines, Req, Target};
use crate::report::{Check, Verdict};

const ID: &str = "expiry.ttl";
const SOURCE: &str = "draft 2.3 MAY (publish TTL); ours";

/// The first request, sent at the start so the wait overlaps the other
/// checks.
pub(crate) struct Pending {
    key: String,
    first: Result<Answer, String>,
    done: Instant,
}

/// Sends the first request if a TTL is given.
pub(crate) async fn start(t: &Target) -> Option<Pending> {
    t.config().ttl?;
    let key = fresh_key("expiry");
    let first = t
        .send(&Req::new(KeyLines::quoted(&key), &t.config().body))
        .await;
    Some(Pending {
        key,
        first,
        done: Instant::now(),
    })
}

/// Waits out the TTL (plus a quarter and half a second for clocks and
/// sweeps) and retries.
pub(crate) async fn finish(t: &Target, pending: Option<Pending>) -> Check {
    let (Some(pending), Some(ttl)) = (pending, t.config().ttl) else {
        return row(
            ID,
            SOURCE,
            Verdict::Skip,
            "needs the server's TTL: --ttl".into(),
        );
    };
    let first = match &pending.first {
        Ok(a) if a.success() => a.clone(),
        other => {
            return row(
                ID,
                SOURCE,
                Verdict::Fail,
                format!("the first request did not succeed: {}", show(t, other)),
            )
        }
    };
    let wait = ttl + ttl / 4 + Duration::from_millis(500);
    tokio::time::sleep_until((pending.done + wait).into()).await;
    let retry = t
        .send(&Req::new(KeyLines::quoted(&pending.key), &t.config().body))
        .await;
    let pointer = &t.config().id_pointer;
    let seen = format!(
        "first {}; {:.1} s later {}",
        show(t, &Ok(first.clone())),
        wait.as_secs_f64(),
        show(t, &retry)
    );
    let marked = |a: &Answer| {
        t.config()
            .replay_header
            .as_ref()
            .is_some_and(|m| a.marked(m))
    };
    let (mut verdict, why, runs) = match &retry {
        Ok(a) if a.success() && !marked(a) && a.id(pointer) != first.id(pointer) => {
            (Verdict::Pass, ": the key is new again", 2)
        }
        Ok(a) if a.success() || marked(a) => (Verdict::Fail, ": still replayed after --ttl", 1),
        Ok(a) if a.status == 410 => (Verdict::Pass, ": 410 Gone", 1),
        Ok(a) if (400..500).contains(&a.status) => (Verdict::Pass, ": refused as expired", 1),
        _ => (Verdict::Fail, ": expected a new run, 410 or a refusal", 1),
    };
    let note = count_note(t, &pending.key, runs, &mut verdict).await;
    row(ID, SOURCE, verdict, format!("{seen}{why}{note}"))
}
