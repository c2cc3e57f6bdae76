//! What salvage gathers from a damaged file before writing the new one,
//! and the shapes its steps pass between them.

use std::collections::{BTreeMap, BTreeSet};

use crate::error::OpenError;
use crate::policy::ExpiryPolicy;
use crate::salvage::SalvageReport;

/// An index entry: (index name, instant ms, record key).
pub(super) type IndexEntry = (&'static str, u64, Vec<u8>);

/// Record key → stored value.
pub(super) type Entries = BTreeMap<Vec<u8>, Vec<u8>>;

/// Record key → why it was not copied.
pub(super) type Reasons = BTreeMap<Vec<u8>, String>;

/// A stored counter: its value (`None`: absent), or why it is unreadable.
pub(super) type StoredCounter = std::result::Result<Option<u64>, OpenError>;

/// What was read of the damaged file, checked and ready to write.
#[derive(Default)]
pub(super) struct Gathered {
    pub(super) records: BTreeMap<Vec<u8>, Vec<u8>>,
    pub(super) index: BTreeSet<IndexEntry>,
    pub(super) outbox: BTreeMap<u64, Vec<u8>>,
    pub(super) entities: BTreeMap<String, Vec<u8>>,
    /// (Record key, step name) → encoded step.
    pub(super) steps: BTreeMap<(Vec<u8>, String), Vec<u8>>,
    /// (Record key, seq) → encoded log entry.
    pub(super) history: BTreeMap<(Vec<u8>, u32), Vec<u8>>,
    pub(super) next_token: u64,
    pub(super) next_outbox: u64,
    pub(super) expiry: Option<(u64, ExpiryPolicy)>,
    /// The damaged file is of format 3: so is the new one.
    pub(super) partitioned: bool,
    pub(super) report: SalvageReport,
}
