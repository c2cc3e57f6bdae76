//! Before `begin`: is the request ours, under which scoped key, and what
//! is its fingerprint.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;
use std::time::Duration;

use bytes::Bytes;
use http::header::{CONTENT_LENGTH, CONTENT_TYPE, COOKIE};
use http::request::Parts;
use http::{HeaderMap, StatusCode};
use http_body::Body;
use http_body_util::{BodyExt, LengthLimitError, Limited};

use super::config::Config;
use super::problem::ProblemDetails;
use super::route::BodyMode;
use super::{header, Caller, CallerKind, Route, IDEMPOTENCY_KEY};
use crate::{canonical, BoxError, Fingerprint, IdempotencyKey};

/// blake3 `derive_key` context of the caller digest in the scope.
const CALLER_CONTEXT: &str = "idempotency http caller v1";
/// blake3 `derive_key` context of the digest of a scope too long to keep.
const LONG_SCOPE_CONTEXT: &str = "idempotency http long scope v1";
/// blake3 `derive_key` context of the per-pointer digests.
const POINTER_CONTEXT: &str = "idempotency http pointer digest v1";

/// A request the layer claims a key for.
pub(crate) struct Admitted {
    pub(crate) key: IdempotencyKey,
    /// The matched route's pattern, or `""`: where duration estimates go.
    pub(crate) route: String,
    pub(crate) lease: Option<Duration>,
    pub(crate) wait: Option<Duration>,
    pub(crate) job: FingerprintJob,
}

/// What the checks on the request head decided.
pub(crate) enum Head<'c> {
    /// Not ours: pass the request through.
    Pass,
    /// Ours: read the body, then fingerprint it. `route` is borrowed from
    /// the layer's settings (no per-request copy).
    Claim {
        key: IdempotencyKey,
        route: Option<&'c Route>,
    },
}

/// Decides, from the head alone, whether the request is ours and under
/// which key.
pub(crate) fn check_head<'c>(cfg: &'c Config, parts: &Parts) -> Result<Head<'c>, ProblemDetails> {
    if !cfg.methods.contains(&parts.method) {
        return Ok(Head::Pass);
    }
    let path = parts.uri.path();
    let route = cfg.routes.iter().find(|r| r.matches(path));
    let required = route.and_then(|r| r.require_key).unwrap_or(cfg.require_key);
    if route.is_none() && !cfg.routes.is_empty() {
        cfg.unmatched.warn(&parts.method, path, required);
    }
    let client_key = match header::parse_key(&parts.headers.get_all(&IDEMPOTENCY_KEY)) {
        Ok(Some(key)) => key,
        Ok(None) if !required => return Ok(Head::Pass),
        Ok(None) => {
            return Err(ProblemDetails::new(
                StatusCode::BAD_REQUEST,
                "missing-key",
                "Idempotency-Key required",
                format!("{} {path} requires an Idempotency-Key header", parts.method),
            ))
        }
        Err(detail) => {
            return Err(ProblemDetails::new(
                StatusCode::BAD_REQUEST,
                "malformed-key",
                "Malformed Idempotency-Key",
                detail,
            ))
        }
    };
    let route_path = route.map_or(path, Route::pattern);
    let scope = match &cfg.scope {
        Some(scope) => scope(parts, route_path),
        None => default_scope(cfg, parts, route_path)?,
    };
    let key = IdempotencyKey::new(scope, client_key).map_err(|e| {
        ProblemDetails::new(
            StatusCode::BAD_REQUEST,
            "invalid-scope",
            "Invalid idempotency scope",
            e.to_string(),
        )
    })?;
    Ok(Head::Claim { key, route })
}

/// Reads the body and prepares its fingerprint (computed later, off the
/// async workers).
pub(crate) async fn admit<B>(
    cfg: &Config,
    parts: &Parts,
    key: IdempotencyKey,
    route: Option<&Route>,
    body: B,
) -> Result<Admitted, ProblemDetails>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    let body = read_body(
        &parts.headers,
        body,
        cfg.max_body_bytes,
        cfg.body_read_timeout,
    )
    .await?;
    let json = match route.map_or(&BodyMode::Auto, |r| &r.body) {
        BodyMode::Json(pointers) => Some(pointers.clone()),
        BodyMode::Auto if is_json(&parts.headers) => Some(Vec::new()),
        BodyMode::Auto | BodyMode::Raw => None,
    };
    Ok(Admitted {
        key,
        route: route.map_or_else(String::new, |r| r.pattern.clone()),
        lease: route.and_then(|r| r.lease),
        wait: route.and_then(|r| r.wait),
        job: FingerprintJob {
            method: parts.method.as_str().to_owned(),
            path: parts.uri.path().to_owned(),
            query: parts.uri.query().unwrap_or("").to_owned(),
            json,
            body,
        },
    })
}

