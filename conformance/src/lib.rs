//! A black-box conformance kit for an HTTP API's `Idempotency-Key`
//! behaviour (the IETF draft
//! [draft-ietf-httpapi-idempotency-key-header-06](https://datatracker.ietf.org/doc/draft-ietf-httpapi-idempotency-key-header/)
//! and the stricter rules of this workspace's `idempotency` HTTP layer).
//!
//! It talks to a running server over HTTP only: it sends requests with
//! chosen keys and compares the answers. What a target must offer for each
//! check (an execution id in its answers, a slow request, a status hook, an
//! execution count) is described in `conformance/README.md`; a check whose
//! prerequisite is missing is reported as skipped, never as passed.
//!
//! ```no_run
//! # async fn example() -> Result<(), idem_conformance::Error> {
//! let config = idem_conformance::Config::new("http://127.0.0.1:8080");
//! let report = idem_conformance::run(&config).await?;
//! print!("{}", report.table());
//! # Ok(())
//! # }
//! ```
//!
//! It is not a load test: every check sends a handful of requests (at most
//! [`Config::concurrency`] at once), each bounded by
//! [`Config::request_timeout`].

#![forbid(unsafe_code)]
#![deny(missing_docs)]

mod checks;
mod client;
mod config;
mod report;
mod run;

pub use config::{Config, Restart};
pub use report::{Check, Report, Verdict};
pub use run::{run, Error};
