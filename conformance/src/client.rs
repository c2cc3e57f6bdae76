//! Sending one request to the target and keeping its whole answer.

use std::time::Duration;

use reqwest::header::{HeaderName, HeaderValue};
use serde_json::Value;

use crate::config::Config;

/// How a request carries its `Idempotency-Key` field lines: each entry is
/// one raw field value.
#[derive(Clone, Debug)]
pub(crate) struct KeyLines(pub Vec<Vec<u8>>);

impl KeyLines {
    /// No `Idempotency-Key` header.
    pub fn none() -> KeyLines {
        KeyLines(Vec::new())
    }

    /// One line holding `key` as an RFC 8941 sf-string (`"key"`).
    pub fn quoted(key: &str) -> KeyLines {
        KeyLines::raw(format!("\"{key}\"").into_bytes())
    }

    /// One line holding these exact bytes.
    pub fn raw(value: impl Into<Vec<u8>>) -> KeyLines {
        KeyLines(vec![value.into()])
    }
}

/// One request of a check.
#[derive(Clone, Debug)]
pub(crate) struct Req {
    pub key: KeyLines,
    pub body: Value,
    /// Ask the target to stay in flight (slow header or slow path).
    pub slow: bool,
    /// Ask the target for this status (the status header).
    pub status: Option<u16>,
}

impl Req {
    pub fn new(key: KeyLines, body: &Value) -> Req {
        Req {
            key,
            body: body.clone(),
            slow: false,
            status: None,
        }
    }

    pub fn slow(mut self) -> Req {
        self.slow = true;
        self
    }

    pub fn status(mut self, status: u16) -> Req {
        self.status = Some(status);
        self
    }
}

/// A whole answer: status, every header line (lower-case names, in order),
/// body bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Answer {
    pub status: u16,
    pub headers: Vec<(String, Vec<u8>)>,
    pub body: Vec<u8>,
}

impl Answer {
    pub fn success(&self) -> bool {
        (200..300).contains(&self.status)
    }

    pub fn header(&self, name: &str) -> Option<&[u8]> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_slice())
    }

    pub fn header_values(&self, name: &str) -> Vec<&[u8]> {
        self.headers
            .iter()
            .filter(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_slice())
            .collect()
    }

    pub fn retry_after(&self) -> Option<String> {
        self.header("retry-after")
            .map(|v| String::from_utf8_lossy(v).into_owned())
    }

    /// The execution id at `pointer` in a JSON body (a string as is, any
    /// other JSON value in its JSON form).
    pub fn id(&self, pointer: &str) -> Option<String> {
        let json: Value = serde_json::from_slice(&self.body).ok()?;
        match json.pointer(pointer)? {
            Value::String(s) => Some(s.clone()),
            Value::Null => None,
            other => Some(other.to_string()),
        }
    }

    /// Whether the answer carries the replay marker.
    pub fn marked(&self, marker: &(String, Option<String>)) -> bool {
        let (name, value) = marker;
        self.header_values(name).iter().any(|v| match value {
            None => true,
            Some(want) => v.eq_ignore_ascii_case(want.as_bytes()),
        })
    }

    /// `201 id=ch_1` or `409 "problem title"`: for details.
    pub fn summary(&self, pointer: &str) -> String {
        if let Some(id) = self.id(pointer) {
            return format!("{} id={id}", self.status);
        }
        let json: Option<Value> = serde_json::from_slice(&self.body).ok();
        let text = json
            .as_ref()
            .and_then(|j| {
                j.get("title")
                    .or_else(|| j.get("error"))
                    .or(j.get("message"))
            })
            .and_then(Value::as_str)
            .map(str::to_owned)
            .unwrap_or_else(|| {
                let s = String::from_utf8_lossy(&self.body);
                if s.trim_start().starts_with('<') {
                    "(an HTML page)".to_owned()
                } else {
                    s.chars().take(60).collect()
                }
            });
        if text.is_empty() {
            self.status.to_string()
        } else {
            format!("{} {text:?}", self.status)
        }
    }
}

/// The target: one HTTP client, the endpoint and its hooks.
#[derive(Clone)]
pub(crate) struct Target {
    client: reqwest::Client,
    config: Config,
}

