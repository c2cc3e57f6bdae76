//! Key validation: which `Idempotency-Key` field values are accepted.

use crate::checks::{count_note, fresh_key, row, show};
use crate::client::{KeyLines, Req, Target};
use crate::report::{Check, Verdict};

/// The key checks, in order.
pub(crate) async fn run(t: &Target) -> Vec<Check> {
    vec![
        missing(t).await,
        sf_string(t).await,
        refused(
            t,
            "key.empty-field",
            "draft 2.1 sf-string; ours: 400",
            Ignorable::Unparsable,
            vec![KeyLines::raw(Vec::new())],
        )
        .await,
        refused(
            t,
            "key.not-sf-string",
            "draft 2.1 sf-string; ours: 400",
            Ignorable::Unparsable,
            vec![
                KeyLines::raw(format!("\"{}", fresh_key("open"))),
                KeyLines::raw(format!("\"{}\" x", fresh_key("trail"))),
                KeyLines::raw(format!("\"{}\\n\"", fresh_key("escape"))),
                KeyLines::raw(format!("\"{}\";X=1", fresh_key("param"))),
            ],
        )
        .await,
        refused(
            t,
            "key.non-ascii",
            "RFC 8941 3.3.3 ASCII; ours: 400",
            Ignorable::Unparsable,
            vec![KeyLines::raw(
                format!("\"{}-café\"", fresh_key("utf8")).into_bytes(),
            )],
        )
        .await,
        refused(
            t,
            "key.repeated",
            "draft 2.1 one line; ours: 400",
            Ignorable::Unparsable,
            vec![KeyLines(vec![
                format!("\"{}\"", fresh_key("rep-a")).into_bytes(),
                format!("\"{}\"", fresh_key("rep-b")).into_bytes(),
            ])],
        )
        .await,
        refused(
            t,
            "key.blank",
            "ours (blank key is malformed)",
            Ignorable::Ours,
            vec![KeyLines::raw("\"\""), KeyLines::raw("\"   \"")],
        )
        .await,
        too_long(t).await,
        bare_token(t).await,
        refused(
            t,
            "key.bare-bad-chars",
            "ours (bare key: visible ASCII)",
            Ignorable::Ours,
            vec![
                KeyLines::raw(format!("{} x", fresh_key("space"))),
                KeyLines::raw(format!("{},x", fresh_key("comma"))),
                KeyLines::raw(format!("{};x", fresh_key("semi"))),
            ],
        )
        .await,
    ]
}

/// No key at all: 400 where the route requires one.
async fn missing(t: &Target) -> Check {
    const ID: &str = "key.missing";
    const SOURCE: &str = "draft 2.7 SHOULD (400)";
    let answer = t.send(&Req::new(KeyLines::none(), &t.config().body)).await;
    let seen = show(t, &answer);
    let (verdict, detail) = match &answer {
        Ok(a) if a.status == 400 => (Verdict::Pass, format!("no key: {seen}")),
        Ok(a) if (400..500).contains(&a.status) => (
            Verdict::Warn,
            format!("no key: {seen}; the draft's answer is 400"),
        ),
        Ok(a) if a.success() && !t.config().key_required => (
            Verdict::Skip,
            format!("no key: {seen}: the key is optional here (--key-required not given)"),
        ),
        Ok(_) => (
            Verdict::Fail,
            format!("no key: {seen}; the route requires a key: expected 400"),
        ),
        Err(_) => (Verdict::Fail, format!("no key: {seen}")),
    };
    row(ID, SOURCE, verdict, detail)
}

/// A quoted key (the draft's form) is accepted and runs.
async fn sf_string(t: &Target) -> Check {
    const ID: &str = "key.sf-string";
    const SOURCE: &str = "draft 2.1 MUST (sf-string)";
    let key = fresh_key("quoted");
    let answer = t
        .send(&Req::new(KeyLines::quoted(&key), &t.config().body))
        .await;
    let seen = show(t, &answer);
    let mut verdict = match &answer {
        Ok(a) if a.success() => Verdict::Pass,
        _ => Verdict::Fail,
    };
    let note = if verdict == Verdict::Pass {
        count_note(t, &key, 1, &mut verdict).await
    } else {
        String::new()
    };
    row(ID, SOURCE, verdict, format!("\"{key}\": {seen}{note}"))
}

