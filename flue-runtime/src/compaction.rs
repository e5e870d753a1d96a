//! Compaction: when the history nears the model's context window, the older part is
//! summarized by a model call and the model reads the summary in its place from then on (the
//! stored records stay; a `compaction` record says where the cut is).
//!
//! - **Threshold compaction** (per `use_model` options): before a model call whose estimated
//!   input exceeds the window minus `reserve_tokens` (default: a quarter of the window, at most
//!   20,000), keeping about `keep_recent_tokens` (default 8,000; at most half of the window
//!   less the reserve, so a small window is compacted too) of the newest history verbatim,
//!   summarized with `CompactionConfig::model` or the session's model. It needs the model's
//!   context window (`ModelProvider::context_window`); `Compaction::Disabled` turns it off.
//! - **Overflow recovery**: a call the provider refuses as a context overflow compacts and is
//!   retried once — also with threshold compaction off. A tool step (a call and its results)
//!   estimated over `keep_recent_tokens` is summarized rather than kept (a tool's long result
//!   is what overflows, and kept, the retry would overflow too), the whole history when it is
//!   the newest step.
//! - The summary may be as long as four fifths of the reserve, at most 16,000 tokens and at
//!   most what the summarizing model may answer ([`ModelProvider::max_output_tokens`]); 4,000
//!   when neither the reserve nor the session model's window is known (an endpoint's own limit
//!   may be small). It is asked for with low reasoning effort, or none when the session's
//!   thinking level is off (a model or endpoint that takes no reasoning setting would refuse
//!   it).
//! - Both are best-effort: a summary that cannot be made (the call refused, an empty summary,
//!   one the output limit cut off, a compaction model that does not resolve) is reported as a
//!   failed `compaction` event and a warning, and the session goes on uncompacted (an overflow
//!   is then the call's failure). No other threshold compaction is tried in the session then,
//!   unless the summary failed for a reason that passes (the provider overloaded, unreachable
//!   or asking to wait, past its retries): then the threshold is checked again after 4 steps
//!   (8, 16, … up to 64 when the summaries keep failing so).
//!   The summary's transcript shows at most 2,000 characters of each tool result and of each
//!   call's arguments. When the summarizing model's window is known, the summary call fits
//!   it: the answer takes at most half the window, and is made shorter (down to a quarter)
//!   before an input too long beside it is cut, keeping the earlier summary's start (in what
//!   the conversation since leaves, at least half the room when both are long) and the
//!   transcript's newest part, each saying so; a window too small to summarize in leaves the
//!   session uncompacted. A cut always takes more than the previous compaction's summary.
//! - The transcript is of the history as the message hooks let the model read it: the older
//!   rows `filter_messages` leaves (run on the history as for a request; rows it adds are
//!   context, not history, and left out), after `prefilter_llm_history` in the provider format
//!   (the summary instructions as its system message: a hook can tell a summary's call by
//!   them, [`SUMMARY_INSTRUCTIONS`]). What `prefilter_llm_history` adds there is summarized with the history (its
//!   output cannot say which messages are the history's), so a hook adding per-request
//!   context leaves a summary's call alone. The summarizing model's window unknown, a call it
//!   refuses as too long is made again with the transcript's newest half, then a quarter.
//!   What a hook withholds from the model
//!   does not reach it through a summary; a hook that blocks leaves the session uncompacted,
//!   as a failed summary does. An earlier summary is carried over as it was made (one made
//!   before a hook existed is not filtered again).
//! - After a compaction the system prompt's catalogs take a new baseline (the then-current
//!   skills and delegates), and the stream shows a `conversation-reset`.
//! - A task's child session compacts the same way, with the submission's settings (a
//!   delegate's render cannot call `use_model`): its `compaction` record is in the child's own
//!   stream, so a reattached child goes on from the compacted history, and its events carry
//!   the task's id.
//!
//! What a compaction does is here ([`compact_if_needed`], [`compact`]); what differs between
//! the root's turn loop and a task's child session — how they publish, record and fail — is
//! behind [`Compacting`].
//!
//! Estimates are characters / 4 (and a flat 1,000 tokens per image): coarse, but they only
//! decide when to compact; the provider's own count decides overflow. The threshold takes the
//! larger of the history's estimate and the latest call's own count (which sees tool schemas
//! and reasoning) plus an estimate of what came after that call's answer.

use std::future::Future;
use std::time::Instant;

use flue_core::abort::AbortSignal;
use flue_core::model::{Compaction, CompactionConfig, ThinkingLevel};
use flue_core::usage::Usage;

use crate::events::{Event, LazyId, TurnPurpose, TurnResponse};
use crate::provider::{ModelMessage, ModelProvider, ModelRequest, ModelResponse, ProviderErrorKind, StopReason};
use crate::record::{RecordBody, SettlementError};
use crate::runtime::RuntimeInner;
use crate::session::{Conversation, turn_request};

