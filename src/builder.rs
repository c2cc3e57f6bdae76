//! Opening an engine: settings, defaults, and the format check on open.

use std::fmt;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use redb::{Database, DatabaseError, Durability, ReadableDatabase, TableError};

use crate::clock::{duration_ms, Clock, SystemClock};
use crate::codec::FORMAT_VERSION;
use crate::engine::Engine;
use crate::envelope::{Envelope, Upcasters};
use crate::error::{Error, Result};
use crate::ops::{ExpiryPolicy, WriteConfig};
use crate::recovery::Resolver;
use crate::tables::{
    ENTITIES, EXPIRY, LEASES, META, META_EXPIRY_POLICY, META_FORMAT_VERSION, META_TTL_MS, OUTBOX,
    RECORDS, RECOVERY,
};

/// Settings fixed when the engine opens.
#[derive(Clone)]
pub(crate) struct Config {
    pub(crate) lease: Duration,
    pub(crate) write: WriteConfig,
    pub(crate) upcasters: Upcasters,
    pub(crate) resolver: Option<Arc<dyn Resolver>>,
    pub(crate) max_batch: usize,
    pub(crate) queue_capacity: usize,
    pub(crate) sweep_batch: usize,
}

impl fmt::Debug for Config {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Config")
            .field("lease", &self.lease)
            .field("max_response_bytes", &self.write.max_response_bytes)
            .field("ttl_ms", &self.write.ttl_ms)
            .field("expiry", &self.write.expiry)
            .field("upcasters", &self.upcasters)
            .field("resolver", &self.resolver.is_some())
            .field("max_batch", &self.max_batch)
            .finish()
    }
}

/// Configures and opens an [`Engine`].
///
/// ## Defaults
///
/// | setting | default |
/// |---|---|
/// | [`ttl`](Self::ttl) | 24 h |
/// | [`lease`](Self::lease) | 30 s |
/// | [`max_response_bytes`](Self::max_response_bytes) | 1 MiB (1,048,576 bytes) |
/// | [`clock`](Self::clock) | [`SystemClock`] |
/// | [`expiry_policy`](Self::expiry_policy) | [`ExpiryPolicy::Forget`] |
/// | [`sweep_interval`](Self::sweep_interval) | 1 s |
/// | [`sweep_batch`](Self::sweep_batch) | 64 records per step |
/// | [`max_batch`](Self::max_batch) | 512 operations per group commit |
/// | [`queue_capacity`](Self::queue_capacity) | 4,096 queued operations |
/// | response schema version | none (replays are never checked) |
/// | resolver | none (`begin` answers [`crate::Begin::Unknown`]) |
#[must_use]
pub struct EngineBuilder {
    cfg: Config,
    clock: Arc<dyn Clock>,
    sweep_interval: Option<Duration>,
    stored_expiry: bool,
}

impl Default for EngineBuilder {
    fn default() -> EngineBuilder {
        EngineBuilder {
            cfg: Config {
                lease: Duration::from_secs(30),
                write: WriteConfig {
                    ttl_ms: 24 * 60 * 60 * 1000,
                    expiry: ExpiryPolicy::Forget,
                    max_response_bytes: 1 << 20,
                },
                upcasters: Upcasters::default(),
                resolver: None,
                max_batch: 512,
                queue_capacity: 4096,
                sweep_batch: 64,
            },
            clock: Arc::new(SystemClock),
            sweep_interval: Some(Duration::from_secs(1)),
            stored_expiry: false,
        }
    }
}

impl fmt::Debug for EngineBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EngineBuilder")
            .field("cfg", &self.cfg)
            .field("clock", &self.clock)
            .field("sweep_interval", &self.sweep_interval)
            .finish()
    }
}

