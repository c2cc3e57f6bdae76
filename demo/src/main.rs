//! A small payments API made safe to retry with the `Idempotency-Key`
//! layer: axum on a real redb file (or a PostgreSQL database or a Redis
//! server, with the `postgres` or `redis` feature), a simulated payment
//! provider that keeps its own durable ledger and dedupes charges by the
//! claim's reference, and a resolver that asks the provider what happened to an UNKNOWN payment.
//! Each payment makes two calls, each an effect step of its claim: the
//! charge, then a receipt through a second simulated provider with a
//! ledger of its own.
//!
//! ```text
//! cargo run --release -p payments-demo -- demo
//! cargo run --release -p payments-demo -- serve --addr 127.0.0.1:8080
//! cargo run --release -p payments-demo --features postgres -- demo --store postgres://postgres@127.0.0.1/postgres
//! cargo run --release -p payments-demo --features redis -- demo --store redis://127.0.0.1:6379/
//! ```
//!
//! `demo` runs the server as a child process on an ephemeral loopback port
//! and drives real HTTP traffic at it: 20 concurrent duplicates, lost
//! responses retried, a tampered retry, a declined card, a provider timeout
//! after the charge, a server crash (abort) between the provider's
//! charge and its confirmation, and a SIGKILL between the two calls
//! (charge confirmed, receipt not sent), each followed by a restart and a
//! retry that resumes.
//! Then it serves the same API inside its own process on two engines of
//! its own: one on a manual clock, where a payment's key expires (TTL,
//! sweep, a tombstone answered 409, never charged again), and one on an
//! in-memory disk that fills up (503s, writes refused, space freed, the
//! database reopened, retries replayed, never charged twice). It then
//! audits both providers' ledgers and exits 1 if any payment was charged
//! or receipted twice or lost, or if a ledger is torn or unreadable. Its files go to a
//! fresh temporary directory unless `--store` names a redb file or a
//! PostgreSQL database (then only the provider's ledger is a temporary file);
//! the expiry phase's engine file is always a temporary one.
//!
//! `serve` keeps the API up for curl; demo/README.md ("Trying it by hand") has
//! the curl lines.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use axum::http::StatusCode;
use idempotency::ExpiryPolicy;
use payments_demo::store::Store;
use payments_demo::{demo, server};
use tracing_subscriber::filter::LevelFilter;

const USAGE: &str = "usage:
  payments demo [--store STORE] [--nats URL]
  payments serve [--addr ADDR] [--store STORE] [--ledger PATH] [--lease-ms MS]
                 [--nats URL]
                 [--ttl DURATION] [--expiry tombstone|tombstone:DURATION|forget]
                 [--header-read-timeout DURATION] [--mismatch-status 422|409|400]
                 [--crash-after-charge] [--crash-between-steps]
                 [--exit-on-stdin-eof]

