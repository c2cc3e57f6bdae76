//! Which answers are stored: a retry after a hooked error status.

use crate::checks::{count_note, fresh_key, row, show};
use crate::client::{Answer, KeyLines, Req, Target};
use crate::report::{Check, Verdict};

/// What the retry after the error must get.
#[derive(Clone, Copy)]
enum Expect {
    /// The work runs (the error was not stored).
    Runs,
    /// The work runs, or the retry is told the outcome is in doubt (503
    /// with `Retry-After`); never the stored error.
    RunsOrInDoubt,
    /// The stored error, byte for byte.
    Replayed,
}

/// The classification checks, in order.
pub(crate) async fn run(t: &Target) -> Vec<Check> {
    vec![
        hooked(
            t,
            "classify.503-released",
            "ours (503 + Retry-After: released)",
            503,
            Expect::Runs,
        )
        .await,
        hooked(
            t,
            "classify.500-not-stored",
            "ours (5xx never replayed)",
            500,
            Expect::RunsOrInDoubt,
        )
        .await,
        hooked(
            t,
            "classify.4xx-stored",
            "draft 2.6 SHOULD; ours: stored",
            402,
            Expect::Replayed,
        )
        .await,
        hooked(
            t,
            "classify.422-released",
            "ours (400/422 released)",
            422,
            Expect::Runs,
        )
        .await,
    ]
}

/// The first request asks the target (status header) for `status`; its
/// retry, without the hook, must get what `expect` says.
async fn hooked(
    t: &Target,
    id: &'static str,
    source: &'static str,
    status: u16,
    expect: Expect,
) -> Check {
    if t.config().status_header.is_none() {
        return row(
            id,
            source,
            Verdict::Skip,
            "needs a status hook: --status-header".into(),
        );
    }
    let key = fresh_key(&format!("status{status}"));
    let first = t
        .send(&Req::new(KeyLines::quoted(&key), &t.config().body).status(status))
        .await;
    let first = match first {
        Ok(a) if a.status == status => a,
        other => {
            return row(
                id,
                source,
                Verdict::Skip,
                format!(
                    "the target did not answer the hooked {status}: {}",
                    show(t, &other)
                ),
            )
        }
    };
    let retry = t
        .send(&Req::new(KeyLines::quoted(&key), &t.config().body))
        .await;
    let seen = format!(
        "hooked {}; retry {}",
        show(t, &Ok(first.clone())),
        show(t, &retry)
    );
    let (mut verdict, why, runs) = judge(t, &first, &retry, expect);
    let note = count_note(t, &key, runs, &mut verdict).await;
    row(id, source, verdict, format!("{seen}{why}{note}"))
}

/// The verdict, a reason, and how many executions the count should show.
fn judge(
    t: &Target,
    first: &Answer,
    retry: &Result<Answer, String>,
    expect: Expect,
) -> (Verdict, &'static str, u64) {
    let Ok(retry) = retry else {
        return (Verdict::Fail, ": the retry failed", 0);
    };
    let replayed = retry.status == first.status && retry.body == first.body;
    let marked = t
        .config()
        .replay_header
        .as_ref()
        .is_some_and(|m| retry.marked(m));
    match expect {
        Expect::Runs | Expect::RunsOrInDoubt if retry.success() && !marked => {
            (Verdict::Pass, ": ran again", 1)
        }
        Expect::RunsOrInDoubt if retry.status == 503 && retry.retry_after().is_some() => {
            (Verdict::Pass, ": in doubt, not replayed", 0)
        }
        Expect::Runs | Expect::RunsOrInDoubt if replayed => {
            (Verdict::Fail, ": the error was stored and replayed", 0)
        }
        Expect::Runs | Expect::RunsOrInDoubt => (Verdict::Fail, ": expected a new run", 0),
        Expect::Replayed if replayed => (Verdict::Pass, ": replayed", 0),
        Expect::Replayed if retry.success() => (
            Verdict::Fail,
            ": the error was not stored; the retry ran",
            1,
        ),
        Expect::Replayed => (Verdict::Fail, ": expected the stored error", 0),
    }
}
