//! Opening an engine: settings, defaults, and the store it runs on.

use std::fmt;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use crate::clock::{duration_ms, Clock, SystemClock};
use crate::engine::config::Config;
use crate::engine::core::{Core, Counters};
use crate::engine::early::Asked;
use crate::engine::handle::Engine;
use crate::engine::sweeper::Sweeper;
use crate::envelope::Envelope;
use crate::error::OpenError;
use crate::policy::ExpiryPolicy;
use crate::resolver::Resolver;
use crate::store::redb::{self as redb_store, RedbReader, RedbStore};

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
/// | [`max_group_bytes`](Self::max_group_bytes) | 64 MiB (67,108,864 bytes) per group commit |
/// | [`queue_capacity`](Self::queue_capacity) | 4,096 queued operations |
/// | [`recovery_reserve`](Self::recovery_reserve) | 64 MiB, at most 1/8 of the file system |
/// | format of a new redb file | 3 (time-partitioned records); an existing file keeps its format unless [`migrate_to_format_3`](Self::migrate_to_format_3) |
/// | [`partition_limits`](Self::partition_limits) | 32,768 keys or 10 minutes a partition |
/// | [`cache_size`](Self::cache_size) | redb's default, 1 GiB (1,073,741,824 bytes) |
/// | response schema version | none (replays are never checked) |
/// | resolver | none (`begin` answers [`crate::Begin::InDoubt`]) |
/// | [`resolver_interval`](Self::resolver_interval) | 1 s |
/// | [`step_resolver`](Self::step_resolver)s | none (steps are put to the resolver's `resolve_step`) |
#[must_use]
pub struct EngineBuilder {
    cfg: Config,
    clock: Arc<dyn Clock>,
    sweep_interval: Option<Duration>,
    stored_expiry: bool,
    new_format: redb_store::NewFormat,
    migration: Option<redb_store::MigrationSteps>,
    seal_rule: redb_store::PartitionSealRule,
    /// redb's page cache, bytes (`None`: redb's default).
    pub(super) cache_bytes: Option<usize>,
    #[cfg(feature = "postgres")]
    postgres: PostgresSettings,
    #[cfg(feature = "redis")]
    redis: RedisSettings,
}

/// Settings only an engine on Redis reads.
#[cfg(feature = "redis")]
#[derive(Debug, Clone)]
struct RedisSettings {
    prefix: String,
    pool_size: u32,
    connect_timeout: Duration,
    command_timeout: Duration,
    allow_volatile: bool,
    durability_attested: bool,
    wait_replicas: Option<(u32, Duration)>,
    tls_ca: Option<std::path::PathBuf>,
    tls_client: Option<(std::path::PathBuf, std::path::PathBuf)>,
    password: Option<crate::store::redis::Password>,
}

/// Settings only an engine on PostgreSQL reads.
#[cfg(feature = "postgres")]
#[derive(Debug, Clone)]
struct PostgresSettings {
    prefix: String,
    pool_size: u32,
    connect_timeout: Duration,
    statement_timeout: Duration,
    pool_idle_timeout: Option<Duration>,
    pool_max_lifetime: Option<Duration>,
    database_clock: bool,
}

