//! Guards against a lost connection to PostgreSQL turning into a wrong
//! answer: a `complete` or `begin` that could not reach the database must
//! return an error (never `Ok`, never a panic), and a claimed key must never
//! become claimable again while its work may have happened (issue 11).
//!
//! The engine connects through a TCP proxy in this test that can be cut
//! (every connection closed, new ones dropped at once) and restored. A
//! second engine connects directly and watches the records while the proxy
//! is cut. Time moves on a `ManualClock` (`database_clock(false)`), so
//! leases run out without sleeping.
#![cfg(unix)]

#[path = "common/pg_chaos.rs"]
mod pg_chaos;

use std::error::Error;
use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use idempotency::postgres::config::Host;
use idempotency::{
    Begin, Engine, Envelope, Fingerprint, IdempotencyKey, ManualClock, Resolution, State,
};

type TestResult<T = ()> = Result<T, Box<dyn Error + Send + Sync>>;

const T0: u64 = 1_700_000_000_000;
const LEASE: Duration = Duration::from_secs(10);
/// How long an engine may take to notice the database is back.
const RECONNECT_WITHIN: Duration = Duration::from_secs(40);

/// A TCP proxy from a loopback port to the test server that can be cut.
struct Proxy {
    addr: SocketAddr,
    shared: Arc<ProxyShared>,
}

struct ProxyShared {
    upstream: SocketAddr,
    cut: AtomicBool,
    closed: AtomicBool,
    /// Once a client sends bytes containing all of these, every reply from
    /// the server is dropped (until restored): the server acts on the
    /// request, the client never hears the answer.
    trigger: Mutex<Option<Vec<Vec<u8>>>>,
    /// The trigger was seen in a statement being prepared (a Parse without
    /// an Execute): the next chunk that executes a statement is the one.
    prepared: AtomicBool,
    swallowing: AtomicBool,
    /// Both ends of every live connection, to shut them down on a cut.
    live: Mutex<Vec<TcpStream>>,
}

impl Proxy {
    /// Listens on 127.0.0.1 (an ephemeral port) and forwards to the host
    /// and port of `url`.
    fn start(url: &str) -> TestResult<Proxy> {
        let cfg = pg_chaos::config(url)?;
        let host = match cfg.get_hosts().first() {
            Some(Host::Tcp(h)) => h.clone(),
            Some(Host::Unix(p)) => {
                return Err(format!(
                    "{} names a Unix socket ({}); this test needs TCP",
                    pg_chaos::PG_VAR,
                    p.display()
                )
                .into())
            }
            None => "localhost".to_string(),
        };
        let port = cfg.get_ports().first().copied().unwrap_or(5432);
        let upstream = (host.as_str(), port)
            .to_socket_addrs()?
            .next()
            .ok_or_else(|| format!("{host}:{port} resolves to no address"))?;
        let listener = TcpListener::bind("127.0.0.1:0")?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(ProxyShared {
            upstream,
            cut: AtomicBool::new(false),
            closed: AtomicBool::new(false),
            trigger: Mutex::new(None),
            prepared: AtomicBool::new(false),
            swallowing: AtomicBool::new(false),
            live: Mutex::new(Vec::new()),
        });
        let s = shared.clone();
        std::thread::Builder::new()
            .name("pg-proxy-accept".into())
            .spawn(move || accept_loop(&listener, &s))?;
        Ok(Proxy { addr, shared })
    }

    /// A connection string for the engine: the original's user, database
    /// and password, through the proxy.
    fn url(&self, original: &str) -> TestResult<String> {
        let cfg = pg_chaos::config(original)?;
        let quote = |v: &str| format!("'{}'", v.replace('\\', "\\\\").replace('\'', "\\'"));
        // Plaintext: the proxy reads the statements going through it (and
        // the test server has TLS, which `prefer`, the default, would use).
        let mut s = format!(
            "host=127.0.0.1 port={} connect_timeout=5 sslmode=disable",
            self.addr.port()
        );
        if let Some(u) = cfg.get_user() {
            s += &format!(" user={}", quote(u));
        }
        if let Some(d) = cfg.get_dbname() {
            s += &format!(" dbname={}", quote(d));
        }
        if let Some(p) = cfg.get_password() {
            s += &format!(" password={}", quote(&String::from_utf8_lossy(p)));
        }
        Ok(s)
    }

