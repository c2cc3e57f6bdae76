//! Messages the client cannot read: found by stream sequence, dead-lettered
//! and removed from the stream, so the consumer does not stall on them.
//!
//! async-nats parses every delivered message's headers as UTF-8. A message
//! whose headers are not (nats-server stores any bytes a raw `HPUB` sends)
//! makes the client drop its connection and reconnect; the server
//! redelivers it after its ack wait, and the same happens again. The
//! consumer never sees it: fetches come back empty, and the messages
//! behind it are never delivered either.
//!
//! So after a pass that handled nothing, while the JetStream consumer has
//! messages awaiting an ack, the consumer reads those messages
//! (`$JS.API.STREAM.MSG.GET`, whose JSON reply carries the headers in
//! base64, so no header parsing stands in the way) and checks each as the
//! client would parse it. One that does not parse goes to the dead letters
//! (the reason names the stream, the sequence and the bad bytes, escaped)
//! and is then deleted from the stream (`$JS.API.STREAM.MSG.DELETE`): no
//! client of this library could ever read it, and a deleted message leaves
//! the consumer's pending list, so the consumer moves on.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};

use async_nats::jetstream;
use async_nats::jetstream::stream::RawMessage;
use base64::Engine as _;
use serde::Deserialize;

use super::error::NatsError;
use super::support::{blocking, MSG_ID_HEADER};
use crate::dead_letter::Delivery;
use crate::Engine;

/// At most this many of the consumer's messages are read per check. A
/// check goes on where the last one stopped (back to the ack floor after
/// the last delivered), so every pending message is reached.
const SCAN_LIMIT: u64 = 64;

/// JetStream's "no message found" API error.
const NO_MESSAGE_FOUND: u64 = 10037;

/// What a consumer needs to find and clear unreadable messages.
#[derive(Clone)]
pub(super) struct Unreadable {
    js: jetstream::Context,
    stream: String,
    filters: Vec<String>,
    /// Stream sequences dead-lettered but not yet deleted (the delete
    /// failed): retried without a second letter.
    lettered: Arc<Mutex<HashSet<u64>>>,
    /// The stream sequence the next check starts at (0: the ack floor).
    cursor: Arc<Mutex<u64>>,
}

#[derive(Deserialize)]
struct ApiError {
    #[serde(default)]
    err_code: u64,
    #[serde(default)]
    description: String,
}

#[derive(Deserialize)]
struct GetReply {
    message: Option<RawMessage>,
    error: Option<ApiError>,
}

#[derive(Deserialize)]
struct DeleteReply {
    #[serde(default)]
    success: bool,
    error: Option<ApiError>,
}

impl Unreadable {
    pub(super) fn new(js: jetstream::Context, pull_info: &jetstream::consumer::Info) -> Unreadable {
        // `filter_subjects` (several) is behind async-nats's `server_2_10`
        // feature, which we do not take: with those, every pending message
        // of the stream is checked.
        let filter = &pull_info.config.filter_subject;
        let filters = if filter.is_empty() {
            Vec::new()
        } else {
            vec![filter.clone()]
        };
        Unreadable {
            js,
            stream: pull_info.stream_name.clone(),
            filters,
            lettered: Arc::default(),
            cursor: Arc::default(),
        }
    }

    /// Reads the consumer's messages awaiting an ack (between `info`'s ack
    /// floor and its last delivered, at most [`SCAN_LIMIT`] per call, going
    /// on where the last call stopped; other subjects than the consumer's
    /// filter are skipped by the server) and clears each one the client
    /// cannot parse: dead letter of `inbox`, then deleted from the stream.
    /// Returns how many were cleared.
    pub(super) async fn clear(
        &self,
        engine: &Arc<Engine>,
        inbox: &str,
        info: &jetstream::consumer::Info,
    ) -> Result<usize, NatsError> {
        if info.num_ack_pending == 0 {
            return Ok(0);
        }
        let floor = info.ack_floor.stream_sequence.saturating_add(1);
        let last = info.delivered.stream_sequence;
        let mut seq = (*self.lock_cursor()).max(floor);
        if seq > last {
            seq = floor;
        }
        let mut cleared = 0;
        let mut read = 0;
        while seq <= last && read < SCAN_LIMIT {
            let Some(raw) = self.get_next(seq).await? else {
                seq = last.saturating_add(1);
                break;
            };
            if raw.sequence < seq || raw.sequence > last {
                seq = last.saturating_add(1);
                break;
            }
            seq = raw.sequence.saturating_add(1);
            read += 1;
            if !self.filters.is_empty() && !self.filters.iter().any(|f| matches(f, &raw.subject)) {
                continue;
            }
            if self.clear_one(engine, inbox, &raw).await? {
                cleared += 1;
            }
        }
        *self.lock_cursor() = if seq > last { 0 } else { seq };
        Ok(cleared)
    }