impl Default for EngineBuilder {
    fn default() -> EngineBuilder {
        EngineBuilder {
            cfg: Config::default(),
            clock: Arc::new(SystemClock),
            sweep_interval: Some(Duration::from_secs(1)),
            stored_expiry: false,
            new_format: redb_store::NewFormat::default(),
            migration: None,
            seal_rule: redb_store::PartitionSealRule::DEFAULT,
            cache_bytes: None,
            #[cfg(feature = "postgres")]
            postgres: PostgresSettings {
                prefix: crate::store::postgres::DEFAULT_PREFIX.to_owned(),
                pool_size: 16,
                connect_timeout: Duration::from_secs(2),
                statement_timeout: Duration::from_secs(5),
                pool_idle_timeout: Some(Duration::from_secs(600)),
                pool_max_lifetime: Some(Duration::from_secs(1800)),
                database_clock: true,
            },
            #[cfg(feature = "redis")]
            redis: RedisSettings {
                prefix: crate::store::redis::DEFAULT_PREFIX.to_owned(),
                pool_size: 16,
                connect_timeout: Duration::from_secs(2),
                command_timeout: Duration::from_secs(5),
                allow_volatile: false,
                durability_attested: false,
                wait_replicas: None,
                tls_ca: None,
                tls_client: None,
                password: None,
            },
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
    /// Migrates an existing format-2 database file to format 3
    /// (time-partitioned records: docs/design.md, docs/format.md) at a
    /// writable open, after its journal is applied; a new file is format 3
    /// without it, and a format-3 file is opened as it is. Without this
    /// call a format-2 file stays format 2 and is served as before.
    ///
    /// The migration copies every record, effect step and evidence-log
    /// entry, in key order, into one sealed partition, in steps of 50,000
    /// records, each one durable transaction, while the file stays format
    /// 2; the last step switches the file to format 3. A crash or an error
    /// between steps leaves a format-2 file, and the next open with this
    /// call goes on from the last step committed (an open without it
    /// deletes the partial copy, which its writes would make stale). It
    /// cannot be undone: a release before format 3 refuses the file. Only
    /// redb files opened from a path.
    ///
    /// # Errors
    ///
    /// The open returns [`OpenError::Storage`] when a step fails (the file
    /// is then format 2, as the last committed step left it), or
    /// [`OpenError::Corrupt`] for a damaged meta value.
    pub fn migrate_to_format_3(mut self) -> Self {
        if self.migration.is_none() {
            self.migration = Some(redb_store::MigrationSteps::DEFAULT);
        }
        self
    }

    /// [`Self::migrate_to_format_3`], in steps of `step_records` records
    /// (at least 1; default 50,000), each one durable transaction; with
    /// `stop_after_steps`, the open fails with `OpenError::Storage` once
    /// that many steps committed (before the last), leaving the
    /// half-migrated file a crash between steps would leave. **Unstable,
    /// for this crate's own tests.**
    #[doc(hidden)]
    pub fn unstable_format_3_migration(
        mut self,
        step_records: u64,
        stop_after_steps: Option<u64>,
    ) -> Self {
        self.migration = Some(redb_store::MigrationSteps {
            records: step_records.max(1),
            stop_after: stop_after_steps,
        });
        self
    }

    /// Creates a new database file in format 2 (one records table, what
    /// releases before format 3 wrote) instead of format 3. **For this
    /// crate's own tests of format-2 files**, which users hold; an existing
    /// file keeps its format.
    #[doc(hidden)]
    pub fn unstable_create_format_2(mut self) -> Self {
        self.new_format = redb_store::NewFormat::Format2;
        self
    }

    /// Format 3: seals the hot partition (new keys then go into a new one)
    /// once it holds `max_keys` keys (at least 1) or `max_age` has passed
    /// since it was opened, whichever comes first. Defaults: 32,768 keys
    /// and ten minutes (stored in whole milliseconds). Smaller partitions
    /// seal and expire in finer steps, at the price of more filters to
    /// probe for a fresh key; a format-2 file ignores it. Not stored in the
    /// file: each open applies its own.
    pub fn partition_limits(mut self, max_keys: u64, max_age: Duration) -> Self {
        self.seal_rule = redb_store::PartitionSealRule {
            interval_ms: duration_ms(max_age),
            max_keys: max_keys.max(1),
        };
        self
    }

    /// The page cache of the redb file, in bytes: the largest share of an
    /// embedded engine's memory. Default: redb's, 1 GiB. Pages past it
    /// are read again from the file (through the OS page cache).
    ///
    /// The engine's resident memory is about this cache, plus format 3's
    /// key filters (about 3.4 bytes per stored key: 34 MiB at 10 million
    /// records), plus the allocator's own overhead. With glibc a server of
    /// many threads keeps an arena per thread; `MALLOC_ARENA_MAX=2` in the
    /// process's environment bounds that (docs/operations.md, "Memory").
    /// Measured at 10 million records with the default: BENCHMARKS.md,
    /// "Format 3 at 10M". Read at each writable open ([`Self::open`],
    /// [`Self::open_existing`] and the reopen after a storage failure);
    /// read-only opens (operator tools) keep redb's default. Ignored by
    /// the other backends. Any value is accepted, never an error: a cache
    /// too small for the workload makes reads and commits slower, not
    /// wrong (`tests/cache_size.rs` serves and replays with 0, 1 and
    /// 4,096 bytes and `usize::MAX`), and memory is taken as pages are
    /// cached, never up front.
    pub fn cache_size(mut self, bytes: usize) -> Self {
        self.cache_bytes = Some(bytes);
        self
    }

    /// How long a COMPLETED or `FINAL_FAILURE` record is replayed, from the
    /// moment its outcome was stored. Stored in whole milliseconds.
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.cfg.store.ttl_ms = duration_ms(ttl);
        self
    }

    /// Default claim lease (see [`Engine::begin_with_lease`] for a per-call
    /// lease). A PROCESSING record whose lease has run out counts as UNKNOWN.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.cfg.lease = lease;
        self
    }

    /// How many deliveries of one message may fail *cleanly* (a
    /// `Failure::Retryable`, or an error before any side effect) before
    /// [`Inbox::fail_cleanly`](crate::Inbox::fail_cleanly) gives it up to
    /// the dead letters instead of asking for a redelivery. Default 5;
    /// at least 1. A message whose handler died mid-effect never counts
    /// here: it is in doubt, for the resolver.
    pub fn dead_letter_after(mut self, deliveries: u32) -> Self {
        self.cfg.dead_letter_after = deliveries.max(1);
        self
    }

    /// Largest response `complete` stores, in bytes as
    /// [`Envelope::size_bytes`](crate::Envelope::size_bytes) counts them
    /// (the body, plus each header's name, value and 32 bytes). Clamped to
    /// [`MIN_RESPONSE_BYTES`](Self::MIN_RESPONSE_BYTES) (256 bytes) ..=
    /// [`MAX_RESPONSE_BYTES_LIMIT`](Self::MAX_RESPONSE_BYTES_LIMIT)
    /// (1 GiB): the HTTP layer's record of a response it could not keep
    /// (a marker header) must always fit, or a known outcome would be left
    /// UNKNOWN; and one operation must always fit in a journal frame beside
    /// a full group.
    pub fn max_response_bytes(mut self, bytes: usize) -> Self {
        self.cfg.store.max_response_bytes =
            bytes.clamp(Self::MIN_RESPONSE_BYTES, Self::MAX_RESPONSE_BYTES_LIMIT);
        self
    }

    /// Lower bound of [`max_response_bytes`](Self::max_response_bytes):
    /// 256 bytes.
    pub const MIN_RESPONSE_BYTES: usize = 256;

    /// Upper bound of [`max_response_bytes`](Self::max_response_bytes): 1 GiB.
    pub const MAX_RESPONSE_BYTES_LIMIT: usize = 1 << 30;

    /// Where the engine reads the time (a [`crate::ManualClock`] in tests).
    pub fn clock(mut self, clock: impl Clock) -> Self {
        self.clock = Arc::new(clock);
        self
    }