impl EngineBuilder {
    /// How long a COMPLETED or FAILED_FINAL record is replayed, from the
    /// moment its outcome was stored. Stored in whole milliseconds.
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.cfg.write.ttl_ms = duration_ms(ttl);
        self
    }

    /// Default claim lease (see [`Engine::begin_with_lease`] for a per-call
    /// lease). A PROCESSING record whose lease has run out counts as UNKNOWN.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.cfg.lease = lease;
        self
    }

    /// Largest response `complete` stores, in bytes of body plus headers.
    pub fn max_response_bytes(mut self, bytes: usize) -> Self {
        self.cfg.write.max_response_bytes = bytes;
        self
    }

    /// Where the engine reads the time (a [`crate::ManualClock`] in tests).
    pub fn clock(mut self, clock: impl Clock) -> Self {
        self.clock = Arc::new(clock);
        self
    }

    /// What happens to a key after its record expires.
    pub fn expiry_policy(mut self, policy: ExpiryPolicy) -> Self {
        self.cfg.write.expiry = policy;
        self
    }

    /// The app's current response schema version. Replays of envelopes with
    /// an older version go through the registered upcasters; if none covers
    /// it, the replay says [`crate::Replay::is_current`]` == false`.
    pub fn response_schema_version(mut self, version: u32) -> Self {
        self.cfg.upcasters.current = Some(version);
        self
    }

    /// Registers an upcaster for envelopes stored under schema version
    /// `from`. It must return an envelope with a higher version; chains run
    /// until the current version.
    pub fn upcaster(
        mut self,
        from: u32,
        upcaster: impl Fn(Envelope) -> std::result::Result<Envelope, String> + Send + Sync + 'static,
    ) -> Self {
        self.cfg
            .upcasters
            .by_version
            .insert(from, Arc::new(upcaster));
        self
    }

    /// Takes TTL and expiry policy from the database instead of this
    /// builder: the values the last app stored when it opened the file
    /// (every open stores its own). For operator tools such as `idem`, so a
    /// sweep or a resolution follows the app's expiry contract, not this
    /// tool's defaults. A database no app has opened yet keeps the
    /// builder's values.
    pub fn expiry_settings_from_database(mut self) -> Self {
        self.stored_expiry = true;
        self
    }

    /// A resolver `begin` consults when it meets an UNKNOWN record, so a
    /// retry queries the provider instead of failing or re-executing.
    pub fn resolver(mut self, resolver: impl Resolver + 'static) -> Self {
        self.cfg.resolver = Some(Arc::new(resolver));
        self
    }

    /// How often the background sweeper runs (at least every 10 ms: shorter
    /// intervals are raised to 10 ms); `None` starts no sweeper thread (call
    /// [`Engine::sweep_now`] yourself). Expiry and leases are decided at
    /// read time either way. A tick with nothing due costs two read
    /// transactions, no write.
    pub fn sweep_interval(mut self, interval: Option<Duration>) -> Self {
        self.sweep_interval = interval.map(|d| d.max(Duration::from_millis(10)));
        self
    }

    /// Records handled per sweep step (one write transaction). Clamped to at
    /// least 1.
    pub fn sweep_batch(mut self, records: usize) -> Self {
        self.cfg.sweep_batch = records.max(1);
        self
    }

    /// Most operations committed together in one group commit. Clamped to at
    /// least 1 (1 = one durable transaction per operation).
    pub fn max_batch(mut self, ops: usize) -> Self {
        self.cfg.max_batch = ops.max(1);
        self
    }

    /// Capacity of the writer's queue; callers beyond it wait (backpressure).
    /// Clamped to at least 1.
    pub fn queue_capacity(mut self, ops: usize) -> Self {
        self.cfg.queue_capacity = ops.max(1);
        self
    }

    /// Opens the database at `path`, creating the file if it does not exist
    /// (or is empty).
    ///
    /// # Errors
    ///
    /// [`Error::NotADatabase`] if the file is not a redb database (nothing is
    /// written to it); [`Error::UnsupportedFormat`] if it holds records of an
    /// unknown format version; [`Error::AlreadyOpen`] if another handle holds
    /// it; storage errors.
    pub fn open(self, path: impl AsRef<Path>) -> Result<Engine> {
        let path = path.as_ref();
        let existing = std::fs::metadata(path)
            .map(|m| m.len() > 0)
            .unwrap_or(false);
        let builder = redb::Builder::new();
        let db = if existing {
            // redb's writable open rewrites the file header even when nothing
            // is committed, so an unknown format is refused from a read-only
            // view first. A file read-only open cannot take (damaged, needing
            // repair, locked) goes on to the writable open, which reports it.
            if let Ok(ro) = builder.open_read_only(path) {
                check_version(stored_format(&ro)?)?;
            }
            builder.open(path)
        } else {
            builder.create(path)
        }
        .map_err(|e| open_error(path, e))?;
        self.start(db)
    }

    /// Opens an existing database at `path`; never creates one.
    ///
    /// # Errors
    ///
    /// [`Error::MissingDatabase`] if there is no file (or it is empty);
    /// otherwise as for [`EngineBuilder::open`].
    pub fn open_existing(self, path: impl AsRef<Path>) -> Result<Engine> {
        let path = path.as_ref();
        match std::fs::metadata(path) {
            Ok(m) if m.len() > 0 => self.open(path),
            _ => Err(Error::MissingDatabase {
                path: path.to_path_buf(),
            }),
        }
    }

    /// An engine on redb's in-memory backend: nothing survives the engine.
    /// For tests and examples.
    ///
    /// # Errors
    ///
    /// Only if the threads cannot start.
    pub fn in_memory(self) -> Result<Engine> {
        let db = redb::Builder::new()
            .create_with_backend(redb::backends::InMemoryBackend::new())
            .map_err(|e| Error::storage("creating an in-memory database", e))?;
        self.start(db)
    }

    /// An engine on any redb storage backend (for fault injection).
    ///
    /// # Errors
    ///
    /// As for [`EngineBuilder::open`].
    pub fn open_with_backend(self, backend: impl redb::StorageBackend) -> Result<Engine> {
        let db = redb::Builder::new()
            .create_with_backend(backend)
            .map_err(|e| open_error(Path::new("<backend>"), e))?;
        self.start(db)
    }

    fn start(mut self, db: Database) -> Result<Engine> {
        init_format(&db)?;
        let stored = stored_expiry(&db)?;
        match stored {
            Some((ttl_ms, expiry)) if self.stored_expiry => {
                self.cfg.write.ttl_ms = ttl_ms;
                self.cfg.write.expiry = expiry;
            }
            _ if self.stored_expiry => {}
            Some(s) if s == (self.cfg.write.ttl_ms, self.cfg.write.expiry) => {}
            _ => store_expiry(&db, self.cfg.write.ttl_ms, self.cfg.write.expiry)?,
        }
        Engine::start(db, self.cfg, self.clock, self.sweep_interval)
    }
}

