//! `POST /:id`: the body rules of an admission, checked in the protocol's order.

use axum::http::{HeaderMap, header};
use flue_core::message::DeliveredMessage;
use serde_json::{Map, Value};

use super::error::ApiError;
use crate::runtime::SendRequest;
use crate::store::{TraceContext, UidCondition};

/// The longest idempotency key, in UTF-16 code units (a JavaScript string's `length`, as the
/// protocol counts it).
const MAX_IDEMPOTENCY_KEY_UNITS: usize = 256;

/// What the message fields of a body must look like (said when they do not).
const MESSAGE_SHAPE: &str = "The body must be a message object: {\"kind\":\"user\",\"body\":\"…\"} or \
     {\"kind\":\"signal\",\"type\":\"…\",\"body\":\"…\"}, optionally with initialData, uid and idempotencyKey.";

/// Parses an admission body into a [`SendRequest`] for the instance `id`.
pub(crate) fn parse(id: &str, headers: &HeaderMap, body: &[u8]) -> Result<SendRequest, ApiError> {
    let content_length = headers.get(header::CONTENT_LENGTH);
    let content_type = headers.get(header::CONTENT_TYPE).and_then(|value| value.to_str().ok());
    // No body at all (declared empty, or nothing declares one) or a blank one is no message:
    // the message rules refuse it below.
    let declared_empty = content_length.is_some_and(|length| length.as_bytes() == b"0");
    let undeclared = content_length.is_none() && headers.get(header::CONTENT_TYPE).is_none();
    let blank = body.iter().all(u8::is_ascii_whitespace);
    let value = if declared_empty || undeclared || blank {
        Value::Null
    } else {
        if !content_type.is_some_and(|content_type| content_type.to_ascii_lowercase().contains("application/json")) {
            return Err(ApiError::unsupported_media_type(content_type));
        }
        serde_json::from_slice::<Value>(body).map_err(|error| ApiError::invalid_json(error.to_string()))?
    };
    let Value::Object(mut fields) = value else {
        return Err(ApiError::invalid_request(MESSAGE_SHAPE));
    };
    let initial_data = fields.remove("initialData");
    let uid = match fields.remove("uid") {
        None => UidCondition::Any,
        Some(Value::Null) => UidCondition::CreateOnly,
        Some(Value::String(uid)) => UidCondition::Existing(uid),
        Some(_) => {
            return Err(ApiError::invalid_request(
                "`uid` must be a string (continue that incarnation) or null (create only).",
            ));
        }
    };
    // Checked after the message, as the reference's schema does: the uid, the message, then
    // the key.
    let idempotency_key = fields.remove("idempotencyKey");
    let message = message(fields)?;
    message
        .validate()
        .map_err(|error| ApiError::invalid_request(error.to_string()))?;
    let idempotency_key = match idempotency_key {
        None => None,
        Some(Value::String(key)) if !key.is_empty() && key.encode_utf16().count() <= MAX_IDEMPOTENCY_KEY_UNITS => {
            Some(key)
        }
        Some(_) => {
            return Err(ApiError::invalid_request(
                "idempotencyKey must be a non-empty string of at most 256 characters (UTF-16 code units).",
            ));
        }
    };
    let mut request = SendRequest::new(id, message);
    request.initial_data = initial_data;
    request.uid = uid;
    request.idempotency_key = idempotency_key;
    let header = |name: &str| headers.get(name).and_then(|value| value.to_str().ok());
    request.trace = header("traceparent").and_then(|parent| TraceContext::parse(parent, header("tracestate")));
    Ok(request)
}

/// The message of the remaining fields (unknown keys are dropped, as the protocol's schema
/// does).
fn message(fields: Map<String, Value>) -> Result<DeliveredMessage, ApiError> {
    match fields.get("kind").and_then(Value::as_str) {
        Some("user" | "signal") => {}
        _ => return Err(ApiError::invalid_request(MESSAGE_SHAPE)),
    }
    serde_json::from_value::<DeliveredMessage>(Value::Object(fields))
        .map_err(|error| ApiError::invalid_request(format!("{MESSAGE_SHAPE} ({error})")))
}
