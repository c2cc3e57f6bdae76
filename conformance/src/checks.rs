//! The checks, one module per family; each returns rows for the report.
//! conformance/README.md documents every check id and its source.

pub(crate) mod classify;
pub(crate) mod crash;
pub(crate) mod duplicates;
pub(crate) mod expiry;
pub(crate) mod keys;
pub(crate) mod replay;

use crate::client::{Answer, Target};
use crate::report::{Check, Verdict};

/// A key no earlier run or check used: `conf-{label}-` and 48 random bits.
pub(crate) fn fresh_key(label: &str) -> String {
    let id = uuid::Uuid::new_v4().simple().to_string();
    format!("conf-{label}-{}", id.get(..12).unwrap_or(&id))
}

pub(crate) fn row(
    id: &'static str,
    source: &'static str,
    verdict: Verdict,
    detail: String,
) -> Check {
    Check {
        id,
        source,
        verdict,
        detail,
    }
}

/// The answer's summary, or the transport error.
pub(crate) fn show(t: &Target, answer: &Result<Answer, String>) -> String {
    match answer {
        Ok(a) => a.summary(&t.config().id_pointer),
        Err(e) => format!("error: {e}"),
    }
}

/// " (N executions)" from the target's count, or "" without one; an
/// unexpected count turns `verdict` into a failure.
pub(crate) async fn count_note(
    t: &Target,
    key: &str,
    expected: u64,
    verdict: &mut Verdict,
) -> String {
    match t.executions(key).await {
        None => String::new(),
        Some(Ok(n)) if n == expected => format!("; count: {n} execution(s)"),
        Some(Ok(n)) => {
            *verdict = Verdict::Fail;
            format!("; count: {n} execution(s), expected {expected}")
        }
        Some(Err(e)) => {
            *verdict = Verdict::Fail;
            format!("; count failed: {e}")
        }
    }
}
