//! The `payment.succeeded` event: what the API sends through the outbox
//! with each successful payment, and what the ledger consumer books.
//!
//! The handler hands it to the idempotency layer with its 201
//! ([`idempotency::http::CompletionMessages`]), so the layer stores it in
//! the same write as the completion: a payment that completed has exactly
//! one event in the outbox (id `<claim reference>/0`), one that did not has
//! none, however often it crashed and was retried.

use idempotency::OutgoingMessage;
use serde::{Deserialize, Serialize};

use crate::provider::Charge;

/// The event's subject (the outbox message's topic).
pub const SUBJECT: &str = "payment.succeeded";

/// The event's JSON payload.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PaymentSucceeded {
    /// The payment's id (the provider's charge id), as the client was told.
    pub payment: String,
    /// The client's `Idempotency-Key`.
    pub key: String,
    /// Amount in minor units.
    pub amount: u64,
    /// ISO 4217 code.
    pub currency: String,
}

impl PaymentSucceeded {
    /// The event for a charge.
    pub fn of(charge: &Charge) -> PaymentSucceeded {
        PaymentSucceeded {
            payment: charge.id.clone(),
            key: charge.client_key.clone(),
            amount: charge.amount,
            currency: charge.currency.clone(),
        }
    }

    /// As an outbox message on [`SUBJECT`].
    pub fn message(&self) -> OutgoingMessage {
        // A struct of strings and a number always serializes.
        OutgoingMessage::new(SUBJECT, serde_json::to_vec(self).unwrap_or_default())
    }

    /// Parses a payload.
    ///
    /// # Errors
    ///
    /// The payload is not this event's JSON.
    pub fn parse(payload: &[u8]) -> Result<PaymentSucceeded, serde_json::Error> {
        serde_json::from_slice(payload)
    }
}
