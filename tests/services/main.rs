//! The tests that use the PostgreSQL, Redis and NATS servers
//! `scripts/with-services` starts (or servers and proxies of their own),
//! in one binary: each `tests/<name>.rs` is the module `<name>` here (run
//! one file with `scripts/with-services cargo test --release --test
//! services <name>::`). Each of them works under table, key or stream
//! names of its own and leaves the shared servers running and reachable;
//! the tests that stop, freeze or restart a shared server have binaries of
//! their own (see Cargo.toml).

// The helpers in tests/common/ stay modules of each file that uses them,
// as when every file was a binary of its own (a helper's `super::` is
// that file), so clippy sees one helper file loaded more than once.
// Only the backends harness is declared once, below.
#![allow(clippy::duplicate_mod)]

// The backends harness, once for the binary: its table and key prefixes
// are unique through one counter per process (a copy per file would give
// two files the same prefix in the same second). `both_backends!` is
// visible in every module below.
#[macro_use]
#[path = "../common/backends.rs"]
mod harness;

// Its test bodies are in tests/backends/, as its inline `mod backends`.
#[allow(clippy::module_inception)]
#[path = "../backends.rs"]
mod backends;
#[path = "../breaker22b_in_place.rs"]
mod breaker22b_in_place;
#[path = "../breaker22b_races.rs"]
mod breaker22b_races;
#[path = "../breaker24_redis_damage.rs"]
mod breaker24_redis_damage;
#[path = "../breaker24_redis_input.rs"]
mod breaker24_redis_input;
#[path = "../breaker24_redis_races.rs"]
mod breaker24_redis_races;
#[path = "../breaker24_redis_server.rs"]
mod breaker24_redis_server;
#[path = "../breaker24ro_open_modes.rs"]
mod breaker24ro_open_modes;
#[path = "../breaker24ro_tls.rs"]
mod breaker24ro_tls;
#[path = "../breaker29_consumer_config.rs"]
mod breaker29_consumer_config;
#[path = "../breaker29_poison_header.rs"]
mod breaker29_poison_header;
#[path = "../breaker29_unpublishable.rs"]
mod breaker29_unpublishable;
#[path = "../breaker29b_poison_scan.rs"]
mod breaker29b_poison_scan;
#[path = "../fault29_broker_cut.rs"]
mod fault29_broker_cut;
#[path = "../fault29_full_disk.rs"]
mod fault29_full_disk;
#[path = "../fault29_poison_run.rs"]
mod fault29_poison_run;
#[path = "../http_corrupt_record.rs"]
mod http_corrupt_record;
#[path = "../model.rs"]
mod model;
#[path = "../nats_jetstream.rs"]
mod nats_jetstream;
#[path = "../pg_breaker_input.rs"]
mod pg_breaker_input;
#[path = "../pg_breaker_read_only.rs"]
mod pg_breaker_read_only;
#[path = "../pg_connection_loss.rs"]
mod pg_connection_loss;
#[path = "../pg_in_place_cut.rs"]
mod pg_in_place_cut;
#[path = "../pg_lost_commit.rs"]
mod pg_lost_commit;
#[path = "../pg_open_modes.rs"]
mod pg_open_modes;
#[path = "../pg_tls.rs"]
mod pg_tls;
#[path = "../pg_verify_stream.rs"]
mod pg_verify_stream;
#[path = "../postgres_basics.rs"]
mod postgres_basics;
#[path = "../redis_app_acl.rs"]
mod redis_app_acl;
#[path = "../redis_bad_input.rs"]
mod redis_bad_input;
#[path = "../redis_commands_per_request.rs"]
mod redis_commands_per_request;
#[path = "../redis_index_upkeep.rs"]
mod redis_index_upkeep;
#[path = "../redis_lost_reply.rs"]
mod redis_lost_reply;
#[path = "../redis_open_modes.rs"]
mod redis_open_modes;
#[path = "../redis_tls.rs"]
mod redis_tls;
#[path = "../step_kills.rs"]
mod step_kills;
#[path = "../steps_breaker_audit.rs"]
mod steps_breaker_audit;
#[path = "../steps_breaker_pg_cut.rs"]
mod steps_breaker_pg_cut;
#[path = "../steps_breaker_races.rs"]
mod steps_breaker_races;
#[path = "../steps_breaker_resume.rs"]
mod steps_breaker_resume;