STORE holds the idempotency records: the path of a redb file, a PostgreSQL
connection string (postgres://USER@HOST:PORT/DB or 'host=H port=P user=U
dbname=D'; needs a build with --features postgres), or a Redis URL
(redis://[:PASSWORD@]HOST:PORT/[DB]; needs --features redis, and a server
with appendonly yes and appendfsync always). On PostgreSQL the records
live in the tables payments_demo_* (created on first use), on Redis under
the keys payments_demo:*. The demo does not
clear them: its keys are new on every run, so earlier runs' records never
meet this run's. Without --store, demo uses a redb file in a fresh temporary
directory. demo's expiry and full-disk phases run in its own process on
engines of their own (a manual clock; an in-memory disk), whatever STORE is.
serve defaults: --addr 127.0.0.1:8080 --store payments.redb --lease-ms 10000
  --ttl 24h --expiry tombstone:30d --header-read-timeout 10s
  --mismatch-status 422
DURATION is a whole number with a unit: 500ms, 30s, 10m, 24h, 7d.
--ttl: how long a completed payment is replayed. --expiry: what a reused key
gets after that: `tombstone` (409 for the tombstone's lifetime, never a second
charge) or `forget` (the key is new again: a retry that late charges again).
--mismatch-status: the answer to a key reused with a different request: 422
(the IETF Idempotency-Key draft's), 409 or 400 (Stripe's).
The simulated card provider keeps its own ledger file: by default beside a
redb store (payments.redb -> payments.provider.jsonl) and
payments.provider.jsonl with PostgreSQL or Redis; --ledger names another.
The receipt provider's ledger is beside it (payments.receipts.jsonl). demo keeps both in
a temporary directory unless STORE is a redb file.
Each successful payment stores a payment.succeeded event in the outbox, in the
same write as its completion. --nats URL (needs a build with --features nats;
scripts/demo-nats runs one against a throwaway nats-server -js) relays the
outbox to the NATS JetStream stream PAYMENTS (subjects payment.>); demo then
also runs a ledger consumer that books each event exactly once, and audits
the events: published once per payment, 0 booked twice, 0 lost.
--crash-after-charge aborts the server right after the first charge, before
its step is confirmed; --crash-between-steps holds each payment once its
charge is confirmed, before the receipt is sent, and prints a line on stdout
(the demo then kills the server with SIGKILL).
Logs (the engine's and the HTTP layer's events) go to stderr at the level
RUST_LOG names (off, error, warn, info, debug or trace): serve logs warn and
above by default. demo prints its narrative on stdout and its servers'
stderr lines on stderr, marked [server]; it runs its servers at error unless
RUST_LOG is set, which also turns on logging for its in-process phases.";

/// The tombstone lifetime of `--expiry tombstone` without a duration.
const DEFAULT_TOMBSTONE_KEEP: Duration = Duration::from_secs(30 * 24 * 3600);

fn main() -> ExitCode {
    match try_main() {
        Ok(code) => code,
        Err(e) => {
            eprintln!("payments: {e}");
            ExitCode::FAILURE
        }
    }
}

fn try_main() -> Result<ExitCode, Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let command = args.next().ok_or(USAGE)?;
    let mut store = None;
    let mut ledger = None;
    let mut addr: SocketAddr = ([127, 0, 0, 1], 8080).into();
    let mut lease_ms = 10_000;
    let mut ttl = Duration::from_secs(24 * 3600);
    let mut expiry = ExpiryPolicy::Tombstone {
        keep: DEFAULT_TOMBSTONE_KEEP,
    };
    let mut header_read_timeout = Duration::from_secs(10);
    let mut mismatch_status = server::DEFAULT_MISMATCH_STATUS;
    let mut crash_after_charge = false;
    let mut pause_between_steps = false;
    let mut exit_on_stdin_eof = false;
    let mut nats = None;
    while let Some(arg) = args.next() {
        let mut value = || args.next().ok_or_else(|| format!("{arg} needs a value"));
        match arg.as_str() {
            "--store" => store = Some(Store::parse(&value()?)),
            "--nats" => nats = Some(value()?),
            "--ledger" if command == "serve" => ledger = Some(PathBuf::from(value()?)),
            "--addr" if command == "serve" => addr = value()?.parse()?,
            "--lease-ms" if command == "serve" => lease_ms = value()?.parse()?,
            "--ttl" if command == "serve" => ttl = parse_duration(&value()?)?,
            "--expiry" if command == "serve" => expiry = parse_expiry(&value()?)?,
            "--header-read-timeout" if command == "serve" => {
                header_read_timeout = parse_duration(&value()?)?;
            }
            "--mismatch-status" if command == "serve" => {
                mismatch_status = parse_mismatch_status(&value()?)?;
            }
            "--crash-after-charge" if command == "serve" => crash_after_charge = true,
            "--crash-between-steps" if command == "serve" => pause_between_steps = true,
            "--exit-on-stdin-eof" if command == "serve" => exit_on_stdin_eof = true,
            "-h" | "--help" => {
                println!("{USAGE}");
                return Ok(ExitCode::SUCCESS);
            }
            other => return Err(format!("unexpected argument {other:?}\n{USAGE}").into()),
        }
    }
    if let Some(store) = &store {
        store.check_supported()?;
    }
    #[cfg(not(feature = "nats"))]
    if let Some(url) = &nats {
        return Err(format!("--nats {url}: {}", payments_demo::store::NEEDS_NATS).into());
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    match command.as_str() {
        "demo" => {
            // The engines this process runs (the expiry and full-disk
            // phases) log only if RUST_LOG asks: the warnings and errors
            // those phases cause on purpose are what the narrative tells.
            server::init_logging(LevelFilter::OFF);
            let ok = runtime.block_on(demo::run(store, nats))?;
            Ok(if ok {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            })
        }
        "serve" => {
            let store = store.unwrap_or_else(|| Store::Redb(PathBuf::from("payments.redb")));
            let ledger = ledger.unwrap_or_else(|| match store.redb_path() {
                Some(db) => server::provider_path(db),
                None => PathBuf::from("payments.provider.jsonl"),
            });
            runtime.block_on(server::serve(server::ServeOptions {
                addr,
                store,
                ledger,
                lease: Duration::from_millis(lease_ms),
                ttl,
                expiry,
                header_read_timeout,
                mismatch_status,
                crash_after_charge,
                pause_between_steps,
                exit_on_stdin_eof,
                nats,
            }))?;
            Ok(ExitCode::SUCCESS)
        }
        "-h" | "--help" => {
            println!("{USAGE}");
            Ok(ExitCode::SUCCESS)
        }
        other => Err(format!("unknown command {other:?}\n{USAGE}").into()),
    }
}

/// `500ms`, `30s`, `10m`, `24h`, `7d`.
fn parse_duration(s: &str) -> Result<Duration, String> {
    let digits = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (number, unit) = s.split_at(digits);
    let n: u64 = number
        .parse()
        .map_err(|_| format!("{s:?} is not a duration (e.g. 500ms, 30s, 10m, 24h, 7d)"))?;
    let unit_ms: u64 = match unit {
        "ms" => 1,
        "s" => 1_000,
        "m" => 60_000,
        "h" => 3_600_000,
        "d" => 86_400_000,
        _ => return Err(format!("{s:?} needs a unit: ms, s, m, h or d (e.g. 30s)")),
    };
    n.checked_mul(unit_ms)
        .map(Duration::from_millis)
        .ok_or_else(|| format!("{s:?} is too long"))
}

/// `422`, `409` or `400`: the statuses a key reused with a different
/// request may get (the draft's, the layer's default, Stripe's).
fn parse_mismatch_status(s: &str) -> Result<StatusCode, String> {
    match s {
        "422" => Ok(StatusCode::UNPROCESSABLE_ENTITY),
        "409" => Ok(StatusCode::CONFLICT),
        "400" => Ok(StatusCode::BAD_REQUEST),
        _ => Err(format!("--mismatch-status {s:?}: expected 422, 409 or 400")),
    }
}

/// `tombstone`, `tombstone:DURATION` or `forget`.
fn parse_expiry(s: &str) -> Result<ExpiryPolicy, String> {
    match s.split_once(':') {
        None if s == "tombstone" => Ok(ExpiryPolicy::Tombstone {
            keep: DEFAULT_TOMBSTONE_KEEP,
        }),
        None if s == "forget" => Ok(ExpiryPolicy::Forget),
        Some(("tombstone", keep)) => Ok(ExpiryPolicy::Tombstone {
            keep: parse_duration(keep)?,
        }),
        _ => Err(format!(
            "--expiry {s:?}: expected tombstone, tombstone:DURATION or forget"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_need_a_unit() {
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("24h"), Ok(Duration::from_secs(86_400)));
        assert_eq!(parse_duration("7d"), Ok(Duration::from_secs(7 * 86_400)));
        assert!(parse_duration("30").is_err());
        assert!(parse_duration("s").is_err());
        assert!(parse_duration("1w").is_err());
    }

    #[test]
    fn mismatch_status_is_one_of_three() {
        assert_eq!(
            parse_mismatch_status("422"),
            Ok(StatusCode::UNPROCESSABLE_ENTITY)
        );
        assert_eq!(parse_mismatch_status("409"), Ok(StatusCode::CONFLICT));
        assert_eq!(parse_mismatch_status("400"), Ok(StatusCode::BAD_REQUEST));
        assert!(parse_mismatch_status("500").is_err());
        assert!(parse_mismatch_status("conflict").is_err());
    }

    #[test]
    fn expiry_defaults_to_a_tombstone() {
        assert_eq!(
            parse_expiry("tombstone"),
            Ok(ExpiryPolicy::Tombstone {
                keep: DEFAULT_TOMBSTONE_KEEP
            })
        );
        assert_eq!(
            parse_expiry("tombstone:1h"),
            Ok(ExpiryPolicy::Tombstone {
                keep: Duration::from_secs(3600)
            })
        );
        assert_eq!(parse_expiry("forget"), Ok(ExpiryPolicy::Forget));
        assert!(parse_expiry("delete").is_err());
    }
}
