//! `idem`: inspect and repair an idempotency database from the shell.
//!
//! The database is a redb file, a PostgreSQL database or a Redis server:
//! every DB argument takes a file path, a PostgreSQL connection string (a
//! `postgres://` or `postgresql://` URL, or libpq's `host=... dbname=...`
//! form; see `target.rs`), and `--table-prefix` names the tables there, or
//! a Redis URL (`redis://`, `rediss://`), and `--key-prefix` names the key
//! prefix there.
//!
//! The database is opened with no background sweeper and never created:
//! `open_existing` / `open_postgres_existing` / `open_redis_existing` for
//! the commands that change it (`resolve`, `sweep`, `purge`, `redrive`),
//! `open_read_only` / `open_postgres_read_only` / `open_redis_read_only`
//! for the others, which write nothing (on PostgreSQL their sessions are
//! read-only, so a role with only `SELECT` on the tables can run them; on
//! Redis they run only reading commands, so a user whose ACL allows only
//! those, plus `INFO`, `CLIENT ID` and `MULTI`/`EXEC`, can run them, on a
//! replica too). A
//! mistyped Redis key prefix or database number is an error, not a new
//! empty store. redb locks the file: stop the app (or use its own admin
//! endpoint) while the CLI runs. On PostgreSQL and Redis the CLI may run
//! beside the app servers, as one more engine on the same data. Like any
//! engine on Redis, the commands that write refuse a server without
//! `appendonly yes` and `appendfsync always`, or one whose settings
//! `CONFIG GET` cannot read unless `--redis-durability-attested` is given.

#![forbid(unsafe_code)]

mod commands;
mod envelope_json;
mod logging;
mod render;
mod target;

use std::error::Error as StdError;
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::{ArgGroup, Parser, Subcommand};
use idempotency::{
    Engine, EngineBuilder, IdempotencyKey, OpenError, RecordFilter, Resolution, State,
    StepResolution,
};

use crate::commands::{CliError, CliResult};
use crate::target::Target;