fn open_error(path: &Path, e: DatabaseError) -> Error {
    match e {
        DatabaseError::DatabaseAlreadyOpen => Error::AlreadyOpen {
            path: path.to_path_buf(),
        },
        source => Error::NotADatabase {
            path: path.to_path_buf(),
            source,
        },
    }
}

/// Checks the record format version; on a database without the engine's
/// tables, creates them. An unknown version is refused before any write.
fn init_format(db: &Database) -> Result<()> {
    // The version and all tables are created in one transaction, so a
    // version present means every table is.
    match stored_format(db)? {
        Some(v) => check_version(Some(v)),
        None => {
            let ctx = "creating the engine's tables";
            let mut txn = db.begin_write().map_err(|e| Error::storage(ctx, e))?;
            txn.set_durability(Durability::Immediate)
                .map_err(|e| Error::storage(ctx, e))?;
            {
                let mut meta = txn.open_table(META).map_err(|e| Error::storage(ctx, e))?;
                meta.insert(META_FORMAT_VERSION, [FORMAT_VERSION].as_slice())
                    .map_err(|e| Error::storage(ctx, e))?;
                txn.open_table(RECORDS)
                    .map_err(|e| Error::storage(ctx, e))?;
                txn.open_table(LEASES).map_err(|e| Error::storage(ctx, e))?;
                txn.open_table(RECOVERY)
                    .map_err(|e| Error::storage(ctx, e))?;
                txn.open_table(EXPIRY).map_err(|e| Error::storage(ctx, e))?;
                txn.open_table(OUTBOX).map_err(|e| Error::storage(ctx, e))?;
                txn.open_table(ENTITIES)
                    .map_err(|e| Error::storage(ctx, e))?;
            }
            txn.commit().map_err(|e| Error::storage(ctx, e))
        }
    }
}

