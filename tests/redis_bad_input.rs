//! Bad Redis input at open, end to end: guards against an engine that
//! opens on a server that would lose acknowledged outcomes (`appendonly
//! no`, `appendfsync everysec`) without the explicit `allow_volatile`
//! opt-in, that talks to a cluster, a server that is not Redis, or one that
//! refuses scripts, that hangs on a silent server, or whose error for a
//! malformed URL or a wrong password shows the password; and against
//! `verify` missing keys that something else wrote under the prefix.
//!
//! Each case starts its own `redis-server` (Debian's package) on a free
//! loopback port in a temp dir; skipped without the binary (a failure under
//! `CI=true`). The foreign-key case uses `IDEMPOTENCY_TEST_REDIS`.

mod common;

// Declared once at the test binary's root (tests/services/main.rs): its
// table and key prefixes are unique through one counter per process.
use crate::harness;

use std::io::{Read, Write};
use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use harness::{Backend, Harness, TestResult};
use idempotency::{Damage, Engine, OpenError};

const PASSWORD: &str = "Hunter2-redis-secret";

/// A throwaway `redis-server`, killed (it is our own child) on drop.
struct Server {
    child: Child,
    port: u16,
    _dir: tempfile::TempDir,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_port() -> Result<u16, Box<dyn std::error::Error + Send + Sync>> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// A free port whose cluster bus port (the port + 10000, which a server in
/// cluster mode also binds, or exits) is free and below 65536 too: an
/// ephemeral port above 55535 made the cluster-mode server exit right
/// after it accepted the test's connection.
fn free_cluster_port() -> Result<u16, Box<dyn std::error::Error + Send + Sync>> {
    for _ in 0..1_000 {
        let port = free_port()?;
        let Some(bus) = port.checked_add(10_000) else {
            continue;
        };
        if TcpListener::bind(("127.0.0.1", bus)).is_ok() {
            return Ok(port);
        }
    }
    Err("no free port pair for a cluster-mode redis-server".into())
}

/// Starts `redis-server` with `args`; `None` (skip) without the binary.
fn server(args: &[&str]) -> Result<Option<Server>, Box<dyn std::error::Error + Send + Sync>> {
    if Command::new("redis-server")
        .arg("--version")
        .output()
        .is_err()
    {
        if std::env::var("CI").as_deref() == Ok("true") {
            return Err("redis-server is not installed and CI=true".into());
        }
        eprintln!("skipped: redis-server is not installed");
        return Ok(None);
    }
    let dir = tempfile::tempdir()?;
    let port = if args.contains(&"--cluster-enabled") {
        free_cluster_port()?
    } else {
        free_port()?
    };
    let child = Command::new("redis-server")
        .args([
            "--port",
            &port.to_string(),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
        ])
        .arg("--dir")
        .arg(dir.path())
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()?;
    let server = Server {
        child,
        port,
        _dir: dir,
    };
    let until = Instant::now() + Duration::from_secs(10);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        if Instant::now() > until {
            return Err("redis-server did not start".into());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(Some(server))
}

const DURABLE: &[&str] = &["--appendonly", "yes", "--appendfsync", "always"];

fn open(url: &str) -> Result<Engine, OpenError> {
    Engine::builder()
        .sweep_interval(None)
        .redis_connect_timeout(Duration::from_secs(2))
        .redis_command_timeout(Duration::from_secs(2))
        .open_redis(url)
}

/// The error's text, Debug form and source chain.
fn everything(e: &OpenError) -> String {
    let mut all = format!("{e} {e:?}");
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        all.push_str(&format!(" {s} {s:?}"));
        source = s.source();
    }
    all
}

#[test]
fn a_volatile_server_is_refused_unless_allowed() -> TestResult {
    for (args, setting) in [
        (&["--appendonly", "no"][..], "appendonly"),
        (
            &["--appendonly", "yes", "--appendfsync", "everysec"][..],
            "appendfsync",
        ),
    ] {
        let Some(s) = server(args)? else {
            return Ok(());
        };
        let url = format!("redis://127.0.0.1:{}/", s.port);
        let err = open(&url)
            .err()
            .ok_or("a volatile server must be refused")?;
        assert!(
            matches!(&err, OpenError::RedisNotDurable { setting: got, .. } if *got == setting),
            "{err:?}"
        );
        let text = err.to_string();
        assert!(
            text.contains("allow_volatile") && text.contains("CONFIG SET"),
            "{text}"
        );
        // Nothing was written before the refusal.
        let keys: Vec<String> = redis::cmd("KEYS")
            .arg("*")
            .query(&mut redis::Client::open(url.as_str())?.get_connection()?)?;
        assert!(keys.is_empty(), "{keys:?}");
        // The explicit opt-in opens it.
        let engine = Engine::builder()
            .sweep_interval(None)
            .allow_volatile(true)
            .open_redis(&url)?;
        assert!(engine.verify()?.is_sound());
    }
    Ok(())
}

#[test]
fn a_durable_server_opens_and_works() -> TestResult {
    let Some(s) = server(DURABLE)? else {
        return Ok(());
    };
    let engine = open(&format!("redis://127.0.0.1:{}/", s.port))?;
    let key = idempotency::IdempotencyKey::new("bad-input", "k")?;
    let fp = idempotency::Fingerprint::of_json(b"{}", &[])?;
    let idempotency::Begin::Claimed(claim) = engine.begin(&key, fp)? else {
        return Err("a fresh key must be claimed".into());
    };
    engine.complete(claim, idempotency::Envelope::new(1, 200, "ok"))?;
    assert!(matches!(
        engine.begin(&key, fp)?,
        idempotency::Begin::Replay(_)
    ));
    Ok(())
}

#[test]
fn a_wrong_password_says_so_without_the_password() -> TestResult {
    let Some(s) = server(&[DURABLE, &["--requirepass", "the-right-one"]].concat())? else {
        return Ok(());
    };
    for url in [
        format!("redis://:{PASSWORD}@127.0.0.1:{}/", s.port),
        format!("redis://someone:{PASSWORD}@127.0.0.1:{}/", s.port),
        format!("redis://127.0.0.1:{}/", s.port),
    ] {
        let err = open(&url).err().ok_or("a wrong password must be refused")?;
        let all = everything(&err);
        assert!(!all.contains(PASSWORD), "the password shows: {all}");
        assert!(
            all.contains("authentication") || all.contains("NOAUTH") || all.contains("WRONGPASS"),
            "{all}"
        );
    }
    // The right one opens.
    open(&format!("redis://:the-right-one@127.0.0.1:{}/", s.port))?;
    // Given apart from the URL (`redis_password`): used when the URL has
    // none, never shown by an error or by the builder's Debug output.
    let plain = format!("redis://127.0.0.1:{}/", s.port);
    let with = |password: &str| {
        Engine::builder()
            .sweep_interval(None)
            .redis_connect_timeout(Duration::from_secs(2))
            .redis_password(password)
    };
    assert!(!format!("{:?}", with(PASSWORD)).contains(PASSWORD));
    with("the-right-one").open_redis(&plain)?;
    let err = with(PASSWORD)
        .open_redis(&plain)
        .err()
        .ok_or("a wrong redis_password must be refused")?;
    let all = everything(&err);
    assert!(!all.contains(PASSWORD), "the password shows: {all}");
    assert!(all.contains("redis_password"), "{all}");
    // A URL with its own password keeps it.
    with(PASSWORD).open_redis(&format!("redis://:the-right-one@127.0.0.1:{}/", s.port))?;
    Ok(())
}

#[test]
fn malformed_and_cluster_urls_are_refused_without_the_password() -> TestResult {
    for url in [
        format!("redis://:{PASSWORD}@"),
        format!("redis://:{PASSWORD}@127.0.0.1:notaport/"),
        format!("redis//:{PASSWORD}@127.0.0.1/"),
        format!("http://:{PASSWORD}@127.0.0.1/"),
        format!("redis://:{PASSWORD}@127.0.0.1:6379/notadb"),
        String::new(),
        "\u{0}".repeat(100),
    ] {
        let err = open(&url).err().ok_or(format!("{url:?} must be refused"))?;
        let all = everything(&err);
        assert!(
            !all.contains(PASSWORD),
            "the password shows for {url:?}: {all}"
        );
    }
    for url in [
        format!("redis+cluster://:{PASSWORD}@127.0.0.1:7000/"),
        format!("redis-cluster://:{PASSWORD}@127.0.0.1:7000/"),
    ] {
        let err = open(&url).err().ok_or("a cluster URL must be refused")?;
        assert!(matches!(err, OpenError::RedisUnsupported { .. }), "{err:?}");
        assert!(err.to_string().contains("Cluster"), "{err}");
        assert!(!everything(&err).contains(PASSWORD));
    }
    Ok(())
}

/// A TLS file with a plaintext `redis://` URL is refused before any
/// connection or file read, and the error says to use `rediss://` rather
/// than blaming a file that was never read.
#[test]
fn tls_files_with_a_plaintext_url_are_refused_naming_the_scheme() -> TestResult {
    let url = "redis://127.0.0.1:1/";
    let with_ca = Engine::builder()
        .sweep_interval(None)
        .redis_tls_ca("/nonexistent/ca.pem")
        .open_redis(url);
    let with_client = Engine::builder()
        .sweep_interval(None)
        .redis_tls_client_cert("/nonexistent/client.pem", "/nonexistent/client.key")
        .open_redis(url);
    for opened in [with_ca, with_client] {
        let err = opened
            .err()
            .ok_or("TLS files with redis:// must be refused")?;
        let words = err.to_string();
        assert!(words.contains("not rediss://"), "{words}");
        assert!(words.contains("use a rediss:// URL"), "{words}");
        assert!(!words.contains("reading the Redis TLS"), "{words}");
        assert!(words.contains("/nonexistent/"), "{words}");
    }
    Ok(())
}

#[test]
fn a_server_in_cluster_mode_is_refused() -> TestResult {
    let Some(s) = server(&[DURABLE, &["--cluster-enabled", "yes"]].concat())? else {
        return Ok(());
    };
    let err = open(&format!("redis://127.0.0.1:{}/", s.port))
        .err()
        .ok_or("cluster mode must be refused")?;
    assert!(
        matches!(&err, OpenError::RedisUnsupported { reason } if reason.contains("cluster_enabled")),
        "{err:?}"
    );
    Ok(())
}

#[test]
fn a_server_without_scripting_is_refused() -> TestResult {
    let Some(s) = server(DURABLE)? else {
        return Ok(());
    };
    let url = format!("redis://127.0.0.1:{}/", s.port);
    let mut admin = redis::Client::open(url.as_str())?.get_connection()?;
    let _: () = redis::cmd("ACL")
        .arg("SETUSER")
        .arg("noscript")
        .arg("on")
        .arg(format!(">{PASSWORD}"))
        .arg("~*")
        .arg("+@all")
        .arg("-@scripting")
        .query(&mut admin)?;
    let err = open(&format!(
        "redis://noscript:{PASSWORD}@127.0.0.1:{}/",
        s.port
    ))
    .err()
    .ok_or("a user without scripting must be refused")?;
    assert!(
        matches!(&err, OpenError::RedisUnsupported { reason } if reason.contains("Lua")),
        "{err:?}"
    );
    assert!(!everything(&err).contains(PASSWORD));
    Ok(())
}

/// A listener that answers like an HTTP server, and one that never
/// answers: neither is taken for Redis, and neither hangs the open.
#[test]
fn a_server_that_is_not_redis_is_refused_in_time() -> TestResult {
    let http = TcpListener::bind("127.0.0.1:0")?;
    let http_port = http.local_addr()?.port();
    std::thread::spawn(move || {
        for stream in http.incoming().flatten() {
            let mut stream = stream;
            let mut buf = [0u8; 512];
            let _ = stream.read(&mut buf);
            let _ = stream.write_all(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n");
        }
    });
    let silent = TcpListener::bind("127.0.0.1:0")?;
    let silent_port = silent.local_addr()?.port();
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for stream in silent.incoming().flatten() {
            held.push(stream);
        }
    });
    for port in [http_port, silent_port] {
        let started = Instant::now();
        let err = open(&format!("redis://127.0.0.1:{port}/"))
            .err()
            .ok_or("a non-Redis server must be refused")?;
        assert!(started.elapsed() < Duration::from_secs(20), "the open hung");
        assert!(
            matches!(
                err,
                OpenError::Storage { .. } | OpenError::RedisUnsupported { .. }
            ),
            "{err:?}"
        );
    }
    Ok(())
}

