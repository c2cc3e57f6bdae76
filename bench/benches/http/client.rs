//! The load client: `conns` HTTP/1.1 keep-alive connections (hyper 1's
//! connection API over tokio, one task per connection, each sending its
//! next request when the last answer is read), to 127.0.0.1 only.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1;
use hyper::Request;
use hyper_util::rt::TokioIo;

use super::server::PATH;

/// The request body every request carries (51 bytes of JSON).
const BODY: &str = r#"{"amount":1250,"currency":"EUR","customer":"cus_42"}"#;

/// What a slot's requests asked for.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
pub enum Workload {
    /// A fresh `Idempotency-Key` (a UUID v4) per request; one session
    /// cookie per connection.
    Unique,
    /// The same 1,000 keys over and over, completed by a warm-up first;
    /// one session cookie shared by all connections (one client), so every
    /// request is a replay for both layers.
    Replay,
}

impl Workload {
    pub fn name(self) -> &'static str {
        match self {
            Workload::Unique => "unique",
            Workload::Replay => "replay",
        }
    }
}

/// Keys of the replay workload.
pub const REPLAY_KEYS: usize = 1_000;

/// What the connections measured in one slot.
#[derive(Default)]
pub struct Load {
    /// Requests answered with the expected status (201).
    pub ok: u64,
    /// Requests answered with another status, or failed.
    pub bad: u64,
    /// The first unexpected answer, for the log.
    pub first_bad: Option<String>,
    /// Seconds from the start signal to the last answer.
    pub elapsed: f64,
    /// Latency percentiles of the good requests, µs.
    pub p50_us: u64,
    pub p99_us: u64,
}

/// A session id in the form `ruts` accepts (22 characters of base64url),
/// distinct per `n`.
pub fn session_id(n: u64) -> String {
    const B64: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    let mut x = n ^ 0x9e37_79b9_7f4a_7c15 ^ (u64::from(std::process::id()) << 32);
    let mut id = String::with_capacity(22);
    for i in 0..22 {
        if i % 10 == 0 {
            x = x
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
        }
        id.push(B64[(x >> (58 - 6 * (i % 10))) as usize & 63] as char);
    }
    // 22 base64url characters carry 132 bits; the last one must leave the
    // 4 bits past 128 zero to decode as 16 bytes.
    id.pop();
    id.push('A');
    id
}

type Sender = http1::SendRequest<Full<Bytes>>;

async fn connect(port: u16) -> Sender {
    let stream = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .expect("connect to the server");
    stream.set_nodelay(true).expect("TCP_NODELAY");
    let (sender, conn) = http1::handshake(TokioIo::new(stream))
        .await
        .expect("HTTP/1.1 handshake");
    tokio::spawn(async move {
        // Ends when the server closes the connection (at the slot's end).
        let _ = conn.await;
    });
    sender
}

/// Sends one request and reads its answer to the end; the status on
/// success.
async fn send(sender: &mut Sender, port: u16, key: &str, cookie: &str) -> Result<u16, String> {
    let req = Request::post(PATH)
        .header(hyper::header::HOST, format!("127.0.0.1:{port}"))
        .header(hyper::header::CONTENT_TYPE, "application/json")
        .header("idempotency-key", key)
        .header(hyper::header::COOKIE, cookie)
        .body(Full::new(Bytes::from_static(BODY.as_bytes())))
        .map_err(|e| e.to_string())?;
    sender.ready().await.map_err(|e| e.to_string())?;
    let res = sender.send_request(req).await.map_err(|e| e.to_string())?;
    let status = res.status().as_u16();
    let body = res.into_body().collect().await.map_err(|e| e.to_string())?;
    if status == 201 {
        Ok(status)
    } else {
        Err(format!(
            "status {status}: {}",
            String::from_utf8_lossy(&body.to_bytes())
        ))
    }
}

fn replay_key(nonce: u64, i: usize) -> String {
    format!("\"replay-{nonce}-{i}\"")
}

/// Opens `conns` connections to `port`; for [`Workload::Replay`] completes
/// the replay keys once through them (the warm-up); then, once `ready`
/// returns (the caller starts sampling there), runs the workload until
/// `secs` have passed or `max_requests` were sent.
pub async fn run(
    port: u16,
    conns: usize,
    workload: Workload,
    secs: Duration,
    max_requests: u64,
    nonce: u64,
    ready: impl FnOnce(),
) -> Load {
    let mut senders = Vec::with_capacity(conns);
    for _ in 0..conns {
        senders.push(connect(port).await);
    }
    let shared_cookie = format!("session={}", session_id(nonce));
    if workload == Workload::Replay {
        let keys: Vec<usize> = (0..REPLAY_KEYS).collect();
        let mut parts = keys.chunks(REPLAY_KEYS.div_ceil(conns));
        let mut warm = Vec::with_capacity(conns);
        for mut s in senders.drain(..) {
            let (cookie, part) = (shared_cookie.clone(), parts.next().unwrap_or(&[]).to_vec());
            warm.push(tokio::spawn(async move {
                for i in part {
                    send(&mut s, port, &replay_key(nonce, i), &cookie)
                        .await
                        .expect("warm-up request");
                }
                s
            }));
        }
        for w in warm {
            senders.push(w.await.expect("warm-up task"));
        }
    }
    ready();
    let sent = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let deadline = start + secs;
    let mut tasks = Vec::with_capacity(conns);
    for (c, mut sender) in senders.into_iter().enumerate() {
        let sent = sent.clone();
        let cookie = match workload {
            Workload::Unique => format!("session={}", session_id(nonce.wrapping_add(1 + c as u64))),
            Workload::Replay => shared_cookie.clone(),
        };
        tasks.push(tokio::spawn(async move {
            let mut lat = Vec::new();
            let (mut bad, mut first_bad) = (0u64, None);
            let mut next = c * 7919;
            while Instant::now() < deadline && sent.fetch_add(1, Ordering::Relaxed) < max_requests {
                let key = match workload {
                    Workload::Unique => format!("\"{}\"", uuid::Uuid::new_v4()),
                    Workload::Replay => {
                        next = (next + 1) % REPLAY_KEYS;
                        replay_key(nonce, next)
                    }
                };
                let t = Instant::now();
                match send(&mut sender, port, &key, &cookie).await {
                    Ok(_) => lat.push(t.elapsed().as_micros() as u64),
                    Err(e) => {
                        bad += 1;
                        first_bad.get_or_insert(e);
                        if sender.is_closed() {
                            break;
                        }
                    }
                }
            }
            (lat, bad, first_bad, Instant::now())
        }));
    }
    let mut all = Vec::new();
    let mut load = Load::default();
    let mut last = start;
    for t in tasks {
        let (lat, bad, first_bad, end) = t.await.expect("client task");
        all.extend(lat);
        load.bad += bad;
        if load.first_bad.is_none() {
            load.first_bad = first_bad;
        }
        last = last.max(end);
    }
    load.ok = all.len() as u64;
    load.elapsed = (last - start).as_secs_f64();
    (load.p50_us, load.p99_us) = percentiles(&mut all);
    load
}

/// p50 and p99 of `v` (sorted in place); zeros if empty.
pub fn percentiles(v: &mut [u64]) -> (u64, u64) {
    if v.is_empty() {
        return (0, 0);
    }
    v.sort_unstable();
    let at = |q: f64| v[((v.len() - 1) as f64 * q).round() as usize];
    (at(0.5), at(0.99))
}
