//! A small TCP proxy on 127.0.0.1 between an engine and the test server
//! (`IDEMPOTENCY_TEST_PG`), speaking plaintext (the engine's connection
//! string says `sslmode=disable`), that can lose a COMMIT's answer or the
//! COMMIT itself, or stop answering altogether:
//!
//! - [`PgProxy::cut_after_commit`]: the next frontend message that is the
//!   simple query `COMMIT` is either forwarded and its answer swallowed
//!   ([`Forward::Yes`]: the commit went through, the client never hears it)
//!   or not forwarded ([`Forward::No`]: it never happened); then both sides
//!   of that connection are cut. [`PgProxy::cut_after_statement`] does the
//!   same to the next extended-protocol Execute (an autocommitted
//!   statement).
//! - [`PgProxy::black_hole`]: connections stay open, nothing is forwarded
//!   either way and (after at most one chunk) nothing more is read, so the
//!   client's kernel goes on ACKing while no answer ever comes; new
//!   connections are accepted and left hanging likewise.
//!   [`PgProxy::heal`] forwards again.
//! - [`PgProxy::refuse`]: every new connection is closed as soon as it is
//!   accepted (a server that is down), until [`PgProxy::heal`].
//!
//! The byte pump knows nothing of PostgreSQL but the two armed cuts:
//! [`PgProxy::start_to`] puts it in front of any TCP server (the NATS
//! broker tests use it with [`PgProxy::cut_all`] and
//! [`PgProxy::refuse`]).
//!
//! Bounded: at most [`MAX_CONNECTIONS`] connections in its life, 5 s to
//! reach the server, 5 s for a swallowed COMMIT answer. Dropping it closes
//! every connection. Used through `#[path = "common/pg_proxy.rs"] mod
//! pg_proxy;` beside `pg_chaos.rs`.

#![allow(dead_code)] // each test file uses some of these

use std::error::Error;
use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use idempotency::postgres::config::Host;

use super::pg_chaos;

type TestResult<T = ()> = Result<T, Box<dyn Error + Send + Sync>>;

/// Connections one proxy accepts in its life; later ones are closed at once.
pub const MAX_CONNECTIONS: usize = 256;
/// How long a swallowed answer may take before the cut happens anyway.
const ANSWER_WAIT: Duration = Duration::from_secs(5);

/// The simple query `COMMIT` as `postgres` and `tokio-postgres` send it.
const COMMIT: &[u8] = b"Q\0\0\0\x0bCOMMIT\0";
/// The start of a ReadyForQuery message: the end of an answer.
const READY: &[u8] = b"Z\0\0\0\x05";

/// Whether an intercepted message reaches the server before the cut.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Forward {
    /// Forwarded, executed by the server; its answer is swallowed.
    Yes,
    /// Never forwarded.
    No,
}

#[derive(Clone, Copy, Debug)]
enum Trigger {
    Commit,
    Execute,
}

#[derive(Clone, Copy, Debug)]
struct Arm {
    trigger: Trigger,
    forward: Forward,
}

#[derive(Default)]
struct State {
    closed: bool,
    black_hole: bool,
    refuse: bool,
    arm: Option<Arm>,
    /// Both sockets of every connection, to shut them down.
    live: Vec<TcpStream>,
}

struct Shared {
    upstream: SocketAddr,
    /// Forward bytes as they come, unframed (not PostgreSQL: no arms).
    raw: bool,
    state: Mutex<State>,
    changed: Condvar,
    accepted: AtomicUsize,
    fired: AtomicUsize,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Waits while the proxy is a black hole; `false` once it is closed.
    fn wait_open(&self) -> bool {
        let mut s = self.lock();
        while s.black_hole && !s.closed {
            s = self.changed.wait(s).unwrap_or_else(PoisonError::into_inner);
        }
        !s.closed
    }
}

/// The proxy; see the module docs.
pub struct PgProxy {
    addr: SocketAddr,
    shared: Arc<Shared>,
    /// The test server's connection string, for [`PgProxy::url`].
    original: String,
}

