//! Stored responses: the versioned envelope and the app's upcasters.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

/// A response as stored for replay.
///
/// `schema_version` is the *app's* version of its response schema (not the
/// crate's record format): when the app changes what its responses look
/// like, it bumps the version and registers an upcaster for the old one
/// (see [`crate::EngineBuilder::upcaster`]), so a replay after an upgrade is
/// never an old body silently presented as current.
#[derive(Clone, PartialEq, Eq)]
pub struct Envelope {
    /// The app's response schema version.
    pub schema_version: u32,
    /// Status code (an HTTP status for HTTP apps; any app-defined code
    /// otherwise).
    pub status: u16,
    /// Selected response headers, in order, as `(name, value bytes)`.
    pub headers: Vec<(String, Vec<u8>)>,
    /// The response body bytes.
    pub body: Vec<u8>,
}

impl Envelope {
    /// An envelope with no headers.
    pub fn new(schema_version: u32, status: u16, body: impl Into<Vec<u8>>) -> Envelope {
        Envelope {
            schema_version,
            status,
            headers: Vec::new(),
            body: body.into(),
        }
    }

    /// Adds a header (builder style).
    #[must_use]
    pub fn with_header(mut self, name: impl Into<String>, value: impl Into<Vec<u8>>) -> Envelope {
        self.headers.push((name.into(), value.into()));
        self
    }

    /// Size counted against the engine's `max_response_bytes`, in bytes:
    /// the body's length plus [`Envelope::header_size_bytes`] of every
    /// header. Saturates at `usize::MAX`.
    pub fn size_bytes(&self) -> usize {
        headers_size_bytes(&self.headers).saturating_add(self.body.len())
    }

    /// What one header counts towards [`Envelope::size_bytes`], in bytes:
    /// its name's and value's lengths plus
    /// [`HEADER_OVERHEAD_BYTES`](Envelope::HEADER_OVERHEAD_BYTES), so
    /// many empty headers cannot slip past the size limit. The rule is
    /// HPACK's size of a header-table entry (RFC 7541, section 4.1).
    pub fn header_size_bytes(name: &str, value: &[u8]) -> usize {
        name.len()
            .saturating_add(value.len())
            .saturating_add(Envelope::HEADER_OVERHEAD_BYTES)
    }

    /// Bytes each header counts beyond its name and value (32, as in
    /// RFC 7541, section 4.1).
    pub const HEADER_OVERHEAD_BYTES: usize = 32;

    /// The value of the first header named `name` (ASCII case-insensitive).
    pub fn header(&self, name: &str) -> Option<&[u8]> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_slice())
    }
}

/// What `headers` count towards [`Envelope::size_bytes`], in bytes (the
/// one rule the engine and the HTTP layer both apply).
pub(crate) fn headers_size_bytes(headers: &[(String, Vec<u8>)]) -> usize {
    headers
        .iter()
        .map(|(n, v)| Envelope::header_size_bytes(n, v))
        .fold(0, usize::saturating_add)
}

impl fmt::Debug for Envelope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut d = f.debug_struct("Envelope");
        d.field("schema_version", &self.schema_version)
            .field("status", &self.status)
            .field("headers", &self.headers.len());
        match std::str::from_utf8(&self.body) {
            Ok(s) if s.len() <= 256 => d.field("body", &s),
            _ => d.field("body_bytes", &self.body.len()),
        };
        d.finish()
    }
}

/// Converts an envelope stored under an older schema version into a newer
/// one. Returns `Err(reason)` if it cannot.
pub(crate) type Upcaster = Arc<dyn Fn(Envelope) -> Result<Envelope, String> + Send + Sync>;

/// The app's registered upcasters, keyed by the schema version they read.
#[derive(Clone, Default)]
pub(crate) struct Upcasters {
    pub(crate) current: Option<u32>,
    pub(crate) by_version: BTreeMap<u32, Upcaster>,
}

impl Upcasters {
    /// Runs the chain of upcasters from the envelope's version while one is
    /// registered and the version is below `current`. Returns the envelope
    /// and whether it is now at the current version (always true when no
    /// current version is configured).
    pub(crate) fn apply(&self, mut env: Envelope) -> Result<(Envelope, bool), (u32, String)> {
        let Some(current) = self.current else {
            return Ok((env, true));
        };
        while env.schema_version < current {
            let Some(up) = self.by_version.get(&env.schema_version) else {
                return Ok((env, false));
            };
            let from = env.schema_version;
            env = up(env).map_err(|reason| (from, reason))?;
            if env.schema_version <= from {
                return Err((
                    from,
                    format!(
                        "upcaster returned schema version {} (must be above {from})",
                        env.schema_version
                    ),
                ));
            }
        }
        let is_current = env.schema_version == current;
        Ok((env, is_current))
    }
}

impl fmt::Debug for Upcasters {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Upcasters")
            .field("current", &self.current)
            .field("versions", &self.by_version.keys().collect::<Vec<_>>())
            .finish()
    }
}
