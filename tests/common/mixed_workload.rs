//! The mixed workload the damage and salvage tests (`salvage.rs`,
//! `salvage_format3.rs`, `byte_flips.rs`) write through the public API:
//! tombstones first (completed, expired past a 30-day TTL and swept, the
//! clock then set back), then every other key in order as its test's
//! `kind(i)` says: completed (plain, after an effect step, with a receipt
//! message or with a resource), declined, UNKNOWN, PROCESSING, an inbox
//! mark or an entity. Each test names its own keys, fingerprints and
//! bodies, which its assertions depend on ([`key`] and [`payment_body`]
//! serve those that share them).
//!
//! Include it with `#[path = "common/mixed_workload.rs"] mod mixed_workload;`
//! beside `mod common;` (it unwraps claims with `common::claimed`).

#![allow(dead_code)] // each test file uses what it needs

use std::error::Error;
use std::ops::Range;
use std::time::Duration;

use idempotency::{
    Clock, Engine, Envelope, Failure, Fingerprint, IdempotencyKey, ManualClock, OutgoingMessage,
    Receive,
};

use super::common::claimed;

/// How far the clock jumps so that the tombstones' records expire: past
/// the 30-day TTL of the tests' builder (`common/fixture_engine.rs`).
const PAST_TTL: Duration = Duration::from_secs(31 * 24 * 60 * 60);

/// The payment key `order-{i:04}` in scope `shop:pay`.
pub fn key(i: usize) -> Result<IdempotencyKey, idempotency::Error> {
    IdempotencyKey::new("shop:pay", format!("order-{i:04}"))
}

/// A distinct JSON body of about 300 bytes, like a payment provider's,
/// for payment `i` (`pay_{i}` with `digits` digits, at least).
pub fn payment_body(i: usize, digits: usize) -> Vec<u8> {
    let note: String = (0..200)
        .map(|j| char::from(b'a' + u8::try_from((i * 31 + j * 7) % 26).unwrap_or(0)))
        .collect();
    format!(
        r#"{{"payment":"pay_{i:0digits$}","amount":{},"currency":"EUR","customer":"cus_{:016x}","note":"{note}"}}"#,
        100 + i * 7,
        (i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15)
    )
    .into_bytes()
}

/// What key `i` becomes. Envelopes are of schema 1; bodies are the
/// workload's `body(i)` unless said otherwise.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Kind {
    /// Completed (201) before all other keys, then expired and swept.
    Tombstone,
    /// Completed (201).
    Completed,
    /// The effect step `charge` begun and confirmed with `ch_{i}`, then
    /// completed (201): a record with a step and its log entries.
    CompletedAfterStep,
    /// Completed (201, with `content-type: application/json` when `json`)
    /// with one outbox message to `email`: `receipt {i}`.
    CompletedWithReceipt {
        /// Whether the envelope has the JSON content type.
        json: bool,
    },
    /// Completed (201, with `content-type: application/json`) with the
    /// resource given.
    CompletedWithResource(String),
    /// Failed for good: a 402 whose body is the text given.
    Declined(String),
    /// Failed in doubt (`provider timed out for {i}`): UNKNOWN.
    Unknown,
    /// Claimed, and the claim forgotten (never reported back, never
    /// dropped): PROCESSING.
    Processing,
    /// No record: message `msg-{i}` received and acked in the `ledger`
    /// inbox.
    InboxMark,
    /// No record: entity `order-{i}` `created`, then `paid` when `paid`.
    Entity {
        /// Whether the entity goes on to `paid`.
        paid: bool,
    },
}

/// One test's workload: its keys, fingerprints, bodies, and what each key
/// becomes.
pub struct Workload {
    /// Key `i`.
    pub key: fn(usize) -> Result<IdempotencyKey, idempotency::Error>,
    /// The fingerprint key `i` is claimed with.
    pub fp: fn(usize) -> Result<Fingerprint, idempotency::FingerprintError>,
    /// The body key `i` is completed with.
    pub body: fn(usize) -> Vec<u8>,
    /// What key `i` becomes.
    pub kind: fn(usize) -> Kind,
}

impl Workload {
    /// Writes the keys in `keys` through `engine`: first the tombstones
    /// (completed, then `clock` moved past the TTL, a sweep, and `clock`
    /// set back to where it stood), then every other key in order.
    ///
    /// # Errors
    ///
    /// Any engine error, or a `begin` that does not claim.
    pub fn write(
        &self,
        engine: &Engine,
        clock: &ManualClock,
        keys: Range<usize>,
    ) -> Result<(), Box<dyn Error>> {
        let start = clock.now_ms();
        for i in keys.clone().filter(|&i| (self.kind)(i) == Kind::Tombstone) {
            let c = claimed(engine.begin(&(self.key)(i)?, (self.fp)(i)?)?)?;
            engine.complete(c, Envelope::new(1, 201, (self.body)(i)))?;
        }
        clock.advance(PAST_TTL);
        engine.sweep_now()?;
        clock.set(start);
        let mut forgotten = Vec::new();
        for i in keys {
            let claim = || -> Result<_, Box<dyn Error>> {
                Ok(claimed(engine.begin(&(self.key)(i)?, (self.fp)(i)?)?)?)
            };
            // A 201 of `body(i)`, with the JSON content type when `json`.
            let created = |json: bool| {
                let envelope = Envelope::new(1, 201, (self.body)(i));
                if json {
                    envelope.with_header("content-type", "application/json")
                } else {
                    envelope
                }
            };
            match (self.kind)(i) {
                Kind::Tombstone => {}
                Kind::Completed => engine.complete(claim()?, created(false))?,
                Kind::CompletedAfterStep => {
                    let c = claim()?;
                    let _ = c.effect("charge")?;
                    c.confirm("charge", format!("ch_{i}").as_bytes())?;
                    engine.complete(c, created(false))?;
                }
                Kind::CompletedWithReceipt { json } => {
                    let receipt = OutgoingMessage::new("email", format!("receipt {i}"));
                    engine.complete_with_messages(claim()?, created(json), vec![receipt])?;
                }
                Kind::CompletedWithResource(resource) => {
                    engine.complete_with_resource(claim()?, created(true), resource)?;
                }
                Kind::Declined(text) => {
                    engine.fail(claim()?, Failure::Final(Envelope::new(1, 402, text)))?;
                }
                Kind::Unknown => {
                    let reason = format!("provider timed out for {i}");
                    engine.fail(claim()?, Failure::InDoubt { reason })?;
                }
                Kind::Processing => forgotten.push(claim()?),
                Kind::InboxMark => {
                    let inbox = engine.inbox("ledger")?;
                    if let Receive::Fresh(ticket) = inbox.receive(&format!("msg-{i}"))? {
                        ticket.ack()?;
                    }
                }
                Kind::Entity { paid } => {
                    let order = format!("order-{i}");
                    engine.transition(&order, &[], "created")?;
                    if paid {
                        engine.transition(&order, &["created"], "paid")?;
                    }
                }
            }
        }
        for claim in forgotten {
            std::mem::forget(claim);
        }
        Ok(())
    }
}
