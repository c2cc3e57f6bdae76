//! A claim's writes in one statement, without a transaction block.
//!
//! The full path (`Shared::write`) is many round trips: `BEGIN`, `SELECT …
//! FOR UPDATE`, the step and log reads, the writes, `COMMIT`. But a claim
//! this engine inserted itself knows its rows exactly: the record bytes it
//! wrote, and the steps and log entries it wrote since (a [`View`]). So the
//! shared operation (`Ops::complete`, `step_ops::reserve_step`,
//! `finish_step`: the same rules as every backend) runs against that view
//! through [`Recorder`], which holds its writes back, and the writes are
//! sent as one autocommitted statement (`in_place_sql.rs`): a
//! compare-and-set of the record row (`… WHERE token AND record = <the
//! remembered bytes>`, which locks the row and is re-checked on its latest
//! version), and the step upserts and log inserts only when it matched.
//!
//! Why the view is exact when the statement lands: the record row holds
//! the remembered bytes, and every other write that changes a step or the
//! log of a PROCESSING claim (the claim's own calls through the full path)
//! also appends to the log, whose next sequence number the statement
//! inserts: a log entry written meanwhile makes that insert fail on the
//! primary key, and the whole statement with it. So an op that writes no
//! log entry is sent only while the view has no steps and no log (the
//! plain completion). In every other case (nothing remembered, the row or
//! the log changed, the op refuses, or needs anything but the record, its
//! steps and its log) nothing was written and the caller takes the full
//! path, which decides on the rows as they are.

use std::collections::HashMap;

use parking_lot::Mutex;

use crate::key::IdempotencyKey;
use crate::message::OutgoingMessage;
use crate::store::config::StoreConfig;
use crate::store::ops::{Loaded, LoadedStep, OpResult, Txn};
use crate::store::record::{EntityState, Record};
use crate::store::step::{HistoryRecord, StepRecord};

/// Claims remembered at most; beyond this, new claims are not remembered
/// and write through the full path.
const REMEMBERED: usize = 4_096;

/// What a claim's rows hold, as this engine wrote them.
#[derive(Clone, Debug)]
pub(super) struct View {
    /// The record, with its token (the row's bytes may carry token 0, see
    /// `txn::with_token`).
    pub(super) record: Record,
    /// The record row's bytes.
    pub(super) bytes: Vec<u8>,
    /// The key's steps, in name order.
    pub(super) steps: Vec<StepRecord>,
    /// The first and last sequence numbers of the key's log.
    pub(super) span: Option<(u32, u32)>,
}

impl View {
    /// A fresh claim's view: its record, no steps, no log.
    pub(super) fn fresh(record: Record, bytes: Vec<u8>) -> View {
        View {
            record,
            bytes,
            steps: Vec::new(),
            span: None,
        }
    }
}

/// The views of claims this engine inserted and has not finished yet. A
/// write takes its claim's view out while it runs, so a second write of
/// the same claim at the same time takes the full path.
#[derive(Default)]
pub(super) struct Remembered(Mutex<HashMap<IdempotencyKey, View>>);

impl Remembered {
    pub(super) fn insert(&self, key: &IdempotencyKey, view: View) {
        let mut map = self.0.lock();
        if map.len() < REMEMBERED || map.contains_key(key) {
            map.insert(key.clone(), view);
        }
    }

    /// Takes the view remembered for `key`'s claim `token`.
    pub(super) fn take(&self, key: &IdempotencyKey, token: u64) -> Option<View> {
        let mut map = self.0.lock();
        match map.get(key) {
            Some(view) if view.record.token == token => map.remove(key),
            _ => None,
        }
    }

    pub(super) fn forget(&self, key: &IdempotencyKey) {
        self.0.lock().remove(key);
    }
}

/// The writes an op made against a view.
#[derive(Debug, Default)]
pub(super) struct Writes {
    /// The record's new value and bytes.
    pub(super) record: Option<(Record, Vec<u8>)>,
    /// Steps written, each once (its last value).
    pub(super) steps: Vec<StepRecord>,
    /// Log entries appended, in sequence order from the view's next one.
    pub(super) history: Vec<HistoryRecord>,
}

/// A transaction that sees one [`View`] and holds back the op's writes;
/// anything else it cannot do (`Err(())`).
pub(super) struct Recorder<'a> {
    key: &'a IdempotencyKey,
    view: &'a View,
    now: u64,
    cfg: StoreConfig,
    /// The view's steps with the op's writes applied.
    steps: Vec<StepRecord>,
    writes: Writes,
}

impl Recorder<'_> {
    fn span(&self) -> Option<(u32, u32)> {
        let added = u32::try_from(self.writes.history.len()).unwrap_or(u32::MAX);
        match self.view.span {
            _ if added == 0 => self.view.span,
            None => Some((0, added - 1)),
            Some((first, last)) => Some((first, last.saturating_add(added))),
        }
    }
}