    /// What happens to a key after its record expires. A tombstone's
    /// lifetime is kept in whole milliseconds.
    pub fn expiry_policy(mut self, policy: ExpiryPolicy) -> Self {
        self.cfg.store.expiry = match policy.keep_ms() {
            None => ExpiryPolicy::Forget,
            Some(keep_ms) => ExpiryPolicy::Tombstone {
                keep: Duration::from_millis(keep_ms),
            },
        };
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

    /// A resolver for the effect steps named `name` (one per provider: the
    /// card processor for `"charge"`, the mailer for `"receipt"`). When an
    /// in-doubt key's step of that name is unsettled, `resolve` is asked
    /// about it (look [`crate::InDoubtStep::reference`] up at the
    /// provider) instead of [`Resolver::resolve_step`]. A later call for
    /// the same name replaces the earlier one. A key with steps is settled
    /// by these (and the resolver) even on an engine without a
    /// [`resolver`](Self::resolver).
    pub fn step_resolver(
        mut self,
        name: impl Into<String>,
        resolve: impl Fn(&crate::InDoubtStep) -> crate::StepResolution + Send + Sync + 'static,
    ) -> Self {
        self.cfg
            .step_resolvers
            .insert(name.into(), Arc::new(resolve));
        self
    }

    /// Shortest time between two questions to the resolver about one
    /// dropped claim while its lease still runs (a claim dropped without an
    /// outcome, or held by a process that ended). In that time a positive
    /// answer settles the key at once, "not executed" waits for the lease
    /// end, and retries between two questions answer
    /// [`crate::Begin::Processing`] with the time to the next one as their
    /// `retry_after`, so a crowd of retries asks the provider once per
    /// interval, not once per retry. Whole milliseconds, at least 1 ms.
    pub fn resolver_interval(mut self, interval: Duration) -> Self {
        self.cfg.resolver_interval = interval;
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

    /// Bytes of stored values after which a group commit takes no more
    /// operations: the operation that reaches it is the group's last, and
    /// the rest of the batch goes on in the next group (of the same
    /// durable sync when it can). Bounds the journal frame a burst of large
    /// responses makes: a frame can hold at most 4 GiB, and a group over
    /// that would fail and poison the engine. Clamped to 1 byte ..= 1 GiB.
    /// Only a database opened from a path keeps a journal; elsewhere each
    /// group is one redb transaction, which this does not split.
    pub fn max_group_bytes(mut self, bytes: usize) -> Self {
        self.cfg.max_group_bytes = bytes.clamp(1, 1 << 30);
        self
    }

    /// Capacity of the writer's queue; callers beyond it wait (backpressure).
    /// Clamped to at least 1.
    pub fn queue_capacity(mut self, ops: usize) -> Self {
        self.cfg.queue_capacity = ops.max(1);
        self
    }

    /// Bytes of disk kept for recovery beside a database opened from a
    /// path: a file of zeros, `<database file>.reserve`, given back when
    /// the engine must recover (an open after a crash or a full disk, a
    /// reopen after a storage failure) so that replaying the journal and
    /// its checkpoint need no new space, and taken again once it has
    /// recovered. Default 64 MiB (67,108,864 bytes: a replay and
    /// checkpoint of a full 32 MiB journal), but never more than an
    /// eighth of the file system, nor more than half of what is free when
    /// it is taken (short of space, the engine runs with less, or none,
    /// and logs a warning). The engine checkpoints at least every half
    /// reserve of journal (at most every 32 MiB), so what a crash leaves to
    /// replay fits in it, and grows the journal by at most that much at a
    /// time. `0` keeps no reserve (then the engine checkpoints every 32 MiB of
    /// journal, and a full disk may need that much freed to recover). Ignored for databases not
    /// opened from a path (PostgreSQL, [`Self::open_with_backend`],
    /// [`Self::in_memory`]).
    pub fn recovery_reserve(mut self, bytes: u64) -> Self {
        self.cfg.recovery_reserve = bytes;
        self
    }

    /// Opens the database at `path`, creating the file if it does not exist
    /// (or is empty). A file of record format 1 (written by an older build)
    /// is migrated to format 2 first, in one durable transaction: every
    /// stored value is rewritten with its checksum.
    ///
    /// Every page's checksum is verified first (redb's integrity check; it
    /// reads the whole file). The engine keeps a write-ahead journal beside
    /// the file, `<path>.journal` (links in `path` resolved): group commits
    /// are made durable there, and the database file catches up at
    /// checkpoints (every 32 MiB of journal, or every half
    /// [`recovery_reserve`](Self::recovery_reserve) if less, after 5 s
    /// without work, and when the engine is dropped). Frames written after
    /// the last checkpoint (a crash) are applied here. Keep the two files
    /// together. A third, `<path>.reserve`, is the recovery reserve: space
    /// held for recovery, no data.
    ///
    /// # Errors
    ///
    /// [`OpenError::NotADatabase`] if the file is not a redb database
    /// (nothing is written to it); [`OpenError::Corrupt`] with
    /// [`Corrupted::File`](crate::Corrupted::File) if the integrity check
    /// finds damage (nothing is written); [`OpenError::Journal`] if
    /// the journal is damaged before its end, belongs to another database,
    /// or, after a crash, lacks the frame of the last checkpoint (deleted,
    /// emptied or an older copy); [`OpenError::UnsupportedFormat`] if it
    /// holds records of an unknown format version;
    /// [`OpenError::PreReleaseFormat`] if a pre-release build of format 2
    /// wrote it; [`OpenError::Corrupt`] with
    /// [`Corrupted::Meta`](crate::Corrupted::Meta) if a value of its meta
    /// table (format, counters, journal position, expiry settings) is
    /// damaged (nothing is written);
    /// [`OpenError::AlreadyOpen`] if another handle holds it;
    /// [`OpenError::Storage`]; [`OpenError::ThreadStart`].
    pub fn open(self, path: impl AsRef<Path>) -> Result<Engine, OpenError> {
        let path = path.as_ref().to_path_buf();
        redb_store::open_contained(&path, || {
            let cache = self.cache_bytes;
            let opened = redb_store::Opened::path(&path, cache)?;
            let again = path.clone();
            let reopen: redb_store::Reopen =
                Arc::new(move || redb_store::Opened::path(&again, cache));
            let mut probe_path = path.clone().into_os_string();
            probe_path.push(".write-probe");
            let probe_path = std::path::PathBuf::from(probe_path);
            let probe: redb_store::Probe = Arc::new(move || redb_store::probe_write(&probe_path));
            self.start(opened, Some((reopen, probe)))
        })
    }

    /// Opens an existing database at `path`; never creates one.
    ///
    /// # Errors
    ///
    /// [`OpenError::MissingDatabase`] if there is no file;
    /// [`OpenError::EmptyFile`] if it has 0 bytes; otherwise as for
    /// [`EngineBuilder::open`].
    pub fn open_existing(self, path: impl AsRef<Path>) -> Result<Engine, OpenError> {
        let path = path.as_ref();
        existing(path)?;
        self.open(path)
    }

    /// Opens an existing database read-only, for operator tools: reads
    /// (`record`, `records`, `stats`, `in_doubt`, replays through `begin`)
    /// work; every write returns [`crate::Error::ReadOnly`]. The file is
    /// never written, not even its header, and no background thread runs.
    /// Reads see the file as it is; `begin` answers from it as a writable
    /// engine would, except that claiming (a write) is refused.
    ///
    /// # Errors
    ///
    /// [`OpenError::MissingDatabase`], [`OpenError::EmptyFile`];
    /// [`OpenError::NeedsRecovery`] if the file was not closed cleanly
    /// (recovery writes), or its journal holds frames the file does not
    /// (applying them writes); [`OpenError::Journal`] if, after a crash, the
    /// journal is missing or lacks the last checkpoint's frame;
    /// [`OpenError::NoEngineTables`] for a redb file
    /// without the engine's tables; [`OpenError::UnsupportedFormat`];
    /// [`OpenError::PreReleaseFormat`]; [`OpenError::Corrupt`] with
    /// [`Corrupted::Meta`](crate::Corrupted::Meta) if a meta value the open uses (the format, the journal's position, the
    /// expiry settings when taken from the database) is damaged (the others
    /// are reported by [`crate::Engine::verify`]);
    /// [`OpenError::NotADatabase`]; [`OpenError::AlreadyOpen`].
    pub fn open_read_only(mut self, path: impl AsRef<Path>) -> Result<Engine, OpenError> {
        let path = path.as_ref();
        existing(path)?;
        let store = redb_store::open_contained(path, || RedbReader::open(path))?;
        if self.stored_expiry {
            if let Some((ttl_ms, expiry)) = store.stored_expiry()? {
                self.cfg.store.ttl_ms = ttl_ms;
                self.cfg.store.expiry = expiry;
            }
        }
        let core = Arc::new(Core {
            store: Arc::new(store),
            clock: self.clock,
            cfg: self.cfg,
            counters: Counters::default(),
            asked: Asked::default(),
        });
        Ok(Engine::new(core, None))
    }

    /// An engine on redb's in-memory backend: nothing survives the engine.
    /// For tests and examples.
    ///
    /// # Errors
    ///
    /// Only if the threads cannot start ([`OpenError::ThreadStart`]).
    pub fn in_memory(self) -> Result<Engine, OpenError> {
        self.open_with_backend(redb::backends::InMemoryBackend::new())
    }

    /// An engine on any redb storage backend (for fault injection: a backend
    /// that fails writes or syncs on command).
    ///
    /// # Errors
    ///
    /// As for [`EngineBuilder::open`].
    pub fn open_with_backend(
        self,
        backend: impl redb::StorageBackend,
    ) -> Result<Engine, OpenError> {
        redb_store::open_contained(Path::new("<backend>"), || {
            let db = redb_store::open_backend(backend)?;
            self.start(redb_store::Opened::plain(db), None)
        })
    }

    /// An engine on the redb storage backend `make` returns, which the
    /// engine calls again to reopen the database after a storage failure
    /// has poisoned it (as [`EngineBuilder::open`] does with its file):
    /// `make` must return a backend over the same storage each time (the
    /// same device, or shared bytes); the engine closes the previous one
    /// first. `healthy` tells whether the storage takes writes again: it is
    /// called (at most once a second of the engine's clock, by a write or
    /// [`Engine::poisoned`]) before each reopen attempt, and an error skips
    /// the attempt, so the old database keeps serving replays. A reopen
    /// that fails after `healthy` passed doubles the wait before the next
    /// attempt (2 s, 4 s, ... at most 30 s); one that works resets it.
    ///
    /// # Errors
    ///
    /// As for [`EngineBuilder::open`]; an error `make` returns is an
    /// [`OpenError::Storage`].
    pub fn open_with_backend_factory<B, F, H>(
        self,
        make: F,
        healthy: H,
    ) -> Result<Engine, OpenError>
    where
        B: redb::StorageBackend,
        F: Fn() -> std::io::Result<B> + Send + Sync + 'static,
        H: Fn() -> std::io::Result<()> + Send + Sync + 'static,
    {
        let make = Arc::new(make);
        let open = move || -> Result<redb_store::Opened, OpenError> {
            let backend = make().map_err(|e| OpenError::Storage {
                context: "creating the storage backend",
                source: Box::new(e),
            })?;
            redb_store::open_backend(backend).map(redb_store::Opened::plain)
        };
        redb_store::open_contained(Path::new("<backend>"), || {
            let opened = open()?;
            self.start(opened, Some((Arc::new(open), Arc::new(healthy))))
        })
    }

    /// Table prefix of an engine on PostgreSQL (feature `postgres`): its
    /// tables are `<prefix>records`, `<prefix>outbox`, `<prefix>entities`
    /// and `<prefix>meta`, so several apps (or several engines of one app)
    /// can share a database. Default `idempotency_`. Checked when opening:
    /// 1 to 40 characters of `a-z`, `0-9` and `_`, not starting with a
    /// digit ([`OpenError::InvalidTablePrefix`] otherwise).
    #[cfg(feature = "postgres")]
    pub fn table_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.postgres.prefix = prefix.into();
        self
    }

    /// Most connections an engine on PostgreSQL keeps open (feature
    /// `postgres`); callers beyond it wait for one (see
    /// [`connect_timeout`](Self::connect_timeout)). Default 16; clamped to
    /// at least 1. One is opened at once, the rest on demand.
    #[cfg(feature = "postgres")]
    pub fn pool_size(mut self, connections: u32) -> Self {
        self.postgres.pool_size = connections.max(1);
        self
    }

    /// How long a call to an engine on PostgreSQL waits for a connection
    /// (feature `postgres`): a free one from the pool (then
    /// [`crate::Error::Storage`] naming the pool size and the wait), or a
    /// new one while the server is unreachable. Making a connection (the
    /// socket, the startup handshake and authentication together) is
    /// bounded by it too, so a server that accepts the socket and never
    /// answers (a stopped postmaster) fails the call instead of hanging it.
    /// Requests fail fast during an outage instead of piling up. Default
    /// 2 s; at least 1 ms. Opening the engine waits this long for its first
    /// connection and up to five times as long for the pool's first.
    #[cfg(feature = "postgres")]
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.postgres.connect_timeout = timeout.max(Duration::from_millis(1));
        self
    }

