//! The states a stored record can be in.

use std::fmt;

/// The state of a stored record.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum State {
    /// A claim holds the key and its work is running (or its holder crashed
    /// and the lease has not run out yet).
    Processing,
    /// The work finished; the response is stored for replay.
    Completed,
    /// The work ended in a final failure (a business failure such as
    /// "insufficient funds") that is stored and replayed like a success.
    FinalFailure,
    /// Side effects may have happened but the result was never recorded
    /// (crash, timeout, dropped claim, lease ran out): the record is in
    /// doubt. Never re-executed and never deleted by expiry: it waits for
    /// recovery.
    Unknown,
    /// The record expired under a tombstone policy: key and fingerprint are
    /// kept so a reuse is answered [`crate::Begin::Tombstoned`].
    Tombstone,
}

impl State {
    /// Every state, in the order the CLI lists them.
    pub const ALL: [State; 5] = [
        State::Processing,
        State::Completed,
        State::FinalFailure,
        State::Unknown,
        State::Tombstone,
    ];

    /// Upper-case name as shown by the CLI (`PROCESSING`, `COMPLETED`,
    /// `FINAL_FAILURE`, `UNKNOWN`, `TOMBSTONE`).
    pub fn as_str(self) -> &'static str {
        match self {
            State::Processing => "PROCESSING",
            State::Completed => "COMPLETED",
            State::FinalFailure => "FINAL_FAILURE",
            State::Unknown => "UNKNOWN",
            State::Tombstone => "TOMBSTONE",
        }
    }

    /// Parses a name as printed by [`State::as_str`] (ASCII
    /// case-insensitive); `None` for any other string.
    pub fn parse(name: &str) -> Option<State> {
        State::ALL
            .into_iter()
            .find(|s| s.as_str().eq_ignore_ascii_case(name))
    }
}

impl fmt::Display for State {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}
