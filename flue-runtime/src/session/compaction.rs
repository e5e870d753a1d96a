//! Compaction in the turn loop (see `crate::compaction`).

use std::time::Instant;

use flue_core::model::{Compaction, CompactionConfig};
use flue_core::usage::Usage;

use super::{Failure, Response, turn_request};
use crate::compaction::{SUMMARY_INSTRUCTIONS, transcript};
use crate::events::{Event, LazyId, TurnPurpose, TurnResponse};
use crate::provider::{ModelMessage, ModelProvider, ModelRequest, ModelResponse};
use crate::record::{RecordBody, SettlementError};

/// Why a compaction runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Reason {
    Threshold,
    Overflow,
}

impl Reason {
    fn as_str(self) -> &'static str {
        match self {
            Self::Threshold => "threshold",
            Self::Overflow => "overflow",
        }
    }
}

impl Response<'_> {
    fn compaction_config(&self) -> CompactionConfig {
        match &self.compaction {
            Compaction::Threshold(config) => config.clone(),
            Compaction::Default | Compaction::Disabled => CompactionConfig::default(),
        }
    }

    /// Threshold compaction before a model call whose estimated input (a system prompt of
    /// `system_len` bytes and the history) exceeds the window minus the reserve.
    pub(super) async fn compact_if_needed(
        &mut self,
        provider: &dyn ModelProvider,
        model_id: &str,
        system_len: usize,
        step: u32,
    ) -> Result<(), Failure> {
        if self.compaction == Compaction::Disabled {
            return Ok(());
        }
        let Some(window) = provider.context_window(model_id) else {
            return Ok(());
        };
        let config = self.compaction_config();
        let reserve = config.reserve_tokens.map_or(
            (window / 4).min(u64::from(CompactionConfig::MAX_DEFAULT_RESERVE_TOKENS)),
            u64::from,
        );
        let estimate = self.conversation.estimated_tokens() + system_len as u64 / 4;
        if estimate.max(self.last_call_tokens) > window.saturating_sub(reserve) {
            self.compact(Reason::Threshold, provider, model_id, step).await?;
        }
        Ok(())
    }

    /// Summarizes the older history before the response's `step`; returns whether anything
    /// was compacted.
    pub(super) async fn compact(
        &mut self,
        reason: Reason,
        provider: &dyn ModelProvider,
        model_id: &str,
        step: u32,
    ) -> Result<bool, Failure> {
        let config = self.compaction_config();
        let keep = u64::from(
            config
                .keep_recent_tokens
                .unwrap_or(CompactionConfig::DEFAULT_KEEP_RECENT_TOKENS),
        );
        let Some((cut, first_kept)) = self.conversation.compaction_cut(keep, reason == Reason::Overflow) else {
            return Ok(false);
        };
        let tokens_before = self.conversation.estimated_tokens();
        self.emit(Event::CompactionStart {
            reason: reason.as_str().to_owned(),
            estimated_tokens: tokens_before,
        });
        let started = Instant::now();
        let request = |model: String| ModelRequest {
            model,
            system: Some(SUMMARY_INSTRUCTIONS.to_owned()),
            messages: vec![ModelMessage::user(transcript(self.conversation.before(cut)))].into(),
            tools: Vec::new(),
            thinking_level: flue_core::model::ThinkingLevel::Low,
            max_output_tokens: Some(4_000),
        };
        let summary = match &config.model {
            Some(spec) => match self.runtime.providers.resolve(spec) {
                Ok((summarizer, summary_model)) => self.summarize(&*summarizer, request(summary_model), step).await,
                Err(error) => Err(format!("The compaction model: {error}")),
            },
            None => self.summarize(provider, request(model_id.to_owned()), step).await,
        };
        let (summary, usage) = match summary {
            Ok(response) if !response.text.trim().is_empty() => (response.text, response.usage),
            Ok(response) => {
                let failure = summary_failed("the summary was empty");
                return Err(self.compaction_failed(started, failure, Some(response.usage)));
            }
            Err(error) => {
                // An abort (or the deadline's) that ended the summary call ends the submission
                // as aborted (or timed out), not as a failed compaction.
                let failure = if self.attempt.signal.is_aborted() {
                    Failure::aborted()
                } else {
                    summary_failed(&error)
                };
                return Err(self.compaction_failed(started, failure, None));
            }
        };
        let messages_before = self.conversation.messages.len();
        let mut records = vec![self.record(RecordBody::Compaction {
            summary,
            first_kept_message_id: first_kept,
            tokens_before,
            reason: reason.as_str().to_owned(),
            usage: Some(usage),
        })];
        // A new baseline for the system prompt's catalogs: what is declared now.
        if let Some((_, snapshot)) = &self.declared {
            records.push(self.record(RecordBody::ResourceSnapshot {
                snapshot: snapshot.clone(),
                baseline: self.framework_sections.text().map(str::to_owned),
            }));
            self.first_snapshot = None;
        }
        if let Err(failure) = self.commit(records, false).await {
            // The summary is lost with the attempt: the compaction ends failed.
            return Err(self.compaction_failed(started, failure, Some(usage)));
        }
        self.last_call_tokens = 0;
        self.emit(Event::Compaction {
            messages_before: messages_before as u64,
            messages_after: self.conversation.messages.len() as u64,
            duration_ms: started.elapsed().as_millis() as u64,
            is_error: false,
            error: None,
            usage: Some(usage),
        });
        Ok(true)
    }

    /// The summarization call, reported as a `compaction`-purpose turn: `turn_request` before
    /// it, `turn` after it (no `turn_start`: that one is the agent's own turns').
    async fn summarize(
        &self,
        provider: &dyn ModelProvider,
        request: ModelRequest,
        step: u32,
    ) -> Result<ModelResponse, String> {
        let turn_id = LazyId::new("turn");
        self.set_turn(Some(&turn_id));
        let thinking = request.thinking_level;
        self.emit_with(|| Event::TurnRequest {
            turn_id: turn_id.get(),
            purpose: TurnPurpose::Compaction,
            request: turn_request(provider, &request.model, thinking),
        });
        let started = Instant::now();
        let summary = crate::provider::complete(&self.runtime.options, provider, &request, &self.attempt.signal).await;
        self.emit_with(|| {
            let aborted = self.attempt.signal.is_aborted();
            let (stop_reason, response) = match &summary {
                Ok(response) => (
                    response.stop_reason.to_string(),
                    TurnResponse {
                        text: response.text.clone(),
                        tool_calls: Vec::new(),
                        usage: Some(response.usage),
                        error: None,
                    },
                ),
                Err(message) => (
                    if aborted { "aborted" } else { "error" }.to_owned(),
                    TurnResponse {
                        error: Some(SettlementError::new(
                            if aborted { "aborted" } else { "model_call_failed" },
                            message.clone(),
                        )),
                        ..TurnResponse::default()
                    },
                ),
            };
            Event::Turn {
                turn_id: turn_id.get(),
                purpose: TurnPurpose::Compaction,
                step,
                stop_reason,
                duration_ms: started.elapsed().as_millis() as u64,
                request: turn_request(provider, &request.model, thinking),
                is_error: summary.is_err(),
                response,
            }
        });
        self.set_turn(None);
        summary
    }

    /// Ends a failed compaction with its terminal `compaction` event (`usage` when its summary
    /// call answered); returns `failure`.
    fn compaction_failed(&self, started: Instant, failure: Failure, usage: Option<Usage>) -> Failure {
        self.emit(Event::Compaction {
            messages_before: self.conversation.messages.len() as u64,
            messages_after: self.conversation.messages.len() as u64,
            duration_ms: started.elapsed().as_millis() as u64,
            is_error: true,
            error: Some(failure.error.clone()),
            usage,
        });
        failure
    }
}

/// The failure of a compaction whose summary call failed or answered nothing usable.
fn summary_failed(error: &str) -> Failure {
    Failure::failed("compaction_failed", format!("[flue] Compaction failed: {error}"))
}