fn default_scope(cfg: &Config, parts: &Parts, route: &str) -> Result<String, ProblemDetails> {
    let mut scope = format!("{} {route}", parts.method);
    if let Some(name) = &cfg.tenant_header {
        let mut values = parts.headers.get_all(name).iter();
        if let Some(value) = values.next() {
            let invalid = |detail: String| {
                ProblemDetails::new(
                    StatusCode::BAD_REQUEST,
                    "invalid-scope",
                    "Invalid idempotency scope",
                    detail,
                )
            };
            if values.next().is_some() {
                return Err(invalid(format!("the {name} header must appear once")));
            }
            let tenant = value
                .to_str()
                .map_err(|_| invalid(format!("the {name} header must be visible ASCII")))?;
            // The scope's parts are separated by spaces: the route is a URI
            // path (no spaces), and the tenant is escaped so that no header
            // value can spell another part (` caller=…`) or another scope.
            scope.push_str(" tenant=");
            for c in tenant.chars() {
                match c {
                    '%' => scope.push_str("%25"),
                    ' ' => scope.push_str("%20"),
                    c => scope.push(c),
                }
            }
        }
    }
    if let Some(caller) = caller_digest(&cfg.caller, cfg.caller_key.as_ref(), parts) {
        scope.push_str(" caller=");
        scope.push_str(&caller);
    }
    Ok(fit_scope(&parts.method, scope))
}

/// A scope too long for a key's scope (a long request path on a route no
/// `Route` matches, a long tenant value) becomes the method and a digest of
/// the whole scope, so the request is served rather than refused; a scope
/// that fits is kept as it is.
fn fit_scope(method: &http::Method, scope: String) -> String {
    static LONG: OnceLock<blake3::Hasher> = OnceLock::new();
    if scope.len() <= crate::MAX_KEY_BYTES {
        return scope;
    }
    let mut hasher = LONG
        .get_or_init(|| blake3::Hasher::new_derive_key(LONG_SCOPE_CONTEXT))
        .clone();
    hasher.update(scope.as_bytes());
    format!("{method} #{}", hex(&hasher.finalize().as_bytes()[..16]))
}

/// The caller's identity as 32 hex digits (a keyed blake3 digest), or
/// `None` for the anonymous caller or shared keys.
fn caller_digest(caller: &Caller, secret: Option<&[u8; 32]>, parts: &Parts) -> Option<String> {
    static CONTEXT: OnceLock<blake3::Hasher> = OnceLock::new();
    let mut hasher = match secret {
        Some(key) => blake3::Hasher::new_keyed(key),
        // Derived once: a fresh hasher, cloned, is the same hasher.
        None => CONTEXT
            .get_or_init(|| blake3::Hasher::new_derive_key(CALLER_CONTEXT))
            .clone(),
    };
    let mut any = false;
    let put = |hasher: &mut blake3::Hasher, bytes: &[u8]| {
        hasher.update(&(bytes.len() as u64).to_le_bytes());
        hasher.update(bytes);
    };
    match &caller.0 {
        CallerKind::Shared => return None,
        CallerKind::Custom(f) => {
            put(&mut hasher, b"custom");
            put(&mut hasher, f(parts)?.as_bytes());
            any = true;
        }
        CallerKind::Credentials { headers, cookies } => {
            // Headers hash as before cookies existed here (name, value), so
            // an `Authorization` caller's scope is unchanged.
            for name in headers {
                for value in parts.headers.get_all(name) {
                    put(&mut hasher, name.as_str().as_bytes());
                    put(&mut hasher, value.as_bytes());
                    any = true;
                }
            }
            for name in cookies {
                for value in cookie_values(&parts.headers, name) {
                    // A marker no header name can spell (':' is not a
                    // token character), so a cookie never hashes like a
                    // header.
                    put(&mut hasher, b"cookie:");
                    put(&mut hasher, name.as_bytes());
                    put(&mut hasher, value);
                    any = true;
                }
            }
            if !any && cookies.is_empty() && parts.headers.contains_key(COOKIE) {
                warn_cookies_ignored();
            }
        }
    }
    any.then(|| hex(&hasher.finalize().as_bytes()[..16]))
}