/// The system message of a compaction's summary call: what a `prefilter_llm_history` hook is
/// given as the system message when the history it filters is to be summarized (one that adds
/// per-request context leaves such a call alone: what it adds would be summarized for good).
pub const SUMMARY_INSTRUCTIONS: &str = "You compress a conversation between a user, an AI agent and its tools so the agent can continue it without the original messages. \
Write a concise summary that keeps: the user's goals and constraints, decisions made, facts learned (names, numbers, identifiers, file paths), \
the results of tool calls that still matter, and what remains to do. Leave out pleasantries and anything superseded. \
Write it as notes, in the language of the conversation. \
When an earlier summary comes first, yours replaces it: carry over everything in it that still matters, then add what came after.";

/// The estimated tokens of one image.
pub(crate) const IMAGE_TOKENS: u64 = 1_000;

/// The estimated tokens of one message.
pub(crate) fn estimate_message(message: &ModelMessage) -> u64 {
    let chars = match message {
        ModelMessage::User { content, images } => content.len() + images.len() * (IMAGE_TOKENS as usize * 4),
        ModelMessage::Assistant { text, tool_calls, .. } => {
            text.len()
                + tool_calls
                    .iter()
                    .map(|call| call.name.len() + call.arguments.len())
                    .sum::<usize>()
        }
        ModelMessage::Tool { content, name, .. } => content.len() + name.len(),
    };
    (chars as u64).div_ceil(4) + 4
}

/// How many characters of one tool result (and of one call's arguments) a summary transcript
/// shows: the call's request carries the gist, and a transcript of whole results (files,
/// pages) or written contents could overflow the very window the compaction is to make room
/// in.
const TRANSCRIPT_TOOL_RESULT_CHARS: usize = 2_000;

/// `text`'s first [`TRANSCRIPT_TOOL_RESULT_CHARS`] characters, saying how many more it has.
fn push_cut(out: &mut String, text: &str) {
    match text.char_indices().nth(TRANSCRIPT_TOOL_RESULT_CHARS) {
        Some((cut, _)) => {
            out.push_str(&text[..cut]);
            out.push_str(&format!(" [… {} more characters]", text[cut..].chars().count()));
        }
        None => out.push_str(text),
    }
}

/// The messages to summarize as one transcript.
pub(crate) fn transcript(messages: &[ModelMessage]) -> String {
    let mut out = String::new();
    for message in messages {
        match message {
            ModelMessage::User { content, images } => {
                out.push_str("User: ");
                out.push_str(content);
                if !images.is_empty() {
                    out.push_str(&format!(" [{} image(s)]", images.len()));
                }
            }
            ModelMessage::Assistant { text, tool_calls, .. } => {
                out.push_str("Agent: ");
                out.push_str(text);
                for call in tool_calls {
                    out.push_str(&format!("\n[called {} with ", call.name));
                    push_cut(&mut out, &call.arguments);
                    out.push(']');
                }
            }
            ModelMessage::Tool {
                name,
                content,
                is_error,
                ..
            } => {
                out.push_str(&format!("Tool {name}{}: ", if *is_error { " (error)" } else { "" }));
                push_cut(&mut out, content);
            }
        }
        out.push_str("\n\n");
    }
    out
}

/// What the summary call reads: the `older` messages' `transcript` (of those the cut takes
/// after the previous compaction's summary, see [`Conversation::compaction_cut`]), after that
/// summary set apart as the earlier summary; cut to `room` characters when it must be (see
/// [`plan`]): the earlier summary keeps its start in what the transcript leaves (at least half
/// the room when both are long), the transcript its newest part in the rest, each saying so.
fn summary_input(previous: Option<&str>, transcript: &str, room: Option<usize>) -> String {
    let Some(room) = room else {
        return previous.map_or_else(String::new, earlier) + transcript;
    };
    // The earlier summary gets what the transcript leaves, and at least half the room when
    // both are long.
    let transcript_needs = (transcript.len() + LEFT_OUT.len()).min(room / 2);
    let head = previous.map_or_else(String::new, |previous| {
        let framing = earlier("").len();
        earlier(&keep_start(previous, room.saturating_sub(transcript_needs + framing)))
    });
    let left = room.saturating_sub(head.len() + LEFT_OUT.len());
    let mut from = transcript.len().saturating_sub(left);
    while !transcript.is_char_boundary(from) {
        from += 1;
    }
    // From the next message's start, when one starts in what fits (else the newest message's
    // end is what fits of it).
    if from > 0
        && let Some(next) = transcript[from..].find("\n\n")
        && from + next + 2 < transcript.len()
    {
        from += next + 2;
    }
    if from == 0 {
        return head + transcript;
    }
    format!("{head}{LEFT_OUT}{}", &transcript[from..])
}