/// Inspect and repair an idempotency database.
#[derive(Parser, Debug)]
#[command(name = "idem", version)]
struct Cli {
    /// The prefix of the engine's tables on PostgreSQL, as the app gives
    /// `EngineBuilder::table_prefix` (default `idempotency_`). Only with a
    /// PostgreSQL connection string.
    #[arg(long, global = true, value_name = "PREFIX")]
    table_prefix: Option<String>,
    /// The prefix of the engine's keys on Redis, as the app gives
    /// `EngineBuilder::redis_key_prefix` (default `idempotency:`). Only with
    /// a Redis URL.
    #[arg(long, global = true, value_name = "PREFIX")]
    key_prefix: Option<String>,
    /// A PEM file of the CA certificates trusted for a `rediss://` server,
    /// as the app gives `EngineBuilder::redis_tls_ca` (default: the
    /// system's trust store). Only with a `rediss://` URL.
    #[arg(long, global = true, value_name = "PEM_FILE")]
    redis_ca: Option<PathBuf>,
    /// A PEM file with the client certificate (then any intermediates) a
    /// `rediss://` connection presents to a server that requires one
    /// (mutual TLS), as the app gives
    /// `EngineBuilder::redis_tls_client_cert`. Needs --redis-client-key.
    #[arg(
        long,
        global = true,
        value_name = "PEM_FILE",
        requires = "redis_client_key"
    )]
    redis_client_cert: Option<PathBuf>,
    /// The PEM file of the private key of --redis-client-cert.
    #[arg(
        long,
        global = true,
        value_name = "PEM_FILE",
        requires = "redis_client_cert"
    )]
    redis_client_key: Option<PathBuf>,
    /// The Redis server's persistence settings cannot be read (a managed
    /// service that blocks CONFIG) and you checked with the provider that
    /// every write persists before its reply and no key is evicted, as the
    /// app gives `EngineBuilder::redis_durability_attested(true)`. Only
    /// with a Redis URL; the commands that write need it on such a server.
    #[arg(long, global = true)]
    redis_durability_attested: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// List records: scope, key, state, age, fingerprint prefix, status.
    Inspect {
        /// The database file, a PostgreSQL connection string or a Redis URL.
        db: PathBuf,
        /// Only records in this scope.
        #[arg(long)]
        scope: Option<String>,
        /// Only records in this state, as stored (PROCESSING, COMPLETED,
        /// FINAL_FAILURE, UNKNOWN, TOMBSTONE).
        #[arg(long, value_parser = parse_state)]
        state: Option<State>,
        /// At most this many rows.
        #[arg(long)]
        limit: Option<usize>,
        /// One JSON array of objects.
        #[arg(long)]
        json: bool,
    },
    /// Show one record with every field, its stored response, its effect
    /// steps and its history (the evidence log).
    Show {
        /// The database file, a PostgreSQL connection string or a Redis URL.
        db: PathBuf,
        /// The record's scope.
        scope: String,
        /// The record's key.
        key: String,
        /// One JSON object; its `response` is valid input for
        /// `resolve --completed`.
        #[arg(long)]
        json: bool,
    },
    /// List records in doubt awaiting recovery, oldest first: UNKNOWN ones
    /// and PROCESSING ones whose lease has ended, each with its effect
    /// steps not yet settled (their attempts and age).
    Unknown {
        /// The database file, a PostgreSQL connection string or a Redis URL.
        db: PathBuf,
        /// One JSON array of objects.
        #[arg(long)]
        json: bool,
        /// At most this many rows.
        #[arg(long)]
        limit: Option<usize>,
    },
    /// Settle one UNKNOWN record, or one of its effect steps (--step), after
    /// checking with the provider. --reason is required and recorded in the
    /// key's history.
    #[command(group(ArgGroup::new("outcome").required(true).args(["not_executed", "completed", "executed"])))]
    Resolve {
        /// The database file, a PostgreSQL connection string or a Redis URL.
        db: PathBuf,
        /// The record's scope.
        scope: String,
        /// The record's key.
        key: String,
        /// Why you settle it this way (what the provider said, a ticket):
        /// written to the key's history with the settlement. Required, not
        /// blank, at most 1024 bytes.
        #[arg(long, value_name = "TEXT")]
        reason: String,
        /// Settle this effect step only (by its name, as `idem show`
        /// lists it), with --executed or --not-executed. The key settles
        /// once all its steps have.
        #[arg(long, value_name = "NAME", conflicts_with = "completed")]
        step: Option<String>,
        /// Without --step: the work never happened, release the key so the
        /// next request executes afresh. With --step: the provider never
        /// executed that call; the next attempt makes it under the same
        /// reference.
        #[arg(long)]
        not_executed: bool,
        /// The work happened and this was its response (see cli/README.md
        /// for the file's shape). Later requests replay it.
        #[arg(long, value_name = "ENVELOPE.json")]
        completed: Option<PathBuf>,
        /// With --step: the provider executed the call; EVIDENCE (its
        /// answer, as text) is recorded with the step, and the next
        /// attempt skips the call.
        #[arg(long, value_name = "EVIDENCE", requires = "step")]
        executed: Option<String>,
    },
    /// List dead letters, oldest first: messages an inbox gave up on after
    /// clean failures (or refused as bad input). Messages in doubt are never
    /// here: they are listed by `unknown`.
    DeadLetters {
        /// The database file, a PostgreSQL connection string or a Redis URL.
        db: PathBuf,
        /// One JSON array of objects (payloads as lossy UTF-8 and hex).
        #[arg(long)]
        json: bool,
        /// At most this many rows.
        #[arg(long)]
        limit: Option<usize>,
    },
    /// Move one dead letter back for redelivery: out of the list and into
    /// the outbox (same topic and payload) in one write, under a new
    /// message id `<id>~redrive<seq>.<unique>@<dead_at_ms>.<digest>` that the relay publishes.
    Redrive {
        /// The database file, a PostgreSQL connection string or a Redis URL.
        db: PathBuf,
        /// The dead letter's SEQ, as `dead-letters` lists it.
        seq: u64,
    },
    /// Run one sweep pass: stale claims to UNKNOWN, expired records deleted
    /// or tombstoned.
    Sweep {
        /// The database file, a PostgreSQL connection string or a Redis URL.
        db: PathBuf,
    },
    /// Scrub the whole database (file or tables): every record, outbox message and entity
    /// decodes, every index entry matches its record and back; on a file, also
    /// redb's page checksums, as the server's open checks them, naming the
    /// damaged page and the keys on it. Read-only;
    /// exits 1 with the list of problems if there is any.
    Verify {
        /// The database file, a PostgreSQL connection string or a Redis URL.
        db: PathBuf,
        /// One JSON object.
        #[arg(long)]
        json: bool,
    },
    /// Count records by state.
    Stats {
        /// The database file, a PostgreSQL connection string or a Redis URL.
        db: PathBuf,
        /// One JSON object.
        #[arg(long)]
        json: bool,
    },
    /// Delete one record (PROCESSING and UNKNOWN only with --force).
    Purge {
        /// The database file, a PostgreSQL connection string or a Redis URL.
        db: PathBuf,
        /// The record's scope.
        scope: String,
        /// The record's key.
        key: String,
        /// Also delete a PROCESSING or UNKNOWN record. A retry may then
        /// execute its work a second time.
        #[arg(long)]
        force: bool,
    },
    /// Copy what still reads of a damaged database file (one an open
    /// refuses as corrupt) into a new file, with the changes its journal
    /// holds, and list every key that could not be copied. DAMAGED is only
    /// read; NEW must not exist (or be empty). Exit code: 0 when
    /// everything was copied, 3 when some keys were lost (they are listed:
    /// resolve them before serving them), 1 on an error (nothing written to
    /// NEW, unless only the final directory sync failed: the message says
    /// so), 2 on a command-line mistake (for example a PostgreSQL
    /// connection string: salvage reads redb files). Stop the app first. See docs/operations.md, "Salvage: back in service after damage".
    Salvage {
        /// The damaged database file (redb only).
        damaged: PathBuf,
        /// The new database file to write.
        new: PathBuf,
        /// One JSON object.
        #[arg(long)]
        json: bool,
    },
    /// Migrate a redb file of format 2 (an earlier release's) to format 3
    /// (time-partitioned records), as `EngineBuilder::migrate_to_format_3`
    /// does, and say the format before and after. A format-3 file is left
    /// as it is. A crash or an error part way leaves a format-2 file that
    /// serves as before; running the command again goes on from the last
    /// step. Cannot be undone: releases before format 3 refuse the file, so
    /// keep a copy of it and its journal. Stop the app first. See
    /// docs/operations.md, "Migrating a format-2 file".
    Migrate {
        /// The database file (redb only).
        db: PathBuf,
        /// One JSON object.
        #[arg(long)]
        json: bool,
    },
    /// Give a redb file's free pages back to the file system, as
    /// `EngineBuilder::compact` does: redb never shrinks a file whose free
    /// pages are not at its end, so a store that once held more records
    /// keeps its length until compacted. Recovers the file first if a
    /// crash left it so (its journal applied), then moves its pages in
    /// use to the front and cuts the rest off; nothing it holds changes. A
    /// crash part way leaves a file that opens as before. Reads and
    /// rewrites up to the whole file. Stop the app first (an app holding
    /// the file makes it fail). See docs/operations.md, "Compacting a file".
    Compact {
        /// The database file (redb only).
        db: PathBuf,
        /// One JSON object.
        #[arg(long)]
        json: bool,
    },
}