impl PgProxy {
    /// Listens on an ephemeral port of 127.0.0.1 and forwards to the host
    /// and port of `url` (which must name a TCP host).
    ///
    /// # Errors
    ///
    /// An unparsable `url`, a Unix-socket host, no address, no port.
    pub fn start(url: &str) -> TestResult<PgProxy> {
        let cfg = pg_chaos::config(url)?;
        let host = match cfg.get_hosts().first() {
            Some(Host::Tcp(h)) => h.clone(),
            Some(Host::Unix(p)) => {
                return Err(format!(
                    "{} names a Unix socket ({}); the proxy needs TCP",
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
        let mut proxy = PgProxy::listen(upstream, false)?;
        proxy.original = url.to_string();
        Ok(proxy)
    }

    /// Listens on an ephemeral port of 127.0.0.1 and forwards bytes to
    /// `upstream` as they come, whatever it speaks: the armed cuts (which
    /// need PostgreSQL's framing) never fire, and [`PgProxy::url`] is of
    /// no use (see [`PgProxy::addr`]).
    ///
    /// # Errors
    ///
    /// Binding the listener, starting its thread.
    pub fn start_to(upstream: SocketAddr) -> TestResult<PgProxy> {
        PgProxy::listen(upstream, true)
    }

    fn listen(upstream: SocketAddr, raw: bool) -> TestResult<PgProxy> {
        let listener = TcpListener::bind("127.0.0.1:0")?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            upstream,
            raw,
            state: Mutex::new(State::default()),
            changed: Condvar::new(),
            accepted: AtomicUsize::new(0),
            fired: AtomicUsize::new(0),
        });
        let s = shared.clone();
        std::thread::Builder::new()
            .name("pg-proxy-accept".into())
            .spawn(move || accept_loop(&listener, &s))?;
        Ok(PgProxy {
            addr,
            shared,
            original: String::new(),
        })
    }

    /// The address the proxy listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// A connection string through the proxy, plaintext, with the test
    /// server's user, database and password, and `extra` `key=value`
    /// pairs (e.g. `application_name=...`).
    ///
    /// # Errors
    ///
    /// An unparsable original connection string.
    pub fn url(&self, extra: &str) -> TestResult<String> {
        let cfg = pg_chaos::config(&self.original)?;
        let quote = |v: &str| format!("'{}'", v.replace('\\', "\\\\").replace('\'', "\\'"));
        let mut s = format!("host=127.0.0.1 port={} sslmode=disable", self.addr.port());
        if let Some(u) = cfg.get_user() {
            s += &format!(" user={}", quote(u));
        }
        if let Some(d) = cfg.get_dbname() {
            s += &format!(" dbname={}", quote(d));
        }
        if let Some(p) = cfg.get_password() {
            s += &format!(" password={}", quote(&String::from_utf8_lossy(p)));
        }
        if !extra.is_empty() {
            s += " ";
            s += extra;
        }
        Ok(s)
    }

    /// Arms the proxy for the next `COMMIT` (simple query) on any
    /// connection: see [`Forward`]. Fires once.
    pub fn cut_after_commit(&self, forward: Forward) {
        self.shared.lock().arm = Some(Arm {
            trigger: Trigger::Commit,
            forward,
        });
    }

    /// Arms the proxy for the next extended-protocol Execute on any
    /// connection (with [`Forward::Yes`] the rest of its batch, up to the
    /// Sync that commits an autocommitted statement, goes too). Fires once.
    pub fn cut_after_statement(&self, forward: Forward) {
        self.shared.lock().arm = Some(Arm {
            trigger: Trigger::Execute,
            forward,
        });
    }

    /// Disarms a cut that has not fired.
    pub fn disarm(&self) {
        self.shared.lock().arm = None;
    }

    /// How many armed cuts have fired.
    pub fn fired(&self) -> usize {
        self.shared.fired.load(Ordering::SeqCst)
    }

    /// From now on nothing is forwarded, and new connections hang.
    pub fn black_hole(&self) {
        self.shared.lock().black_hole = true;
    }

    /// From now on every new connection is closed at once, unforwarded
    /// (open ones are left alone: [`PgProxy::cut_all`] closes those).
    pub fn refuse(&self) {
        self.shared.lock().refuse = true;
    }

    /// Forwards again (what was held back goes on its way) and accepts
    /// connections again.
    pub fn heal(&self) {
        let mut s = self.shared.lock();
        s.black_hole = false;
        s.refuse = false;
        drop(s);
        self.shared.changed.notify_all();
    }

    /// Closes every open connection (new ones are still accepted).
    pub fn cut_all(&self) {
        let live = std::mem::take(&mut self.shared.lock().live);
        for s in live {
            let _ = s.shutdown(Shutdown::Both);
        }
    }

    /// Connections accepted so far.
    pub fn connections(&self) -> usize {
        self.shared.accepted.load(Ordering::SeqCst)
    }
}

impl Drop for PgProxy {
    fn drop(&mut self) {
        {
            let mut s = self.shared.lock();
            s.closed = true;
            s.black_hole = false;
        }
        self.shared.changed.notify_all();
        self.cut_all();
        // Wake the accept loop so it sees `closed`.
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_secs(1));
    }
}

fn accept_loop(listener: &TcpListener, shared: &Arc<Shared>) {
    for client in listener.incoming() {
        if shared.lock().closed {
            return;
        }
        let Ok(client) = client else { continue };
        {
            // Checked and registered under one lock: a `refuse` or
            // `cut_all` either comes first (refused here) or finds the
            // connection in `live` (closed by it). Registered by its
            // thread instead, a connection accepted just before a cut
            // could outlive it.
            let mut s = shared.lock();
            if s.refuse || shared.accepted.fetch_add(1, Ordering::SeqCst) >= MAX_CONNECTIONS {
                let _ = client.shutdown(Shutdown::Both);
                continue;
            }
            if let Ok(c) = client.try_clone() {
                s.live.push(c);
            }
        }
        let s = shared.clone();
        let spawned = std::thread::Builder::new()
            .name("pg-proxy-conn".into())
            .spawn(move || connection(client, &s));
        if spawned.is_err() {
            eprintln!("pg-proxy: cannot spawn a connection thread");
        }
    }
}

/// Serves one client: waits out a black hole (the client's connect
/// hangs), reaches the server, and pumps both ways.
fn connection(client: TcpStream, shared: &Arc<Shared>) {
    // The client side is registered (by the accept loop), so a drop or a
    // cut closes it even while it waits here.
    if !shared.wait_open() {
        let _ = client.shutdown(Shutdown::Both);
        return;
    }
    let Ok(server) = TcpStream::connect_timeout(&shared.upstream, Duration::from_secs(5)) else {
        let _ = client.shutdown(Shutdown::Both);
        return;
    };
    let _ = (client.set_nodelay(true), server.set_nodelay(true));
    let (Ok(c2), Ok(s2), Ok(s3)) = (client.try_clone(), server.try_clone(), server.try_clone())
    else {
        let _ = client.shutdown(Shutdown::Both);
        return;
    };
    {
        let mut s = shared.lock();
        if s.closed {
            let _ = (
                client.shutdown(Shutdown::Both),
                server.shutdown(Shutdown::Both),
            );
            return;
        }
        s.live.push(s3);
    }
    let swallow = Arc::new(AtomicBool::new(false));
    let (down_shared, down_swallow) = (shared.clone(), swallow.clone());
    let spawned = std::thread::Builder::new()
        .name("pg-proxy-down".into())
        .spawn(move || down(s2, c2, &down_shared, &down_swallow));
    if spawned.is_err() {
        let _ = (
            client.shutdown(Shutdown::Both),
            server.shutdown(Shutdown::Both),
        );
        return;
    }
    up(client, server, shared, &swallow);
}

fn cut(a: &TcpStream, b: &TcpStream) {
    let _ = (a.shutdown(Shutdown::Both), b.shutdown(Shutdown::Both));
}

/// Splits the frontend byte stream into whole messages: the first ones
/// (SSLRequest, GSSENCRequest, StartupMessage) have no type byte.
struct Framer {
    pending: Vec<u8>,
    started: bool,
}

impl Framer {
    /// Appends `bytes` and takes every complete message out, each with its
    /// type byte (`None` for an untyped startup-phase message).
    fn push(&mut self, bytes: &[u8]) -> Vec<(Option<u8>, Vec<u8>)> {
        self.pending.extend_from_slice(bytes);
        let mut out = Vec::new();
        loop {
            let head = usize::from(self.started);
            let Some(len_bytes) = self.pending.get(head..head + 4) else {
                break;
            };
            let len = u32::from_be_bytes([len_bytes[0], len_bytes[1], len_bytes[2], len_bytes[3]])
                as usize;
            let total = head + len.max(4);
            if self.pending.len() < total {
                break;
            }
            let msg: Vec<u8> = self.pending.drain(..total).collect();
            if self.started {
                out.push((msg.first().copied(), msg));
            } else {
                // SSLRequest and GSSENCRequest (8 bytes) keep the startup
                // phase going; the StartupMessage ends it.
                let code = msg
                    .get(4..8)
                    .map(|c| u32::from_be_bytes([c[0], c[1], c[2], c[3]]));
                if !matches!(code, Some(80_877_103 | 80_877_104)) {
                    self.started = true;
                }
                out.push((None, msg));
            }
        }
        out
    }
}

/// Client to server: forwards whole messages, and fires an armed cut.
fn up(
    mut client: TcpStream,
    mut server: TcpStream,
    shared: &Arc<Shared>,
    swallow: &Arc<AtomicBool>,
) {
    let mut framer = Framer {
        pending: Vec::new(),
        started: false,
    };
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        if !shared.wait_open() {
            break;
        }
        let n = match client.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        // Read while open, held while a black hole.
        if !shared.wait_open() {
            break;
        }
        let msgs = if shared.raw {
            vec![(None, buf[..n].to_vec())]
        } else {
            framer.push(&buf[..n])
        };
        let hit = {
            let mut s = shared.lock();
            let found = s.arm.filter(|_| !shared.raw).and_then(|arm| {
                msgs.iter()
                    .position(|(kind, m)| match arm.trigger {
                        Trigger::Commit => m.as_slice() == COMMIT,
                        Trigger::Execute => *kind == Some(b'E'),
                    })
                    .map(|i| (i, arm.forward))
            });
            if found.is_some() {
                s.arm = None;
                shared.fired.fetch_add(1, Ordering::SeqCst);
            }
            found
        };
        if let Some((_, Forward::Yes)) = hit {
            // Before the COMMIT leaves, so its answer cannot slip through.
            swallow.store(true, Ordering::SeqCst);
        }
        let send = match hit {
            Some((i, Forward::No)) => &msgs[..i],
            _ => &msgs[..],
        };
        let bytes: Vec<u8> = send.iter().flat_map(|(_, m)| m.iter().copied()).collect();
        if !bytes.is_empty() && server.write_all(&bytes).is_err() {
            break;
        }
        match hit {
            None => {}
            Some((_, Forward::No)) => break,
            Some((_, Forward::Yes)) => {
                // The down pump swallows the answer and cuts when it has
                // come; cut anyway if it does not.
                if let (Ok(c), Ok(s)) = (client.try_clone(), server.try_clone()) {
                    let _ = std::thread::Builder::new()
                        .name("pg-proxy-cut".into())
                        .spawn(move || {
                            std::thread::sleep(ANSWER_WAIT);
                            cut(&c, &s);
                        });
                }
            }
        }
    }
    cut(&client, &server);
}

/// Server to client: forwards, or swallows an answer and then cuts.
fn down(mut server: TcpStream, mut client: TcpStream, shared: &Arc<Shared>, swallow: &AtomicBool) {
    let mut buf = vec![0u8; 64 * 1024];
    let mut swallowed: Vec<u8> = Vec::new();
    loop {
        if !shared.wait_open() {
            break;
        }
        let n = match server.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        if !shared.wait_open() {
            break;
        }
        if swallow.load(Ordering::SeqCst) {
            swallowed.extend_from_slice(&buf[..n]);
            if swallowed.windows(READY.len()).any(|w| w == READY) {
                break;
            }
            continue;
        }
        if client.write_all(&buf[..n]).is_err() {
            break;
        }
    }
    cut(&server, &client);
}