    /// The longest one statement of an engine on PostgreSQL may run
    /// (feature `postgres`), and so the longest a call waits for the
    /// server. Sent to the server as the session's `statement_timeout`
    /// (which also bounds waiting for a row lock), unless the connection
    /// string's `options` set one; the client itself waits at most this
    /// plus one second for each answer (so the server's own error, which
    /// names the statement, usually comes first), and then gives the
    /// connection up and fails the call with [`crate::Error::Timeout`]:
    /// a server that stops answering (stopped, or behind a network that
    /// drops packets) never blocks a caller for longer. The same bound
    /// applies to the statements an app runs in a local write
    /// ([`crate::LocalTx::postgres`]). Default 5 s; at least 1 ms. See
    /// "Bounded waits" in `docs/postgres.md` for the worst case per call.
    #[cfg(feature = "postgres")]
    pub fn statement_timeout(mut self, timeout: Duration) -> Self {
        self.postgres.statement_timeout = timeout.max(Duration::from_millis(1));
        self
    }

    /// How long a pooled connection of an engine on PostgreSQL may sit
    /// unused before it is closed (feature `postgres`); `None`: never.
    /// Default 10 minutes. The pool keeps at least one connection.
    #[cfg(feature = "postgres")]
    pub fn pool_idle_timeout(mut self, timeout: Option<Duration>) -> Self {
        self.postgres.pool_idle_timeout = timeout;
        self
    }

