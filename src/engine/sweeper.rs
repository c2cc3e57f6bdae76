//! The background sweeper thread.
//!
//! Every `interval` it runs one sweep pass: stale PROCESSING records move to
//! UNKNOWN, expired records are deleted (or tombstoned). A pass is a series of
//! bounded sweep steps through the writer, so a claim waits behind at most
//! one step, never a whole large sweep.

use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};

use crate::engine::core::Core;

/// Handle to the running sweeper; dropping it does not stop it: call `stop`.
pub(crate) struct Sweeper {
    stop: Sender<()>,
    thread: JoinHandle<()>,
}

impl Sweeper {
    pub(crate) fn start(core: Arc<Core>, interval: Duration) -> std::io::Result<Sweeper> {
        let (stop, stopped) = crossbeam_channel::bounded(1);
        let thread = std::thread::Builder::new()
            .name("idempotency-sweeper".into())
            .spawn(move || run(&core, interval, &stopped))?;
        Ok(Sweeper { stop, thread })
    }

    /// Asks the thread to stop and joins it.
    pub(crate) fn stop(self) {
        let _ = self.stop.send(());
        if self.thread.join().is_err() {
            tracing::error!("sweeper thread panicked");
        }
    }
}

fn run(core: &Core, interval: Duration, stopped: &Receiver<()>) {
    loop {
        match stopped.recv_timeout(interval) {
            Err(RecvTimeoutError::Timeout) => {}
            Ok(()) | Err(RecvTimeoutError::Disconnected) => return,
        }
        // A poisoned engine refuses writes until it has reopened its
        // database; asking is one of the moments it tries. Skip this tick
        // and keep going: the sweeper must run again after the reopen.
        if core.store.check().is_err() {
            continue;
        }
        match core.sweep_pass(&|| !stopped.is_empty()) {
            Ok(c) if c.moved_to_unknown + c.deleted + c.tombstoned > 0 => tracing::info!(
                moved_to_unknown = c.moved_to_unknown,
                deleted = c.deleted,
                tombstoned = c.tombstoned,
                "sweep pass"
            ),
            Ok(_) => {}
            Err(e) => tracing::error!(error = %e, "sweep pass failed"),
        }
    }
}
