//! A whole model call read to its response: what compaction uses ([`complete`], with the
//! runtime's retries) and a task's child ([`call_observed`], one call at a time: it retries
//! each as a turn of its own). The turn loop streams its calls itself, to publish deltas as
//! they come.

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
    let mut retries = 0;
    // A retry's request: the provider may retry it only as often as the budget has left
    // (`ModelRequest::max_retries`, which the caller sets to the whole budget).
    let mut retry: Option<ModelRequest> = None;
    loop {
        let call = retry.as_ref().unwrap_or(request);
        match call_observed(provider, call, signal, |_| {}).await {
            Err(CallError::Failed(error)) if error.may_retry(retries, options.model_retries) => {
                let delay;
                (retries, delay) = options.model_retry(retries, &error);
                let left = options.model_retries.saturating_sub(retries);
                retry.get_or_insert_with(|| request.clone()).max_retries = Some(left);
                tokio::select! {
                    () = tokio::time::sleep(delay) => {}
                    () = signal.aborted() => return Err(CallError::Aborted),
                }
            }
            other => return other,
        }
    }
}

/// One model call, not retried (the provider's own retries aside), handing `observe` what
/// streams before its response as it comes: for a caller that makes each retry a turn of its
/// own.
pub(crate) async fn call_observed(
    provider: &dyn ModelProvider,
    request: &ModelRequest,
    signal: &AbortSignal,
    mut observe: impl FnMut(StreamEvent),
) -> Result<ModelResponse, CallError> {
    match stream_to_end(provider, request, signal, &mut observe).await {
        Ok(response) => Ok(response),
        Err(None) => Err(CallError::Aborted),
        Err(Some(error)) => Err(CallError::Failed(error)),
    }
}

/// Reads a model stream to its completed response (`Err(None)` when aborted).
async fn stream_to_end(
    provider: &dyn ModelProvider,
    request: &ModelRequest,
    signal: &AbortSignal,
    observe: &mut impl FnMut(StreamEvent),
) -> Result<ModelResponse, Option<ProviderError>> {
    let mut stream = provider.stream(request);
    loop {
        let next = tokio::select! {
            next = stream.next() => next,
            () = signal.aborted() => return Err(None),
        };
        match next {
            Some(Ok(StreamEvent::Completed(response))) => {
                response.check_completed(provider.id())?;
                return Ok(response);
            }
            Some(Ok(event)) => observe(event),
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

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use super::*;
    use crate::provider::{ModelStream, ProviderErrorKind};

    /// Fails each call with a stream cut (retryable), recording what each call allowed the
    /// provider to retry itself.
    #[derive(Default)]
    struct Cut {
        allowed: Mutex<Vec<Option<u32>>>,
    }

    impl ModelProvider for Cut {
        fn id(&self) -> &str {
            "cut"
        }

        fn context_window(&self, _model: &str) -> Option<u64> {
            None
        }

        fn stream(&self, request: &ModelRequest) -> ModelStream {
            self.allowed
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(request.max_retries);
            Box::pin(futures_util::stream::once(async {
                Err(crate::provider::ProviderError::new(ProviderErrorKind::Network, "cut"))
            }))
        }
    }

    /// A one-message request, with a budget of three retries.
    fn request() -> ModelRequest {
        ModelRequest {
            model: "m".into(),
            system: None,
            messages: vec![crate::provider::ModelMessage::user("hi")].into(),
            tools: Vec::new(),
            thinking_level: flue_core::model::ThinkingLevel::Off,
            max_output_tokens: None,
            max_retries: Some(3),
        }
    }

    /// A task child's call and a compaction's summary share the one budget as a turn does:
    /// each retry leaves the provider only what the budget has left.
    #[tokio::test]
    async fn each_retry_leaves_the_provider_what_the_budget_has_left() {
        let options = RuntimeOptions {
            model_retries: 3,
            model_retry_delay: std::time::Duration::from_millis(1),
            ..RuntimeOptions::default()
        };
        let provider = Cut::default();
        let request = request();
        let result = complete(&options, &provider, &request, &AbortSignal::new()).await;
        assert!(matches!(result, Err(CallError::Failed(_))));
        assert_eq!(
            *provider.allowed.lock().unwrap_or_else(|e| e.into_inner()),
            [Some(3), Some(2), Some(1), Some(0)]
        );
    }

    /// Answers every call with one tool call whose arguments are `arguments`.
    struct Calls {
        arguments: String,
        calls: Mutex<u32>,
    }

    impl ModelProvider for Calls {
        fn id(&self) -> &str {
            "calls"
        }

        fn stream(&self, _request: &ModelRequest) -> ModelStream {
            *self.calls.lock().unwrap_or_else(|e| e.into_inner()) += 1;
            let response = crate::provider::ModelResponse {
                text: String::new(),
                reasoning: String::new(),
                reasoning_blocks: Vec::new(),
                tool_calls: vec![crate::provider::ModelToolCall {
                    id: "call_1".into(),
                    name: "add".into(),
                    arguments: self.arguments.clone(),
                }],
                stop_reason: crate::provider::StopReason::ToolUse,
                usage: Default::default(),
            };
            Box::pin(futures_util::stream::iter([Ok(StreamEvent::Completed(response))]))
        }
    }

    /// A task child's call (and a compaction's) refuses tool-call arguments past the JSON
    /// limits as the turn loop does: an invalid response, not retried.
    #[tokio::test]
    async fn tool_call_arguments_past_the_json_limits_are_an_invalid_response() {
        let request = request();
        let at_limit = format!("[{}]", vec!["0"; crate::MAX_JSON_VALUES - 1].join(","));
        let past = format!("[{}]", vec!["0"; crate::MAX_JSON_VALUES].join(","));
        for (arguments, refused) in [(at_limit, false), (past, true)] {
            let provider = Calls {
                arguments,
                calls: Mutex::new(0),
            };
            let result = complete(&RuntimeOptions::default(), &provider, &request, &AbortSignal::new()).await;
            match result {
                Err(CallError::Failed(error)) => {
                    assert!(refused, "{error}");
                    assert_eq!(error.kind, ProviderErrorKind::InvalidResponse);
                    assert!(error.message.contains("500000 JSON values"), "{error}");
                }
                Ok(response) => assert!(!refused, "{response:?}"),
                Err(other) => panic!("{other}"),
            }
            assert_eq!(*provider.calls.lock().unwrap_or_else(|e| e.into_inner()), 1);
        }
    }
}