    /// How long a pooled connection of an engine on PostgreSQL is used at
    /// most before it is replaced (feature `postgres`); `None`: forever.
    /// Default 30 minutes (so connections move to a failed-over or
    /// rebalanced server in time).
    #[cfg(feature = "postgres")]
    pub fn pool_max_lifetime(mut self, lifetime: Option<Duration>) -> Self {
        self.postgres.pool_max_lifetime = lifetime;
        self
    }

    /// Whether an engine on PostgreSQL reads the time from the database
    /// (feature `postgres`). Default `true`: every engine sharing the
    /// database decides leases and expiry by the database server's clock,
    /// measured as an offset to the builder's [`clock`](Self::clock) at
    /// open and then at most once a second when the sweeper looks for
    /// work (so about once per [`sweep_interval`](Self::sweep_interval);
    /// with no sweeper, at open and at each [`Engine::sweep_now`]); the
    /// app servers' clocks may disagree by any amount. Engines agree to within half a round
    /// trip plus the local clocks' drift between two measurements. `false`:
    /// the builder's clock is used as it is (for tests with a
    /// [`crate::ManualClock`]; all engines' clocks must then agree).
    #[cfg(feature = "postgres")]
    pub fn database_clock(mut self, on: bool) -> Self {
        self.postgres.database_clock = on;
        self
    }

    /// Opens the engine on PostgreSQL (feature `postgres`), creating its
    /// tables on first use. `url` is a libpq-style connection string
    /// (`host=localhost user=app dbname=app`) or URL
    /// (`postgres://app@localhost/app`). Every engine, in any
    /// process, opened with the same database and
    /// [`table_prefix`](Self::table_prefix) shares the same records.
    ///
    /// TLS follows libpq's `sslmode` (`disable`, `allow`, `prefer`, the
    /// default, `require`, `verify-ca`, `verify-full`) and `sslrootcert`
    /// (a PEM file of CA certificates, or `system`), through rustls; for a
    /// database across a network use
    /// `...?sslmode=verify-full&sslrootcert=/path/to/ca.pem`. What each
    /// mode protects against: `docs/postgres.md`, "TLS".
    ///
    /// A write returns once PostgreSQL has committed it, so it is as
    /// durable as the server's `synchronous_commit` (and replication)
    /// makes it. A failed write does not stop the engine: the next call
    /// uses a fresh connection.
    ///
    /// # Errors
    ///
    /// [`OpenError::InvalidTablePrefix`]; [`OpenError::Storage`] if the
    /// connection string does not parse (a malformed string, an unknown
    /// `sslmode`), `sslrootcert` cannot be read, the server cannot be
    /// reached within five times [`connect_timeout`](Self::connect_timeout),
    /// the TLS handshake is refused (the message names the mode and the
    /// host), authentication fails, or creating the schema fails (no
    /// message shows the password);
    /// [`OpenError::UnsupportedSchema`] if the tables were made by a newer
    /// version of the crate (nothing is changed);
    /// [`OpenError::ThreadStart`].
    #[cfg(feature = "postgres")]
    pub fn open_postgres(self, url: &str) -> Result<Engine, OpenError> {
        self.open_postgres_in(url, crate::store::postgres::Mode::Create)
    }

    /// Opens the engine on PostgreSQL tables that already exist (feature
    /// `postgres`); never creates them and runs no DDL, so a role with
    /// `SELECT`, `INSERT`, `UPDATE` and `DELETE` on the tables and `USAGE`
    /// on their sequences (no `CREATE`) can use it. Otherwise as
    /// [`open_postgres`](Self::open_postgres): the open stores this
    /// engine's TTL and expiry policy (or, with
    /// [`expiry_settings_from_database`](Self::expiry_settings_from_database),
    /// takes the stored ones), and writes work. For operator tools, as
    /// [`open_existing`](Self::open_existing) is for a file.
    ///
    /// # Errors
    ///
    /// [`OpenError::NoPostgresTables`] if a table or sequence under the
    /// [`table_prefix`](Self::table_prefix) is missing (nothing is
    /// created); otherwise as for [`open_postgres`](Self::open_postgres).
    #[cfg(feature = "postgres")]
    pub fn open_postgres_existing(self, url: &str) -> Result<Engine, OpenError> {
        self.open_postgres_in(url, crate::store::postgres::Mode::Existing)
    }

