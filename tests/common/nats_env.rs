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

/// A stream name no other test run on this server has used: `prefix`,
/// this process's id and the time in ns. The process id alone is not
/// enough: runs against one long-lived server (a test looped by hand)
/// reuse process ids, and a stream found again under an old name holds
/// the old run's messages, consumer and deduplication window (the new
/// run's messages are then dropped as duplicates).
pub fn unique_name(prefix: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!("{prefix}{}_{nanos}", std::process::id())
}

/// A new JetStream stream named `name` (the server's defaults otherwise)
/// taking every subject under `name.`. An error if the server already
/// has a stream of that name (see [`unique_name`]).
pub async fn stream_under(
    js: &jetstream::Context,
    name: &str,
) -> Result<stream::Stream, idempotency::BoxError> {
    if js.get_stream(name).await.is_ok() {
        return Err(format!("stream {name} already exists on this server: a reused name").into());
    }
    Ok(js
        .create_stream(stream::Config {
            name: name.to_owned(),
            subjects: vec![format!("{name}.>")],
            ..Default::default()
        })
        .await?)
}

/// Publishes one message to `subject` of the server at `url` with raw
/// protocol bytes (HPUB), its `Nats-Msg-Id` header `header_value` as given
/// (bytes no client library would send: nats-server stores them).
pub fn raw_hpub(
    url: &str,
    subject: &str,
    header_value: &[u8],
    payload: &[u8],
) -> Result<(), idempotency::BoxError> {
    use std::io::{Read, Write};
    let addr = url.trim_start_matches("nats://");
    let mut sock = std::net::TcpStream::connect(addr)?;
    sock.set_read_timeout(Some(std::time::Duration::from_secs(5)))?;
    let mut info = [0_u8; 4096];
    let _ = sock.read(&mut info)?;
    let mut headers = b"NATS/1.0\r\nNats-Msg-Id: ".to_vec();
    headers.extend_from_slice(header_value);
    headers.extend_from_slice(b"\r\n\r\n");
    let mut out = b"CONNECT {\"verbose\":false,\"pedantic\":false,\"headers\":true}\r\n".to_vec();
    out.extend_from_slice(
        format!(
            "HPUB {subject} {} {}\r\n",
            headers.len(),
            headers.len() + payload.len()
        )
        .as_bytes(),
    );
    out.extend_from_slice(&headers);
    out.extend_from_slice(payload);
    out.extend_from_slice(b"\r\nPING\r\n");
    sock.write_all(&out)?;
    let mut reply = [0_u8; 512];
    let n = sock.read(&mut reply)?;
    let reply = String::from_utf8_lossy(&reply[..n]);
    if !reply.contains("PONG") {
        return Err(format!("server said: {reply}").into());
    }
    Ok(())
}
