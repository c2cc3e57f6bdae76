//! The write half of a read-only backend (redb's `RedbReader`, and
//! `read_only.rs`'s `ReadOnly` for PostgreSQL and Redis): every write
//! refused with `Error::ReadOnly`, written once.

/// `Error::ReadOnly` for `operation`.
pub(crate) fn refused<T>(operation: &'static str) -> crate::error::Result<T> {
    Err(crate::error::Error::ReadOnly { operation })
}

/// Expands, inside an `impl Backend for ...` block, to every write method
/// of `Backend`, each refused with `Error::ReadOnly` naming the operation
/// (dropping a claim and flushing have nothing to refuse and do nothing).
macro_rules! refuse_writes {
    () => {
        fn claim(
            &self,
            _: $crate::store::ClaimRequest,
        ) -> $crate::error::Result<$crate::store::ClaimResult> {
            $crate::store::refuse::refused("claim")
        }

        fn reserve_step(
            &self,
            _: $crate::store::StepRequest,
        ) -> $crate::error::Result<$crate::store::StepRecord> {
            $crate::store::refuse::refused("reserve an effect step")
        }

        fn finish_step(
            &self,
            _: $crate::store::FinishStepRequest,
        ) -> $crate::error::Result<$crate::store::StepRecord> {
            $crate::store::refuse::refused("confirm an effect step")
        }

        fn settle_step(
            &self,
            _: $crate::store::SettleStepRequest,
        ) -> $crate::error::Result<$crate::store::StepRecord> {
            $crate::store::refuse::refused("settle an effect step")
        }

        fn complete(&self, _: $crate::store::CompleteRequest) -> $crate::error::Result<()> {
            $crate::store::refuse::refused("complete")
        }

        fn release(&self, _: $crate::key::IdempotencyKey, _: u64) -> $crate::error::Result<()> {
            $crate::store::refuse::refused("release")
        }

        fn mark_in_doubt(&self, _: $crate::store::InDoubtRequest) -> $crate::error::Result<()> {
            $crate::store::refuse::refused("mark unknown")
        }

        fn mark_in_doubt_detached(&self, _: $crate::store::InDoubtRequest) {}

        fn extend(
            &self,
            _: $crate::key::IdempotencyKey,
            _: u64,
            _: u64,
        ) -> $crate::error::Result<u64> {
            $crate::store::refuse::refused("extend")
        }

        fn settle(
            &self,
            _: $crate::store::SettleRequest,
        ) -> $crate::error::Result<$crate::store::Settled<()>> {
            $crate::store::refuse::refused("resolve")
        }

        fn settle_then_claim(
            &self,
            _: $crate::store::SettleRequest,
            _: $crate::store::ClaimRequest,
        ) -> $crate::error::Result<$crate::store::Settled<$crate::store::Claimed>> {
            $crate::store::refuse::refused("resolve")
        }

        fn dead_letter(&self, _: $crate::store::DeadLetterRequest) -> $crate::error::Result<u64> {
            $crate::store::refuse::refused("dead-letter a message")
        }

        fn redrive(&self, _: u64) -> $crate::error::Result<Option<String>> {
            $crate::store::refuse::refused("redrive a dead letter")
        }

        fn sweep(&self, _: usize) -> $crate::error::Result<$crate::report::SweepCounts> {
            $crate::store::refuse::refused("sweep")
        }

        fn purge(
            &self,
            _: $crate::key::IdempotencyKey,
            _: $crate::policy::PurgeMode,
        ) -> $crate::error::Result<Option<$crate::state::State>> {
            $crate::store::refuse::refused("purge")
        }

        fn transition(
            &self,
            _: $crate::store::TransitionRequest,
        ) -> $crate::error::Result<$crate::transition::Transition> {
            $crate::store::refuse::refused("transition")
        }

        fn mark_published(&self, _: Vec<u64>) -> $crate::error::Result<u64> {
            $crate::store::refuse::refused("mark published")
        }

        fn flush(&self) -> $crate::error::Result<()> {
            Ok(())
        }

        fn local(
            &self,
            _: $crate::store::LocalWrite,
        ) -> $crate::error::Result<$crate::store::LocalResult> {
            $crate::store::refuse::refused("local write")
        }
    };
}

pub(crate) use refuse_writes;