    /// Opens existing PostgreSQL tables read-only (feature `postgres`), for
    /// operator tools, as [`open_read_only`](Self::open_read_only) does a
    /// file: reads work; every write returns [`crate::Error::ReadOnly`];
    /// no sweeper runs, whatever
    /// [`sweep_interval`](Self::sweep_interval) says. Nothing is written:
    /// every session starts with `SET default_transaction_read_only = on`
    /// (after the connection is made, so the connection string's
    /// `target_session_attrs` still tells a primary from a standby), so
    /// the server itself refuses a write; the open checks the schema and reads the database
    /// clock in read-only statements. A role with only `SELECT` on the
    /// tables can use it. Other engines may use the tables meanwhile.
    ///
    /// # Errors
    ///
    /// [`OpenError::NoPostgresTables`] if a table or sequence under the
    /// [`table_prefix`](Self::table_prefix) (or the stored schema version)
    /// is missing; [`OpenError::UnsupportedSchema`];
    /// [`OpenError::InvalidTablePrefix`]; [`OpenError::Storage`] if the
    /// connection string does not parse, the server cannot be reached, or
    /// a read fails (a role without `SELECT` on the tables).
    #[cfg(feature = "postgres")]
    pub fn open_postgres_read_only(mut self, url: &str) -> Result<Engine, OpenError> {
        self.sweep_interval = None;
        self.open_postgres_in(url, crate::store::postgres::Mode::ReadOnly)
    }

    #[cfg(feature = "postgres")]
    fn open_postgres_in(
        mut self,
        url: &str,
        mode: crate::store::postgres::Mode,
    ) -> Result<Engine, OpenError> {
        let opts = crate::store::postgres::PgOptions {
            url: url.to_owned(),
            prefix: self.postgres.prefix.clone(),
            pool_size: self.postgres.pool_size,
            connect_timeout: self.postgres.connect_timeout,
            statement_timeout: self.postgres.statement_timeout,
            pool_idle_timeout: self.postgres.pool_idle_timeout,
            pool_max_lifetime: self.postgres.pool_max_lifetime,
            database_clock: self.postgres.database_clock,
            mode,
        };
        let (store, clock, store_cfg) = crate::store::postgres::PgStore::open_contained(
            &opts,
            self.cfg.store,
            self.stored_expiry,
            self.clock.clone(),
        )?;
        self.cfg.store = store_cfg;
        self.clock = clock;
        if mode == crate::store::postgres::Mode::ReadOnly {
            return self.run(Arc::new(crate::store::read_only::ReadOnly(store)));
        }
        self.run(Arc::new(store))
    }