    /// Closes every connection and drops new ones until [`Proxy::restore`].
    fn cut(&self) {
        self.shared.cut.store(true, Ordering::SeqCst);
        let live = std::mem::take(&mut *self.shared.lock_live());
        for s in live {
            let _ = s.shutdown(Shutdown::Both);
        }
    }

    /// Accepts and forwards connections again (and forwards replies again).
    fn restore(&self) {
        *self.shared.lock_trigger() = None;
        self.shared.prepared.store(false, Ordering::SeqCst);
        self.shared.swallowing.store(false, Ordering::SeqCst);
        self.shared.cut.store(false, Ordering::SeqCst);
    }

    /// From the first client message holding every one of `parts` on,
    /// replies are dropped: the request reaches the server, its answer
    /// never reaches the client.
    fn lose_replies_after(&self, parts: &[&str]) {
        *self.shared.lock_trigger() = Some(parts.iter().map(|p| p.as_bytes().to_vec()).collect());
    }

    /// Whether [`Proxy::lose_replies_after`] has fired.
    fn losing_replies(&self) -> bool {
        self.shared.swallowing.load(Ordering::SeqCst)
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.shared.closed.store(true, Ordering::SeqCst);
        self.cut();
        // Wake the accept loop so it sees `closed`.
        let _ = TcpStream::connect(self.addr);
    }
}

impl ProxyShared {
    fn lock_live(&self) -> std::sync::MutexGuard<'_, Vec<TcpStream>> {
        self.live.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn lock_trigger(&self) -> std::sync::MutexGuard<'_, Option<Vec<Vec<u8>>>> {
        self.trigger.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Arms reply dropping if `chunk` (client to server) holds the trigger.
    fn inspect(&self, chunk: &[u8]) {
        let trigger = self.lock_trigger();
        let Some(parts) = trigger.as_ref() else {
            return;
        };
        let holds = |p: &Vec<u8>| chunk.windows(p.len()).any(|w| w == p.as_slice());
        let executes = message_types(chunk).contains(&b'E');
        if parts.iter().all(holds) {
            // An unnamed statement is parsed and executed in one go; a
            // prepared one (the engine caches its hot statements) is
            // executed by a later Bind/Execute that names it.
            if executes {
                self.swallowing.store(true, Ordering::SeqCst);
            } else {
                self.prepared.store(true, Ordering::SeqCst);
            }
        } else if executes && self.prepared.load(Ordering::SeqCst) {
            self.swallowing.store(true, Ordering::SeqCst);
        }
    }
}

/// The frontend message types in `chunk` (each message: a type byte and a
/// big-endian length that counts itself), as far as they parse.
fn message_types(chunk: &[u8]) -> Vec<u8> {
    let mut types = Vec::new();
    let mut rest = chunk;
    while let [kind, a, b, c, d, ..] = rest {
        let len = u32::from_be_bytes([*a, *b, *c, *d]) as usize;
        types.push(*kind);
        match rest.get(1 + len..) {
            Some(next) if len >= 4 => rest = next,
            _ => break,
        }
    }
    types
}

fn accept_loop(listener: &TcpListener, shared: &Arc<ProxyShared>) {
    for client in listener.incoming() {
        if shared.closed.load(Ordering::SeqCst) {
            return;
        }
        let Ok(client) = client else { continue };
        if shared.cut.load(Ordering::SeqCst) {
            let _ = client.shutdown(Shutdown::Both);
            continue;
        }
        let Ok(server) = TcpStream::connect_timeout(&shared.upstream, Duration::from_secs(5))
        else {
            let _ = client.shutdown(Shutdown::Both);
            continue;
        };
        let _ = (client.set_nodelay(true), server.set_nodelay(true));
        let clones = (
            client.try_clone(),
            server.try_clone(),
            client.try_clone(),
            server.try_clone(),
        );
        let (Ok(c1), Ok(s1), Ok(c2), Ok(s2)) = clones else {
            continue;
        };
        {
            // Registered under the lock a cut takes, and checked again, so
            // a connection accepted during a cut is not left open.
            let mut live = shared.lock_live();
            if shared.cut.load(Ordering::SeqCst) {
                let _ = (
                    client.shutdown(Shutdown::Both),
                    server.shutdown(Shutdown::Both),
                );
                continue;
            }
            live.push(client);
            live.push(server);
        }
        let (up, down) = (shared.clone(), shared.clone());
        let _ = std::thread::Builder::new()
            .name("pg-proxy-up".into())
            .spawn(move || {
                pump(c1, s1, |chunk| {
                    up.inspect(chunk);
                    true
                })
            });
        let _ = std::thread::Builder::new()
            .name("pg-proxy-down".into())
            .spawn(move || pump(s2, c2, |_| !down.swallowing.load(Ordering::SeqCst)));
    }
}