/// The values of the cookie `name` in the request's `Cookie` headers, in
/// order (RFC 6265 section 5.4: `name=value` pairs separated by `;`; the
/// name compared exactly, the value taken as sent).
fn cookie_values<'a>(headers: &'a HeaderMap, name: &'a str) -> impl Iterator<Item = &'a [u8]> {
    headers
        .get_all(COOKIE)
        .iter()
        .flat_map(|v| v.as_bytes().split(|&b| b == b';'))
        .filter_map(move |pair| {
            let pair = pair.trim_ascii();
            let eq = pair.iter().position(|&b| b == b'=')?;
            let (n, v) = pair.split_at(eq);
            (n.trim_ascii() == name.as_bytes()).then(|| v[1..].trim_ascii())
        })
}

/// Logs, once per process, that a request's cookies were not used to tell
/// callers apart: a cookie-session app on the default caller scopes all its
/// users as one anonymous caller.
fn warn_cookies_ignored() {
    static WARNED: AtomicBool = AtomicBool::new(false);
    if !WARNED.swap(true, Ordering::Relaxed) {
        tracing::warn!(
            "a request with an Idempotency-Key carries cookies but none of the credentials the \
             caller scope reads (by default Authorization): it is scoped as the anonymous caller, \
             whose keys every such request shares. If cookies identify your users, name the \
             session cookie with Caller::cookies or use Caller::from_fn (logged once)"
        );
    }
}

fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        s.push(char::from(DIGITS[usize::from(b >> 4)]));
        s.push(char::from(DIGITS[usize::from(b & 0x0f)]));
    }
    s
}

async fn read_body<B>(
    headers: &HeaderMap,
    body: B,
    limit: usize,
    timeout: std::time::Duration,
) -> Result<Bytes, ProblemDetails>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    let too_large = |what: String| {
        ProblemDetails::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "body-too-large",
            "Request body too large",
            format!("{what}; at most {limit} bytes are accepted"),
        )
    };
    let declared = headers
        .get(CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if let Some(len) = declared {
        if len > limit as u64 {
            return Err(too_large(format!("the body is {len} bytes")));
        }
    }
    let read = tokio::time::timeout(timeout, Limited::new(body, limit).collect()).await;
    let Ok(read) = read else {
        tracing::info!(?timeout, "request body did not arrive in time");
        return Err(ProblemDetails::new(
            StatusCode::REQUEST_TIMEOUT,
            "body-timeout",
            "Request body not received in time",
            format!(
                "the request body did not fully arrive within {} ms; nothing was stored",
                timeout.as_millis()
            ),
        ));
    };
    match read {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(e) if e.downcast_ref::<LengthLimitError>().is_some() => {
            Err(too_large("the body is larger".into()))
        }
        Err(e) => {
            tracing::info!(error = %e, "request body could not be read");
            Err(ProblemDetails::new(
                StatusCode::BAD_REQUEST,
                "unreadable-body",
                "Unreadable request body",
                "the request body could not be read",
            ))
        }
    }
}

/// The inputs of a request's fingerprint, owned so that a large one can be
/// computed on the blocking pool: canonicalizing a large JSON body takes
/// long enough to stall an async worker.
pub(crate) struct FingerprintJob {
    method: String,
    path: String,
    query: String,
    /// `Some(pointers)`: the body is JSON (whole document if empty).
    json: Option<Vec<String>>,
    pub(crate) body: Bytes,
}

/// A computed fingerprint, with per-pointer digests on pointer routes.
pub(crate) struct Fingerprinted {
    pub(crate) fingerprint: Fingerprint,
    /// `(pointer, digest)`, sorted by pointer.
    pub(crate) digests: Option<Vec<(String, String)>>,
}

/// Bodies from this size on (bytes) are fingerprinted on the blocking
/// pool; smaller ones on the async worker that read them. Canonicalizing
/// 64 KiB of JSON takes a few hundred microseconds, hashing 64 KiB of raw
/// bytes a few tens: a worker can afford that, and saves a thread handoff
/// (most request bodies are under 1 KiB).
pub(crate) const INLINE_FINGERPRINT_BYTES: usize = 64 * 1024;

impl FingerprintJob {
    /// Whether this job is fingerprinted on the async worker (a body under
    /// [`INLINE_FINGERPRINT_BYTES`]).
    pub(crate) fn runs_inline(&self) -> bool {
        self.body.len() < INLINE_FINGERPRINT_BYTES
    }

    /// Whether this job needs one of the layer's fingerprinting permits (a
    /// JSON body not fingerprinted inline).
    pub(crate) fn is_heavy(&self) -> bool {
        self.json.is_some() && !self.runs_inline()
    }

