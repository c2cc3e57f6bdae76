//! The Redis server of the fault tests: the throwaway one
//! `scripts/with-redis` started (which a test may SIGKILL and start again
//! on the same AOF and port), or a private one a test starts for itself
//! with other durability settings. Plus a few raw RESP commands (PING,
//! SCAN, UNLINK), so the tests need no client crate of their own.
//!
//! Include it with `#[path = "common/redis_server.rs"] mod redis_server;`.

#![allow(dead_code)] // each test file uses some of these

use std::error::Error;
use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

pub type BoxError = Box<dyn Error + Send + Sync>;

/// Set by `scripts/with-redis`: the server's URL.
pub const URL_VAR: &str = "IDEMPOTENCY_TEST_REDIS";

/// A Redis server a test can SIGKILL and start again on the same config
/// (same port, same AOF).
#[derive(Debug, Clone)]
pub struct Server {
    /// `redis://127.0.0.1:PORT/`.
    pub url: String,
    pub port: u16,
    /// The redis-server binary (as found on PATH: Debian's is a symlink
    /// whose name picks its role, so it is never resolved).
    pub bin: PathBuf,
    pub conf: PathBuf,
    pub pidfile: PathBuf,
    pub dir: PathBuf,
}

/// The server `scripts/with-redis` started, or `None` (after saying why)
/// when the tests do not run under it. Under `CI=true` a missing server
/// is a failure, not a skip.
pub fn shared_server() -> Option<Server> {
    let var = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
    let Some(url) = var(URL_VAR) else {
        if std::env::var("CI").is_ok_and(|v| v == "true") {
            panic!("CI=true but {URL_VAR} is not set: run the tests through scripts/with-redis (or scripts/with-services)");
        }
        eprintln!("skipped: {URL_VAR} not set (run through scripts/with-redis)");
        return None;
    };
    let fields = (
        var("IDEMPOTENCY_TEST_REDIS_PORT").and_then(|p| p.parse().ok()),
        var("IDEMPOTENCY_TEST_REDIS_SERVER"),
        var("IDEMPOTENCY_TEST_REDIS_CONF"),
        var("IDEMPOTENCY_TEST_REDIS_PIDFILE"),
        var("IDEMPOTENCY_TEST_REDIS_DIR"),
    );
    let (Some(port), Some(bin), Some(conf), Some(pidfile), Some(dir)) = fields else {
        panic!(
            "{URL_VAR} is set but not IDEMPOTENCY_TEST_REDIS_{{PORT,SERVER,CONF,PIDFILE,DIR}}: \
             this test restarts the server, so it needs the one scripts/with-redis starts"
        );
    };
    Some(Server {
        url,
        port,
        bin: bin.into(),
        conf: conf.into(),
        pidfile: pidfile.into(),
        dir: dir.into(),
    })
}

/// A port nothing listens on right now.
fn free_port() -> Result<u16, BoxError> {
    let l = std::net::TcpListener::bind("127.0.0.1:0")?;
    Ok(l.local_addr()?.port())
}

/// A server of this test's own, in its own temp dir, stopped (SIGKILL)
/// when dropped. `persistence` is config lines, e.g. `appendonly yes` and
/// `appendfsync everysec`, or `appendonly no` (no RDB snapshots either).
pub struct PrivateServer {
    pub server: Server,
    _dir: tempfile::TempDir,
}

impl PrivateServer {
    pub fn start(bin: &Path, persistence: &[&str]) -> Result<PrivateServer, BoxError> {
        let dir = tempfile::Builder::new().prefix("idem-redis-").tempdir()?;
        let port = free_port()?;
        let conf = dir.path().join("redis.conf");
        let pidfile = dir.path().join("redis.pid");
        std::fs::write(
            &conf,
            format!(
                "bind 127.0.0.1\nport {port}\nprotected-mode yes\ndaemonize no\ndir {}\n\
                 pidfile {}\nlogfile {}\nsave \"\"\n{}\n",
                dir.path().display(),
                pidfile.display(),
                dir.path().join("server.log").display(),
                persistence.join("\n"),
            ),
        )?;
        let server = Server {
            url: format!("redis://127.0.0.1:{port}/"),
            port,
            bin: bin.to_path_buf(),
            conf,
            pidfile,
            dir: dir.path().to_path_buf(),
        };
        server.start()?;
        Ok(PrivateServer { server, _dir: dir })
    }
}

impl Drop for PrivateServer {
    fn drop(&mut self) {
        if let Some(pid) = self.server.pid() {
            let _ = signal(pid, "KILL");
        }
    }
}