/// The earlier summary as the summary call reads it, before the conversation since.
fn earlier(previous: &str) -> String {
    format!("Earlier summary:\n{previous}\n\nThe conversation since:\n\n")
}

/// `text`'s first `most` bytes (at a character boundary), saying the rest is left out.
fn keep_start(text: &str, most: usize) -> String {
    if text.len() <= most {
        return text.to_owned();
    }
    let mut end = most.saturating_sub(EARLIER_LEFT_OUT.len());
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}{EARLIER_LEFT_OUT}", &text[..end])
}

/// What a transcript cut to fit the summarizing model starts with.
const LEFT_OUT: &str = "[The conversation's start is left out: it does not fit the summarizing model's window.]\n\n";

/// What an earlier summary cut to fit the summarizing model ends with.
const EARLIER_LEFT_OUT: &str = " [The rest of the earlier summary is left out: it does not fit.]";

/// How one summary call is planned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Planning {
    /// To fit the summarizing model's window ([`plan`]; `None`: not known, the input whole),
    /// estimated at this many characters a token.
    Window(Option<u64>, u64),
    /// The window not known and a call refused as too long: the input cut to a part of its
    /// characters (`1 / n`), the answer to a part of its tokens.
    Part(usize),
}

/// The plans of a summary call and of the calls that follow one the summarizing model refuses
/// as too long. With the model's `window` known, it is planned at 4 characters a token, then
/// 2, then 1 (a text whose tokens are shorter, CJK or base64). Not known, the input is sent
/// whole first; refused, half of it (the newest), then a quarter, each with an answer as
/// much shorter: a message larger than the window would otherwise fail every summary of it,
/// and so every later call of the conversation.
fn summary_plans(window: Option<u64>) -> [Planning; 3] {
    match window {
        Some(_) => [4, 2, 1].map(|per_token| Planning::Window(window, per_token)),
        None => [Planning::Window(None, 4), Planning::Part(2), Planning::Part(4)],
    }
}

/// How a summary call fits the summarizing model's `window` (in tokens; `None` when it is not
/// known: nothing changes): the answer it may give, from `answer` (at most half the window),
/// and the characters its input keeps when it must be cut (`None`: it is sent whole). An input
/// of `input` characters too long beside the answer makes the answer shorter first, down to a
/// quarter (a shorter summary of everything is worth more than a longer one of a part); past
/// that, the input is cut. Estimates are characters / `per_token` (4 at first; a text whose
/// tokens are shorter, CJK or base64, takes more tokens than that says, and a summary call the
/// model refuses as too long is planned again at 2, then 1).
fn plan(window: Option<u64>, answer: u32, input: usize, per_token: u64) -> Result<(u32, Option<usize>), String> {
    let Some(window) = window else {
        return Ok((answer, None));
    };
    let per_token = per_token.max(1);
    let instructions = (SUMMARY_INSTRUCTIONS.len() as u64).div_ceil(per_token) + 16;
    let readable = window.saturating_sub(instructions);
    let answer = u64::from(answer).min(window / 2).max(1);
    let input = (input as u64).div_ceil(per_token);
    let tokens = |tokens: u64| u32::try_from(tokens).unwrap_or(u32::MAX);
    if input + answer <= readable {
        return Ok((tokens(answer), None));
    }
    let least = (answer / 4).max(1);
    if input + least <= readable {
        return Ok((tokens(readable - input), None));
    }
    let room = usize::try_from(readable.saturating_sub(least).saturating_mul(per_token)).unwrap_or(usize::MAX);
    // Room for the notes of a cut and some of the conversation, or no summary worth making.
    if room < MIN_CUT_ROOM {
        return Err(format!(
            "the summarizing model's context window ({window} tokens) is too small to summarize in"
        ));
    }
    Ok((tokens(least), Some(room)))
}

/// The fewest characters a cut summary input may keep (its notes and some conversation).
const MIN_CUT_ROOM: usize = 1_000;

/// Why a compaction runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Reason {
    /// The estimated input of the next call passes the window less the reserve.
    Threshold,
    /// The provider refused a call as a context overflow.
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

/// What a session's compaction goes by: the submission's settings and the size of its latest
/// model call.
#[derive(Debug, Default)]
pub(crate) struct Budget {
    /// The submission's compaction settings (`use_model` options).
    pub(crate) settings: Compaction,
    /// The tokens of the latest model call (its input and output), as the provider counted;
    /// 0 once a compaction made that count stale.
    last_call_tokens: u64,
    /// Where in the history that call's answer goes: what follows it (tool results, joined
    /// deliveries) came after the count.
    last_call_at: usize,
    /// A compaction's summary failed in this session for a reason that would fail it again
    /// (refused, empty, cut off): no threshold compaction is tried after it (each would cost a
    /// summary call, and its retries, at every step); overflow recovery still is.
    gave_up: bool,
    /// How many more steps try no threshold compaction, after a summary that failed for a
    /// reason that passes (the provider overloaded or unreachable past its retries).
    paused: u32,
    /// The summaries that failed so in a row: each pause is twice the one before.
    passing_failures: u32,
}

