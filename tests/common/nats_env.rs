//! The NATS server the broker tests use: `IDEMPOTENCY_TEST_NATS`, set by
//! `scripts/with-nats` (and `scripts/with-services`).

#![allow(dead_code)] // each test file uses what it needs

use idempotency::nats::async_nats::jetstream::{self, stream};

/// The variable that names the server's URL.
pub const NATS_ENV: &str = "IDEMPOTENCY_TEST_NATS";

/// The server's URL; `None` (the test is skipped, and says so) without
/// one.
///
/// # Panics
///
/// Without a URL under `CI=true`: there the NATS tests must run, not be
/// skipped.
pub fn nats_url() -> Option<String> {
    match std::env::var(NATS_ENV) {
        Ok(url) if !url.trim().is_empty() => Some(url),
        _ if std::env::var("CI").as_deref() == Ok("true") => panic!(
            "{NATS_ENV} not set and CI=true: the NATS tests must run, not be skipped \
             (run them through scripts/with-nats)"
        ),
        _ => {
            eprintln!("skipped: {NATS_ENV} not set (run through scripts/with-nats)");
            None
        }
    }
}

/// A JetStream stream named `name` (the server's defaults otherwise)
/// taking every subject under `name.`.
pub async fn stream_under(
    js: &jetstream::Context,
    name: &str,
) -> Result<stream::Stream, idempotency::BoxError> {
    Ok(js
        .create_stream(stream::Config {
            name: name.to_owned(),
            subjects: vec![format!("{name}.>")],
            ..Default::default()
        })
        .await?)
}
