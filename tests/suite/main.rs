//! Most integration tests in one binary: each `tests/<name>.rs` is the
//! module `<name>` here, so its tests are named `<name>::<test>` (run one
//! file with `cargo test --release --test suite <name>::`). One binary
//! instead of one per file: each file was its own optimized binary linked
//! against the whole library, and those builds were most of CI's time.
//!
//! Only tests that can share a process and run beside any other test
//! belong here; Cargo.toml lists the ones that have a binary of their own,
//! and why, and those that need the PostgreSQL, Redis and NATS servers
//! (tests/services/main.rs). A test that starts this binary again as a
//! child names itself by its module path (`<name>::child_entry`).

// The helpers in tests/common/ stay modules of each file that uses them,
// as when every file was a binary of its own (a helper's `super::` is
// that file), so clippy sees one helper file loaded more than once.
#![allow(clippy::duplicate_mod)]

#[path = "../async_engine.rs"]
mod async_engine;
#[path = "../bad_input.rs"]
mod bad_input;
#[path = "../breaker29_redrive_ids.rs"]
mod breaker29_redrive_ids;
#[path = "../byte_flips.rs"]
mod byte_flips;
#[path = "../clock_reads.rs"]
mod clock_reads;
#[path = "../close_under_load.rs"]
mod close_under_load;
#[path = "../compaction.rs"]
mod compaction;
#[path = "../concurrent_claims.rs"]
mod concurrent_claims;
#[path = "../crash.rs"]
mod crash;
#[path = "../dead_letter_damage.rs"]
mod dead_letter_damage;
#[path = "../disk_full_figures.rs"]
mod disk_full_figures;
#[path = "../early_settlement.rs"]
mod early_settlement;
#[path = "../expiry.rs"]
mod expiry;
#[path = "../fingerprint_mismatch.rs"]
mod fingerprint_mismatch;
#[path = "../format1_fixture.rs"]
mod format1_fixture;
#[path = "../format2_fixture.rs"]
mod format2_fixture;
#[path = "../format2_steps_fixture.rs"]
mod format2_steps_fixture;
#[path = "../group_split.rs"]
mod group_split;
#[path = "../http_bad_input.rs"]
mod http_bad_input;
#[path = "../http_cancellation.rs"]
mod http_cancellation;
#[path = "../http_capacity.rs"]
mod http_capacity;
#[path = "../http_completion_messages.rs"]
mod http_completion_messages;
#[path = "../http_defaults.rs"]
mod http_defaults;
#[path = "../http_disk_full.rs"]
mod http_disk_full;
#[path = "../http_kill.rs"]
mod http_kill;
#[path = "../http_large_bodies.rs"]
mod http_large_bodies;
#[path = "../http_layer.rs"]
mod http_layer;
#[path = "../http_semantics.rs"]
mod http_semantics;
#[path = "../http_slow_body.rs"]
mod http_slow_body;
#[path = "../http_steps.rs"]
mod http_steps;
#[path = "../inbox_outbox.rs"]
mod inbox_outbox;
#[path = "../journal_damage.rs"]
mod journal_damage;
#[path = "../journal_faults.rs"]
mod journal_faults;
#[path = "../journal_sync_faults.rs"]
mod journal_sync_faults;
#[path = "../kill_checkpoints.rs"]
mod kill_checkpoints;
#[path = "../kill_format3.rs"]
mod kill_format3;
#[path = "../kill_loop.rs"]
mod kill_loop;
#[path = "../kill_mixed.rs"]
mod kill_mixed;
#[path = "../layering.rs"]
mod layering;
#[path = "../merge_races.rs"]
mod merge_races;
#[path = "../meta_damage.rs"]
mod meta_damage;
#[path = "../operator_mistakes.rs"]
mod operator_mistakes;
#[path = "../pipeline_local.rs"]
mod pipeline_local;
#[path = "../pipeline_reads.rs"]
mod pipeline_reads;
#[path = "../poisoned_reads.rs"]
mod poisoned_reads;
#[path = "../power_cuts.rs"]
mod power_cuts;
#[path = "../prop_canonical.rs"]
mod prop_canonical;
#[path = "../recovery.rs"]
mod recovery;
#[path = "../reopen_backoff.rs"]
mod reopen_backoff;
#[path = "../reopen_replay.rs"]
mod reopen_replay;
#[path = "../salvage.rs"]
mod salvage;
#[path = "../salvage_format3.rs"]
mod salvage_format3;
#[path = "../space_reserve.rs"]
mod space_reserve;
#[path = "../steps_breaker_full_disk.rs"]
mod steps_breaker_full_disk;
#[path = "../steps_breaker_http.rs"]
mod steps_breaker_http;
#[path = "../steps_breaker_http_full_log.rs"]
mod steps_breaker_http_full_log;
#[path = "../steps_breaker_purge.rs"]
mod steps_breaker_purge;
#[path = "../steps_breaker_salvage.rs"]
mod steps_breaker_salvage;
// It includes tests/common/storage_faults.rs as `mod storage_faults`.
#[allow(clippy::module_inception)]
#[path = "../storage_faults.rs"]
mod storage_faults;
#[path = "../storage_panics.rs"]
mod storage_panics;
#[path = "../verify_agrees_with_open.rs"]
mod verify_agrees_with_open;