fn parse_state(name: &str) -> Result<State, String> {
    State::parse(name).ok_or_else(|| {
        format!("unknown state {name:?} (PROCESSING, COMPLETED, FINAL_FAILURE, UNKNOWN, TOMBSTONE)")
    })
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    logging::init();
    match try_main(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if is_broken_pipe(&*e) => ExitCode::SUCCESS,
        Err(e) if e.downcast_ref::<commands::KeysLost>().is_some() => {
            eprintln!("idem: {}", one_line(&*e));
            ExitCode::from(3)
        }
        Err(e) if is_usage(&*e) => {
            eprintln!("idem: {}", one_line(&*e));
            ExitCode::from(2)
        }
        Err(e) => {
            eprintln!("idem: {}", one_line(&*e));
            ExitCode::FAILURE
        }
    }
}

fn try_main(cli: Cli) -> CliResult {
    let stdout = io::stdout();
    let mut out = io::BufWriter::new(stdout.lock());
    let prefix = Prefixes {
        table: cli.table_prefix.as_deref(),
        key: cli.key_prefix.as_deref(),
        redis_ca: cli.redis_ca.as_deref(),
        redis_client: cli
            .redis_client_cert
            .as_deref()
            .zip(cli.redis_client_key.as_deref()),
        attested: cli.redis_durability_attested,
    };
    run(cli.command, prefix, &mut out, &mut io::stderr())?;
    out.flush()?;
    Ok(())
}

