//! The payments demo's parts. The binary (`src/main.rs`) is the demo; they
//! are a library only so that the demo's own tests can turn on its
//! `postgres` feature through a dev-dependency on this package (see
//! `Cargo.toml`), which cargo allows only for a package with a library.

#[cfg(feature = "nats")]
pub mod broker;
pub mod demo;
pub mod disk;
pub mod event;
pub mod ledger;
pub mod provider;
pub mod receipts;
pub mod server;
pub mod store;
