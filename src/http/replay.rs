//! Turning a stored envelope back into a replayed response.

use bytes::Bytes;
use http::header::{HeaderName, HeaderValue, LOCATION};
use http::{Response, StatusCode};

use super::body::ResponseBody;
use super::problem::ProblemDetails;
use super::store::{NOT_RETAINED, RESERVED_PREFIX};
use super::IDEMPOTENT_REPLAYED;
use crate::Envelope;

/// The response for a stored envelope.
pub(crate) fn replay_response<B>(envelope: Envelope) -> Response<ResponseBody<B>> {
    if envelope.header(NOT_RETAINED).is_some() {
        return not_retained_response(&envelope);
    }
    let mut response = Response::new(ResponseBody::full(Bytes::from(envelope.body)));
    *response.status_mut() =
        StatusCode::from_u16(envelope.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let headers = response.headers_mut();
    for (name, value) in envelope.headers {
        if name.starts_with(RESERVED_PREFIX) {
            continue;
        }
        // Stored from a valid response, so these parse; skip one that does
        // not rather than fail the replay.
        if let (Ok(name), Ok(value)) = (
            HeaderName::from_bytes(name.as_bytes()),
            HeaderValue::from_bytes(&value),
        ) {
            headers.append(name, value);
        }
    }
    headers.insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
    response
}

fn not_retained_response<B>(envelope: &Envelope) -> Response<ResponseBody<B>> {
    let problem = ProblemDetails::new(
        StatusCode::CONFLICT,
        "response-not-retained",
        "Completed; response not retained",
        "the request with this Idempotency-Key completed, but its response was too large to \
         keep, so it cannot be replayed; it will not run again",
    )
    .member("original_status", envelope.status.into());
    let mut response = problem.into_response();
    if let Some(location) = envelope
        .header(LOCATION.as_str())
        .and_then(|v| HeaderValue::from_bytes(v).ok())
    {
        response.headers_mut().insert(LOCATION, location);
    }
    response
        .headers_mut()
        .insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
    response
}