impl Target {
    pub fn new(config: &Config) -> Result<Target, String> {
        let client = reqwest::Client::builder()
            .timeout(config.request_timeout)
            .connect_timeout(Duration::from_secs(5))
            .build()
            .map_err(|e| format!("cannot build the HTTP client: {}", chain(&e)))?;
        Ok(Target {
            client,
            config: config.clone(),
        })
    }

    pub fn config(&self) -> &Config {
        &self.config
    }

    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.config.base.trim_end_matches('/'))
    }

    /// Sends `req`; `Err` is a transport failure (refused, reset, timeout).
    pub async fn send(&self, req: &Req) -> Result<Answer, String> {
        let path = match (&self.config.slow_path, req.slow) {
            (Some(slow), true) => slow.as_str(),
            _ => self.config.path.as_str(),
        };
        let mut builder = self
            .client
            .post(self.url(path))
            .header("content-type", "application/json")
            .body(req.body.to_string());
        for line in &req.key.0 {
            let value = HeaderValue::from_bytes(line)
                .map_err(|e| format!("the key {line:?} cannot be sent: {e}"))?;
            builder = builder.header("idempotency-key", value);
        }
        if req.slow {
            if let Some((name, value)) = &self.config.slow_header {
                builder = builder.header(header_name(name)?, value.as_str());
            }
        }
        if let (Some(status), Some(name)) = (req.status, &self.config.status_header) {
            builder = builder.header(header_name(name)?, status.to_string());
        }
        let response = builder
            .send()
            .await
            .map_err(|e| format!("POST {path}: {}", chain(&e)))?;
        let status = response.status().as_u16();
        let headers = response
            .headers()
            .iter()
            .map(|(n, v)| (n.as_str().to_owned(), v.as_bytes().to_vec()))
            .collect();
        let body = response
            .bytes()
            .await
            .map_err(|e| format!("POST {path}: reading the body: {}", chain(&e)))?
            .to_vec();
        Ok(Answer {
            status,
            headers,
            body,
        })
    }

    /// How many times the work ran for `key`, if the target offers a count.
    pub async fn executions(&self, key: &str) -> Option<Result<u64, String>> {
        let template = self.config.count_url.as_ref()?;
        let url = template.replace("{key}", &percent_encode(key));
        Some(self.count(&url).await)
    }

    async fn count(&self, url: &str) -> Result<u64, String> {
        let response = self
            .client
            .get(url)
            .send()
            .await
            .map_err(|e| format!("GET {url}: {}", chain(&e)))?;
        let status = response.status();
        let bytes = response
            .bytes()
            .await
            .map_err(|e| format!("GET {url}: {}", chain(&e)))?;
        if !status.is_success() {
            return Err(format!("GET {url}: {status}"));
        }
        let json: Value =
            serde_json::from_slice(&bytes).map_err(|e| format!("GET {url}: not JSON: {e}"))?;
        match &json {
            Value::Number(n) => n.as_u64(),
            Value::Array(a) => Some(a.len() as u64),
            Value::Object(o) => o.get("count").and_then(Value::as_u64),
            _ => None,
        }
        .ok_or_else(|| format!("GET {url}: no count in {json}"))
    }
}

fn header_name(name: &str) -> Result<HeaderName, String> {
    HeaderName::from_bytes(name.as_bytes()).map_err(|e| format!("header name {name:?}: {e}"))
}

/// A reqwest error with its causes ("error sending request: connection
/// refused").
fn chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

/// RFC 3986 percent-encoding of everything but unreserved characters.
fn percent_encode(s: &str) -> String {
    s.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
                char::from(b).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_markers_and_encoding() {
        let answer = Answer {
            status: 201,
            headers: vec![("idempotent-replayed".into(), b"true".to_vec())],
            body: br#"{"id": "ch_1", "n": {"seq": 7}}"#.to_vec(),
        };
        assert_eq!(answer.id("/id").as_deref(), Some("ch_1"));
        assert_eq!(answer.id("/n/seq").as_deref(), Some("7"));
        assert_eq!(answer.id("/missing"), None);
        assert!(answer.marked(&("Idempotent-Replayed".into(), Some("TRUE".into()))));
        assert!(!answer.marked(&("x-cache".into(), None)));
        assert_eq!(percent_encode("a b/\"c\""), "a%20b%2F%22c%22");
    }
}
