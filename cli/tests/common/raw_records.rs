//! The engine's records table read and written with redb directly, in
//! either format, for tests that damage stored records: format 2 keys a
//! record by its record key (`idempotency.records`), format 3 by its slot
//! key `[partition u64 BE][record key]` (`idempotency.partitioned.records`,
//! see `src/store/redb/partition/slot.rs`).

use idempotency::EngineBuilder;
use redb::{ReadableTable, TableDefinition, TableHandle, WriteTransaction};

use super::TestResult;

const FORMAT_2: TableDefinition<&[u8], &[u8]> = TableDefinition::new("idempotency.records");
const FORMAT_3: TableDefinition<&[u8], &[u8]> =
    TableDefinition::new("idempotency.partitioned.records");

/// The format a test creates its file in.
#[derive(Clone, Copy, Debug)]
pub enum Format {
    /// What earlier releases created (the hidden
    /// `EngineBuilder::unstable_create_format_2`).
    Two,
    /// What the engine creates.
    Three,
}

impl Format {
    /// A builder that creates a new file in this format.
    pub fn builder(self) -> EngineBuilder {
        match self {
            Format::Two => idempotency::Engine::builder().unstable_create_format_2(),
            Format::Three => idempotency::Engine::builder(),
        }
    }
}

/// The records table of a file, addressed by record key. In format 3 a
/// key is found in whichever partition holds it; a key no partition holds
/// goes into the newest one (the hot partition of a file the engine
/// wrote: a sealed one's filter would not know it).
pub struct RawRecords<'t> {
    table: redb::Table<'t, &'static [u8], &'static [u8]>,
    /// Format 3: slot keys are `[partition u64 BE][record key]`.
    partitioned: bool,
}

impl<'t> RawRecords<'t> {
    /// The records table of the file `txn` writes, in its format.
    pub fn open(txn: &'t WriteTransaction) -> TestResult<RawRecords<'t>> {
        let partitioned = txn
            .list_tables()?
            .any(|t| t.name() == "idempotency.partitioned.records");
        let table = txn.open_table(if partitioned { FORMAT_3 } else { FORMAT_2 })?;
        Ok(RawRecords { table, partitioned })
    }

    /// Where `rkey` is stored, or would be.
    fn slot(&self, rkey: &[u8]) -> TestResult<Vec<u8>> {
        if !self.partitioned {
            return Ok(rkey.to_vec());
        }
        for entry in self.table.iter()? {
            let (k, _) = entry?;
            if k.value().get(8..) == Some(rkey) {
                return Ok(k.value().to_vec());
            }
        }
        let newest = match self.table.last()? {
            Some((k, _)) => k
                .value()
                .get(..8)
                .ok_or("a slot key under 8 bytes")?
                .to_vec(),
            None => return Err("a format-3 file without records".into()),
        };
        Ok([newest.as_slice(), rkey].concat())
    }

    /// The stored bytes of the record `rkey`.
    pub fn get(&self, rkey: &[u8]) -> TestResult<Option<Vec<u8>>> {
        let slot = self.slot(rkey)?;
        Ok(self.table.get(slot.as_slice())?.map(|v| v.value().to_vec()))
    }

    /// Stores `value` as the record `rkey`.
    pub fn insert(&mut self, rkey: &[u8], value: &[u8]) -> TestResult {
        let slot = self.slot(rkey)?;
        self.table.insert(slot.as_slice(), value)?;
        Ok(())
    }

    /// Removes the record `rkey`, returning its bytes.
    pub fn remove(&mut self, rkey: &[u8]) -> TestResult<Option<Vec<u8>>> {
        let slot = self.slot(rkey)?;
        Ok(self
            .table
            .remove(slot.as_slice())?
            .map(|v| v.value().to_vec()))
    }
}