    /// Computes the fingerprint (blocking work).
    ///
    /// An empty body is an absent body: fingerprinted as empty bytes
    /// whatever the content type or route, never refused.
    pub(crate) fn run(&self) -> Result<Fingerprinted, ProblemDetails> {
        let builder = Fingerprint::builder()
            .part("method", self.method.as_bytes())
            .part("path", self.path.as_bytes())
            .part("query", self.query.as_bytes());
        let pointers = match &self.json {
            Some(pointers) if !self.body.is_empty() => pointers,
            _ => {
                return Ok(Fingerprinted {
                    fingerprint: builder.part("body", &self.body).finish(),
                    digests: None,
                })
            }
        };
        let invalid = |e: &dyn std::fmt::Display| {
            ProblemDetails::new(
                StatusCode::BAD_REQUEST,
                "invalid-body",
                "Request body is not valid JSON",
                format!("the request body is not valid JSON: {e}"),
            )
        };
        if pointers.is_empty() {
            let fingerprint = builder
                .json("body", &self.body, &[])
                .map_err(|e| invalid(&e))?
                .finish();
            return Ok(Fingerprinted {
                fingerprint,
                digests: None,
            });
        }
        // A pointer route: the body is parsed once, for the fingerprint and
        // the per-pointer digests both.
        let refs: Vec<&str> = pointers.iter().map(String::as_str).collect();
        for pointer in &refs {
            canonical::validate_pointer(pointer)
                .map_err(|e| invalid(&crate::FingerprintError::from(e)))?;
        }
        let value =
            canonical::parse(&self.body).map_err(|e| invalid(&crate::FingerprintError::from(e)))?;
        let fingerprint = builder
            .json_pointers_of("body", &value, &refs)
            .map_err(|e| invalid(&e))?
            .finish();
        let digests = pointer_digests_of(&value, pointers).map_err(|e| invalid(&e))?;
        Ok(Fingerprinted {
            fingerprint,
            digests: Some(digests),
        })
    }
}

/// One short digest (64 bits, hex) of each pointer's canonical value, or
/// of its absence.
#[cfg(test)]
fn pointer_digests(
    body: &[u8],
    pointers: &[String],
) -> Result<Vec<(String, String)>, canonical::CanonicalError> {
    pointer_digests_of(&canonical::parse(body)?, pointers)
}

/// [`pointer_digests`] of a parsed body.
fn pointer_digests_of(
    value: &canonical::JsonValue,
    pointers: &[String],
) -> Result<Vec<(String, String)>, canonical::CanonicalError> {
    static POINTERS: OnceLock<blake3::Hasher> = OnceLock::new();
    let mut out = Vec::with_capacity(pointers.len());
    let mut canonical = Vec::new();
    for pointer in pointers {
        let mut hasher = POINTERS
            .get_or_init(|| blake3::Hasher::new_derive_key(POINTER_CONTEXT))
            .clone();
        match canonical::resolve(value, pointer)? {
            None => {
                hasher.update(&[0]);
            }
            Some(selected) => {
                canonical.clear();
                selected.write_canonical(&mut canonical);
                hasher.update(&[1]);
                hasher.update(&canonical);
            }
        }
        out.push((pointer.clone(), hex(&hasher.finalize().as_bytes()[..8])));
    }
    out.sort();
    out.dedup();
    Ok(out)
}

/// The pointers whose digests differ between the stored request's
/// (`stored`, the envelope header's JSON) and this one's; pointers missing
/// on either side are skipped.
pub(crate) fn differing_pointers(
    stored: &[u8],
    current: &[(String, String)],
) -> Option<Vec<String>> {
    let stored: Vec<(String, String)> = serde_json::from_slice(stored).ok()?;
    Some(
        current
            .iter()
            .filter(|(p, d)| stored.iter().any(|(sp, sd)| sp == p && sd != d))
            .map(|(p, _)| p.clone())
            .collect(),
    )
}

