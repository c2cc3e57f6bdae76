//! Check results: the printed table and the JSON report.

use std::fmt::Write as _;

use serde::Serialize;

/// A check's result.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Verdict {
    /// The target behaves as the source says.
    Pass,
    /// Safe (nothing ran twice, nothing was lost) but not what a SHOULD of
    /// the source asks, or not verifiable with what the target offers.
    Warn,
    /// The target does not behave as the source says.
    Fail,
    /// Not checked: the target lacks a prerequisite (a hook, a TTL) or the
    /// check does not apply; the detail says which.
    Skip,
}

impl Verdict {
    fn as_str(self) -> &'static str {
        match self {
            Verdict::Pass => "pass",
            Verdict::Warn => "warn",
            Verdict::Fail => "FAIL",
            Verdict::Skip => "skip",
        }
    }
}

/// One check's row.
#[derive(Clone, Debug, Serialize)]
pub struct Check {
    /// Stable id, e.g. `dup.concurrent` (conformance/README.md lists them).
    pub id: &'static str,
    /// Where the rule comes from: a section of the IETF draft with its
    /// MUST/SHOULD, an RFC, or `ours` (this workspace's stricter rule).
    pub source: &'static str,
    /// The result.
    pub verdict: Verdict,
    /// What was sent and seen.
    pub detail: String,
}

/// Every check's row, in the order run.
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    /// The endpoint checked (base URL and path).
    pub target: String,
    /// The rows.
    pub checks: Vec<Check>,
}

impl Report {
    /// The rows with this verdict.
    pub fn with(&self, verdict: Verdict) -> impl Iterator<Item = &Check> {
        self.checks.iter().filter(move |c| c.verdict == verdict)
    }

    /// The row of check `id`.
    pub fn check(&self, id: &str) -> Option<&Check> {
        self.checks.iter().find(|c| c.id == id)
    }

    /// `N pass, N warn, N fail, N skip`.
    pub fn summary(&self) -> String {
        let n = |v| self.with(v).count();
        format!(
            "{} pass, {} warn, {} fail, {} skip",
            n(Verdict::Pass),
            n(Verdict::Warn),
            n(Verdict::Fail),
            n(Verdict::Skip)
        )
    }

    /// A plain-text table: check, source, result, detail; then the summary.
    pub fn table(&self) -> String {
        let id_w = self
            .checks
            .iter()
            .map(|c| c.id.len())
            .max()
            .unwrap_or(5)
            .max(5);
        let src_w = self
            .checks
            .iter()
            .map(|c| c.source.len())
            .max()
            .unwrap_or(6)
            .max(6);
        let mut out = String::new();
        let _ = writeln!(out, "target: {}", self.target);
        let _ = writeln!(
            out,
            "{:id_w$}  {:src_w$}  {:6}  detail",
            "check", "source", "result"
        );
        let _ = writeln!(out, "{}", "-".repeat(id_w + src_w + 24));
        for c in &self.checks {
            let _ = writeln!(
                out,
                "{:id_w$}  {:src_w$}  {:6}  {}",
                c.id,
                c.source,
                c.verdict.as_str(),
                c.detail
            );
        }
        let _ = writeln!(out, "{}", self.summary());
        out
    }

    /// The report as pretty JSON: `{"target", "summary", "checks": [{"id",
    /// "source", "verdict", "detail"}]}`.
    pub fn to_json(&self) -> String {
        let summary = serde_json::json!({
            "pass": self.with(Verdict::Pass).count(),
            "warn": self.with(Verdict::Warn).count(),
            "fail": self.with(Verdict::Fail).count(),
            "skip": self.with(Verdict::Skip).count(),
        });
        let json = serde_json::json!({
            "target": self.target,
            "summary": summary,
            "checks": self.checks,
        });
        serde_json::to_string_pretty(&json).unwrap_or_else(|e| format!("{{\"error\": \"{e}\"}}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_and_json_hold_every_row() -> Result<(), serde_json::Error> {
        let report = Report {
            target: "http://127.0.0.1:1/payments".into(),
            checks: vec![
                Check {
                    id: "dup.concurrent",
                    source: "ours",
                    verdict: Verdict::Pass,
                    detail: "1 execution".into(),
                },
                Check {
                    id: "expiry.ttl",
                    source: "draft 2.3",
                    verdict: Verdict::Fail,
                    detail: "still replayed".into(),
                },
            ],
        };
        let table = report.table();
        assert!(table.contains("dup.concurrent  ours"), "{table}");
        assert!(table.contains("FAIL    still replayed"), "{table}");
        assert!(
            table.ends_with("1 pass, 0 warn, 1 fail, 0 skip\n"),
            "{table}"
        );
        let json: serde_json::Value = serde_json::from_str(&report.to_json())?;
        assert_eq!(json["summary"]["fail"], 1);
        assert_eq!(json["checks"][1]["verdict"], "fail");
        assert_eq!(json["checks"][0]["id"], "dup.concurrent");
        Ok(())
    }
}