/// The steps a first summary failure that passes skips threshold compaction for; doubled at
/// each such failure in a row, up to [`MAX_PAUSE_STEPS`].
const PAUSE_STEPS: u32 = 4;

/// The longest pause after summaries that failed for reasons that pass.
const MAX_PAUSE_STEPS: u32 = 64;

impl Budget {
    /// A budget with `settings`, before any call.
    pub(crate) fn new(settings: Compaction) -> Self {
        Self {
            settings,
            last_call_tokens: 0,
            last_call_at: 0,
            gave_up: false,
            paused: 0,
            passing_failures: 0,
        }
    }

    /// Notes what a call the provider answered counted, made on a history of `messages`
    /// messages (its answer is the next one added).
    pub(crate) fn called(&mut self, usage: &Usage, messages: usize) {
        self.last_call_tokens = usage.total_tokens();
        self.last_call_at = messages;
    }

    fn config(&self) -> CompactionConfig {
        match &self.settings {
            Compaction::Threshold(config) => config.clone(),
            Compaction::Default | Compaction::Disabled => CompactionConfig::default(),
        }
    }
}

/// Why a compaction failed before anything was recorded.
pub(crate) enum Failed {
    /// The session's signal ended the summary call (an abort, or the deadline's).
    Aborted,
    /// The summary call failed or answered nothing usable: the message.
    Summary(String),
}

/// A session whose conversation compacts: the root's turn loop, or a task's child session.
pub(crate) trait Compacting {
    /// How the session fails.
    type Failure;

    fn runtime(&self) -> &RuntimeInner;

    /// The signal that ends the session's calls.
    fn signal(&self) -> &AbortSignal;

    fn budget(&mut self) -> &mut Budget;

    fn conversation(&self) -> &Conversation;

    /// Publishes an event of the session (built only when someone observes).
    fn publish(&self, event: impl FnOnce() -> Event);

    /// The model turn the session's events belong to from now on (`None`: none).
    fn turn(&self, turn: Option<&LazyId>);

    /// Records `compaction` durably in the session's stream (with what the session keeps
    /// beside it) and folds it into the conversation.
    fn record_compaction(&mut self, compaction: RecordBody) -> impl Future<Output = Result<(), Self::Failure>> + Send;

    /// The messages of the rows `from..cut` as the session's message hooks let the model read
    /// them: what a summary may read (a summary must not pass what a hook withholds on to the
    /// model, nor keep it for good). `Err` says why there are none (a hook blocked them). A
    /// session without message hooks (a task's child) reads them as stored.
    fn summarized(
        &mut self,
        from: usize,
        cut: usize,
    ) -> impl Future<Output = Result<Vec<ModelMessage>, String>> + Send {
        std::future::ready(Ok(self.conversation().older_messages(from, cut)))
    }

    /// The session's failure for a compaction that `failed`.
    fn failure(&self, failed: Failed) -> Self::Failure;

    /// What the terminal `compaction` event says of `failure`.
    fn describe(failure: &Self::Failure) -> SettlementError;
}

/// Threshold compaction before a model call (the `step`th of the session) whose estimated
/// input (a system prompt of `system_len` bytes and the history) exceeds the window minus the
/// reserve.
pub(crate) async fn compact_if_needed<S: Compacting>(
    session: &mut S,
    provider: &dyn ModelProvider,
    model_id: &str,
    thinking: ThinkingLevel,
    system_len: usize,
    step: u32,
) -> Result<(), S::Failure> {
    let budget = session.budget();
    if budget.settings == Compaction::Disabled || budget.gave_up {
        return Ok(());
    }
    if budget.paused > 0 {
        budget.paused -= 1;
        return Ok(());
    }
    let Some(window) = provider.context_window(model_id) else {
        return Ok(());
    };
    let reserve = reserve_tokens(&budget.config(), Some(window));
    let (last_call_tokens, last_call_at) = (budget.last_call_tokens, budget.last_call_at);
    let conversation = session.conversation();
    let estimate = conversation.estimated_tokens() + system_len as u64 / 4;
    // The provider's count of the latest call covers what no estimate sees (tool schemas,
    // reasoning); what came after its answer (tool results, joined deliveries) it could not
    // count, so it is estimated on top.
    let counted = match last_call_tokens {
        0 => 0,
        counted => {
            // What the history grew by since the call, less the call's own answer (its output
            // is in the count).
            let mut answer_seen = false;
            let since: u64 = conversation
                .messages
                .iter()
                .skip(last_call_at)
                .filter(|message| {
                    let answer = !answer_seen && matches!(message, ModelMessage::Assistant { .. });
                    answer_seen |= answer;
                    !answer
                })
                .map(estimate_message)
                .sum();
            counted.saturating_add(since)
        }
    };
    if estimate.max(counted) > window.saturating_sub(reserve) {
        compact(session, Reason::Threshold, provider, model_id, thinking, step).await?;
    }
    Ok(())
}

