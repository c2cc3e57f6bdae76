//! A small payments API made safe to retry with the `Idempotency-Key`
//! layer: axum on a real redb file, a simulated payment provider that keeps
//! its own durable ledger and dedupes charges by the claim's reference, and
//! a resolver that asks the provider what happened to an UNKNOWN payment.
//!
//! ```text
//! cargo run --release -p payments-demo -- demo
//! cargo run --release -p payments-demo -- serve --addr 127.0.0.1:8080
//! ```
//!
//! `demo` runs the server as a child process on an ephemeral loopback port
//! and drives real HTTP traffic at it: 20 concurrent duplicates, lost
//! responses retried, a tampered retry, a declined card, a provider timeout
//! after the charge, and a server crash (abort) between the provider's
//! charge and the recorded outcome, followed by a restart and a retry. It
//! then audits the provider's ledger and exits 1 if any payment was charged
//! twice or lost. Its files go to a fresh temporary directory unless
//! `--db PATH` is given.
//!
//! `serve` keeps the API up for curl; README.md ("The payments example") has
//! the curl lines.

mod demo;
mod provider;
mod server;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

const USAGE: &str = "usage:
  payments demo [--db PATH]
  payments serve [--addr ADDR] [--db PATH] [--lease-ms MS] [--crash-after-charge] [--exit-on-stdin-eof]

serve defaults: --addr 127.0.0.1:8080 --db payments.redb --lease-ms 10000
The provider's ledger is kept beside the database (payments.provider.jsonl).";

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
    let mut db = None;
    let mut addr: SocketAddr = ([127, 0, 0, 1], 8080).into();
    let mut lease_ms = 10_000;
    let mut crash_after_charge = false;
    let mut exit_on_stdin_eof = false;
    while let Some(arg) = args.next() {
        let mut value = || args.next().ok_or_else(|| format!("{arg} needs a value"));
        match arg.as_str() {
            "--db" => db = Some(PathBuf::from(value()?)),
            "--addr" if command == "serve" => addr = value()?.parse()?,
            "--lease-ms" if command == "serve" => lease_ms = value()?.parse()?,
            "--crash-after-charge" if command == "serve" => crash_after_charge = true,
            "--exit-on-stdin-eof" if command == "serve" => exit_on_stdin_eof = true,
            "-h" | "--help" => {
                println!("{USAGE}");
                return Ok(ExitCode::SUCCESS);
            }
            other => return Err(format!("unexpected argument {other:?}\n{USAGE}").into()),
        }
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    match command.as_str() {
        "demo" => {
            let ok = runtime.block_on(demo::run(db))?;
            Ok(if ok {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            })
        }
        "serve" => {
            runtime.block_on(server::serve(server::ServeOptions {
                addr,
                db: db.unwrap_or_else(|| PathBuf::from("payments.redb")),
                lease: Duration::from_millis(lease_ms),
                crash_after_charge,
                exit_on_stdin_eof,
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
