//! Errors as OpenAI's API writes them: `{"error": {"message", "type", "param", "code"}}`, with
//! the status code that says who is at fault.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Serialize;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    pub status: StatusCode,
    /// OpenAI's `type`: `invalid_request_error`, `authentication_error`, …
    pub kind: &'static str,
    pub code: Option<&'static str>,
    pub message: String,
    /// Seconds after which a refused request may be tried again.
    pub retry_after: Option<u64>,
}

impl ApiError {
    fn new(status: StatusCode, kind: &'static str, code: Option<&'static str>, message: impl Into<String>) -> Self {
        Self { status, kind, code, message: message.into(), retry_after: None }
    }

    /// 400: the request cannot be served as it is.
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", None, message)
    }

    /// 400: the prompt does not fit the context.
    pub fn too_long(prompt: usize, n_ctx: usize) -> Self {
        let message = format!("the prompt has {prompt} tokens but the context holds {n_ctx}");
        Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", Some("context_length_exceeded"), message)
    }

    pub fn unauthorized() -> Self {
        let message = "a valid API key is required: send `Authorization: Bearer KEY` (or `x-api-key: KEY`)";
        Self::new(StatusCode::UNAUTHORIZED, "authentication_error", Some("invalid_api_key"), message)
    }

    pub fn not_found(path: &str) -> Self {
        Self::new(StatusCode::NOT_FOUND, "invalid_request_error", None, format!("no route {path}"))
    }

    /// 404: the model asked for is not the one served.
    pub fn model_not_found(asked: &str, served: &str) -> Self {
        let message = format!("the model '{asked}' does not exist here; this server has '{served}'");
        Self::new(StatusCode::NOT_FOUND, "invalid_request_error", Some("model_not_found"), message)
    }

    /// 503: the queue is full; worth trying again after `retry_after` seconds.
    pub fn busy(queue: usize) -> Self {
        let message = format!("the server is busy: {queue} requests are already waiting");
        Self {
            retry_after: Some(1),
            ..Self::new(StatusCode::SERVICE_UNAVAILABLE, "server_error", Some("queue_full"), message)
        }
    }

    /// 500: the model failed where it should not have.
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", None, message)
    }

    /// 503: the model's thread has stopped taking requests.
    pub fn shutting_down() -> Self {
        Self::new(StatusCode::SERVICE_UNAVAILABLE, "server_error", Some("shutting_down"), "the server is shutting down")
    }

    /// The error as a body: what a stream sends in place of its next chunk.
    pub fn body(&self) -> ErrorBody<'_> {
        ErrorBody { error: ErrorDetail { message: &self.message, kind: self.kind, param: None, code: self.code } }
    }
}

#[derive(Serialize)]
pub struct ErrorBody<'a> {
    error: ErrorDetail<'a>,
}

#[derive(Serialize)]
struct ErrorDetail<'a> {
    message: &'a str,
    #[serde(rename = "type")]
    kind: &'static str,
    param: Option<&'static str>,
    code: Option<&'static str>,
}

impl ApiError {
    /// The error's status (and `Retry-After`) with `body`, the error as one API writes it.
    pub fn respond(&self, body: impl Serialize) -> Response {
        let mut response = (self.status, Json(body)).into_response();
        if let Some(seconds) = self.retry_after {
            response.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(seconds));
        }
        response
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = self.respond(self.body());
        if self.status == StatusCode::UNAUTHORIZED {
            response.headers_mut().insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        response
    }
}