/// Each of `cases` must be refused with a 4xx (400 is the RFC 9110 answer
/// to a malformed request; another 4xx is a warning).
async fn refused(
    t: &Target,
    id: &'static str,
    source: &'static str,
    ignorable: Ignorable,
    cases: Vec<KeyLines>,
) -> Check {
    let mut verdict = Verdict::Pass;
    let mut seen = Vec::new();
    for lines in cases {
        let answer = t.send(&Req::new(lines.clone(), &t.config().body)).await;
        let this = match &answer {
            Ok(a) if a.status == 400 => Verdict::Pass,
            Ok(a) if (400..500).contains(&a.status) => Verdict::Warn,
            Ok(a) if a.success() && ignorable.lets_it_run(t) => Verdict::Warn,
            _ => Verdict::Fail,
        };
        verdict = worse(verdict, this);
        let shown: Vec<String> = lines.0.iter().map(|l| shorten(l)).collect();
        seen.push(format!("{} -> {}", shown.join(" + "), show(t, &answer)));
    }
    let mut detail = seen.join("; ");
    if verdict != Verdict::Pass {
        detail.push_str(" (expected 400, nothing run");
        if ignorable.lets_it_run(t) {
            detail.push_str(
                "; RFC 8941 lets a server ignore the field on a route whose key is optional",
            );
        }
        detail.push(')');
    }
    row(id, source, verdict, detail)
}

/// Whether RFC 8941 section 4.2 lets the server ignore the value (treat
/// the field as absent: the request runs without a key) where the key is
/// optional. Our rule refuses it anyway; a run is then a warning.
#[derive(Clone, Copy)]
enum Ignorable {
    /// Not a structured-field String: ignored per RFC 8941.
    Unparsable,
    /// Parses, but breaks our stricter rule.
    Ours,
}

impl Ignorable {
    fn lets_it_run(self, t: &Target) -> bool {
        matches!(self, Ignorable::Unparsable) && !t.config().key_required
    }
}

/// One byte over the limit is refused; exactly the limit is accepted.
async fn too_long(t: &Target) -> Check {
    const ID: &str = "key.too-long";
    const SOURCE: &str = "ours (at most 255 bytes)";
    let max = t.config().max_key_bytes;
    let padded = |len: usize| {
        let mut key = fresh_key("long");
        while key.len() < len {
            key.push('k');
        }
        key.truncate(len);
        key
    };
    let over = t
        .send(&Req::new(
            KeyLines::quoted(&padded(max + 1)),
            &t.config().body,
        ))
        .await;
    let at = t
        .send(&Req::new(KeyLines::quoted(&padded(max)), &t.config().body))
        .await;
    let over_ok = matches!(&over, Ok(a) if (400..500).contains(&a.status));
    let at_ok = matches!(&at, Ok(a) if a.success());
    let verdict = if over_ok && at_ok {
        Verdict::Pass
    } else {
        Verdict::Fail
    };
    row(
        ID,
        SOURCE,
        verdict,
        format!(
            "{} bytes -> {}; {max} bytes -> {}",
            max + 1,
            show(t, &over),
            show(t, &at)
        ),
    )
}

/// A bare (unquoted) key is accepted and names the same key as its
/// quoted form.
async fn bare_token(t: &Target) -> Check {
    const ID: &str = "key.bare-token";
    const SOURCE: &str = "ours (Stripe-style bare key)";
    let key = fresh_key("bare");
    let pointer = &t.config().id_pointer;
    let bare = t
        .send(&Req::new(KeyLines::raw(key.clone()), &t.config().body))
        .await;
    let quoted = t
        .send(&Req::new(KeyLines::quoted(&key), &t.config().body))
        .await;
    let ids = (
        bare.as_ref()
            .ok()
            .filter(|a| a.success())
            .and_then(|a| a.id(pointer)),
        quoted
            .as_ref()
            .ok()
            .filter(|a| a.success())
            .and_then(|a| a.id(pointer)),
    );
    let mut verdict = match &ids {
        (Some(a), Some(b)) if a == b => Verdict::Pass,
        _ => Verdict::Fail,
    };
    let note = if verdict == Verdict::Pass {
        count_note(t, &key, 1, &mut verdict).await
    } else if ids.0.is_some() && ids.1.is_some() {
        "; the two forms ran as two keys".to_owned()
    } else {
        String::new()
    };
    row(
        ID,
        SOURCE,
        verdict,
        format!(
            "{key} -> {}; \"{key}\" -> {}{note}",
            show(t, &bare),
            show(t, &quoted)
        ),
    )
}

pub(crate) fn worse(a: Verdict, b: Verdict) -> Verdict {
    let rank = |v| match v {
        Verdict::Pass | Verdict::Skip => 0,
        Verdict::Warn => 1,
        Verdict::Fail => 2,
    };
    if rank(b) > rank(a) {
        b
    } else {
        a
    }
}

/// A field value for a detail: its text, or its length if long.
fn shorten(line: &[u8]) -> String {
    if line.len() > 48 {
        format!("<{} bytes>", line.len())
    } else {
        format!("{:?}", String::from_utf8_lossy(line))
    }
}