/// Runs `op` against `view` at `now`: its answer, its writes and the view
/// after them; `None` when the op refused, needed anything the view does
/// not hold, or its writes cannot be checked in one statement (see the
/// module docs): the full path decides.
pub(super) fn decide<T>(
    key: &IdempotencyKey,
    view: &View,
    now: u64,
    cfg: StoreConfig,
    op: impl FnOnce(&mut Recorder<'_>) -> OpResult<T, ()>,
) -> Option<(T, Writes, View)> {
    let mut t = Recorder {
        key,
        view,
        now,
        cfg,
        steps: view.steps.clone(),
        writes: Writes::default(),
    };
    let answer = op(&mut t).ok()?;
    let unchecked = t.writes.history.is_empty();
    if unchecked && (!view.steps.is_empty() || view.span.is_some() || !t.writes.steps.is_empty()) {
        return None;
    }
    if unchecked && t.writes.record.is_none() {
        return None;
    }
    let span = t.span();
    let (record, bytes) = match &t.writes.record {
        Some((record, bytes)) => (record.clone(), bytes.clone()),
        None => (view.record.clone(), view.bytes.clone()),
    };
    let after = View {
        record,
        bytes,
        steps: t.steps,
        span,
    };
    Some((answer, t.writes, after))
}

impl Txn for Recorder<'_> {
    type Fatal = ();

    fn now(&self) -> u64 {
        self.now
    }

    fn cfg(&self) -> StoreConfig {
        self.cfg
    }

    fn load(&mut self, key: &IdempotencyKey) -> Result<Loaded<Record>, ()> {
        if key == self.key && self.writes.record.is_none() {
            Ok(Some(Ok(self.view.record.clone())))
        } else {
            Err(())
        }
    }

    fn store(
        &mut self,
        key: &IdempotencyKey,
        old: Option<&Record>,
        new: &Record,
    ) -> Result<(), ()> {
        if key == self.key && old == Some(&self.view.record) && self.writes.record.is_none() {
            let bytes = crate::store::codec::encode(key.record_key(), new);
            self.writes.record = Some((new.clone(), bytes));
            Ok(())
        } else {
            Err(())
        }
    }

    fn remove(&mut self, _: &IdempotencyKey, _: Option<&Record>) -> Result<(), ()> {
        Err(())
    }

    fn next_token(&mut self) -> Result<u64, ()> {
        Err(())
    }

    fn push_outbox(&mut self, _: String, _: OutgoingMessage) -> Result<(), ()> {
        Err(())
    }

    fn remove_outbox(&mut self, _: u64) -> Result<bool, ()> {
        Err(())
    }

    fn push_dead_letter(&mut self, _: crate::dead_letter::DeadLetter) -> Result<u64, ()> {
        Err(())
    }

    fn load_dead_letter(&mut self, _: u64) -> Result<Loaded<crate::dead_letter::DeadLetter>, ()> {
        Err(())
    }

    fn remove_dead_letter(&mut self, _: u64) -> Result<(), ()> {
        Err(())
    }

    fn load_entity(&mut self, _: &str) -> Result<Loaded<EntityState>, ()> {
        Err(())
    }

    fn store_entity(&mut self, _: &str, _: &EntityState) -> Result<(), ()> {
        Err(())
    }

    fn load_steps(&mut self, key: &IdempotencyKey) -> Result<Vec<LoadedStep>, ()> {
        if key != self.key {
            return Err(());
        }
        Ok(self
            .steps
            .iter()
            .map(|s| (s.name.clone(), Ok(s.clone())))
            .collect())
    }

    fn store_step(&mut self, key: &IdempotencyKey, step: &StepRecord) -> Result<(), ()> {
        if key != self.key {
            return Err(());
        }
        match self.steps.binary_search_by(|s| s.name.cmp(&step.name)) {
            Ok(at) => self.steps[at] = step.clone(),
            Err(at) => self.steps.insert(at, step.clone()),
        }
        self.writes.steps.retain(|s| s.name != step.name);
        self.writes.steps.push(step.clone());
        Ok(())
    }

    fn remove_steps(&mut self, _: &IdempotencyKey) -> Result<(), ()> {
        Err(())
    }

    fn history_span(&mut self, key: &IdempotencyKey) -> Result<Option<(u32, u32)>, ()> {
        if key == self.key {
            Ok(self.span())
        } else {
            Err(())
        }
    }

    fn append_history(&mut self, key: &IdempotencyKey, entry: &HistoryRecord) -> Result<(), ()> {
        // Only the next entry of a contiguous log (what `step_ops::log`
        // appends): its sequence number is the statement's check.
        let next = self.span().map_or(0, |(_, last)| last.saturating_add(1));
        if key != self.key || entry.seq != next || self.span().is_some_and(|(_, l)| l == u32::MAX) {
            return Err(());
        }
        self.writes.history.push(entry.clone());
        Ok(())
    }

    fn remove_history(&mut self, _: &IdempotencyKey) -> Result<(), ()> {
        Err(())
    }
}

/// How often a remembered claim's write was sent in place, and how often
/// it fell back to the full path (the row or log changed, or the op
/// refused or needed more than the view): for tests and debugging.
#[derive(Default, Debug)]
pub(super) struct Counts {
    pub(super) written: std::sync::atomic::AtomicU64,
    pub(super) fell_back: std::sync::atomic::AtomicU64,
}

impl Counts {
    pub(super) fn count(&self, written: bool) {
        let counter = if written {
            &self.written
        } else {
            &self.fell_back
        };
        counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }

    /// `(written, fell_back)` so far.
    #[cfg(test)]
    pub(super) fn get(&self) -> (u64, u64) {
        use std::sync::atomic::Ordering::Relaxed;
        (self.written.load(Relaxed), self.fell_back.load(Relaxed))
    }
}