/// Opens the database (tables or keys under `prefix` on PostgreSQL or
/// Redis) and runs one
/// command, writing its report to `out` and warnings to `warn`.
fn run<W: Write, E: Write>(
    command: Command,
    prefix: Prefixes<'_>,
    out: &mut W,
    warn: &mut E,
) -> CliResult {
    // Never sweep unless asked; follow the app's stored TTL and expiry
    // policy, so a sweep or a resolution keeps the app's contract.
    let builder = || Opener {
        builder: Engine::builder()
            .sweep_interval(None)
            .expiry_settings_from_database(),
        prefix,
    };
    match command {
        Command::Inspect {
            db,
            scope,
            state,
            limit,
            json,
        } => {
            let filter = RecordFilter {
                scope,
                state,
                limit,
            };
            commands::inspect(&open_read_only(&db, builder())?, &filter, json, out)
        }
        Command::Show {
            db,
            scope,
            key,
            json,
        } => {
            let key = IdempotencyKey::parse_any(&scope, &key)?;
            commands::show(&open_read_only(&db, builder())?, &key, json, out)
        }
        Command::Unknown { db, json, limit } => {
            let engine = open_read_only(&db, builder())?;
            commands::unknown(&engine, limit.unwrap_or(usize::MAX), json, out)
        }
        Command::Resolve {
            db,
            scope,
            key,
            reason,
            step,
            not_executed,
            completed,
            executed,
        } => {
            let key = IdempotencyKey::parse_any(&scope, &key)?;
            if reason.trim().is_empty() {
                return Err(UsageError(
                    "--reason must say why (what the provider said, a ticket): it is \
                     recorded in the key's history"
                        .into(),
                )
                .into());
            }
            // clap enforces exactly one outcome, --completed without --step
            // and --executed with it.
            if let Some(step) = step {
                let resolution = match (not_executed, executed) {
                    (true, None) => StepResolution::NotExecuted,
                    (false, Some(evidence)) => StepResolution::Executed(evidence.into_bytes()),
                    _ => return Err(UsageError("give --executed or --not-executed".into()).into()),
                };
                let engine = open(&db, builder())?;
                return commands::resolve_step(&engine, &key, &step, resolution, &reason, out);
            }
            let resolution = match (not_executed, completed) {
                (true, None) => Resolution::NotExecuted,
                (false, Some(path)) => Resolution::Completed(read_envelope(&path)?),
                _ => {
                    return Err(UsageError(
                        "give --not-executed or --completed (--executed needs --step)".into(),
                    )
                    .into())
                }
            };
            let engine = open(&db, builder())?;
            commands::resolve(&engine, &key, resolution, &reason, out)
        }
        Command::DeadLetters { db, json, limit } => commands::dead_letters(
            &open_read_only(&db, builder())?,
            limit.unwrap_or(usize::MAX),
            json,
            out,
        ),
        Command::Redrive { db, seq } => commands::redrive(&open(&db, builder())?, seq, out),
        Command::Sweep { db } => commands::sweep(&open(&db, builder())?, out),
        Command::Stats { db, json } => commands::stats(&open_read_only(&db, builder())?, json, out),
        Command::Verify { db, json } => {
            commands::verify(&open_read_only(&db, builder())?, json, out)
        }
        Command::Purge {
            db,
            scope,
            key,
            force,
        } => {
            let key = IdempotencyKey::parse_any(&scope, &key)?;
            commands::purge(&open(&db, builder())?, &key, force, out, warn)
        }
        Command::Salvage { damaged, new, json } => {
            for path in [&damaged, &new] {
                if !matches!(target::classify(path), Target::File(_)) {
                    return Err(UsageError(
                        "salvage works on redb files, not PostgreSQL databases or Redis servers"
                            .into(),
                    )
                    .into());
                }
            }
            if prefix.table.is_some() {
                return Err(UsageError(
                    "--table-prefix applies to a PostgreSQL connection string, not to salvage"
                        .into(),
                )
                .into());
            }
            if prefix.key.is_some()
                || prefix.redis_ca.is_some()
                || prefix.redis_client.is_some()
                || prefix.attested
            {
                return Err(UsageError(
                    "--key-prefix, --redis-ca, --redis-client-cert and --redis-durability-attested \
                     apply to a Redis URL, not to salvage"
                        .into(),
                )
                .into());
            }
            commands::salvage(&damaged, &new, json, out)
        }
        Command::Compact { db, json } => {
            let Target::File(path) = target::classify(&db) else {
                return Err(UsageError(
                    "compact works on redb files; PostgreSQL and Redis manage their own space"
                        .into(),
                )
                .into());
            };
            let started = std::time::Instant::now();
            let report = builder().builder.compact(path)?;
            commands::compacted(path, &report, started.elapsed(), json, out)
        }
        Command::Migrate { db, json } => {
            if !matches!(target::classify(&db), Target::File(_)) {
                return Err(UsageError(
                    "migrate works on redb files; PostgreSQL and Redis have no format to migrate"
                        .into(),
                )
                .into());
            }
            // The format before. The read-only probe also refuses what is
            // no database of ours (another program's redb file, a
            // directory) before anything is written. A file that needs
            // recovery after a crash cannot be read without writing: an
            // open without the migration recovers it first (a format-1
            // file also becomes format 2 there, as any writable open).
            let before = match open_read_only(&db, builder()) {
                Ok(engine) => engine.redb_format(),
                Err(e) if matches!(e.downcast_ref(), Some(OpenError::NeedsRecovery { .. })) => {
                    open(&db, builder())?.redb_format()
                }
                Err(e) => return Err(e),
            };
            let started = std::time::Instant::now();
            let mut opener = builder();
            opener.builder = opener.builder.migrate_to_format_3();
            let engine = open(&db, opener)?;
            let report = commands::Migrated {
                path: &db,
                before,
                after: engine.redb_format(),
                took: started.elapsed(),
            };
            drop(engine);
            commands::migrated(&report, json, out)
        }
    }
}

