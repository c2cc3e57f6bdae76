//! The library's `tracing` events on stderr. The engine reports what it
//! drops or repairs as warnings, not errors: a torn last journal frame at
//! open, salvage and sweep (`docs/operations.md` tells operators to look
//! for that warning after any crash), a merged record repaired from its
//! twin, a partition row rebuilt. Without a subscriber the CLI would
//! exit 0 and say nothing of them.

use tracing_subscriber::filter::{filter_fn, LevelFilter};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::Layer;

/// Sends `tracing` events to stderr at the level `RUST_LOG` names (`off`,
/// `error`, `warn`, `info`, `debug`, `trace`), else at `warn`. A
/// `RUST_LOG` that is not one of those (a per-module filter) is reported
/// on stderr and `warn` is used. The audit events of an operator's action
/// (`idempotency::AUDIT_TARGET`: a purge) are left out: the command prints
/// what it did itself. Installs nothing if a subscriber is set already.
pub(crate) fn init() {
    let default = LevelFilter::WARN;
    let level = match std::env::var("RUST_LOG") {
        Err(_) => default,
        Ok(value) => value.trim().parse().unwrap_or_else(|_| {
            eprintln!(
                "idem: RUST_LOG={value:?} is not a level (off, error, warn, info, debug, \
                 trace); logging at {default}"
            );
            default
        }),
    };
    let stderr = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_target(false)
        .without_time()
        .with_filter(level)
        .with_filter(filter_fn(|meta| meta.target() != idempotency::AUDIT_TARGET));
    let _ = tracing_subscriber::registry().with(stderr).try_init();
}