    /// Key prefix of an engine on Redis (feature `redis`): every key the
    /// engine writes starts with it (`<prefix>r:…` records, `<prefix>i:…`
    /// indexes, `<prefix>token`; the layout is in `docs/design.md`), so
    /// several apps or engines can share a server. Default
    /// `idempotency:`. Checked when opening: 1 to 64 printable ASCII
    /// characters without spaces or `* ? [ ] \`
    /// ([`OpenError::InvalidKeyPrefix`] otherwise). Nothing else may write
    /// under it: [`Engine::verify`] reports keys it did not write, except
    /// those of another engine on a longer prefix (`ten:eu:` beside
    /// `ten:`), which it skips. Nested prefixes are allowed; avoid one
    /// that ends in a layout name (`ten:r:` beside `ten:`).
    #[cfg(feature = "redis")]
    pub fn redis_key_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.redis.prefix = prefix.into();
        self
    }

    /// Most connections an engine on Redis keeps open (feature `redis`);
    /// callers beyond it wait for one, up to five times the
    /// [`redis_connect_timeout`](Self::redis_connect_timeout). Default 16;
    /// at least 1.
    #[cfg(feature = "redis")]
    pub fn redis_pool_size(mut self, connections: u32) -> Self {
        self.redis.pool_size = connections.max(1);
        self
    }

    /// How long an engine on Redis waits to make a connection (feature
    /// `redis`): the socket, TLS and authentication together. Default 2 s;
    /// at least 1 ms.
    #[cfg(feature = "redis")]
    pub fn redis_connect_timeout(mut self, timeout: Duration) -> Self {
        self.redis.connect_timeout = timeout.max(Duration::from_millis(1));
        self
    }

    /// The longest an engine on Redis waits for one answer (feature
    /// `redis`): the read and write timeout of every round trip, so a
    /// server that stops answering fails a call instead of blocking it.
    /// A write whose answer does not come in time is settled by reading
    /// it back (see `docs/design.md`, "Redis"). Default 5 s; at least 1 ms.
    #[cfg(feature = "redis")]
    pub fn redis_command_timeout(mut self, timeout: Duration) -> Self {
        self.redis.command_timeout = timeout.max(Duration::from_millis(1));
        self
    }

    /// Opens on a Redis server that does not fsync every write or that
    /// may evict keys (feature `redis`): without `appendonly yes` and
    /// `appendfsync always`, a server crash can forget acknowledged
    /// outcomes; with `maxmemory-policy allkeys-*`, a full server deletes
    /// claims and the fencing-token counter; either way work may run
    /// twice. Default `false`: such a server is refused
    /// ([`OpenError::RedisNotDurable`], [`OpenError::RedisEvicts`]). With
    /// `true` the open logs a warning and goes on (also when `CONFIG GET`
    /// is not allowed).
    #[cfg(feature = "redis")]
    pub fn allow_volatile(mut self, allow: bool) -> Self {
        self.redis.allow_volatile = allow;
        self
    }

    /// Vouches for the durability of a Redis server whose settings the
    /// open cannot read (feature `redis`): most managed services block or
    /// rename `CONFIG`, so the open's check of `appendonly`, `appendfsync`
    /// and `maxmemory-policy` finds them unreadable and refuses the server
    /// ([`OpenError::RedisNotDurable`], `found` saying `unreadable`).
    /// Give `true` only after checking with the provider that every write
    /// is persisted before the server answers it (AOF with `appendfsync
    /// always`, or a service durable by design such as one that commits a
    /// transaction log before replying) and that it never evicts keys
    /// (`noeviction` or a `volatile-*` policy): a server that loses an
    /// acknowledged write makes work run twice.
    ///
    /// Unlike [`allow_volatile`](Self::allow_volatile) this covers only
    /// what cannot be read: a setting `CONFIG GET` does return is checked
    /// as without it (`appendfsync everysec` is still refused). The open
    /// logs at INFO each setting it took on the app's word. Default
    /// `false`.
    #[cfg(feature = "redis")]
    pub fn redis_durability_attested(mut self, attested: bool) -> Self {
        self.redis.durability_attested = attested;
        self
    }

    /// Makes every write of an engine on Redis wait until `replicas`
    /// replicas acknowledged it (Redis `WAIT`, feature `redis`), at most
    /// `timeout` (at least 1 ms). A write fewer replicas acknowledged in
    /// time returns [`crate::Error::Storage`] saying how many did; it
    /// stands on the primary (a retry of the call finds it). `0`: no wait
    /// (the default).
    #[cfg(feature = "redis")]
    pub fn wait_replicas(mut self, replicas: u32, timeout: Duration) -> Self {
        self.redis.wait_replicas =
            (replicas > 0).then(|| (replicas, timeout.max(Duration::from_millis(1))));
        self
    }

    /// The CA certificates trusted for a `rediss://` server (feature
    /// `redis`): a PEM file holding one or more `-----BEGIN
    /// CERTIFICATE-----` blocks, read at open. They replace the system's
    /// trust store, which a `rediss://` URL uses without this setting.
    /// The server's certificate must name the URL's host (a DNS name or
    /// an IP address in its subject alternative names). There is no
    /// setting that skips the check.
    ///
    /// # Errors
    ///
    /// At [`open_redis`](Self::open_redis): [`OpenError::Storage`] naming
    /// the file if it cannot be read or holds no certificate, and if the
    /// URL is not `rediss://` (a CA for a plaintext connection is a
    /// mistake, not a no-op).
    #[cfg(feature = "redis")]
    pub fn redis_tls_ca(mut self, pem_file: impl Into<std::path::PathBuf>) -> Self {
        self.redis.tls_ca = Some(pem_file.into());
        self
    }

    /// The client certificate a `rediss://` connection presents, for a
    /// server that authenticates clients by certificate (mutual TLS,
    /// `tls-auth-clients yes`; feature `redis`): `cert_file` is a PEM file
    /// with the client's certificate first (then any intermediates),
    /// `key_file` a PEM file with its private key (PKCS#8, PKCS#1 or
    /// SEC1, unencrypted). Both are read and checked at open, before any
    /// connection. A password in the URL is still sent (`AUTH`) if given.
    ///
    /// # Errors
    ///
    /// At [`open_redis`](Self::open_redis): [`OpenError::Storage`] naming
    /// the file at fault (never its contents) if a file cannot be read,
    /// holds no certificate or no private key, or the key is not the
    /// certificate's; if the URL is not `rediss://`; and, at the
    /// handshake, if the server refuses the certificate (its
    /// `tls-ca-cert-file` does not hold the CA that signed it). Without
    /// this setting, a server that requires a client certificate is
    /// named as such.
    #[cfg(feature = "redis")]
    pub fn redis_tls_client_cert(
        mut self,
        cert_file: impl Into<std::path::PathBuf>,
        key_file: impl Into<std::path::PathBuf>,
    ) -> Self {
        self.redis.tls_client = Some((cert_file.into(), key_file.into()));
        self
    }

    /// The password for the Redis server when the URL gives none (feature
    /// `redis`), so it need not sit in a URL that configuration files,
    /// logs or `ps` show; sent with the URL's user name, if any, as
    /// `AUTH`. A URL with its own password keeps it (as a libpq
    /// connection string's password wins over `PGPASSWORD`). Never shown
    /// by the builder's `Debug` output or by an error.
    ///
    /// # Errors
    ///
    /// At [`open_redis`](Self::open_redis): [`OpenError::Storage`]
    /// (authentication failed) if the server refuses it.
    #[cfg(feature = "redis")]
    pub fn redis_password(mut self, password: impl Into<String>) -> Self {
        self.redis.password = Some(crate::store::redis::Password(password.into()));
        self
    }

    /// Opens the engine on a Redis or Valkey server (feature `redis`).
    /// `url` is `redis://[user:password@]host[:port][/db]`,
    /// `rediss://…` for TLS (rustls; the server's certificate is checked
    /// against the system's trust store or
    /// [`redis_tls_ca`](Self::redis_tls_ca), and must name the host; the
    /// first `rediss://` open makes rustls's `ring` provider the process
    /// default unless the app installed one), or
    /// `unix:///path/to/redis.sock`; every engine, in any process, opened
    /// on the same server, database and
    /// [`redis_key_prefix`](Self::redis_key_prefix) shares the same
    /// records. Every transition is one atomic Lua script on the server.
    ///
    /// The server must keep what it acknowledged: the open reads `CONFIG
    /// GET appendonly` and `appendfsync` and refuses anything but `yes`
    /// and `always`, and a `maxmemory-policy` of `allkeys-*` (it evicts
    /// the engine's keys), unless [`allow_volatile`](Self::allow_volatile). A
    /// write returns once the server has applied it (and, with `always`,
    /// fsynced its AOF); with [`wait_replicas`](Self::wait_replicas), once
    /// replicas have it too. Time comes from the builder's
    /// [`clock`](Self::clock): engines sharing a server need clocks that
    /// agree.
    ///
    /// # Errors
    ///
    /// [`OpenError::InvalidKeyPrefix`];
    /// [`OpenError::RedisUnsupported`] for a cluster URL or a server in
    /// cluster mode, a server that is not Redis, or one that refuses Lua
    /// scripts; [`OpenError::RedisNotDurable`], naming the setting and the
    /// fix; [`OpenError::RedisEvicts`] for `maxmemory-policy allkeys-*`;
    /// [`OpenError::Storage`] for a malformed URL, a server that
    /// cannot be reached in time, failed authentication, a TLS handshake
    /// that fails (a certificate not trusted or not naming the host, a
    /// server that does not speak TLS, or that wants or refuses a client
    /// certificate) or an unusable [`redis_tls_ca`](Self::redis_tls_ca) or
    /// [`redis_tls_client_cert`](Self::redis_tls_client_cert) (no message
    /// shows the URL, the password or a key); [`OpenError::ExpiryPolicyConflict`]
    /// if other engines on the prefix expire by another policy;
    /// [`OpenError::UnsupportedSchema`] if the prefix holds a newer layout;
    /// [`OpenError::ThreadStart`].
    #[cfg(feature = "redis")]
    pub fn open_redis(self, url: &str) -> Result<Engine, OpenError> {
        self.open_redis_in(url, crate::store::redis::Mode::Create)
    }

    /// Opens the engine on a Redis key prefix that an engine has already
    /// opened (feature `redis`): never writes the layout to a prefix that
    /// has none, so a wrong database number or a mistyped
    /// [`redis_key_prefix`](Self::redis_key_prefix) is an error, not a new
    /// empty store. Otherwise as [`open_redis`](Self::open_redis): the open
    /// stores this engine's TTL and expiry policy (or, with
    /// [`expiry_settings_from_database`](Self::expiry_settings_from_database),
    /// takes the stored ones), and writes work. For operator tools, as
    /// [`open_existing`](Self::open_existing) is for a file.
    ///
    /// # Errors
    ///
    /// [`OpenError::NoRedisData`] if the prefix holds no `<prefix>meta`
    /// (nothing is written); otherwise as for
    /// [`open_redis`](Self::open_redis).
    #[cfg(feature = "redis")]
    pub fn open_redis_existing(self, url: &str) -> Result<Engine, OpenError> {
        self.open_redis_in(url, crate::store::redis::Mode::Existing)
    }

    /// Opens a Redis key prefix read-only (feature `redis`), for operator
    /// tools, as [`open_read_only`](Self::open_read_only) does a file:
    /// reads work; every write returns [`crate::Error::ReadOnly`] before
    /// it reaches the server; no sweeper runs, whatever
    /// [`sweep_interval`](Self::sweep_interval) says. The open writes
    /// nothing and runs no script: it checks that the server is a single
    /// Redis (`INFO`) and reads `<prefix>meta`. The durability settings are
    /// not checked (reading needs none), so a replica will do, and so will
    /// a user whose ACL allows only reading commands, `INFO`, `CLIENT ID`
    /// and `MULTI`/`EXEC` (for example `-@all +@read +info +client|id
    /// +multi +exec`, plus `+select` for a URL naming a database number;
    /// a record and its effect steps are read in one `MULTI`). Other
    /// engines may use the prefix meanwhile.
    ///
    /// # Errors
    ///
    /// [`OpenError::NoRedisData`] if the prefix holds no `<prefix>meta`;
    /// [`OpenError::UnsupportedSchema`] for a newer layout;
    /// [`OpenError::InvalidKeyPrefix`]; [`OpenError::RedisUnsupported`]
    /// for a cluster; [`OpenError::Storage`] as for
    /// [`open_redis`](Self::open_redis), or a read the server refuses.
    #[cfg(feature = "redis")]
    pub fn open_redis_read_only(mut self, url: &str) -> Result<Engine, OpenError> {
        self.sweep_interval = None;
        self.open_redis_in(url, crate::store::redis::Mode::ReadOnly)
    }

    #[cfg(feature = "redis")]
    fn open_redis_in(
        mut self,
        url: &str,
        mode: crate::store::redis::Mode,
    ) -> Result<Engine, OpenError> {
        let opts = crate::store::redis::RedisOptions {
            url: url.to_owned(),
            prefix: self.redis.prefix.clone(),
            pool_size: self.redis.pool_size,
            connect_timeout: self.redis.connect_timeout,
            command_timeout: self.redis.command_timeout,
            allow_volatile: self.redis.allow_volatile,
            durability_attested: self.redis.durability_attested,
            wait_replicas: self.redis.wait_replicas,
            tls: crate::store::redis::TlsFiles {
                ca: self.redis.tls_ca.clone(),
                client: self.redis.tls_client.clone(),
            },
            password: self.redis.password.clone(),
            mode,
        };
        let (store, store_cfg) = crate::store::redis::RedisStore::open(
            &opts,
            self.cfg.store,
            self.stored_expiry,
            self.clock.clone(),
        )?;
        self.cfg.store = store_cfg;
        if mode == crate::store::redis::Mode::ReadOnly {
            return self.run(Arc::new(crate::store::read_only::ReadOnly(store)));
        }
        self.run(Arc::new(store))
    }

    fn start(
        mut self,
        opened: redb_store::Opened,
        reopen: Option<(redb_store::Reopen, redb_store::Probe)>,
    ) -> Result<Engine, OpenError> {
        self.cfg.store = redb_store::prepare_new_as(
            &opened.db,
            opened.name(),
            self.cfg.store,
            self.stored_expiry,
            self.new_format,
        )?;
        let store = RedbStore::start(
            opened,
            self.cfg.store,
            self.clock.clone(),
            redb_store::Sizes {
                max_batch: self.cfg.max_batch,
                max_group_bytes: self.cfg.max_group_bytes,
                queue_capacity: self.cfg.queue_capacity,
                recovery_reserve: self.cfg.recovery_reserve,
                seal_rule: self.seal_rule,
                migration: self.migration,
            },
            reopen,
        )?;
        self.run(Arc::new(store))
    }

    /// Starts the engine (and its sweeper) on an opened store.
    fn run(self, store: Arc<dyn crate::store::Backend>) -> Result<Engine, OpenError> {
        let core = Arc::new(Core {
            store,
            clock: self.clock,
            cfg: self.cfg,
            counters: Counters::default(),
            asked: Asked::default(),
        });
        let sweeper = match self.sweep_interval {
            Some(interval) => Some(Sweeper::start(core.clone(), interval).map_err(|source| {
                OpenError::ThreadStart {
                    thread: "sweeper",
                    source,
                }
            })?),
            None => None,
        };
        Ok(Engine::new(core, sweeper))
    }
}

/// Checks that `path` is a file with something in it.
pub(super) fn existing(path: &Path) -> Result<(), OpenError> {
    match std::fs::metadata(path) {
        Ok(m) if m.len() > 0 => Ok(()),
        Ok(_) => Err(OpenError::EmptyFile {
            path: path.to_path_buf(),
        }),
        Err(_) => Err(OpenError::MissingDatabase {
            path: path.to_path_buf(),
        }),
    }
}