/// The `--table-prefix`, `--key-prefix`, `--redis-ca` and
/// `--redis-client-cert`/`--redis-client-key` given.
#[derive(Debug, Clone, Copy)]
struct Prefixes<'a> {
    table: Option<&'a str>,
    key: Option<&'a str>,
    redis_ca: Option<&'a Path>,
    /// The client certificate and key files.
    redis_client: Option<(&'a Path, &'a Path)>,
    /// `--redis-durability-attested`.
    attested: bool,
}

/// A builder with the CLI's settings, and the prefixes given.
struct Opener<'a> {
    builder: EngineBuilder,
    prefix: Prefixes<'a>,
}

/// A mistake in the command line found after parsing (exit code 2, as
/// clap's own).
#[derive(Debug)]
struct UsageError(String);

impl std::fmt::Display for UsageError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl StdError for UsageError {}

/// The builder for `db`: the table prefix applies to PostgreSQL only, the
/// key prefix to Redis only.
fn target<'d>(db: &'d Path, opener: Opener<'_>) -> CliResult<(Target<'d>, EngineBuilder)> {
    let target = target::classify(db);
    let Opener { builder, prefix } = opener;
    let tls = matches!(target, Target::Redis(url) if target::has_scheme(url, "rediss"));
    // What `db` is, for a usage error; `tls_flag` when the flag is a TLS
    // one, whose mistake on Redis is a URL without TLS.
    let what = |tls_flag: bool| match &target {
        Target::File(path) => format!("the file {}", path.display()),
        Target::Postgres(_) => "a PostgreSQL connection string".to_owned(),
        Target::Redis(_) if tls_flag && !tls => {
            "a redis:// URL (no TLS: use rediss://, or drop the flag)".to_owned()
        }
        Target::Redis(_) => "a Redis URL".to_owned(),
    };
    // A prefix flag given for a target it does not apply to.
    let misplaced = |flag: &str, applies: &str| -> CliResult<(Target<'d>, EngineBuilder)> {
        let what = what(false);
        Err(UsageError(format!("{flag} applies to {applies}, not to {what}")).into())
    };
    // A TLS flag (`--redis-ca`, `--redis-client-cert`) without a rediss:// URL.
    let misplaced_tls = |flag: &str| -> CliResult<(Target<'d>, EngineBuilder)> {
        let what = what(true);
        Err(UsageError(format!("{flag} applies to a rediss:// URL, not to {what}")).into())
    };
    let builder = match (&target, prefix.redis_ca) {
        (Target::Redis(_), Some(ca)) if tls => builder.redis_tls_ca(ca),
        (_, Some(_)) => return misplaced_tls("--redis-ca"),
        (_, None) => builder,
    };
    let builder = match (&target, prefix.redis_client) {
        (Target::Redis(_), Some((cert, key))) if tls => builder.redis_tls_client_cert(cert, key),
        (_, Some(_)) => return misplaced_tls("--redis-client-cert"),
        (_, None) => builder,
    };
    // redis-cli's variable: a password kept off the command line, used
    // when the URL has none.
    let builder = match (&target, std::env::var(REDIS_PASSWORD_VAR)) {
        (Target::Redis(_), Ok(password)) if !password.is_empty() => {
            builder.redis_password(password)
        }
        _ => builder,
    };
    let builder = match (&target, prefix.attested) {
        (Target::Redis(_), true) => builder.redis_durability_attested(true),
        (_, true) => return misplaced("--redis-durability-attested", "a Redis URL"),
        (_, false) => builder,
    };
    match (&target, prefix.table, prefix.key) {
        (Target::File(_) | Target::Redis(_), Some(_), _) => {
            misplaced("--table-prefix", "a PostgreSQL connection string")
        }
        (Target::File(_) | Target::Postgres(_), _, Some(_)) => {
            misplaced("--key-prefix", "a Redis URL")
        }
        (Target::Postgres(_), Some(p), None) => Ok((target, builder.table_prefix(p))),
        (Target::Redis(_), None, Some(p)) => Ok((target, builder.redis_key_prefix(p))),
        (_, None, None) => Ok((target, builder)),
    }
}