    /// Clears `raw` if the client cannot parse it; whether it did.
    async fn clear_one(
        &self,
        engine: &Arc<Engine>,
        inbox: &str,
        raw: &RawMessage,
    ) -> Result<bool, NatsError> {
        let seq = raw.sequence;
        let Some((message_id, problem)) = problem(raw)? else {
            return Ok(false);
        };
        if !self.is_lettered(seq) {
            let reason = format!(
                "stream {} seq {seq}: {problem}; the client cannot read it (each delivery \
                 drops its connection), so it was removed from the stream",
                self.stream
            );
            let payload = base64::engine::general_purpose::STANDARD
                .decode(&raw.payload)
                .map_err(|e| self.bad_reply(seq, &e.to_string()))?;
            let (engine, inbox, topic) =
                (Arc::clone(engine), inbox.to_owned(), raw.subject.clone());
            let letter = blocking(move || {
                engine.inbox(&inbox)?.reject(
                    &Delivery {
                        message_id: &message_id,
                        topic: &topic,
                        payload: &payload,
                        attempt: 0,
                    },
                    &reason,
                )
            })
            .await??;
            tracing::warn!(stream = %self.stream, seq, letter, problem = %problem, "unreadable message dead-lettered; deleting it from the stream");
            self.set_lettered(seq, true);
        }
        self.delete(seq).await?;
        self.set_lettered(seq, false);
        Ok(true)
    }

    fn lock_cursor(&self) -> std::sync::MutexGuard<'_, u64> {
        self.cursor
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn is_lettered(&self, seq: u64) -> bool {
        self.lettered
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .contains(&seq)
    }

    fn set_lettered(&self, seq: u64, lettered: bool) {
        let mut set = self
            .lettered
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if lettered {
            set.insert(seq);
        } else {
            set.remove(&seq);
        }
    }

    fn bad_reply(&self, seq: u64, what: &str) -> NatsError {
        NatsError::Fetch {
            source: format!("stream {} seq {seq}: {what}", self.stream).into(),
        }
    }

    /// The first stored message at or after `seq` on the consumer's
    /// filter subject (any subject without one), with its headers still
    /// base64; `None` when there is none (deleted, or past the stream's
    /// end). The server skips the other subjects and deleted messages.
    async fn get_next(&self, seq: u64) -> Result<Option<RawMessage>, NatsError> {
        let subject = match self.filters.as_slice() {
            [one] => one.as_str(),
            _ => ">",
        };
        let reply: GetReply = self
            .js
            .request(
                format!("STREAM.MSG.GET.{}", self.stream),
                &serde_json::json!({ "seq": seq, "next_by_subj": subject }),
            )
            .await
            .map_err(|e| self.bad_reply(seq, &format!("reading the message: {e}")))?;
        match (reply.message, reply.error) {
            (_, Some(e)) if e.err_code == NO_MESSAGE_FOUND => Ok(None),
            (_, Some(e)) => {
                Err(self.bad_reply(seq, &format!("reading the message: {}", e.description)))
            }
            (message, None) => Ok(message),
        }
    }