/// Sends `sig` (a name: `KILL`, `TERM`) to `pid` with kill(1).
fn signal(pid: u32, sig: &str) -> Result<(), BoxError> {
    let status = Command::new("kill")
        .arg(format!("-{sig}"))
        .arg(pid.to_string())
        .status()?;
    if !status.success() {
        return Err(format!("kill -{sig} {pid}: {status}").into());
    }
    Ok(())
}

/// Whether `pid` is a live redis-server (not a zombie, not a recycled PID).
fn is_redis(pid: u32) -> bool {
    let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
    let state = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // Field 3 of stat is the state; after the `(comm)` field.
    let zombie = state
        .rsplit_once(')')
        .is_some_and(|(_, rest)| rest.trim_start().starts_with('Z'));
    comm.starts_with("redis-server") && !zombie
}

impl Server {
    /// The PID of the running server, from its PID file.
    pub fn pid(&self) -> Option<u32> {
        let text = std::fs::read_to_string(&self.pidfile).ok()?;
        text.trim().parse().ok().filter(|&p| is_redis(p))
    }

    /// Starts `redis-server CONF` (detached from our stdio, so it may
    /// outlive this process: `scripts/with-redis` stops it through the PID
    /// file) and waits until it answers PING.
    pub fn start(&self) -> Result<(), BoxError> {
        let _ = std::fs::remove_file(&self.pidfile);
        Command::new(&self.bin)
            .arg(&self.conf)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()?;
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if self.ping() {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(format!(
                    "redis-server {} did not answer PING within 30 s (log in {})",
                    self.conf.display(),
                    self.dir.display()
                )
                .into());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// SIGKILLs the server (no shutdown, no final fsync), then starts it
    /// again on the same config and AOF. Returns how long it was down.
    pub fn kill_and_restart(&self) -> Result<Duration, BoxError> {
        let pid = self
            .pid()
            .ok_or_else(|| format!("no live redis-server in {}", self.pidfile.display()))?;
        let t0 = Instant::now();
        signal(pid, "KILL")?;
        while is_redis(pid) {
            if t0.elapsed() > Duration::from_secs(10) {
                return Err(format!("redis-server {pid} survived SIGKILL for 10 s").into());
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        self.start()?;
        Ok(t0.elapsed())
    }

    /// Whether the server answers PING with PONG (not LOADING).
    pub fn ping(&self) -> bool {
        self.command(&["PING"])
            .is_ok_and(|r| matches!(r, Reply::Status(s) if s == "PONG"))
    }

    /// One command on a fresh connection.
    pub fn command(&self, args: &[&str]) -> Result<Reply, BoxError> {
        let mut conn = Resp::connect(self.port)?;
        conn.call(args)
    }

    /// Deletes every key that starts with `prefix`.
    pub fn delete_prefix(&self, prefix: &str) -> Result<u64, BoxError> {
        delete_prefix(self.port, prefix)
    }
}

/// The port of a `redis://host:port/…` URL.
pub fn port_of(url: &str) -> Option<u16> {
    let rest = url.split_once("://")?.1;
    let authority = rest.split('/').next()?;
    let host_port = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
    host_port.rsplit_once(':')?.1.parse().ok()
}

/// Deletes every key that starts with `prefix` on the server at
/// 127.0.0.1:`port`; returns how many.
pub fn delete_prefix(port: u16, prefix: &str) -> Result<u64, BoxError> {
    let mut conn = Resp::connect(port)?;
    let pattern = format!("{prefix}*");
    let (mut cursor, mut deleted) = ("0".to_string(), 0);
    loop {
        let reply = conn.call(&["SCAN", &cursor, "MATCH", &pattern, "COUNT", "1000"])?;
        let Reply::Array(mut parts) = reply else {
            return Err(format!("SCAN answered {reply:?}").into());
        };
        let (Some(Reply::Array(keys)), Some(Reply::Bulk(Some(next)))) = (parts.pop(), parts.pop())
        else {
            return Err("SCAN answered an unexpected shape".into());
        };
        let keys: Vec<String> = keys
            .into_iter()
            .filter_map(|k| match k {
                Reply::Bulk(Some(b)) => String::from_utf8(b).ok(),
                _ => None,
            })
            .collect();
        if !keys.is_empty() {
            let mut args = vec!["UNLINK"];
            args.extend(keys.iter().map(String::as_str));
            if let Reply::Integer(n) = conn.call(&args)? {
                deleted += u64::try_from(n).unwrap_or(0);
            }
        }
        cursor = String::from_utf8(next)?;
        if cursor == "0" {
            return Ok(deleted);
        }
    }
}

/// A RESP2 reply.
#[derive(Debug, PartialEq, Eq)]
pub enum Reply {
    Status(String),
    Error(String),
    Integer(i64),
    Bulk(Option<Vec<u8>>),
    Array(Vec<Reply>),
}

/// A bare RESP2 connection, 5 s timeouts.
pub struct Resp {
    reader: BufReader<TcpStream>,
    writer: TcpStream,
}

impl Resp {
    pub fn connect(port: u16) -> Result<Resp, BoxError> {
        let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
        let stream = TcpStream::connect_timeout(&addr, Duration::from_secs(5))?;
        stream.set_read_timeout(Some(Duration::from_secs(5)))?;
        stream.set_write_timeout(Some(Duration::from_secs(5)))?;
        Ok(Resp {
            reader: BufReader::new(stream.try_clone()?),
            writer: stream,
        })
    }

    pub fn call(&mut self, args: &[&str]) -> Result<Reply, BoxError> {
        let mut out = format!("*{}\r\n", args.len()).into_bytes();
        for a in args {
            out.extend_from_slice(format!("${}\r\n", a.len()).as_bytes());
            out.extend_from_slice(a.as_bytes());
            out.extend_from_slice(b"\r\n");
        }
        self.writer.write_all(&out)?;
        self.read()
    }

    fn line(&mut self) -> Result<String, BoxError> {
        let mut line = String::new();
        if self.reader.read_line(&mut line)? == 0 {
            return Err("the server closed the connection".into());
        }
        Ok(line.trim_end_matches(['\r', '\n']).to_string())
    }

    fn read(&mut self) -> Result<Reply, BoxError> {
        let line = self.line()?;
        let (kind, rest) = line.split_at_checked(1).ok_or("an empty reply line")?;
        Ok(match kind {
            "+" => Reply::Status(rest.to_string()),
            "-" => Reply::Error(rest.to_string()),
            ":" => Reply::Integer(rest.parse()?),
            "$" => {
                let n: i64 = rest.parse()?;
                if n < 0 {
                    Reply::Bulk(None)
                } else {
                    let mut buf = vec![0; usize::try_from(n)? + 2];
                    std::io::Read::read_exact(&mut self.reader, &mut buf)?;
                    buf.truncate(buf.len() - 2);
                    Reply::Bulk(Some(buf))
                }
            }
            "*" => {
                let n: i64 = rest.parse()?;
                let mut items = Vec::new();
                for _ in 0..n.max(0) {
                    items.push(self.read()?);
                }
                Reply::Array(items)
            }
            _ => return Err(format!("not a RESP reply: {line:?}").into()),
        })
    }
}

/// A durable `redis-server` of one test's own (`appendonly yes`,
/// `appendfsync always`, no RDB) on a free loopback port, in its own temp
/// dir, started with `extra` command-line arguments (e.g. `--requirepass
/// PW`, `--maxmemory 2mb`), killed when dropped.
pub struct OwnServer {
    child: std::process::Child,
    /// The port it listens on (127.0.0.1).
    pub port: u16,
    _dir: tempfile::TempDir,
}

impl OwnServer {
    /// `redis://127.0.0.1:PORT/`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }
}

impl Drop for OwnServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts an [`OwnServer`] and waits (at most 10 s) until it accepts
/// connections. `Ok(None)`, after saying so, without a `redis-server` on
/// PATH; under `CI=true` that is an error, not a skip.
pub fn own_server(extra: &[&str]) -> Result<Option<OwnServer>, BoxError> {
    start_own(|port| {
        let mut args = vec!["--port".to_owned(), port.to_string()];
        args.extend(extra.iter().map(|a| (*a).to_owned()));
        args
    })
}

/// The files of a TLS server: its certificate (PEM, with the chain) and
/// key, and the CA file clients would check it against.
pub struct TlsFiles<'a> {
    pub cert: &'a Path,
    pub key: &'a Path,
    pub ca: &'a Path,
}

/// An [`OwnServer`] that speaks TLS only (no plaintext port; clients need
/// no certificate of their own), on `port` of the result. As
/// [`own_server`] otherwise.
pub fn own_tls_server(tls: &TlsFiles<'_>, extra: &[&str]) -> Result<Option<OwnServer>, BoxError> {
    start_own(|port| {
        let mut args: Vec<String> = ["--port", "0", "--tls-port", &port.to_string()]
            .iter()
            .map(|a| (*a).to_owned())
            .collect();
        for (flag, path) in [
            ("--tls-cert-file", tls.cert),
            ("--tls-key-file", tls.key),
            ("--tls-ca-cert-file", tls.ca),
        ] {
            args.push(flag.to_owned());
            args.push(path.display().to_string());
        }
        args.extend(["--tls-auth-clients".to_owned(), "no".to_owned()]);
        args.extend(extra.iter().map(|a| (*a).to_owned()));
        args
    })
}

/// Starts a durable server on a free port with the arguments `args(port)`
/// gives, and waits for its own "Ready to accept connections" log line.
fn start_own(args: impl Fn(u16) -> Vec<String>) -> Result<Option<OwnServer>, BoxError> {
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
    // A port found free may be taken by another test's server before this
    // one binds it: then this server exits, and is started again on
    // another port.
    for _ in 0..5 {
        let dir = tempfile::tempdir()?;
        let port = free_port()?;
        let log = dir.path().join("server.log");
        if let Some(child) = start_durable(dir.path(), &log, port, &args(port))? {
            return Ok(Some(OwnServer {
                child,
                port,
                _dir: dir,
            }));
        }
    }
    Err("redis-server exited at start five times (ports taken?)".into())
}

/// Starts a durable `redis-server` (`appendonly yes`, `appendfsync
/// always`, no RDB) on 127.0.0.1 with its AOF in `dir`, its log at `log`
/// and `args` after those (the port among them), and waits (at most 10 s)
/// for its own "Ready to accept connections" log line and a connection to
/// `port`: a connection alone could reach another test's server that took
/// the port first. `Ok(None)` when the server exited at start (the port
/// was taken); the server is killed if it does not get ready in time.
pub fn start_durable(
    dir: &Path,
    log: &Path,
    port: u16,
    args: &[String],
) -> Result<Option<std::process::Child>, BoxError> {
    let mut child = Command::new("redis-server")
        .args(["--bind", "127.0.0.1"])
        .args([
            "--save",
            "",
            "--appendonly",
            "yes",
            "--appendfsync",
            "always",
        ])
        .arg("--dir")
        .arg(dir)
        .arg("--logfile")
        .arg(log)
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()?;
    let until = Instant::now() + Duration::from_secs(10);
    loop {
        if child.try_wait()?.is_some() {
            return Ok(None);
        }
        let ready =
            std::fs::read_to_string(log).is_ok_and(|l| l.contains("Ready to accept connections"));
        if ready && TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return Ok(Some(child));
        }
        if Instant::now() > until {
            let _ = child.kill();
            let _ = child.wait();
            return Err("redis-server did not start".into());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `args` on the server at `port`, an error reply turned into an `Err`
/// naming the command.
pub fn checked(port: u16, args: &[&str]) -> Result<Reply, BoxError> {
    match Resp::connect(port)?.call(args)? {
        Reply::Error(e) => Err(format!("{args:?}: {e}").into()),
        reply => Ok(reply),
    }
}

/// The dataset digest of the server at `port` (`DEBUG DIGEST`; the server
/// needs `--enable-debug-command local`): any write changes it.
pub fn digest(port: u16) -> Result<String, BoxError> {
    match checked(port, &["DEBUG", "DIGEST"])? {
        Reply::Status(d) => Ok(d),
        other => Err(format!("DEBUG DIGEST answered {other:?}").into()),
    }
}

/// Makes `user` (password `password`) the read-only user the docs of
/// `EngineBuilder::open_redis_read_only` describe (`-@all +@read +info
/// +client|id +multi +exec`) on the server of `url`, allowed the keys
/// `keys` (a pattern such as `~*`; `None`: no key at all), and returns
/// `url` logged in as it.
pub fn read_only_user(
    url: &str,
    user: &str,
    password: &str,
    keys: Option<&str>,
) -> Result<String, BoxError> {
    let port = port_of(url).ok_or("a port in the server's URL")?;
    let password_rule = format!(">{password}");
    // `resetkeys` is the ACL default: no key until a pattern is given.
    checked(
        port,
        &[
            "ACL",
            "SETUSER",
            user,
            "on",
            &password_rule,
            keys.unwrap_or("resetkeys"),
            "-@all",
            "+@read",
            "+info",
            "+client|id",
            "+multi",
            "+exec",
        ],
    )?;
    Ok(url.replacen("redis://", &format!("redis://{user}:{password}@"), 1))
}

/// A user named `user` allowed every command and key except `CONFIG`, as a
/// managed service grants its customers, on the server at `url`; returns
/// the URL that logs in as that user.
pub fn no_config_user(url: &str, user: &str, password: &str) -> Result<String, BoxError> {
    let port = port_of(url).ok_or("a port in the server's URL")?;
    let password_rule = format!(">{password}");
    checked(
        port,
        &[
            "ACL",
            "SETUSER",
            user,
            "on",
            &password_rule,
            "~*",
            "&*",
            "+@all",
            "-config",
        ],
    )?;
    Ok(url.replacen("redis://", &format!("redis://{user}:{password}@"), 1))
}