/// For commands that write: never creates a database or tables (on Redis,
/// see the module doc).
fn open(db: &Path, opener: Opener<'_>) -> CliResult<Engine> {
    Ok(match target(db, opener)? {
        (Target::File(path), builder) => builder.open_existing(path)?,
        (Target::Postgres(url), builder) => builder.open_postgres_existing(url)?,
        (Target::Redis(url), builder) => builder.open_redis_existing(url)?,
    })
}

/// For commands that only read: a file is left byte-identical (no header
/// rewrite, no tables added to another program's file); on PostgreSQL
/// every session is read-only; on Redis only reading commands are sent
/// (see the module doc).
fn open_read_only(db: &Path, opener: Opener<'_>) -> CliResult<Engine> {
    Ok(match target(db, opener)? {
        (Target::File(path), builder) => builder.open_read_only(path)?,
        (Target::Postgres(url), builder) => builder.open_postgres_read_only(url)?,
        (Target::Redis(url), builder) => builder.open_redis_read_only(url)?,
    })
}

fn read_envelope(path: &Path) -> CliResult<idempotency::Envelope> {
    let text = std::fs::read_to_string(path).map_err(|e| {
        CliError(format!(
            "{}: cannot read envelope file: {e}",
            path.display()
        ))
    })?;
    envelope_json::parse(&text)
        .map_err(|e| CliError(format!("{}: invalid envelope: {e}", path.display())).into())
}

/// The environment variable a Redis password is read from when the URL
/// has none: redis-cli's.
const REDIS_PASSWORD_VAR: &str = "REDISCLI_AUTH";