/// The tokens kept free of history for the model's answer: the configured reserve, else a
/// quarter of the `window`, at most [`CompactionConfig::MAX_DEFAULT_RESERVE_TOKENS`] (that
/// most when the window is not known).
fn reserve_tokens(config: &CompactionConfig, window: Option<u64>) -> u64 {
    let most = u64::from(CompactionConfig::MAX_DEFAULT_RESERVE_TOKENS);
    config
        .reserve_tokens
        .map_or_else(|| window.map_or(most, |window| (window / 4).min(most)), u64::from)
}

/// How much of the newest history a compaction keeps verbatim: `keep_recent_tokens` (8,000 by
/// default), at most half of the room the `window` leaves for history (the window less the
/// reserve). A model whose window is smaller than what is to be kept would otherwise never be
/// compacted: the whole history would be kept, and an overflow fail again after its recovery.
fn kept_tokens(config: &CompactionConfig, window: Option<u64>) -> u64 {
    let keep = u64::from(
        config
            .keep_recent_tokens
            .unwrap_or(CompactionConfig::DEFAULT_KEEP_RECENT_TOKENS),
    );
    match window {
        Some(window) => keep.min(window.saturating_sub(reserve_tokens(config, Some(window))) / 2),
        None => keep,
    }
}

/// The most a summary may take: four fifths of the reserve (with the session model's `window`,
/// see [`reserve_tokens`]), at most 16,000 tokens, at least 1,000, and at most the summarizing
/// model's output cap `most` when known. 4,000 (within that cap) when neither the configured
/// reserve nor the window is known.
fn summary_tokens(config: &CompactionConfig, window: Option<u64>, most: Option<u64>) -> u32 {
    let budget = if config.reserve_tokens.is_none() && window.is_none() {
        4_000
    } else {
        (reserve_tokens(config, window) * 4 / 5).clamp(1_000, 16_000)
    };
    u32::try_from(budget.min(most.unwrap_or(u64::MAX))).unwrap_or(4_000)
}

