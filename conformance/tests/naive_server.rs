//! The kit against a server with no idempotency at all (every POST runs
//! and gets a new id): the duplicate, mismatch, replay and bare-key checks
//! must fail and the hook-dependent ones must be skipped, so a kit that
//! passes everything (a check that cannot fail) is caught here.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use idem_conformance::{Config, Verdict};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

type Result<T> = std::result::Result<T, Box<dyn std::error::Error + Send + Sync>>;

/// Answers every request `201 {"id": "n-N"}` with a fresh N, one request
/// per connection.
async fn naive_server() -> Result<String> {
    let listener = TcpListener::bind(("127.0.0.1", 0)).await?;
    let base = format!("http://{}", listener.local_addr()?);
    let counter = Arc::new(AtomicU64::new(0));
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let counter = counter.clone();
            tokio::spawn(async move {
                let _ = answer(stream, &counter).await;
            });
        }
    });
    Ok(base)
}

async fn answer(mut stream: TcpStream, counter: &AtomicU64) -> Result<()> {
    let mut request = Vec::new();
    let mut buf = [0u8; 4096];
    // Read the head, then as much body as Content-Length says.
    let head_end = loop {
        let n = stream.read(&mut buf).await?;
        if n == 0 {
            return Ok(());
        }
        request.extend_from_slice(&buf[..n]);
        if let Some(i) = request.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
    };
    let head = String::from_utf8_lossy(&request[..head_end]).to_ascii_lowercase();
    let length: usize = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0);
    while request.len() < head_end + length {
        let n = stream.read(&mut buf).await?;
        if n == 0 {
            break;
        }
        request.extend_from_slice(&buf[..n]);
    }
    let body = format!(
        r#"{{"id": "n-{}"}}"#,
        counter.fetch_add(1, Ordering::SeqCst)
    );
    let response = format!(
        "HTTP/1.1 201 Created\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\
         connection: close\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(response.as_bytes()).await?;
    stream.shutdown().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_without_idempotency_fails_the_core_checks() -> Result<()> {
    let base = naive_server().await?;
    let report = idem_conformance::run(&Config::new(&base)).await?;
    let table = report.table();
    let verdict = |id: &str| report.check(id).map(|c| c.verdict);
    for id in [
        "dup.concurrent",
        "dup.mismatch",
        "replay.identical",
        "replay.marked",
        "key.bare-token",
        "key.blank",
        "key.too-long",
    ] {
        assert_eq!(verdict(id), Some(Verdict::Fail), "{id}\n{table}");
    }
    // Unparsable keys on a route whose key is optional: RFC 8941 lets the
    // server ignore them, so a run is a warning, not a failure.
    assert_eq!(verdict("key.not-sf-string"), Some(Verdict::Warn), "{table}");
    assert_eq!(verdict("key.sf-string"), Some(Verdict::Pass), "{table}");
    for id in [
        "key.missing",
        "inflight.conflict",
        "classify.503-released",
        "classify.4xx-stored",
        "expiry.ttl",
        "crash.restart",
    ] {
        assert_eq!(verdict(id), Some(Verdict::Skip), "{id}\n{table}");
    }
    let concurrent = report.check("dup.concurrent").ok_or("no row")?;
    assert!(
        concurrent.detail.starts_with("8 execution ids"),
        "{}",
        concurrent.detail
    );
    Ok(())
}

#[tokio::test]
async fn an_unreachable_target_is_an_error_not_a_report() -> Result<()> {
    // A port that was free a moment ago: the first request is refused, and
    // the kit says what it needs instead of judging anything.
    let port = std::net::TcpListener::bind(("127.0.0.1", 0))?
        .local_addr()?
        .port();
    let err = idem_conformance::run(&Config::new(format!("http://127.0.0.1:{port}")))
        .await
        .err()
        .ok_or("no error")?;
    let text = err.to_string();
    assert!(text.contains("must answer 2xx"), "{text}");
    assert!(text.contains("/payments"), "{text}");
    Ok(())
}