/// The library's builder settings that have a flag (or a variable) here,
/// and that flag: an error that names the setting names the flag instead.
const FLAGS: [(&str, &str); 6] = [
    ("EngineBuilder::redis_password", REDIS_PASSWORD_VAR),
    (
        "EngineBuilder::redis_durability_attested(true)",
        "--redis-durability-attested",
    ),
    ("EngineBuilder::redis_tls_ca", "--redis-ca"),
    (
        "EngineBuilder::redis_tls_client_cert",
        "--redis-client-cert and --redis-client-key",
    ),
    ("EngineBuilder::redis_key_prefix", "--key-prefix"),
    ("EngineBuilder::table_prefix", "--table-prefix"),
];

/// The error's message and its sources joined with `": "`, on one line. A
/// source whose text the message already contains (errors that print their
/// source in their own `Display`) is not repeated. A builder setting the
/// CLI has a flag for is named by its flag ([`FLAGS`]).
fn one_line(e: &dyn StdError) -> String {
    let mut line = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let text = s.to_string();
        if !line.contains(&text) {
            line.push_str(": ");
            line.push_str(&text);
        }
        source = s.source();
    }
    for (setting, flag) in FLAGS {
        line = line.replace(setting, flag);
    }
    line.replace(['\n', '\r'], " ")
}

/// A command-line mistake: exit code 2.
fn is_usage(e: &(dyn StdError + 'static)) -> bool {
    e.downcast_ref::<UsageError>().is_some()
        || matches!(
            e.downcast_ref::<OpenError>(),
            Some(OpenError::InvalidTablePrefix { .. })
        )
        || matches!(
            e.downcast_ref::<idempotency::Error>(),
            Some(idempotency::Error::ReasonRequired | idempotency::Error::ReasonTooLong { .. })
        )
}

fn is_broken_pipe(e: &(dyn StdError + 'static)) -> bool {
    e.downcast_ref::<io::Error>()
        .is_some_and(|e| e.kind() == io::ErrorKind::BrokenPipe)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug)]
    struct Outer(io::Error, bool);

    impl std::fmt::Display for Outer {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            if self.1 {
                write!(f, "outer: {}", self.0)
            } else {
                write!(f, "outer")
            }
        }
    }

    impl StdError for Outer {
        fn source(&self) -> Option<&(dyn StdError + 'static)> {
            Some(&self.0)
        }
    }

    #[test]
    fn one_line_joins_sources_without_repeating_them() {
        let inner = || io::Error::other("disk\nfull");
        assert_eq!(one_line(&Outer(inner(), false)), "outer: disk full");
        assert_eq!(one_line(&Outer(inner(), true)), "outer: disk full");
    }

    #[test]
    fn one_line_names_flags_not_builder_settings() {
        let e = io::Error::other(
            "name a CA file with EngineBuilder::redis_tls_ca; give one with \
             EngineBuilder::redis_tls_client_cert; or EngineBuilder::allow_volatile(true)",
        );
        assert_eq!(
            one_line(&e),
            "name a CA file with --redis-ca; give one with --redis-client-cert and \
             --redis-client-key; or EngineBuilder::allow_volatile(true)"
        );
    }

    #[test]
    fn cli_definition_is_valid() {
        use clap::CommandFactory;
        Cli::command().debug_assert();
    }

    #[test]
    fn missing_database_is_an_error_not_a_new_file() -> Result<(), Box<dyn StdError>> {
        let dir = std::env::temp_dir().join(format!("idem-unit-{}", std::process::id()));
        let path = dir.join("absent.redb");
        let cmd = Command::Stats {
            db: path.clone(),
            json: false,
        };
        let mut out = Vec::new();
        let err = run(
            cmd,
            Prefixes {
                table: None,
                key: None,
                redis_ca: None,
                redis_client: None,
                attested: false,
            },
            &mut out,
            &mut io::sink(),
        )
        .err()
        .ok_or("expected an error")?;
        assert!(one_line(&*err).contains("no such database file"), "{err}");
        assert!(!path.exists());
        Ok(())
    }
}
