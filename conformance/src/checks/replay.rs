//! Replays: byte-identical to the first answer, and marked as replays.

use std::collections::BTreeSet;

use crate::checks::{count_note, fresh_key, row, show};
use crate::client::{Answer, KeyLines, Req, Target};
use crate::report::{Check, Verdict};

/// Headers never compared: they differ per response by design.
const NOT_COMPARED: [&str; 5] = [
    "date",
    "connection",
    "keep-alive",
    "transfer-encoding",
    "set-cookie",
];

/// A request and its retry: `replay.identical` and `replay.marked`.
pub(crate) async fn run(t: &Target) -> Vec<Check> {
    const IDENTICAL: &str = "replay.identical";
    const MARKED: &str = "replay.marked";
    const IDENTICAL_SOURCE: &str = "draft 2.6 SHOULD; ours: byte-identical";
    const MARKED_SOURCE: &str = "ours (Idempotent-Replayed: true)";
    let key = fresh_key("replay");
    let req = Req::new(KeyLines::quoted(&key), &t.config().body);
    let first = t.send(&req).await;
    let retry = t.send(&req).await;
    let (first, retry) = match (&first, &retry) {
        (Ok(f), Ok(r)) if f.success() => (f, r),
        _ => {
            let detail = format!("first {}; retry {}", show(t, &first), show(t, &retry));
            return vec![
                row(IDENTICAL, IDENTICAL_SOURCE, Verdict::Fail, detail.clone()),
                row(MARKED, MARKED_SOURCE, Verdict::Skip, detail),
            ];
        }
    };
    let differences = differences(t, first, retry);
    let mut verdict = if differences.is_empty() {
        Verdict::Pass
    } else {
        Verdict::Fail
    };
    let mut detail = if differences.is_empty() {
        let compared = compared_names(t, first).len();
        format!(
            "{} and its retry: same status, {} body bytes and {compared} headers",
            first.status,
            first.body.len()
        )
    } else {
        differences.join("; ")
    };
    detail.push_str(&count_note(t, &key, 1, &mut verdict).await);
    let identical = row(IDENTICAL, IDENTICAL_SOURCE, verdict, detail);
    let marked = match &t.config().replay_header {
        None => row(
            MARKED,
            MARKED_SOURCE,
            Verdict::Skip,
            "no replay header configured (--replay-header none)".into(),
        ),
        Some(marker) => {
            let name = match &marker.1 {
                Some(v) => format!("{}: {v}", marker.0),
                None => marker.0.clone(),
            };
            match (first.marked(marker), retry.marked(marker)) {
                (false, true) => row(
                    MARKED,
                    MARKED_SOURCE,
                    Verdict::Pass,
                    format!("retry carries {name}; the first answer does not"),
                ),
                (true, _) => row(
                    MARKED,
                    MARKED_SOURCE,
                    Verdict::Fail,
                    format!("the first answer carries {name}"),
                ),
                (false, false) => row(
                    MARKED,
                    MARKED_SOURCE,
                    Verdict::Fail,
                    format!("the retry does not carry {name}"),
                ),
            }
        }
    };
    vec![identical, marked]
}

/// The lower-case header names compared between a first answer and its
/// replay.
fn compared_names(t: &Target, answer: &Answer) -> BTreeSet<String> {
    let config = t.config();
    answer
        .headers
        .iter()
        .map(|(n, _)| n.to_ascii_lowercase())
        .filter(|n| !NOT_COMPARED.contains(&n.as_str()))
        .filter(|n| {
            !config
                .ignore_headers
                .iter()
                .any(|i| i.eq_ignore_ascii_case(n))
        })
        .filter(|n| {
            config
                .replay_header
                .as_ref()
                .is_none_or(|(m, _)| !m.eq_ignore_ascii_case(n))
        })
        .collect()
}

/// What differs between a first answer and its replay, one line each.
pub(crate) fn differences(t: &Target, first: &Answer, retry: &Answer) -> Vec<String> {
    let mut out = Vec::new();
    if first.status != retry.status {
        out.push(format!("status {} then {}", first.status, retry.status));
    }
    if first.body != retry.body {
        out.push(format!(
            "body differs ({} then {} bytes: {} / {})",
            first.body.len(),
            retry.body.len(),
            first.summary(&t.config().id_pointer),
            retry.summary(&t.config().id_pointer)
        ));
    }
    let names = compared_names(t, first)
        .union(&compared_names(t, retry))
        .cloned()
        .collect::<Vec<_>>();
    for name in names {
        let (a, b) = (first.header_values(&name), retry.header_values(&name));
        if a != b {
            let show = |v: &[&[u8]]| {
                v.iter()
                    .map(|x| String::from_utf8_lossy(x).into_owned())
                    .collect::<Vec<_>>()
                    .join(", ")
            };
            out.push(format!("header {name}: {:?} then {:?}", show(&a), show(&b)));
        }
    }
    out
}
