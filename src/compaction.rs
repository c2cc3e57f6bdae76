//! What a compaction of a closed database file gave back (see
//! [`crate::EngineBuilder::compact`]).

/// The result of [`crate::EngineBuilder::compact`]: the file's length
/// before and after, in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Compaction {
    /// The database file's length before, in bytes (after the recovery
    /// and the clean close that come first).
    pub bytes_before: u64,
    /// Its length after, in bytes: its pages in use, plus the few redb
    /// keeps free.
    pub bytes_after: u64,
}

impl Compaction {
    /// Bytes given back to the file system (0 when the file had no free
    /// pages to give).
    pub fn bytes_freed(&self) -> u64 {
        self.bytes_before.saturating_sub(self.bytes_after)
    }
}
