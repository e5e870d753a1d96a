//! A whole model call read to its response: what child sessions and compaction use (the turn
//! loop streams its calls itself, to publish deltas as they come).

use flue_core::abort::AbortSignal;
use futures_util::StreamExt;

use super::{ModelProvider, ModelRequest, ModelResponse, ProviderError, ProviderErrorKind, StreamEvent};
use crate::runtime::RuntimeOptions;

/// Why a call read by [`complete`] has no response.
#[derive(Debug, thiserror::Error)]
pub(crate) enum CallError {
    /// The signal aborted it.
    #[error("The call was aborted.")]
    Aborted,
    /// The provider refused it or it failed (after the runtime's retries).
    #[error("The model call failed: {0}")]
    Failed(ProviderError),
}

impl CallError {
    /// Whether the provider refused the call as a context overflow (what compaction recovers).
    pub(crate) fn is_context_overflow(&self) -> bool {
        matches!(self, Self::Failed(error) if error.kind == ProviderErrorKind::ContextOverflow)
    }
}

/// One model call, with the runtime's retries on retryable errors.
pub(crate) async fn complete(
    options: &RuntimeOptions,
    provider: &dyn ModelProvider,
    request: &ModelRequest,
    signal: &AbortSignal,
) -> Result<ModelResponse, CallError> {
    complete_observed(options, provider, request, signal, |_| {}).await
}

/// What a call read by [`complete_observed`] streamed before its response.
pub(crate) enum Streamed {
    /// A delta or a tool call's start (never the completed response).
    Event(StreamEvent),
    /// The call failed after `Event`s may have streamed and is made again: what streamed
    /// before belongs to a message that ends here.
    Retrying,
}

/// [`complete`], handing `observe` what streams as it comes.
pub(crate) async fn complete_observed(
    options: &RuntimeOptions,
    provider: &dyn ModelProvider,
    request: &ModelRequest,
    signal: &AbortSignal,
    mut observe: impl FnMut(Streamed),
) -> Result<ModelResponse, CallError> {
    let mut retries = 0;
    loop {
        match stream_to_end(provider, request, signal, &mut observe).await {
            Ok(response) => return Ok(response),
            Err(None) => return Err(CallError::Aborted),
            Err(Some(error)) if error.may_retry(retries, options.model_retries) => {
                let delay;
                (retries, delay) = options.model_retry(retries, &error);
                observe(Streamed::Retrying);
                tokio::select! {
                    () = tokio::time::sleep(delay) => {}
                    () = signal.aborted() => return Err(CallError::Aborted),
                }
            }
            Err(Some(error)) => return Err(CallError::Failed(error)),
        }
    }
}

/// Reads a model stream to its completed response (`Err(None)` when aborted).
async fn stream_to_end(
    provider: &dyn ModelProvider,
    request: &ModelRequest,
    signal: &AbortSignal,
    observe: &mut impl FnMut(Streamed),
) -> Result<ModelResponse, Option<ProviderError>> {
    let mut stream = provider.stream(request);
    loop {
        let next = tokio::select! {
            next = stream.next() => next,
            () = signal.aborted() => return Err(None),
        };
        match next {
            Some(Ok(StreamEvent::Completed(response))) => return Ok(response),
            Some(Ok(event)) => observe(Streamed::Event(event)),
            Some(Err(error)) => return Err(Some(error)),
            None => {
                return Err(Some(ProviderError::new(
                    ProviderErrorKind::Network,
                    "the model stream ended before the response completed",
                )));
            }
        }
    }
}
