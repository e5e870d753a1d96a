//! `POST /:id`: the body rules of an admission, checked in the protocol's order.

use axum::http::{HeaderMap, header};
use flue_core::message::{DeliveredMessage, MessageError};
use serde_json::{Map, Value};

use super::error::ApiError;
use crate::json_shape::JsonShape;
use crate::runtime::SendRequest;
use crate::store::{TraceContext, UidCondition};

/// The longest idempotency key, in UTF-16 code units (a JavaScript string's `length`, as the
/// protocol counts it).
const MAX_IDEMPOTENCY_KEY_UNITS: usize = 256;

/// What the message fields of a body must look like: the reference's words for any body its
/// message schema refuses without a rule of its own (a missing or mistyped field, an empty
/// signal type, a `null` where a field is optional).
const MESSAGE_SHAPE: &str = "Delivered messages must be { kind: \"user\", body: string, attachments?: attachment[] } \
     or { kind: \"signal\", type: string, body: string, attributes?: Record<string, string>, tagName?: string }.";

/// Parses an admission body into a [`SendRequest`] for the instance `id`.
pub(crate) fn parse(id: &str, headers: &HeaderMap, body: &[u8]) -> Result<SendRequest, ApiError> {
    // The body is read as text, as the protocol's reference reads it: a leading byte order
    // mark is no part of it.
    let body = body.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(body);
    let content_length = headers.get(header::CONTENT_LENGTH);
    // A type that is not visible ASCII is quoted as such, not taken for a missing one.
    let content_type = headers
        .get(header::CONTENT_TYPE)
        .map(|value| value.to_str().unwrap_or("a content type that is not ASCII text"));
    // No body at all (declared empty, or nothing declares one) is no message: the message
    // rules refuse it below. A body declared otherwise must be JSON, and a blank JSON body is
    // no message either (the reference's order: the type is checked before the text).
    let declared_empty = content_length.is_some_and(|length| length.as_bytes() == b"0");
    let undeclared = content_length.is_none() && headers.get(header::CONTENT_TYPE).is_none();
    let value = if declared_empty || undeclared {
        Value::Null
    } else if !content_type.is_some_and(declares_json) {
        return Err(ApiError::unsupported_media_type(content_type));
    } else if std::str::from_utf8(body).is_ok_and(flue_core::message::is_blank) {
        // Blank as JavaScript's `trim` sees it: Unicode spaces (a no-break space) and byte
        // order marks too.
        Value::Null
    } else {
        parse_json(body)?
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
                "`uid` must be a string (continue only that incarnation) or null (create only when fresh).",
            ));
        }
    };
    // Checked after the message, as the reference's schema does: the uid, the message, then
    // the key.
    let idempotency_key = fields.remove("idempotencyKey");
    let message = message(fields)?;
    let idempotency_key = match idempotency_key {
        None => None,
        Some(Value::String(key)) if !key.is_empty() => {
            if key.encode_utf16().count() > MAX_IDEMPOTENCY_KEY_UNITS {
                return Err(ApiError::invalid_request(
                    "`idempotencyKey` must be at most 256 characters.",
                ));
            }
            Some(key)
        }
        Some(_) => {
            return Err(ApiError::invalid_request(
                "`idempotencyKey` must be a non-empty string naming this delivery.",
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

/// Whether a `Content-Type` declares JSON: its media type (what comes before any parameter)
/// says `application/json`, as the reference's rule reads the whole header. Reading only the
/// media type is stricter on purpose: `text/plain; charset=application/json` passes the
/// reference's rule, and a browser sends it cross-site from any page without asking first (a
/// CORS "simple" request), so any web page could post messages to an agent served on a
/// developer's machine. A JSON media type makes the browser ask (a preflight) first.
fn declares_json(content_type: &str) -> bool {
    let media_type = content_type.split(';').next().unwrap_or_default();
    media_type.to_ascii_lowercase().contains("application/json")
}

/// The body as JSON, read as the reference reads it (text first, then JSON): bytes that are
/// not UTF-8 read as U+FFFD, and a `\uXXXX` escape of a lone UTF-16 surrogate, which
/// JavaScript's `JSON.parse` takes (a client that cut a string inside an emoji sends one), as
/// U+FFFD too (a Rust string cannot hold the surrogate itself). Both only after a failed
/// parse: a well-formed body pays for neither.
fn parse_json(body: &[u8]) -> Result<Value, ApiError> {
    if !JsonShape::fits([body]) {
        return Err(ApiError::json_too_large());
    }
    serde_json::from_slice::<Value>(body).or_else(|error| {
        let text = String::from_utf8_lossy(body);
        let repaired = match crate::json_shape::without_lone_surrogates(&text) {
            Some(repaired) => repaired,
            None if matches!(text, std::borrow::Cow::Owned(_)) => text.into_owned(),
            None => return Err(ApiError::invalid_json(error.to_string())),
        };
        serde_json::from_str(&repaired).map_err(|_| ApiError::invalid_json(error.to_string()))
    })
}

/// The message of the remaining fields (unknown keys are dropped, as the protocol's schema
/// does), checked against the message rules.
fn message(mut fields: Map<String, Value>) -> Result<DeliveredMessage, ApiError> {
    // The optional fields of each kind, which the reference's schema takes absent but not
    // `null` (a field of the other kind is unknown to it, and dropped whatever its value):
    // taken out here, and refused below unless a rule with words of its own refuses first.
    let optional: &[&str] = match fields.get("kind").and_then(Value::as_str) {
        Some("user") => &["attachments"],
        Some("signal") => &["attributes", "tagName"],
        _ => return Err(ApiError::invalid_request(MESSAGE_SHAPE)),
    };
    let mut null_optional = false;
    for field in optional {
        if fields.get(*field).is_some_and(Value::is_null) {
            fields.remove(*field);
            null_optional = true;
        }
    }
    if let Some(Value::Array(attachments)) = fields.get_mut("attachments")
        && optional.contains(&"attachments")
    {
        for attachment in attachments.iter_mut().filter_map(Value::as_object_mut) {
            if attachment.get("filename").is_some_and(Value::is_null) {
                attachment.remove("filename");
                null_optional = true;
            }
        }
    }
    let message = serde_json::from_value::<DeliveredMessage>(Value::Object(fields))
        .map_err(|_| ApiError::invalid_request(MESSAGE_SHAPE))?;
    // A rule with words of its own is said first, as the reference says the first such issue
    // of all its schema found.
    message.validate().map_err(|error| match error {
        // The reference's schema has no words of its own for an empty type.
        MessageError::EmptySignalType => ApiError::invalid_request(MESSAGE_SHAPE),
        other => ApiError::invalid_request(other.to_string()),
    })?;
    if null_optional {
        return Err(ApiError::invalid_request(MESSAGE_SHAPE));
    }
    Ok(message)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{MAX_JSON_CONTAINERS, MAX_JSON_VALUES};

    fn headers(content_type: Option<&'static str>, length: usize) -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(header::CONTENT_LENGTH, length.into());
        if let Some(content_type) = content_type {
            headers.insert(header::CONTENT_TYPE, header::HeaderValue::from_static(content_type));
        }
        headers
    }

    #[test]
    fn a_json_body_after_a_byte_order_mark_is_admitted() {
        let body = "\u{feff}{\"kind\":\"user\",\"body\":\"hi\"}".as_bytes();
        let request = parse("c1", &headers(Some("application/json"), body.len()), body).expect("admitted");
        assert_eq!(request.message, DeliveredMessage::user("hi"));
    }

    #[test]
    fn a_lone_surrogate_escape_reads_as_a_replacement_character_and_a_pair_as_its_character() {
        let cases = [
            (r#"{"kind":"user","body":"hello \ud83d"}"#, "hello \u{fffd}"),
            (
                r#"{"kind":"user","body":"\udc00 and \ud83d\ude00"}"#,
                "\u{fffd} and \u{1f600}",
            ),
            (r#"{"kind":"user","body":"\\ud83d is text"}"#, "\\ud83d is text"),
            (r#"{"kind":"user","body":"\ud83d\n"}"#, "\u{fffd}\n"),
        ];
        for (body, text) in cases {
            let request = parse("c1", &headers(Some("application/json"), body.len()), body.as_bytes())
                .unwrap_or_else(|error| panic!("{body}: {error:?}"));
            assert_eq!(request.message, DeliveredMessage::user(text), "{body}");
        }
        // Other broken escapes are still invalid JSON.
        let body = r#"{"kind":"user","body":"\uZZZZ \ud83d"}"#;
        let error = parse("c1", &headers(Some("application/json"), body.len()), body.as_bytes()).expect_err("bad");
        assert_eq!(error.error_type(), "invalid_json");
    }

    #[test]
    fn bytes_that_are_not_utf8_read_as_replacement_characters() {
        let body = b"{\"kind\":\"user\",\"body\":\"caf\xE9\"}";
        let request = parse("c1", &headers(Some("application/json"), body.len()), body).expect("admitted");
        assert_eq!(request.message, DeliveredMessage::user("caf\u{fffd}"));
    }

    /// A message whose `initialData` is `items` (JSON text of the array's elements, joined).
    fn with_initial_data(items: &str) -> String {
        format!(r#"{{"kind":"user","body":"hi","initialData":[{items}]}}"#)
    }

    fn parsed(body: &str) -> Result<SendRequest, ApiError> {
        parse("c1", &headers(Some("application/json"), body.len()), body.as_bytes())
    }

    #[test]
    fn a_body_past_the_json_container_limit_is_413_before_it_is_parsed() {
        // The message object and the array are two of the containers.
        let at_limit = with_initial_data(&vec!["{}"; MAX_JSON_CONTAINERS - 2].join(","));
        let request = parsed(&at_limit).expect("at the limit");
        assert_eq!(
            request.initial_data.as_ref().and_then(Value::as_array).map(Vec::len),
            Some(MAX_JSON_CONTAINERS - 2)
        );
        let past = with_initial_data(&vec!["{}"; MAX_JSON_CONTAINERS - 1].join(","));
        let error = parsed(&past).expect_err("past the limit");
        assert_eq!(error.status().as_u16(), 413);
        assert_eq!(error.error_type(), "request_too_large");
        // So is one whose excess is not JSON at all: it is refused before any parse.
        let error = parsed(&format!("{past}!")).expect_err("past the limit");
        assert_eq!(error.error_type(), "request_too_large");
    }

    #[test]
    fn a_body_past_the_json_value_limit_is_413() {
        // Four values besides the array's members: the message object, its kind, its text and
        // the array.
        let at_limit = with_initial_data(&vec!["0"; MAX_JSON_VALUES - 4].join(","));
        assert_eq!(JsonShape::of(at_limit.as_bytes()).values, MAX_JSON_VALUES);
        parsed(&at_limit).expect("at the limit");
        let past = with_initial_data(&vec!["0"; MAX_JSON_VALUES - 3].join(","));
        let error = parsed(&past).expect_err("past the limit");
        assert_eq!(error.error_type(), "request_too_large");
    }

    #[test]
    fn a_body_past_the_limit_is_refused_after_a_byte_order_mark_and_with_bytes_that_are_not_utf8() {
        let past = with_initial_data(&vec!["{}"; MAX_JSON_CONTAINERS - 1].join(","));
        let mut with_mark = b"\xEF\xBB\xBF".to_vec();
        with_mark.extend_from_slice(past.as_bytes());
        // Bytes that are not UTF-8 inside a string: its parse would take the repair path.
        let mut not_utf8 = past.replacen("\"hi\"", "\"caf\u{1}\"", 1).into_bytes();
        let at = not_utf8.iter().position(|&byte| byte == 1).expect("the marked byte");
        not_utf8[at] = 0xE9;
        for body in [with_mark, not_utf8] {
            let error = parse("c1", &headers(Some("application/json"), body.len()), &body).expect_err("past the limit");
            assert_eq!(error.error_type(), "request_too_large");
        }
    }

    #[test]
    fn brackets_and_commas_inside_strings_are_not_counted() {
        // Two commas and four brackets each, with an escaped quote and an escaped backslash:
        // past both limits, were they counted.
        let repeats = MAX_JSON_VALUES / 2 + 1;
        let text = r#"[{,\"[{,\\"#.repeat(repeats);
        let body = format!(r#"{{"kind":"user","body":"{text}"}}"#);
        let request = parsed(&body).expect("one string");
        assert_eq!(request.message, DeliveredMessage::user(r#"[{,"[{,\"#.repeat(repeats)));
        assert_eq!(
            JsonShape::of(body.as_bytes()),
            JsonShape {
                containers: 1,
                values: 3
            }
        );
        // An escaped backslash before the closing quote ends the string; an escaped quote
        // does not.
        assert_eq!(JsonShape::of(br#"["\\",[]]"#).containers, 2);
        assert_eq!(JsonShape::of(br#"["\",[]"]"#).containers, 1);
        // A string left open, or a backslash at the very end, ends the count.
        assert_eq!(JsonShape::of(br#"[["abc"#).containers, 2);
        assert_eq!(JsonShape::of(br#"["\"#).containers, 1);
    }

    /// The reference checks the declared type before it reads the text: a blank body sent as
    /// JSON is no message (400), one sent as anything else (or as nothing, with a length) is
    /// an unsupported media type (415).
    #[test]
    fn a_blank_body_is_no_message_as_json_and_an_unsupported_media_type_otherwise() {
        for body in ["   ", "\u{a0}", "\u{feff}", " \u{2003}\n"] {
            let error =
                parse("c1", &headers(Some("application/json"), body.len()), body.as_bytes()).expect_err("no message");
            assert_eq!(error.status().as_u16(), 400, "{body:?}");
            assert_eq!(error.error_type(), "invalid_request", "{body:?}");
            for content_type in [None, Some("text/plain")] {
                let error = parse("c1", &headers(content_type, body.len()), body.as_bytes()).expect_err("not JSON");
                assert_eq!(error.status().as_u16(), 415, "{body:?} as {content_type:?}");
                assert_eq!(error.error_type(), "unsupported_media_type", "{body:?}");
            }
        }
        // U+0085 is no white space to JavaScript: a body of it is a body, and not JSON.
        let error = parse("c1", &headers(Some("application/json"), 2), "\u{85}".as_bytes()).expect_err("no JSON");
        assert_eq!(error.error_type(), "invalid_json");
    }
}