/// `application/json` or any `*/*+json` media type.
pub(crate) fn is_json(headers: &HeaderMap) -> bool {
    let Some(value) = headers.get(CONTENT_TYPE).and_then(|v| v.to_str().ok()) else {
        return false;
    };
    let essence = value.split(';').next().unwrap_or("").trim();
    essence.eq_ignore_ascii_case("application/json")
        || essence
            .get(essence.len().saturating_sub(5)..)
            .is_some_and(|tail| tail.eq_ignore_ascii_case("+json"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::header::HeaderValue;

    #[test]
    fn json_content_types() {
        let mut h = HeaderMap::new();
        assert!(!is_json(&h));
        for (ct, want) in [
            ("application/json", true),
            ("Application/JSON; charset=utf-8", true),
            ("application/merge-patch+json", true),
            ("text/plain", false),
            ("json", false),
        ] {
            h.insert(CONTENT_TYPE, HeaderValue::from_static(ct));
            assert_eq!(is_json(&h), want, "{ct}");
        }
    }

    #[test]
    fn caller_digest_depends_on_credentials_and_secret() {
        let parts = |auth: &'static str| {
            let (parts, ()) = http::Request::post("/p")
                .header("authorization", auth)
                .body(())
                .expect("valid request")
                .into_parts();
            parts
        };
        let caller = Caller::default();
        let a = caller_digest(&caller, None, &parts("Basic YTpi"));
        let b = caller_digest(&caller, None, &parts("Basic YTpj"));
        let keyed = caller_digest(&caller, Some(&[7; 32]), &parts("Basic YTpi"));
        assert!(a.is_some() && a != b && a != keyed);
        assert_eq!(a.as_ref().map(String::len), Some(32));
        assert_eq!(
            caller_digest(&Caller::shared(), None, &parts("Basic YTpi")),
            None
        );
        let (anonymous, ()) = http::Request::post("/p")
            .body(())
            .expect("valid")
            .into_parts();
        assert_eq!(caller_digest(&caller, None, &anonymous), None);
    }

    fn with_cookies(auth: Option<&'static str>, cookies: &[&'static str]) -> Parts {
        let mut req = http::Request::post("/p");
        if let Some(auth) = auth {
            req = req.header("authorization", auth);
        }
        for c in cookies {
            req = req.header("cookie", *c);
        }
        let (parts, ()) = req.body(()).expect("valid request").into_parts();
        parts
    }

    #[test]
    fn cookies_count_only_by_name() {
        let parts = with_cookies(None, &["a=1; session = s1 ;lb=x", "session=s2; x"]);
        let values: Vec<&[u8]> = cookie_values(&parts.headers, "session").collect();
        assert_eq!(values, [&b"s1"[..], b"s2"]);
        assert_eq!(cookie_values(&parts.headers, "Session").count(), 0);

        let by_session = Caller::cookies(["session"]);
        let one = caller_digest(&by_session, None, &with_cookies(None, &["session=s1"]));
        let more = caller_digest(
            &by_session,
            None,
            &with_cookies(None, &["session=s1; lb=xyz", "_ga=1"]),
        );
        let other = caller_digest(&by_session, None, &with_cookies(None, &["session=s2"]));
        assert!(one.is_some());
        assert_eq!(one, more, "an extra cookie is the same caller");
        assert_ne!(one, other, "another session is another caller");
        assert_eq!(
            caller_digest(&by_session, None, &with_cookies(None, &["lb=xyz"])),
            None
        );
    }

    #[test]
    fn the_default_caller_is_the_authorization_header_alone() {
        let caller = Caller::default();
        let bare = caller_digest(&caller, None, &with_cookies(Some("Bearer t"), &[]));
        let jar = caller_digest(&caller, None, &with_cookies(Some("Bearer t"), &["lb=1"]));
        assert!(bare.is_some());
        assert_eq!(bare, jar);
        // A cookie and a header of the same name and value never hash alike.
        let header = Caller::headers([http::header::HeaderName::from_static("session")]);
        let (parts, ()) = http::Request::post("/p")
            .header("session", "s1")
            .header("cookie", "session=s1")
            .body(())
            .expect("valid")
            .into_parts();
        assert_ne!(
            caller_digest(&header, None, &parts),
            caller_digest(&Caller::cookies(["session"]), None, &parts)
        );
    }

    #[test]
    fn differing_pointers_names_only_changed_ones() {
        let a = pointer_digests(
            br#"{"amount":1,"currency":"EUR"}"#,
            &["/amount".into(), "/currency".into()],
        )
        .expect("valid");
        let b = pointer_digests(
            br#"{"amount":2,"currency":"EUR"}"#,
            &["/amount".into(), "/currency".into()],
        )
        .expect("valid");
        let stored = serde_json::to_vec(&a).expect("serializable");
        assert_eq!(
            differing_pointers(&stored, &b),
            Some(vec!["/amount".to_string()])
        );
        assert_eq!(differing_pointers(&stored, &a), Some(vec![]));
        assert_eq!(differing_pointers(b"not json", &a), None);
    }
}