/// The record format version stored in the database, if any.
fn stored_format(db: &impl ReadableDatabase) -> Result<Option<u8>> {
    let ctx = "checking the record format";
    let txn = db.begin_read().map_err(|e| Error::storage(ctx, e))?;
    match txn.open_table(META) {
        Ok(meta) => Ok(meta
            .get(META_FORMAT_VERSION)
            .map_err(|e| Error::storage(ctx, e))?
            .map(|v| v.value().first().copied().unwrap_or(0))),
        Err(TableError::TableDoesNotExist(_)) => Ok(None),
        Err(e) => Err(Error::storage(ctx, e)),
    }
}

/// The TTL and expiry policy the last app stored, if any.
fn stored_expiry(db: &Database) -> Result<Option<(u64, ExpiryPolicy)>> {
    let ctx = "reading the stored expiry settings";
    let txn = db.begin_read().map_err(|e| Error::storage(ctx, e))?;
    let meta = txn.open_table(META).map_err(|e| Error::storage(ctx, e))?;
    let get = |name| -> Result<Option<Vec<u8>>> {
        Ok(meta
            .get(name)
            .map_err(|e| Error::storage(ctx, e))?
            .map(|v| v.value().to_vec()))
    };
    let (Some(ttl), Some(policy)) = (get(META_TTL_MS)?, get(META_EXPIRY_POLICY)?) else {
        return Ok(None);
    };
    let ttl = <[u8; 8]>::try_from(ttl.as_slice()).map(u64::from_le_bytes);
    let policy = match policy.split_first() {
        Some((0, [])) => Some(ExpiryPolicy::Forget),
        Some((1, keep)) => <[u8; 8]>::try_from(keep)
            .ok()
            .map(|k| ExpiryPolicy::Tombstone {
                keep_ms: u64::from_le_bytes(k),
            }),
        _ => None,
    };
    match (ttl, policy) {
        (Ok(ttl), Some(policy)) => Ok(Some((ttl, policy))),
        // Unreadable settings are ignored, not fatal: they only advise tools.
        _ => Ok(None),
    }
}

fn store_expiry(db: &Database, ttl_ms: u64, policy: ExpiryPolicy) -> Result<()> {
    let ctx = "storing the expiry settings";
    let mut txn = db.begin_write().map_err(|e| Error::storage(ctx, e))?;
    txn.set_durability(Durability::Immediate)
        .map_err(|e| Error::storage(ctx, e))?;
    {
        let mut meta = txn.open_table(META).map_err(|e| Error::storage(ctx, e))?;
        let policy = match policy {
            ExpiryPolicy::Forget => vec![0],
            ExpiryPolicy::Tombstone { keep_ms } => {
                let mut v = vec![1];
                v.extend_from_slice(&keep_ms.to_le_bytes());
                v
            }
        };
        meta.insert(META_TTL_MS, ttl_ms.to_le_bytes().as_slice())
            .map_err(|e| Error::storage(ctx, e))?;
        meta.insert(META_EXPIRY_POLICY, policy.as_slice())
            .map_err(|e| Error::storage(ctx, e))?;
    }
    txn.commit().map_err(|e| Error::storage(ctx, e))
}

/// Refuses a format version this build does not read.
fn check_version(found: Option<u8>) -> Result<()> {
    match found {
        Some(v) if v != FORMAT_VERSION => Err(Error::UnsupportedFormat {
            found: v,
            supported: FORMAT_VERSION,
        }),
        _ => Ok(()),
    }
}
