//! What the kit is pointed at, and what the target offers it.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;

/// The target and its test hooks. [`Config::new`] gives the defaults, which
/// fit the payments demo's `POST /payments`.
///
/// ## Defaults
///
/// | field | default |
/// |---|---|
/// | `path` | `/payments` |
/// | `body` | `{"amount": 1000, "currency": "EUR", "customer": "cus_conformance"}` |
/// | `other_body` | `body` with its first numeric member plus one |
/// | `id_pointer` | `/id` (RFC 6901 JSON Pointer) |
/// | `replay_header` | `Idempotent-Replayed: true` |
/// | `key_required` | `false` (a target that runs keyless requests is not failed) |
/// | `max_key_bytes` | 255 |
/// | `concurrency` | 8 |
/// | `slow_header`, `slow_path`, `status_header`, `count_url`, `ttl`, `restart` | none (their checks are skipped) |
/// | `request_timeout` | 10 s |
#[derive(Clone)]
pub struct Config {
    /// The server, e.g. `http://127.0.0.1:8080`.
    pub base: String,
    /// The route under test, appended to `base`.
    pub path: String,
    /// The JSON body of a normal request.
    pub body: Value,
    /// A body the target must treat as a different request (same key,
    /// different payload).
    pub other_body: Option<Value>,
    /// Where a 2xx answer's body holds the id the server generated for this
    /// execution: two executions never share one.
    pub id_pointer: String,
    /// The header (and value, if any) that marks a replayed answer; `None`:
    /// the target marks none, and the marker check is skipped.
    pub replay_header: Option<(String, Option<String>)>,
    /// The route documents the key as required (a keyless request must be
    /// refused).
    pub key_required: bool,
    /// The longest key the target accepts, in bytes.
    pub max_key_bytes: usize,
    /// How many duplicates are sent at once.
    pub concurrency: usize,
    /// A request header that makes the request stay in flight for at least
    /// a second after it started its work (name, value).
    pub slow_header: Option<(String, String)>,
    /// A path that behaves as `path` but stays in flight for at least a
    /// second (used instead of `path` for slow requests).
    pub slow_path: Option<String>,
    /// A request header whose value, a status from 400 to 599, the target
    /// answers at once without doing the work (a 503 with `Retry-After`).
    pub status_header: Option<String>,
    /// A URL template answering how many times the work ran for a key:
    /// `{key}` is replaced by the key; the answer is JSON, a number, an
    /// array (its length) or an object with a numeric `count`.
    pub count_url: Option<String>,
    /// The server's advertised TTL for a completed key.
    pub ttl: Option<Duration>,
    /// Kills and restarts the server (for the crash check).
    pub restart: Option<Restart>,
    /// Response headers left out of the byte-identical replay comparison,
    /// beside `Date`, `Connection`, `Keep-Alive`, `Transfer-Encoding`,
    /// `Set-Cookie` and the replay header (lower-case names).
    pub ignore_headers: Vec<String>,
    /// The longest any single request may take.
    pub request_timeout: Duration,
}

impl Config {
    /// A config for `base` with the defaults above.
    pub fn new(base: impl Into<String>) -> Config {
        Config {
            base: base.into(),
            path: "/payments".into(),
            body: serde_json::json!({
                "amount": 1000,
                "currency": "EUR",
                "customer": "cus_conformance",
            }),
            other_body: None,
            id_pointer: "/id".into(),
            replay_header: Some(("idempotent-replayed".into(), Some("true".into()))),
            key_required: false,
            max_key_bytes: 255,
            concurrency: 8,
            slow_header: None,
            slow_path: None,
            status_header: None,
            count_url: None,
            ttl: None,
            restart: None,
            ignore_headers: Vec::new(),
            request_timeout: Duration::from_secs(10),
        }
    }

    /// Whether the target offers a slow request.
    pub(crate) fn has_slow(&self) -> bool {
        self.slow_header.is_some() || self.slow_path.is_some()
    }

    /// `other_body`, or `body` with its first numeric member plus one (or,
    /// with none, its first string member with `-other` appended).
    pub(crate) fn different_body(&self) -> Option<Value> {
        if let Some(other) = &self.other_body {
            return Some(other.clone());
        }
        let mut body = self.body.clone();
        let map = body.as_object_mut()?;
        if let Some(v) = map.values_mut().find(|v| v.is_number()) {
            *v = match (v.as_u64(), v.as_i64(), v.as_f64()) {
                (Some(n), _, _) => Value::from(n.wrapping_add(1)),
                (_, Some(n), _) => Value::from(n.wrapping_add(1)),
                (_, _, Some(f)) => Value::from(f + 1.0),
                _ => return None,
            };
            return Some(body);
        }
        let v = map.values_mut().find(|v| v.is_string())?;
        *v = Value::from(format!("{}-other", v.as_str().unwrap_or_default()));
        Some(body)
    }
}

type RestartFn = dyn Fn() -> Pin<Box<dyn Future<Output = Result<(), String>> + Send>> + Send + Sync;

/// Kills the server and starts it again. It should return once the server
/// accepts connections again; the kit keeps retrying (connection refused
/// included) for up to 30 s after it returns.
#[derive(Clone)]
pub struct Restart(Arc<RestartFn>);

impl Restart {
    /// Runs `sh -c CMD` and waits for it (at most 60 s); a non-zero exit is
    /// an error.
    pub fn command(cmd: impl Into<String>) -> Restart {
        let cmd = cmd.into();
        Restart::from_fn(move || {
            let cmd = cmd.clone();
            async move {
                let status = tokio::time::timeout(
                    Duration::from_secs(60),
                    tokio::process::Command::new("sh")
                        .arg("-c")
                        .arg(&cmd)
                        .status(),
                )
                .await
                .map_err(|_| format!("--restart-cmd {cmd:?} ran over 60 s"))?
                .map_err(|e| format!("--restart-cmd {cmd:?} could not run: {e}"))?;
                if status.success() {
                    Ok(())
                } else {
                    Err(format!("--restart-cmd {cmd:?} exited with {status}"))
                }
            }
        })
    }

    /// A restart done by the caller's own code (a test that owns the
    /// server process).
    pub fn from_fn<F, Fut>(f: F) -> Restart
    where
        F: Fn() -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<(), String>> + Send + 'static,
    {
        Restart(Arc::new(move || Box::pin(f())))
    }

    pub(crate) async fn run(&self) -> Result<(), String> {
        (self.0)().await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_different_body_changes_the_first_number() {
        let config = Config::new("http://127.0.0.1:1");
        let other = config.different_body();
        assert_eq!(
            other,
            Some(serde_json::json!({
                "amount": 1001, "currency": "EUR", "customer": "cus_conformance"
            }))
        );
        let mut config = Config::new("http://127.0.0.1:1");
        config.body = serde_json::json!({"name": "x"});
        assert_eq!(
            config.different_body(),
            Some(serde_json::json!({"name": "x-other"}))
        );
        config.body = serde_json::json!([1, 2]);
        assert_eq!(config.different_body(), None);
    }
}
