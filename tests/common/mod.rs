//! Helpers shared by the integration tests: unwrap one expected `begin`
//! outcome, or fail the test with what came instead.

#![allow(dead_code)] // each test file uses some of these

use std::fmt;

use idempotency::{Begin, Claim, InDoubt, Replay, Resolution, Resolver};

/// A `begin` answered something other than what the test expected. Converts
/// into any boxed error with `?`.
#[derive(Debug)]
pub struct Unexpected(String);

impl fmt::Display for Unexpected {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Unexpected {}

/// The claim of a `Begin::Claimed`.
pub fn claimed(b: Begin) -> Result<Claim, Unexpected> {
    match b {
        Begin::Claimed(c) => Ok(c),
        other => Err(Unexpected(format!("expected Claimed, got {other:?}"))),
    }
}

/// The replay of a `Begin::Replay`.
pub fn replay(b: Begin) -> Result<Replay, Unexpected> {
    match b {
        Begin::Replay(r) => Ok(r),
        other => Err(Unexpected(format!("expected Replay, got {other:?}"))),
    }
}

/// The pending record of a `Begin::InDoubt`.
pub fn unknown(b: Begin) -> Result<InDoubt, Unexpected> {
    match b {
        Begin::InDoubt(p) => Ok(p),
        other => Err(Unexpected(format!("expected InDoubt, got {other:?}"))),
    }
}

/// A whole-key resolver that can never tell (`StillInDoubt`): for tests
/// whose keys are settled step by step, or by hand, and that call
/// `recover_in_doubt` (which takes a resolver) or need one set.
pub struct CannotTell;

impl Resolver for CannotTell {
    fn resolve(&self, _: &InDoubt) -> Resolution {
        Resolution::StillInDoubt
    }
}

/// A `Command` that runs this test binary again with only the calling
/// file's `child_entry` test (`<file>::child_entry` when the file is a
/// module of a test binary such as `tests/suite`), its output not
/// captured, on one test thread. Expands where it is called (the file is
/// read from `module_path!()` there) and uses `?` on
/// `std::env::current_exe()`.
#[allow(unused_macros)] // each test file uses some of these
macro_rules! child_entry_command {
    () => {{
        let mut command = std::process::Command::new(std::env::current_exe()?);
        command.args([
            "--exact",
            concat!(module_path!(), "::child_entry")
                .split_once("::")
                .map_or("child_entry", |(_, t)| t),
            "--nocapture",
            "--test-threads=1",
        ]);
        command
    }};
}
#[allow(unused_imports)] // each test file uses some of these
pub(crate) use child_entry_command;