/// Summarizes the older history before the session's `step`th model call (with the
/// compaction model, or `provider`'s `model_id`, at the session's `thinking` level) and
/// records the compaction; returns whether anything was compacted.
pub(crate) async fn compact<S: Compacting>(
    session: &mut S,
    reason: Reason,
    provider: &dyn ModelProvider,
    model_id: &str,
    thinking: ThinkingLevel,
    step: u32,
) -> Result<bool, S::Failure> {
    let config = session.budget().config();
    let window = provider.context_window(model_id);
    let keep = kept_tokens(&config, window);
    let Some((cut, first_kept)) = session.conversation().compaction_cut(keep, reason == Reason::Overflow) else {
        return Ok(false);
    };
    let tokens_before = session.conversation().estimated_tokens();
    session.publish(|| Event::CompactionStart {
        reason: reason.as_str().to_owned(),
        estimated_tokens: tokens_before,
    });
    let started = Instant::now();
    let previous = session.conversation().previous_summary().map(str::to_owned);
    let older = match session.summarized(usize::from(previous.is_some()), cut).await {
        Ok(older) => transcript(&older),
        // An abort (or the deadline's) that came while the hooks ran ends the session as
        // aborted (or timed out).
        Err(_) if session.signal().is_aborted() => {
            let failure = session.failure(Failed::Aborted);
            return Err(compaction_failed(&*session, started, failure, None));
        }
        Err(why) => {
            let failure = session.failure(summary_failed(&why));
            gave_up(session, started, failure, None, false);
            return Ok(false);
        }
    };
    if older.is_empty() && previous.is_none() {
        // The message hooks leave nothing of the older history (a `filter_messages` that
        // keeps the newest rows only): a summary call would carry nothing (Anthropic refuses
        // one; another model would summarize nothing, and that summary would stand for the
        // history for good). Nothing is compacted, no other threshold compaction is tried in
        // the session, and this is no failure: the `compaction` event says nothing changed.
        nothing_compacted(&*session, started, None, None);
        tracing::debug!("compaction skipped: the message hooks leave nothing of the older history to summarize");
        session.budget().gave_up = true;
        return Ok(false);
    }
    let retries = session.runtime().options.model_retries;
    let whole = previous.as_deref().map_or(0, |previous| earlier(previous).len()) + older.len();
    let request = |summarizer: &dyn ModelProvider, model: String, planning: Planning| {
        let answer = summary_tokens(&config, window, summarizer.max_output_tokens(&model));
        let planned = match planning {
            Planning::Window(summarizers, per_token) => plan(summarizers, answer, whole, per_token)?,
            Planning::Part(part) if whole / part < MIN_CUT_ROOM => {
                return Err(format!(
                    "the summarizing model refused the transcript as too long, and a {} of it is too short to summarize",
                    if part == 2 { "half" } else { "part" }
                ));
            }
            Planning::Part(part) => (
                (answer / u32::try_from(part).unwrap_or(u32::MAX)).max(1),
                Some(whole / part),
            ),
        };
        let (answer, room) = planned;
        let request = ModelRequest {
            max_output_tokens: Some(answer),
            messages: vec![ModelMessage::user(summary_input(previous.as_deref(), &older, room))].into(),
            model,
            system: Some(SUMMARY_INSTRUCTIONS.to_owned()),
            tools: Vec::new(),
            thinking_level: if thinking == ThinkingLevel::Off {
                ThinkingLevel::Off
            } else {
                ThinkingLevel::Low
            },
            max_retries: Some(retries),
        };
        Ok((request, planned))
    };
    let resolved = match &config.model {
        Some(spec) => session
            .runtime()
            .providers
            .resolve(spec)
            .map(|(summarizer, model)| (Some(summarizer), model))
            .map_err(|error| format!("The compaction model: {error}")),
        None => Ok((None, model_id.to_owned())),
    };
    let (summary, passing) = match resolved {
        Ok((summarizer, model)) => {
            let summarizer = summarizer.as_deref().unwrap_or(provider);
            let plans = summary_plans(summarizer.context_window(&model));
            let mut summary = Err(String::new());
            let mut made = None;
            // Whether the last summary call failed for a reason that passes.
            let mut passing = false;
            for (attempt, planning) in plans.iter().enumerate() {
                let request = match request(summarizer, model.clone(), *planning) {
                    // The same call as the one refused: it would be refused again.
                    Ok((_, planned)) if made == Some(planned) => continue,
                    Ok((request, planned)) => {
                        made = Some(planned);
                        request
                    }
                    Err(too_small) => {
                        summary = Err(too_small);
                        break;
                    }
                };
                match summarize(&*session, summarizer, request, step).await {
                    Err(error) if error.is_context_overflow() && attempt + 1 < plans.len() => {
                        tracing::debug!(%error, attempt, "the summary call was too long for the summarizing model; planning it again");
                        summary = Err(error.to_string());
                    }
                    outcome => {
                        // An overloaded or unreachable provider, or one that asked to wait
                        // (longer than a retry waits, too).
                        passing = matches!(
                            &outcome,
                            Err(crate::provider::CallError::Failed(error)) if matches!(
                                error.kind,
                                ProviderErrorKind::RateLimited
                                    | ProviderErrorKind::Server
                                    | ProviderErrorKind::Timeout
                                    | ProviderErrorKind::Network
                            )
                        );
                        summary = outcome.map_err(|error| error.to_string());
                        break;
                    }
                }
            }
            (summary, passing)
        }
        Err(error) => (Err(error), false),
    };
    // Compaction is best-effort (it runs on its own, at a threshold or after an overflow): a
    // summary that could not be made is reported (a failed `compaction` event and a warning)
    // and the session goes on uncompacted; an overflow it was to recover from is then the
    // call's failure. Failing the session instead would fail every later one too (the history
    // only grows).
    let (summary, usage) = match summary {
        Ok(response) if !response.text.trim().is_empty() && response.stop_reason != StopReason::Length => {
            (response.text, response.usage)
        }
        Ok(response) => {
            // A summary the output limit cut off would replace the history for good with
            // part of what it should say.
            let why = if response.stop_reason == StopReason::Length {
                "the summary was cut off at its output limit"
            } else {
                "the summary was empty"
            };
            let failure = session.failure(summary_failed(why));
            gave_up(session, started, failure, Some(response.usage), false);
            return Ok(false);
        }
        // An abort (or the deadline's) that ended the summary call ends the session as
        // aborted (or timed out).
        Err(_) if session.signal().is_aborted() => {
            let failure = session.failure(Failed::Aborted);
            return Err(compaction_failed(&*session, started, failure, None));
        }
        Err(error) => {
            let failure = session.failure(summary_failed(&error));
            gave_up(session, started, failure, None, passing);
            return Ok(false);
        }
    };
    let messages_before = session.conversation().messages.len();
    let compaction = RecordBody::Compaction {
        summary,
        first_kept_message_id: first_kept,
        tokens_before,
        reason: reason.as_str().to_owned(),
        usage: Some(usage),
    };
    if let Err(failure) = session.record_compaction(compaction).await {
        // The summary is lost with the attempt: the compaction ends failed.
        return Err(compaction_failed(&*session, started, failure, Some(usage)));
    }
    // The latest call's count was of the history before the compaction.
    session.budget().last_call_tokens = 0;
    session.budget().passing_failures = 0;
    let messages_after = session.conversation().messages.len();
    session.publish(|| Event::Compaction {
        messages_before: messages_before as u64,
        messages_after: messages_after as u64,
        duration_ms: started.elapsed().as_millis() as u64,
        is_error: false,
        error: None,
        usage: Some(usage),
    });
    Ok(true)
}

