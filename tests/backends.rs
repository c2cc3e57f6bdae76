//! The behaviour every backend must share, run on each: every test body
//! here runs twice, as `<name>::redb` (a fresh redb file) and
//! `<name>::postgres` (a fresh table prefix on the server in
//! `IDEMPOTENCY_TEST_PG`; see `tests/common/backends.rs` for when those are
//! skipped). A backend that double-executes a key, replays the wrong bytes,
//! lets a fenced holder write, revives an expired lease, or commits an app
//! write without its completion fails here by name.
//!
//! `scripts/with-services cargo test --release --test services backends::`
//! runs them all.

mod common;

// The harness (`crate::harness`, which backends/support.rs re-exports, and
// its `both_backends!`) is declared once at the test binary's root
// (tests/services/main.rs): its table and key prefixes are unique through
// one counter per process.

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
