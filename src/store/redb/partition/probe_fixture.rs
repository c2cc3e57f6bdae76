//! Bench fixture (feature `bench-fixtures`): the filter probes a fresh key
//! meets in a file of many sealed partitions, with the filters grouped as
//! the engine keeps them (`filter_group.rs`) or each in its own array as
//! before grouping, for `bench/benches/filter_probes.rs`. Only the filters
//! are built: no file, no table.
//!
//! Store layer (layer 2).

use std::convert::Infallible;
use std::sync::Arc;

use super::catalog::{Filters, Probes, SealRule};
use super::filter::{FilterError, FilterHasher, PartitionFilter};

/// The probes of `partitions` sealed partitions of `keys` keys each.
pub(crate) struct SealedProbes {
    hasher: FilterHasher,
    probes: Probes,
    /// Keeps the groups the probes' filters point into.
    _filters: Filters,
}

impl SealedProbes {
    /// Partitions `1..=partitions`, each of `keys` keys
    /// (`bench/{partition}-{i}` under scope `\x04`), its filter sized as
    /// the writer sizes one it seals; `grouped`: kept in groups as an
    /// open keeps them, else each on its own.
    ///
    /// # Errors
    ///
    /// A filter that cannot be allocated.
    pub(crate) fn new(
        partitions: u64,
        keys: u64,
        grouped: bool,
    ) -> Result<SealedProbes, FilterError> {
        let hasher = FilterHasher::new(&[7; 16]);
        let filters = Filters::new(hasher.clone());
        // Kept as an open keeps them: all, then grouped at once.
        if grouped {
            filters.defer_grouping();
        }
        let mut built = Vec::new();
        for p in 1..=partitions {
            let capacity = SealRule::DEFAULT.filter_capacity(p, keys).max(1);
            let mut filter = PartitionFilter::with_capacity(p, capacity, &hasher)?;
            for i in 0..keys {
                filter.insert(format!("\x04bench/{p}-{i}").as_bytes())?;
            }
            let (_, sum) = filter.encode();
            let filter = Arc::new(filter);
            let kept = if grouped {
                filters.keep(p, sum, filter)
            } else {
                filter
            };
            built.push((p, sum, kept));
        }
        if grouped {
            filters.group_deferred();
            // The views of the groups (a probe holds those).
            for (p, sum, kept) in &mut built {
                if let Some(now) = filters.get(*p, sum) {
                    *kept = now;
                }
            }
        }
        Ok(SealedProbes {
            hasher,
            probes: Probes::sealed(built),
            _filters: filters,
        })
    }

    /// How many partitions' filters say "maybe" to record key `rkey`: the
    /// tables a lookup of it would read.
    pub(crate) fn maybes(&self, rkey: &[u8]) -> usize {
        let mut reads = 0;
        let found = self.probes.locate(&self.hasher, rkey, |_| {
            reads += 1;
            Ok::<Option<()>, Infallible>(None)
        });
        debug_assert!(matches!(found, Ok(None)));
        reads
    }
}