/// The summarization call, reported as a `compaction`-purpose turn: `turn_request` before
/// it, `turn` after it (no `turn_start`: that one is the agent's own turns').
async fn summarize<S: Compacting>(
    session: &S,
    provider: &dyn ModelProvider,
    request: ModelRequest,
    step: u32,
) -> Result<ModelResponse, crate::provider::CallError> {
    let turn_id = LazyId::new("turn");
    session.turn(Some(&turn_id));
    let thinking = request.thinking_level;
    session.publish(|| Event::TurnRequest {
        turn_id: turn_id.get(),
        purpose: TurnPurpose::Compaction,
        request: turn_request(provider, &request.model, thinking),
    });
    let started = Instant::now();
    let summary = crate::provider::complete(&session.runtime().options, provider, &request, session.signal()).await;
    session.publish(|| {
        let aborted = session.signal().is_aborted();
        let (finish_reason, response) = match &summary {
            Ok(response) => (
                response.stop_reason.to_string(),
                TurnResponse {
                    text: response.text.clone(),
                    usage: Some(response.usage),
                    ..TurnResponse::default()
                },
            ),
            Err(error) => (
                if aborted { "aborted" } else { "error" }.to_owned(),
                TurnResponse {
                    error: Some(SettlementError::new(
                        if aborted { "aborted" } else { "model_call_failed" },
                        error.to_string(),
                    )),
                    ..TurnResponse::default()
                },
            ),
        };
        Event::Turn {
            turn_id: turn_id.get(),
            purpose: TurnPurpose::Compaction,
            step,
            duration_ms: started.elapsed().as_millis() as u64,
            request: turn_request(provider, &request.model, thinking),
            is_error: summary.is_err(),
            response: TurnResponse {
                finish_reason,
                ..response
            },
        }
    });
    session.turn(None);
    summary
}

/// Ends a failed compaction with its terminal `compaction` event (`usage` when its summary
/// call answered); returns `failure`.
fn compaction_failed<S: Compacting>(
    session: &S,
    started: Instant,
    failure: S::Failure,
    usage: Option<Usage>,
) -> S::Failure {
    nothing_compacted(session, started, Some(S::describe(&failure)), usage);
    failure
}

/// The terminal `compaction` event of a compaction that changed nothing: failed with `error`,
/// or given up without a call.
fn nothing_compacted<S: Compacting>(
    session: &S,
    started: Instant,
    error: Option<SettlementError>,
    usage: Option<Usage>,
) {
    let messages = session.conversation().messages.len() as u64;
    session.publish(|| Event::Compaction {
        messages_before: messages,
        messages_after: messages,
        duration_ms: started.elapsed().as_millis() as u64,
        is_error: error.is_some(),
        error,
        usage,
    });
}

/// Reports a compaction given up (its failed `compaction` event, and a warning), and tries no
/// other threshold compaction in the session (each would cost a summary call, and its
/// retries, at every step); after a failure that `passes` (the provider overloaded or
/// unreachable past its retries), none for a pause of steps instead, twice as long as the one
/// before when the summaries fail so in a row.
fn gave_up<S: Compacting>(session: &mut S, started: Instant, failure: S::Failure, usage: Option<Usage>, passes: bool) {
    let failure = compaction_failed(&*session, started, failure, usage);
    let error = S::describe(&failure);
    tracing::warn!(error = %error.message, "compaction failed; the session goes on uncompacted");
    let budget = session.budget();
    if passes {
        budget.paused = PAUSE_STEPS
            .saturating_mul(1 << budget.passing_failures.min(4))
            .min(MAX_PAUSE_STEPS);
        budget.passing_failures = budget.passing_failures.saturating_add(1);
    } else {
        budget.gave_up = true;
    }
}

