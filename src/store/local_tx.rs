//! What a local write is made of, for every backend: the transaction the
//! app's closure gets ([`LocalTx`]) and the request a backend runs.

use std::panic::{catch_unwind, AssertUnwindSafe};

use crate::envelope::Envelope;
use crate::error::{BoxError, Error};
use crate::fingerprint::Fingerprint;
use crate::key::IdempotencyKey;
use crate::message::OutgoingMessage;

/// The transaction an app's local write runs in (see
/// [`crate::Engine::complete_local`] and [`crate::Engine::execute_local`]).
///
/// It is the backend's own write transaction: everything the app writes
/// through it commits together with the key's COMPLETED record (and any
/// outbox messages sent here), or not at all. Exactly one of
/// [`LocalTx::redb`] and `LocalTx::postgres` (feature `postgres`) returns
/// `Some`, depending on the store the engine was opened on.
pub struct LocalTx<'a> {
    inner: Inner<'a>,
    outbox: Vec<OutgoingMessage>,
}

enum Inner<'a> {
    Redb(&'a redb::WriteTransaction),
    #[cfg(feature = "postgres")]
    Postgres(crate::store::postgres::Transaction<'a>),
    #[cfg(feature = "redis")]
    Redis(crate::store::redis::RedisLocal<'a>),
}

impl<'a> LocalTx<'a> {
    pub(crate) fn on_redb(txn: &'a redb::WriteTransaction) -> LocalTx<'a> {
        LocalTx {
            inner: Inner::Redb(txn),
            outbox: Vec::new(),
        }
    }

    #[cfg(feature = "postgres")]
    pub(crate) fn on_postgres(txn: crate::store::postgres::Transaction<'a>) -> LocalTx<'a> {
        LocalTx {
            inner: Inner::Postgres(txn),
            outbox: Vec::new(),
        }
    }

    #[cfg(feature = "redis")]
    pub(crate) fn on_redis(local: crate::store::redis::RedisLocal<'a>) -> LocalTx<'a> {
        LocalTx {
            inner: Inner::Redis(local),
            outbox: Vec::new(),
        }
    }

    /// The app's keys, when the engine runs on Redis (feature `redis`);
    /// `None` on redb and PostgreSQL. Their reads and writes commit with
    /// the key's completion in one script, or not at all (see
    /// [`crate::RedisLocal`]).
    #[cfg(feature = "redis")]
    pub fn redis(&mut self) -> Option<&mut crate::store::redis::RedisLocal<'a>> {
        match &mut self.inner {
            Inner::Redis(local) => Some(local),
            Inner::Redb(_) => None,
            #[cfg(feature = "postgres")]
            Inner::Postgres(_) => None,
        }
    }

    /// The redb write transaction, when the engine runs on a redb file;
    /// `None` on PostgreSQL. Open the app's own tables on it (any name not
    /// starting with `idempotency.`). The engine's own tables are open for
    /// the whole closure, so opening one of them fails.
    pub fn redb(&self) -> Option<&redb::WriteTransaction> {
        match &self.inner {
            Inner::Redb(txn) => Some(txn),
            #[cfg(feature = "postgres")]
            Inner::Postgres(_) => None,
            #[cfg(feature = "redis")]
            Inner::Redis(_) => None,
        }
    }

    /// The PostgreSQL transaction, when the engine runs on PostgreSQL;
    /// `None` on redb. Run the app's own statements on it (on tables other
    /// than the engine's, whose names start with the table prefix). An
    /// error inside it aborts the transaction: return that error from the
    /// closure, and nothing is written. Each of its round trips waits at
    /// most `EngineBuilder::statement_timeout` plus a second (see
    /// [`crate::PgTransaction`]).
    #[cfg(feature = "postgres")]
    pub fn postgres(&mut self) -> Option<&mut crate::store::postgres::Transaction<'a>> {
        match &mut self.inner {
            Inner::Postgres(txn) => Some(txn),
            Inner::Redb(_) => None,
            #[cfg(feature = "redis")]
            Inner::Redis(_) => None,
        }
    }

    /// Queues an outbox message, stored in the same transaction. Its id is
    /// `<claim reference>/<n>`, in the order sent.
    pub fn send(&mut self, message: OutgoingMessage) {
        self.outbox.push(message);
    }

    pub(crate) fn into_outbox(self) -> Vec<OutgoingMessage> {
        self.outbox
    }

    /// The PostgreSQL transaction back, with the queued outbox messages.
    #[cfg(feature = "postgres")]
    pub(crate) fn into_postgres(
        self,
    ) -> Option<(
        crate::store::postgres::Transaction<'a>,
        Vec<OutgoingMessage>,
    )> {
        match self.inner {
            Inner::Postgres(txn) => Some((txn, self.outbox)),
            Inner::Redb(_) => None,
            #[cfg(feature = "redis")]
            Inner::Redis(_) => None,
        }
    }
}

impl std::fmt::Debug for LocalTx<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let store = match self.inner {
            Inner::Redb(_) => "redb",
            #[cfg(feature = "postgres")]
            Inner::Postgres(_) => "postgres",
            #[cfg(feature = "redis")]
            Inner::Redis(_) => "redis",
        };
        f.debug_struct("LocalTx")
            .field("store", &store)
            .field("outbox", &self.outbox.len())
            .finish()
    }
}

/// The app's closure: gets the transaction, returns the envelope to store.
pub(crate) type LocalFn = Box<dyn FnOnce(&mut LocalTx<'_>) -> Result<Envelope, BoxError> + Send>;

/// Whose record a local write completes.
#[derive(Debug, Clone, Copy)]
pub(crate) enum LocalTarget {
    /// A claim the caller already holds.
    Claimed { token: u64 },
    /// No claim yet: check and claim inside the same transaction, so a crash
    /// anywhere leaves nothing behind (no PROCESSING record to recover).
    Fresh {
        fingerprint: Fingerprint,
        lease_ms: u64,
    },
}

/// A local write waiting for its backend.
pub(crate) struct LocalWrite {
    pub(crate) key: IdempotencyKey,
    pub(crate) target: LocalTarget,
    pub(crate) run: LocalFn,
    /// The claim's deferred step finishes, stored with the outcome.
    pub(crate) finished: Vec<super::step::StepFinish>,
}

impl std::fmt::Debug for LocalWrite {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalWrite")
            .field("key", &self.key)
            .field("target", &self.target)
            .finish()
    }
}

/// Runs the app's closure on `ltx`: its error or panic is
/// `Error::LocalWrite`, an envelope over `max_response_bytes` is
/// `Error::ResponseTooLarge`. Either way the caller rolls the transaction
/// back.
pub(crate) fn run_local(
    run: LocalFn,
    ltx: &mut LocalTx<'_>,
    key: &IdempotencyKey,
    max_response_bytes: usize,
) -> Result<Envelope, Error> {
    let envelope = match catch_unwind(AssertUnwindSafe(|| run(ltx))) {
        Ok(Ok(envelope)) => envelope,
        Ok(Err(source)) => {
            return Err(Error::LocalWrite {
                key: key.clone(),
                source,
            })
        }
        Err(_) => {
            return Err(Error::LocalWrite {
                key: key.clone(),
                source: "the local write panicked".into(),
            })
        }
    };
    let size = envelope.size_bytes();
    if size > max_response_bytes {
        return Err(Error::ResponseTooLarge {
            key: key.clone(),
            size,
            limit: max_response_bytes,
            claim: None,
        });
    }
    Ok(envelope)
}
