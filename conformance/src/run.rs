//! Running every check against one target.

use std::fmt;

use crate::checks::{classify, crash, duplicates, expiry, fresh_key, keys, replay, show};
use crate::client::{KeyLines, Req, Target};
use crate::config::Config;
use crate::report::Report;

/// Why no report could be made.
#[derive(Debug)]
#[non_exhaustive]
pub enum Error {
    /// The HTTP client could not be built.
    Client(String),
    /// The target's first request with a fresh key did not answer 2xx
    /// with an execution id at `id_pointer`: nothing else can be judged.
    Unusable {
        /// The endpoint.
        url: String,
        /// What it answered.
        detail: String,
    },
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Client(e) => f.write_str(e),
            Error::Unusable { url, detail } => write!(
                f,
                "{url}: a POST with a fresh key must answer 2xx with the execution's id in \
                 its JSON body (see --id-pointer); it answered {detail}"
            ),
        }
    }
}

impl std::error::Error for Error {}

/// Runs every check against `config`'s target, in order: the key checks,
/// concurrent duplicates, a mismatch, an in-flight duplicate, replays, the
/// status classification, expiry (its first request is sent at the start,
/// so its wait overlaps the others) and last a crash, whose restart may
/// lose an in-memory server's keys.
///
/// # Errors
///
/// [`Error::Unusable`] when the target's first answer does not fit the
/// kit's convention; a check that fails is a row, not an error.
pub async fn run(config: &Config) -> Result<Report, Error> {
    let t = Target::new(config).map_err(Error::Client)?;
    let url = format!("{}{}", config.base.trim_end_matches('/'), config.path);
    let probe = t
        .send(&Req::new(
            KeyLines::quoted(&fresh_key("probe")),
            &config.body,
        ))
        .await;
    if !matches!(&probe, Ok(a) if a.success() && a.id(&config.id_pointer).is_some()) {
        return Err(Error::Unusable {
            url,
            detail: show(&t, &probe),
        });
    }
    let pending = expiry::start(&t).await;
    let mut checks = keys::run(&t).await;
    checks.push(duplicates::concurrent(&t).await);
    checks.push(duplicates::mismatch(&t).await);
    checks.push(duplicates::in_flight(&t).await);
    checks.extend(replay::run(&t).await);
    checks.extend(classify::run(&t).await);
    checks.push(expiry::finish(&t, pending).await);
    checks.push(crash::run(&t).await);
    Ok(Report {
        target: url,
        checks,
    })
}