    async fn delete(&self, seq: u64) -> Result<(), NatsError> {
        let reply: DeleteReply = self
            .js
            .request(
                format!("STREAM.MSG.DELETE.{}", self.stream),
                &serde_json::json!({ "seq": seq, "no_erase": true }),
            )
            .await
            .map_err(|e| self.bad_reply(seq, &format!("deleting the message: {e}")))?;
        match reply.error {
            Some(e) if e.err_code != NO_MESSAGE_FOUND => {
                Err(self.bad_reply(seq, &format!("deleting the message: {}", e.description)))
            }
            _ if reply.success || reply.error.is_some() => Ok(()),
            _ => Err(self.bad_reply(seq, "deleting the message: the server did not confirm")),
        }
    }
}

/// Why the client cannot read `raw` (with the message id to file it
/// under: its `Nats-Msg-Id` bytes, escaped), or `None` when it can.
fn problem(raw: &RawMessage) -> Result<Option<(String, String)>, NatsError> {
    let Some(encoded) = &raw.headers else {
        return Ok(None);
    };
    let headers = base64::engine::general_purpose::STANDARD
        .decode(encoded)
        .map_err(|e| NatsError::Fetch {
            source: format!("seq {}: headers not base64: {e}", raw.sequence).into(),
        })?;
    // The client's own parse of stored headers (the same rules as for a
    // delivery: UTF-8, a `NATS/1.0` line, valid header names).
    let parsed = async_nats::jetstream::message::StreamMessage::try_from(RawMessage {
        subject: raw.subject.clone(),
        sequence: raw.sequence,
        payload: String::new(),
        headers: raw.headers.clone(),
        time: raw.time,
    });
    let Err(parse_error) = parsed else {
        return Ok(None);
    };
    let id = msg_id_bytes(&headers);
    let message_id = id.map(|b| b.escape_ascii().to_string()).unwrap_or_default();
    let problem = match (std::str::from_utf8(&headers), id) {
        (Err(_), Some(id)) => format!(
            "its {MSG_ID_HEADER} header is not UTF-8: b\"{}\"",
            id.escape_ascii()
        ),
        (Err(_), None) => format!("its headers are not UTF-8: b\"{}\"", headers.escape_ascii()),
        (Ok(_), _) => format!(
            "its headers do not parse ({parse_error}): b\"{}\"",
            headers.escape_ascii()
        ),
    };
    Ok(Some((message_id, problem)))
}

/// The raw value of the `Nats-Msg-Id` header line, trimmed, if there is
/// one (header names compare case-insensitively).
fn msg_id_bytes(headers: &[u8]) -> Option<&[u8]> {
    headers.split(|&b| b == b'\n').find_map(|line| {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        let colon = line.iter().position(|&b| b == b':')?;
        let (name, value) = line.split_at(colon);
        name.eq_ignore_ascii_case(MSG_ID_HEADER.as_bytes())
            .then(|| value[1..].trim_ascii())
    })
}

/// Whether NATS subject `subject` matches filter `filter` (`*` one token,
/// `>` one or more tokens at the end).
fn matches(filter: &str, subject: &str) -> bool {
    let mut subject = subject.split('.');
    for token in filter.split('.') {
        match (token, subject.next()) {
            (">", Some(_)) => return true,
            ("*", Some(_)) => {}
            (literal, Some(s)) if literal == s => {}
            _ => return false,
        }
    }
    subject.next().is_none()
}

#[cfg(test)]
mod tests {
    use super::{matches, msg_id_bytes};

    #[test]
    fn filters_match_as_nats_does() {
        assert!(matches("a.>", "a.b.c"));
        assert!(!matches("a.>", "a"));
        assert!(matches("a.*.c", "a.b.c"));
        assert!(!matches("a.*", "a.b.c"));
        assert!(matches("a.b", "a.b"));
        assert!(!matches("a.b", "a.c"));
        assert!(!matches("a.b.c", "a.b"));
    }

    #[test]
    fn the_message_id_line_is_found_raw() {
        let headers = b"NATS/1.0\r\nX: y\r\nnats-msg-id:  bad-\xff-id \r\n\r\n";
        assert_eq!(msg_id_bytes(headers), Some(&b"bad-\xff-id"[..]));
        assert_eq!(msg_id_bytes(b"NATS/1.0\r\nX: y\r\n\r\n"), None);
    }
}
