//! The error envelope: every failed request answers
//! `{"error":{"type","message","details","meta"?,"ref"?}}` with the type's status and headers.

use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use crate::runtime::RuntimeError;

/// A request that cannot be answered as asked.
#[derive(Clone, Debug, PartialEq)]
pub struct ApiError(Box<Envelope>);

#[derive(Clone, Debug, PartialEq)]
struct Envelope {
    status: StatusCode,
    error_type: &'static str,
    message: String,
    details: String,
    meta: Option<Value>,
    allow: Option<&'static str>,
    /// The id under which the server logged an internal error (`err_<ULID>`).
    reference: Option<String>,
}

impl ApiError {
    fn new(
        status: StatusCode,
        error_type: &'static str,
        message: impl Into<String>,
        details: impl Into<String>,
    ) -> Self {
        Self(Box::new(Envelope {
            status,
            error_type,
            message: message.into(),
            details: details.into(),
            meta: None,
            allow: None,
            reference: None,
        }))
    }

    fn with_meta(mut self, meta: Value) -> Self {
        self.0.meta = Some(meta);
        self
    }

    /// 400 `invalid_request`: the URL, the query or the message breaks a rule (`details` says
    /// which).
    pub fn invalid_request(details: impl Into<String>) -> Self {
        Self::new(
            StatusCode::BAD_REQUEST,
            "invalid_request",
            "The request is invalid.",
            details,
        )
    }

    /// 400 `invalid_json`: a body that is not JSON.
    pub fn invalid_json(details: impl Into<String>) -> Self {
        Self::new(
            StatusCode::BAD_REQUEST,
            "invalid_json",
            "The request body is not valid JSON.",
            details,
        )
    }