/// A summary call that failed or answered nothing usable.
fn summary_failed(error: &str) -> Failed {
    Failed::Summary(format!("[flue] Compaction failed: {error}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An earlier summary too long for the summarizing model keeps its start in half the room,
    /// and the newest messages still fit beside it.
    #[test]
    fn a_long_earlier_summary_leaves_room_for_the_newest_messages() {
        let room = Some(1_000);
        let fact = transcript(&[ModelMessage::user("new fact")]);
        let input = summary_input(Some(&"x".repeat(5_000)), &fact, room);
        assert!(input.len() <= 1_000, "{} characters", input.len());
        assert!(
            input.contains("[The rest of the earlier summary is left out: it does not fit.]"),
            "{input}"
        );
        assert!(input.contains("User: new fact"), "{input}");
        // A short conversation leaves the earlier summary the rest of the room.
        let input = summary_input(Some(&"x".repeat(1_100)), &fact, room);
        assert!(input.len() <= 1_000 && input.len() > 900, "{} characters", input.len());
        assert!(input.contains("User: new fact"), "{input}");
        // Not cut: as it is.
        let input = summary_input(Some("short"), &fact, None);
        assert_eq!(
            input,
            "Earlier summary:\nshort\n\nThe conversation since:\n\nUser: new fact\n\n"
        );
        // Multi-byte text is cut at a character boundary.
        let long = transcript(&[ModelMessage::user("ü".repeat(3_000))]);
        let input = summary_input(Some(&"é".repeat(3_000)), &long, room);
        assert!(input.len() <= 1_000, "{} characters", input.len());
    }

    /// The answer takes at most half the window; an input too long beside it shortens the
    /// answer first (down to a quarter), then is cut so that it and the answer fit.
    #[test]
    fn a_summary_call_fits_the_summarizing_models_window() {
        let instructions = (SUMMARY_INSTRUCTIONS.len() as u64).div_ceil(4) + 16;
        assert_eq!(
            plan(None, 16_000, 1_000_000, 4),
            Ok((16_000, None)),
            "no window known: unchanged"
        );
        assert_eq!(
            plan(Some(200_000), 16_000, 40_000, 4),
            Ok((16_000, None)),
            "room for both"
        );
        assert_eq!(
            plan(Some(10_000), 16_000, 4_000, 4),
            Ok((5_000, None)),
            "half the window at most"
        );
        // Just under what the window reads beside a quarter of the answer: a shorter answer,
        // no cut.
        let input = 4 * (10_000 - instructions as usize - 2_000);
        assert_eq!(plan(Some(10_000), 4_000, input, 4), Ok((2_000, None)));
        // Past that: cut, and both fit.
        let (answer, room) = plan(Some(10_000), 4_000, 4 * 10_000, 4).expect("a plan");
        assert_eq!(answer, 1_000);
        let room = room.expect("a cut") as u64;
        assert!(room / 4 + instructions + u64::from(answer) <= 10_000);
        // A window too small to summarize in: no call.
        assert!(plan(Some(300), 4_000, 40_000, 4).is_err());
    }

    #[test]
    fn a_summary_takes_four_fifths_of_the_reserve_within_the_models_cap_and_4000_knowing_nothing() {
        let default = CompactionConfig::default();
        let reserved = |tokens| CompactionConfig {
            reserve_tokens: Some(tokens),
            ..CompactionConfig::default()
        };
        // Neither a reserve nor a window: an endpoint's limit may be small.
        assert_eq!(summary_tokens(&default, None, None), 4_000);
        assert_eq!(summary_tokens(&default, None, Some(2_048)), 2_048);
        // A 200,000-token window reserves 20,000: four fifths, at most 16,000.
        assert_eq!(summary_tokens(&default, Some(200_000), None), 16_000);
        assert_eq!(summary_tokens(&default, Some(200_000), Some(8_192)), 8_192);
        assert_eq!(summary_tokens(&default, Some(32_000), None), 6_400);
        assert_eq!(summary_tokens(&reserved(10_000), None, None), 8_000);
        assert_eq!(summary_tokens(&reserved(100), Some(600), None), 1_000);
    }

    #[test]
    fn a_summary_transcript_shows_the_start_of_a_long_tool_result_and_how_much_was_left_out() {
        let tool = |content: String| ModelMessage::Tool {
            tool_call_id: "call_1".into(),
            name: "read".into(),
            content,
            is_error: false,
        };
        let long = format!("{}{}", "é".repeat(TRANSCRIPT_TOOL_RESULT_CHARS), "x".repeat(500));
        let shown = transcript(&[tool(long)]);
        assert!(shown.starts_with(&format!("Tool read: {}", "é".repeat(TRANSCRIPT_TOOL_RESULT_CHARS))));
        assert!(shown.contains(" [… 500 more characters]"), "{shown}");
        assert!(!shown.contains('x'));
        // A short one is shown whole.
        assert_eq!(transcript(&[tool("42".into())]), "Tool read: 42\n\n");
    }
}
