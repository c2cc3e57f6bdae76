//! Where a journal's bytes live: a plain file beside the database, or
//! any `redb::StorageBackend` (tests, fault injection).

use std::fmt;
use std::io;

use redb::StorageBackend;

/// Where the journal's bytes live, and its name for messages.
pub(crate) struct JournalStorage {
    pub(crate) backend: std::sync::Arc<dyn StorageBackend>,
    pub(crate) name: String,
}

impl fmt::Debug for JournalStorage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("JournalStorage")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

impl JournalStorage {
    /// The journal file at `path` (see [`JournalStorage::path_of`]),
    /// created if missing.
    pub(crate) fn beside_path(path: &std::path::Path) -> io::Result<JournalStorage> {
        let existed = path.exists();
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)?;
        if !existed {
            // The new name must survive a power loss too.
            if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
                std::fs::File::open(dir)?.sync_all()?;
            }
        }
        Ok(JournalStorage {
            backend: std::sync::Arc::new(PlainFile(file)),
            name: path.display().to_string(),
        })
    }

    /// A journal file opened for reading only.
    pub(crate) fn read_only(file: std::fs::File, path: &std::path::Path) -> JournalStorage {
        JournalStorage {
            backend: std::sync::Arc::new(PlainFile(file)),
            name: path.display().to_string(),
        }
    }

    /// The journal path of the database file `db`: beside the file itself
    /// (links resolved), so every name of one file finds one journal.
    pub(crate) fn path_of(db: &std::path::Path) -> std::path::PathBuf {
        let real = std::fs::canonicalize(db).unwrap_or_else(|_| db.to_path_buf());
        let mut name = real.into_os_string();
        name.push(".journal");
        std::path::PathBuf::from(name)
    }
}

/// A plain file as a storage backend (positioned reads and writes).
#[derive(Debug)]
struct PlainFile(std::fs::File);

impl StorageBackend for PlainFile {
    fn len(&self) -> io::Result<u64> {
        Ok(self.0.metadata()?.len())
    }

    fn read(&self, offset: u64, out: &mut [u8]) -> io::Result<()> {
        std::os::unix::fs::FileExt::read_exact_at(&self.0, out, offset)
    }

    fn set_len(&self, len: u64) -> io::Result<()> {
        self.0.set_len(len)
    }

    fn sync_data(&self) -> io::Result<()> {
        self.0.sync_data()
    }

    fn write(&self, offset: u64, data: &[u8]) -> io::Result<()> {
        std::os::unix::fs::FileExt::write_all_at(&self.0, data, offset)
    }
}