    /// 415 `unsupported_media_type`: a body without a JSON content type.
    pub fn unsupported_media_type(content_type: Option<&str>) -> Self {
        let details = match content_type {
            Some(content_type) => format!("Send the body as application/json, not {content_type}."),
            None => "Send the body as application/json (no content-type was given).".to_owned(),
        };
        Self::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "unsupported_media_type",
            "The request body must be JSON.",
            details,
        )
    }

    /// 413 `request_too_large`: a body past [`MAX_BODY_BYTES`](super::MAX_BODY_BYTES) (a type
    /// the reference's status map does not list).
    pub fn request_too_large() -> Self {
        Self::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "request_too_large",
            "The request body is too large.",
            format!("Request bodies are limited to {} bytes.", super::MAX_BODY_BYTES),
        )
    }

    /// 408 `request_timeout`: the body stopped arriving for
    /// [`HttpOptions::request_body_timeout`](super::HttpOptions::request_body_timeout) (a type
    /// the reference's status map does not list).
    pub fn request_timeout(timeout: std::time::Duration) -> Self {
        Self::new(
            StatusCode::REQUEST_TIMEOUT,
            "request_timeout",
            "The request body stopped arriving.",
            format!("No part of the request's body arrived for {} ms.", timeout.as_millis()),
        )
    }

    /// 408 `request_timeout`: the body kept arriving, but not all of it within
    /// [`HttpOptions::request_body_deadline`](super::HttpOptions::request_body_deadline).
    pub fn body_too_slow(deadline: std::time::Duration) -> Self {
        Self::new(
            StatusCode::REQUEST_TIMEOUT,
            "request_timeout",
            "The request body took too long to arrive.",
            format!("The whole request body must arrive within {} ms.", deadline.as_millis()),
        )
    }

    /// 413 `request_too_large`: a body whose JSON holds more objects and arrays, or more
    /// values, than [`MAX_JSON_CONTAINERS`](crate::MAX_JSON_CONTAINERS) and
    /// [`MAX_JSON_VALUES`](crate::MAX_JSON_VALUES) allow.
    pub fn json_too_large() -> Self {
        Self::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "request_too_large",
            "The request body is too large.",
            format!(
                "Request bodies are limited to {} JSON objects and arrays, and {} JSON values.",
                crate::MAX_JSON_CONTAINERS,
                crate::MAX_JSON_VALUES
            ),
        )
    }

    /// 405 `method_not_allowed`, with the `Allow` header.
    pub fn method_not_allowed(method: &str, allow: &'static str) -> Self {
        let mut error = Self::new(
            StatusCode::METHOD_NOT_ALLOWED,
            "method_not_allowed",
            format!("Method {method} is not allowed here."),
            format!("Allowed: {allow}."),
        );
        error.0.allow = Some(allow);
        error
    }

    /// 401 `unauthorized` (with `WWW-Authenticate: Bearer`): no acceptable credentials.
    pub fn unauthorized(details: impl Into<String>) -> Self {
        Self::new(
            StatusCode::UNAUTHORIZED,
            "unauthorized",
            "The request needs credentials.",
            details,
        )
    }

    /// 403 `forbidden`: the credentials do not reach what the request addresses.
    pub fn forbidden(details: impl Into<String>) -> Self {
        Self::new(
            StatusCode::FORBIDDEN,
            "forbidden",
            "The request is not allowed for these credentials.",
            details,
        )
    }

    /// 403 `forbidden`, whatever the credentials: where the request comes from (the name the
    /// server was reached by, a page of another site) is not served.
    pub fn forbidden_origin(details: impl Into<String>) -> Self {
        Self::new(
            StatusCode::FORBIDDEN,
            "forbidden",
            "The request is not allowed from where it came.",
            details,
        )
    }

    /// 404 `route_not_found`.
    pub fn route_not_found(path: &str) -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            "route_not_found",
            "No route matches this request.",
            format!("Nothing is served at {path}."),
        )
    }

    /// 404 `stream_not_found`: the instance was never contacted.
    pub fn stream_not_found(path: &str) -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            "stream_not_found",
            format!("Event stream \"{path}\" was not found."),
            "The agent instance has no conversation yet: send it a message first.",
        )
    }

    /// 404 `attachment_not_found`.
    pub fn attachment_not_found(id: &str) -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            "attachment_not_found",
            format!("Attachment \"{id}\" was not found."),
            "No attachment with this id belongs to this conversation.",
        )
    }

    /// 500 `attachment_integrity` (reference §6.2: a framework error that reaches a route
    /// renders as 500 with its own type): the stored bytes of an attachment do not match its
    /// recorded size or digest. `meta {attachmentId, reason}`.
    pub fn attachment_integrity(id: &str, reason: crate::store::IntegrityFailure) -> Self {
        Self::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "attachment_integrity",
            format!("Attachment \"{id}\" failed its integrity check."),
            format!(
                "The stored bytes do not match the attachment's recorded {}.",
                reason.as_str()
            ),
        )
        .with_meta(json!({"attachmentId": id, "reason": reason.as_str()}))
    }

    /// 416 `stream_offset_gone`: a read from beyond the stream's head. Its meta has the
    /// reference's `offset` and `nextOffset`, and the stream's `incarnation` (this server's
    /// addition): a reader that followed another incarnation tells its stream was replaced by
    /// a shorter one, not that it asked for too much.
    pub fn stream_offset_gone(offset: &str, next_offset: &str, incarnation: Option<&str>) -> Self {
        let mut meta = json!({"offset": offset, "nextOffset": next_offset});
        if let Some(incarnation) = incarnation {
            meta["incarnation"] = json!(incarnation);
        }
        Self::new(
            StatusCode::RANGE_NOT_SATISFIABLE,
            "stream_offset_gone",
            "The requested offset is beyond the end of the stream.",
            format!("Read from {next_offset} or earlier."),
        )
        .with_meta(meta)
    }

    /// 503 `server_busy` (with `Retry-After: 1`): a message body found no room among the
    /// bodies the server holds at once
    /// ([`HttpOptions::max_buffered_request_bytes`](super::HttpOptions::max_buffered_request_bytes)).
    pub fn server_busy() -> Self {
        Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_busy",
            "The server is reading as many request bodies as it may hold.",
            "Retry shortly.",
        )
    }

    /// 503 `server_busy` (with `Retry-After: 1`): a read that folds the conversation itself
    /// (an SSE reader catching up on its own, a read the updates cache does not serve) found
    /// no room among the folds such reads hold at once
    /// ([`HttpOptions::max_reader_fold_bytes`](super::HttpOptions::max_reader_fold_bytes)).
    pub fn readers_busy() -> Self {
        Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_busy",
            "The server holds as much of the conversations its readers read as it may.",
            "Retry shortly.",
        )
    }

    /// 503 `runtime_unavailable` (with `Retry-After: 1`).
    pub fn runtime_unavailable(state: &str) -> Self {
        Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "runtime_unavailable",
            "The runtime is not accepting messages.",
            format!("The runtime is {state}; retry shortly."),
        )
        .with_meta(json!({"state": state}))
    }

    /// 500 `internal_error`: logged under a reference that the response carries; the cause
    /// never reaches the client.
    pub fn internal(cause: &dyn std::fmt::Display) -> Self {
        let reference = crate::record::new_id("err");
        tracing::error!(error_ref = %reference, error = %cause, "[flue] request failed");
        let mut error = Self::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal_error",
            "An internal error occurred.",
            "",
        );
        error.0.reference = Some(reference);
        error
    }

    /// The status.
    pub fn status(&self) -> StatusCode {
        self.0.status
    }

    /// The stable type.
    pub fn error_type(&self) -> &'static str {
        self.0.error_type
    }

    /// The headers of this error's response (a `HEAD` error sends them without a body).
    fn headers(&self) -> HeaderMap {
        let envelope = &self.0;
        let mut headers = HeaderMap::new();
        headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
        if let Some(allow) = envelope.allow {
            headers.insert(header::ALLOW, HeaderValue::from_static(allow));
        }
        if envelope.status == StatusCode::UNAUTHORIZED {
            headers.insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        if envelope.status == StatusCode::SERVICE_UNAVAILABLE {
            headers.insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        if let Some(reference) = envelope
            .reference
            .as_deref()
            .and_then(|r| HeaderValue::from_str(r).ok())
        {
            headers.insert("flue-error-ref", reference);
        }
        headers
    }

    /// The envelope.
    pub fn body(&self) -> Value {
        let envelope = &self.0;
        let mut error = json!({
            "type": envelope.error_type,
            "message": envelope.message,
            "details": envelope.details,
        });
        if let Some(meta) = &envelope.meta {
            error["meta"] = meta.clone();
        }
        if let Some(reference) = &envelope.reference {
            error["ref"] = json!(reference);
        }
        json!({ "error": error })
    }

    /// The response without a body (for `HEAD`).
    pub fn without_body(self) -> Response {
        (self.0.status, self.headers()).into_response()
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = self.body().to_string();
        (self.0.status, self.headers(), body).into_response()
    }
}

impl From<RuntimeError> for ApiError {
    fn from(error: RuntimeError) -> Self {
        match error {
            RuntimeError::InvalidRequest(details) => Self::invalid_request(details),
            RuntimeError::InvalidMessage(error) => Self::invalid_request(error.to_string()),
            RuntimeError::InstanceNotFound(id) => Self::new(
                StatusCode::NOT_FOUND,
                "agent_instance_not_found",
                format!("Agent instance \"{id}\" was not found."),
                "The uid names no incarnation of this instance; send without a uid to create it.",
            ),
            RuntimeError::InstanceExists { id, uid } => Self::new(
                StatusCode::CONFLICT,
                "agent_instance_exists",
                format!("Agent instance \"{id}\" already exists."),
                "A null uid only creates; send the instance's uid to continue it.",
            )
            .with_meta(json!({"uid": uid})),
            RuntimeError::SubmissionConflict(submission_id) => Self::new(
                StatusCode::CONFLICT,
                "submission_conflict",
                format!("Submission \"{submission_id}\" was already admitted with a different message, initial data or kind."),
                "An idempotency key names one admission: use a new key for a new message or initialData.",
            )
            .with_meta(json!({"submissionId": submission_id})),
            RuntimeError::ShuttingDown => Self::runtime_unavailable("draining"),
            RuntimeError::NotProcessedHere { submission_id } => {
                Self::runtime_unavailable("draining").with_meta(json!({"state": "draining", "submissionId": submission_id}))
            }
            other => Self::internal(&other),
        }
    }
}
