//! The behaviour every backend must share, run on each: every test body
//! here runs twice, as `<name>::redb` (a fresh redb file) and
//! `<name>::postgres` (a fresh table prefix on the server in
//! `IDEMPOTENCY_TEST_PG`; see `tests/common/backends.rs` for when those are
//! skipped). A backend that double-executes a key, replays the wrong bytes,
//! lets a fenced holder write, revives an expired lease, or commits an app
//! write without its completion fails here by name.
//!
//! `scripts/with-postgres cargo test --release --test backends` runs both.

mod common;

#[macro_use]
#[path = "common/backends.rs"]
mod harness;

mod backends {
    mod support;

    mod concurrent;
    mod database_clock;
    mod dead_letters;
    mod early;
    mod expiry;
    mod fencing;
    mod leases;
    mod listing;
    mod local;
    mod messaging;
    mod mismatch;
    mod recovery;
    mod reopen;
    mod steps;
    mod steps_deferred;
    mod steps_recovery;
    mod steps_release;
}