/// Copies `from` to `to` until either side closes or fails, then closes
/// both. `pass` sees each chunk first and says whether to forward it.
fn pump(mut from: TcpStream, mut to: TcpStream, mut pass: impl FnMut(&[u8]) -> bool) {
    let mut buf = [0u8; 64 * 1024];
    loop {
        match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                if pass(&buf[..n]) && to.write_all(&buf[..n]).is_err() {
                    break;
                }
            }
        }
    }
    let _ = (from.shutdown(Shutdown::Both), to.shutdown(Shutdown::Both));
}

struct Setup {
    url: String,
    proxy: Proxy,
    clock: ManualClock,
    prefix: String,
    /// Through the proxy.
    engine: Engine,
    /// Straight to the server: watches while the proxy is cut.
    direct: Engine,
}

fn setup(tag: &str) -> TestResult<Option<Setup>> {
    let Some(url) = pg_chaos::pg_url() else {
        return Ok(None);
    };
    let proxy = Proxy::start(&url)?;
    let clock = ManualClock::new(T0);
    let prefix = pg_chaos::unique_prefix(tag);
    let open = |to: &str| {
        Engine::builder()
            .table_prefix(prefix.as_str())
            .pool_size(2)
            .database_clock(false)
            .clock(clock.clone())
            .lease(LEASE)
            .sweep_interval(None)
            .open_postgres(to)
    };
    let engine = open(&proxy.url(&url)?)?;
    let direct = open(&url)?;
    Ok(Some(Setup {
        url,
        proxy,
        clock,
        prefix,
        engine,
        direct,
    }))
}

impl Setup {
    fn cleanup(self) -> TestResult {
        drop((self.engine, self.direct, self.proxy));
        let mut admin = pg_chaos::connect(&self.url)?;
        pg_chaos::drop_prefix(&mut admin, &self.prefix)
    }
}

fn key(name: &str) -> Result<IdempotencyKey, idempotency::Error> {
    IdempotencyKey::new("tenant-1:payments", name)
}