#[test]
fn verify_reports_keys_written_by_something_else() -> TestResult {
    let Some(h) = Harness::new(Backend::Redis) else {
        return Ok(());
    };
    let (_, prefix) = h.redis_store().ok_or("a Redis harness")?;
    let engine = h.engine()?;
    let key = idempotency::IdempotencyKey::new("verify", "k")?;
    let fp = idempotency::Fingerprint::of_json(b"{}", &[])?;
    let idempotency::Begin::Claimed(claim) = engine.begin(&key, fp)? else {
        return Err("a fresh key must be claimed".into());
    };
    engine.complete(claim, idempotency::Envelope::new(1, 200, "ok"))?;
    assert!(engine.verify()?.is_sound(), "{:?}", engine.verify()?);
    let foreign = format!("{prefix}session:42");
    let mut conn = h.redis_conn()?;
    let _: () = redis::cmd("SET").arg(&foreign).arg("x").query(&mut conn)?;
    let report = engine.verify()?;
    assert!(
        report
            .damage
            .iter()
            .any(|d| matches!(d, Damage::ForeignKey { key } if *key == foreign)),
        "{report:?}"
    );
    Ok(())
}

/// `wait_replicas`: without a replica a write reports the shortfall (it
/// stands on the primary); with one attached, writes return normally.
#[test]
fn wait_replicas_reports_a_shortfall_and_passes_with_a_replica() -> TestResult {
    let Some(primary) = server(DURABLE)? else {
        return Ok(());
    };
    let url = format!("redis://127.0.0.1:{}/", primary.port);
    let key = idempotency::IdempotencyKey::new("wait", "k")?;
    let fp = idempotency::Fingerprint::of_json(b"{}", &[])?;
    let engine = Engine::builder()
        .sweep_interval(None)
        .wait_replicas(1, Duration::from_millis(200))
        .open_redis(&url)?;
    // The claim is a write: it waits too, and reports the shortfall.
    let err = engine
        .begin(&key, fp)
        .err()
        .ok_or("no replica acknowledged the claim: it must say so")?;
    assert!(err.to_string().contains("0 of 1 replicas"), "{err}");
    // It stands on the primary.
    let rec = engine.record(&key)?.ok_or("missing")?;
    assert_eq!(rec.state, idempotency::State::Processing);
    let port = primary.port.to_string();
    let Some(_replica) = server(&[DURABLE, &["--replicaof", "127.0.0.1", &port]].concat())? else {
        return Ok(());
    };
    let mut admin = redis::Client::open(url.as_str())?.get_connection()?;
    let until = Instant::now() + Duration::from_secs(20);
    loop {
        let info: String = redis::cmd("INFO").arg("replication").query(&mut admin)?;
        if info.contains("connected_slaves:1") && info.contains("state=online") {
            break;
        }
        if Instant::now() > until {
            return Err(format!("the replica never came online: {info}").into());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let engine = Engine::builder()
        .sweep_interval(None)
        .wait_replicas(1, Duration::from_secs(10))
        .open_redis(&url)?;
    let other = idempotency::IdempotencyKey::new("wait", "k2")?;
    let idempotency::Begin::Claimed(claim) = engine.begin(&other, fp)? else {
        return Err("a fresh key must be claimed".into());
    };
    engine.complete(claim, idempotency::Envelope::new(1, 200, "ok"))?;
    Ok(())
}