fn fp() -> Result<Fingerprint, idempotency::FingerprintError> {
    Fingerprint::of_json(br#"{"amount": 10, "currency": "EUR"}"#, &[])
}

fn receipt(reference: &str) -> Envelope {
    Envelope::new(1, 201, format!(r#"{{"charged":"{reference}"}}"#))
}

/// Calls `f` until it stops failing: the engine reconnects after a restore
/// in its own time. A failure past `RECONNECT_WITHIN` fails the test.
fn once_reconnected<T>(
    what: &str,
    mut f: impl FnMut() -> Result<T, idempotency::Error>,
) -> TestResult<T> {
    let start = Instant::now();
    loop {
        match f() {
            Ok(v) => return Ok(v),
            Err(e) if start.elapsed() < RECONNECT_WITHIN => {
                eprintln!("{what} after restore, not yet: {e}");
                std::thread::sleep(Duration::from_millis(200));
            }
            Err(e) => {
                return Err(format!(
                    "{what} still fails {:?} after the proxy was restored: {e}",
                    start.elapsed()
                )
                .into())
            }
        }
    }
}

/// The call failed with an error that says the database could not be
/// reached (not a refusal about the record, which would be a made-up
/// answer).
fn assert_unreachable_error<T: std::fmt::Debug>(
    what: &str,
    got: Result<T, idempotency::Error>,
    took: Duration,
) -> TestResult {
    match got {
        Ok(v) => {
            Err(format!("{what} returned Ok({v:?}) while the database was unreachable").into())
        }
        Err(e) => {
            eprintln!("{what} while cut ({took:?}): {e}");
            assert!(
                matches!(
                    e,
                    idempotency::Error::Storage { .. } | idempotency::Error::Poisoned { .. }
                ),
                "{what}: not a storage error: {e:?}"
            );
            Ok(())
        }
    }
}

#[test]
fn complete_during_cut_fails_and_the_key_is_never_claimable_again() -> TestResult {
    let Some(s) = setup("clc")? else {
        return Ok(());
    };
    let k = key("order-complete-cut")?;
    let claim = match s.engine.begin(&k, fp()?)? {
        Begin::Claimed(c) => c,
        other => return Err(format!("expected Claimed, got {other:?}").into()),
    };
    let (token, reference) = (claim.fencing_token(), claim.reference().to_string());
    let envelope = receipt(&reference);

    s.proxy.cut();
    let t = Instant::now();
    let res = s.engine.complete(claim, envelope.clone());
    assert_unreachable_error("complete", res, t.elapsed())?;

    // The database never heard of the completion: the claim still holds
    // the record, and a twin is told to wait.
    let rec = s.direct.record(&k)?.ok_or("the claimed record vanished")?;
    assert!(
        matches!(rec.state, State::Processing | State::Unknown) && rec.fencing_token == token,
        "{rec:?}"
    );
    assert!(rec.response.is_none(), "{rec:?}");
    let twin = s.direct.begin(&k, fp()?)?;
    assert!(
        matches!(twin, Begin::Processing { .. }),
        "twin while cut: {twin:?}"
    );

    s.proxy.restore();
    // The engine that lost its connections answers again, and the same:
    // the lease still runs, so the key is in flight, never claimable.
    let again = once_reconnected("begin", || s.engine.begin(&k, fp()?))?;
    assert!(
        matches!(again, Begin::Processing { .. }),
        "after restore: {again:?}"
    );

    // Past the lease the work may have happened: in doubt, never Claimed.
    s.clock.advance(LEASE + Duration::from_millis(1));
    for e in [&s.engine, &s.direct] {
        match e.begin(&k, fp()?)? {
            Begin::InDoubt(d) => {
                assert_eq!(
                    (d.fencing_token, d.reference.as_str()),
                    (token, reference.as_str())
                );
            }
            other => return Err(format!("after the lease: expected InDoubt, got {other:?}").into()),
        }
    }
    let listed = s.engine.in_doubt(100)?;
    assert!(
        listed
            .iter()
            .any(|d| d.key == k && d.fencing_token == token),
        "{listed:?}"
    );

    // The recovery path settles it: the provider says the charge happened.
    s.engine.resolve(
        &k,
        Resolution::Completed(envelope.clone()),
        "provider has the charge",
    )?;
    for e in [&s.engine, &s.direct] {
        match e.begin(&k, fp()?)? {
            Begin::Replay(r) => assert_eq!(r.envelope.body, envelope.body),
            other => return Err(format!("after resolve: expected Replay, got {other:?}").into()),
        }
    }
    s.cleanup()
}

#[test]
fn a_claim_held_through_a_cut_completes_after_restore() -> TestResult {
    let Some(s) = setup("clh")? else {
        return Ok(());
    };
    let k = key("order-held-through-cut")?;
    let mut claim = match s.engine.begin(&k, fp()?)? {
        Begin::Claimed(c) => c,
        other => return Err(format!("expected Claimed, got {other:?}").into()),
    };
    let envelope = receipt(claim.reference());

    s.proxy.cut();
    let t = Instant::now();
    let res = claim.extend(LEASE);
    assert_unreachable_error("extend", res, t.elapsed())?;
    let twin = s.direct.begin(&k, fp()?)?;
    assert!(
        matches!(twin, Begin::Processing { .. }),
        "twin while cut: {twin:?}"
    );

    s.proxy.restore();
    // The holder still owns the record: once the database answers again,
    // its late completion lands and is what every retry sees.
    once_reconnected("extend", || claim.extend(LEASE))?;
    s.engine.complete(claim, envelope.clone())?;
    for e in [&s.engine, &s.direct] {
        match e.begin(&k, fp()?)? {
            Begin::Replay(r) => assert_eq!(r.envelope.body, envelope.body),
            other => return Err(format!("expected Replay, got {other:?}").into()),
        }
    }
    s.cleanup()
}

#[test]
fn begin_during_cut_fails_and_claims_nothing() -> TestResult {
    let Some(s) = setup("clb")? else {
        return Ok(());
    };
    let k = key("order-begin-cut")?;
    // Warm the pool first, so the cut breaks live connections, not only
    // new ones.
    assert!(s.engine.record(&k)?.is_none());

    s.proxy.cut();
    let t = Instant::now();
    let res = s.engine.begin(&k, fp()?);
    assert_unreachable_error("begin", res, t.elapsed())?;
    assert!(
        s.direct.record(&k)?.is_none(),
        "a failed begin left a record"
    );

    s.proxy.restore();
    let claim = match once_reconnected("begin", || s.engine.begin(&k, fp()?))? {
        Begin::Claimed(c) => c,
        other => return Err(format!("after restore: expected Claimed, got {other:?}").into()),
    };
    let envelope = receipt(claim.reference());
    s.engine.complete(claim, envelope.clone())?;
    match s.direct.begin(&k, fp()?)? {
        Begin::Replay(r) => assert_eq!(r.envelope.body, envelope.body),
        other => return Err(format!("expected Replay, got {other:?}").into()),
    }
    s.cleanup()
}

#[test]
fn begin_whose_claim_landed_but_whose_answer_was_lost_is_never_claimable() -> TestResult {
    let Some(s) = setup("cll")? else {
        return Ok(());
    };
    let k = key("order-answer-lost")?;
    assert!(s.engine.record(&k)?.is_none());

    // The claim's INSERT reaches the server and commits; its answer is
    // dropped, then the connection is cut.
    s.proxy
        .lose_replies_after(&["INSERT", &format!("{}records", s.prefix)]);
    let t = Instant::now();
    let res = std::thread::scope(|scope| -> TestResult<_> {
        let begin = scope.spawn(|| s.engine.begin(&k, fp()?));
        let fired_by = Instant::now() + Duration::from_secs(10);
        while !s.proxy.losing_replies() && Instant::now() < fired_by && !begin.is_finished() {
            std::thread::sleep(Duration::from_millis(5));
        }
        if !s.proxy.losing_replies() {
            s.proxy.cut();
            return Err(
                "begin never sent an INSERT into the records table through the proxy".into(),
            );
        }
        // Cut once the claim has committed (seen from outside the proxy),
        // while its answer is still being dropped.
        let landed_by = Instant::now() + Duration::from_secs(10);
        let landed = loop {
            match s.direct.record(&k) {
                Ok(Some(_)) => break Ok(()),
                Ok(None) if Instant::now() < landed_by => {
                    std::thread::sleep(Duration::from_millis(5));
                }
                Ok(None) => break Err("the claim's INSERT reached the server, yet no record"),
                Err(_) => break Err("the direct engine cannot read the record"),
            }
        };
        s.proxy.cut();
        let answer = begin.join().map_err(|_| "begin panicked")?;
        landed?;
        Ok(answer)
    })?;
    assert_unreachable_error("begin (answer lost)", res.map(|_| ()), t.elapsed())?;

    // The claim is durable, held by nobody: a twin waits for its lease.
    let rec = s.direct.record(&k)?.ok_or("the claimed record vanished")?;
    assert!(matches!(rec.state, State::Processing), "{rec:?}");
    let token = rec.fencing_token;
    let twin = s.direct.begin(&k, fp()?)?;
    assert!(
        matches!(twin, Begin::Processing { .. }),
        "twin while cut: {twin:?}"
    );

    s.proxy.restore();
    let again = once_reconnected("begin", || s.engine.begin(&k, fp()?))?;
    assert!(
        matches!(again, Begin::Processing { .. }),
        "after restore: {again:?}"
    );

    // Past the lease nobody can tell whether the work ran: in doubt.
    s.clock.advance(LEASE + Duration::from_millis(1));
    for e in [&s.engine, &s.direct] {
        match e.begin(&k, fp()?)? {
            Begin::InDoubt(d) => assert_eq!(d.fencing_token, token),
            other => return Err(format!("after the lease: expected InDoubt, got {other:?}").into()),
        }
    }
    // Recovery learns nothing ran: only now may the key run, under a new token.
    s.engine
        .resolve(&k, Resolution::NotExecuted, "provider has no charge")?;
    let claim = match s.engine.begin(&k, fp()?)? {
        Begin::Claimed(c) => c,
        other => return Err(format!("after NotExecuted: expected Claimed, got {other:?}").into()),
    };
    assert!(claim.fencing_token() > token);
    let envelope = receipt(claim.reference());
    s.engine.complete(claim, envelope.clone())?;
    match s.direct.begin(&k, fp()?)? {
        Begin::Replay(r) => assert_eq!(r.envelope.body, envelope.body),
        other => return Err(format!("expected Replay, got {other:?}").into()),
    }
    s.cleanup()
}
