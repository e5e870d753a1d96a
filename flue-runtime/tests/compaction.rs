//! Compaction: threshold compaction before a call that would not fit, overflow recovery, and
//! the summary the model reads in place of the older history (issue 8, item 5).
#![allow(clippy::unwrap_used)] // tests assert by unwrapping

use flue_runtime::events::{Event, TurnPurpose};
use flue_runtime::prelude::*;
use flue_runtime::provider::{ModelMessage, ModelRequest, ProviderError, ProviderErrorKind};
use flue_runtime::record::RecordBody;
use flue_runtime::store::{InstanceKey, Store};
use flue_runtime::testing::{ScriptedModel, ScriptedReply};

mod harness;
use flue_runtime::RuntimeOptions;
use flue_runtime::store::MemoryStore;
use harness::{long, runtime_with, use_tight_model, use_tight_model_summarized_by, user_texts};

#[agent]
fn tight() -> &'static str {
    use_tight_model("scripted/x", 150);
    "Be brief."
}

#[tokio::test]
async fn a_call_that_would_not_fit_is_preceded_by_a_summary_of_the_older_history() {
    // A 600-token window with a 100-token reserve: the fourth message pushes past 500.
    let model = ScriptedModel::new([
        ScriptedReply::text(long("one")),
        ScriptedReply::text(long("two")),
        // The summarization call, then the answer.
        ScriptedReply::text("The user said one and two; the agent echoed them."),
        ScriptedReply::text("three it is"),
    ])
    .with_context_window(600);
    let runtime = runtime_with(&model, [tight.into()]);
    let mut events = runtime.observe();
    let handle = runtime.init(&tight, "t");
    handle.send(long("first")).await.unwrap();
    handle.send(long("second")).await.unwrap();
    let reply = handle.send(long("third")).await.unwrap();
    assert_eq!(reply.text, "three it is");
    let requests = model.requests();
    assert_eq!(requests.len(), 4);
    let summarization = &requests[2];
    assert!(summarization.tools.is_empty());
    let ModelMessage::User { content, .. } = &summarization.messages[0] else {
        panic!("a transcript")
    };
    assert!(content.starts_with("User: first"), "{content}");
    // The answering call reads the summary first, then only the recent history.
    let answered = &requests[3];
    let ModelMessage::User { content, .. } = &answered.messages[0] else {
        panic!("the summary")
    };
    assert_eq!(
        content,
        "<conversation-summary type=\"compaction\">\nThe user said one and two; the agent echoed them.\n</conversation-summary>"
    );
    assert_eq!(answered.messages.last(), Some(&ModelMessage::user(long("third"))));
    assert!(answered.messages.len() < 6, "{} messages", answered.messages.len());
    let stored: Vec<RecordBody> = runtime
        .store()
        .read(&InstanceKey::new("tight", "t"), None)
        .await
        .unwrap()
        .iter()
        .flat_map(|batch| batch.records.iter().map(|record| record.body.clone()))
        .collect();
    assert!(
        stored
            .iter()
            .any(|body| matches!(body, RecordBody::Compaction { reason, .. } if reason == "threshold"))
    );
    let mut seen = Vec::new();
    while let Ok(observation) = events.try_recv() {
        match observation.event {
            Event::CompactionStart { reason, .. } => seen.push(format!("start {reason}")),
            Event::Compaction { is_error, .. } => seen.push(format!("end {is_error}")),
            _ => {}
        }
    }
    assert_eq!(seen, ["start threshold", "end false"]);
}

#[agent]
fn defaulted() -> &'static str {
    use_model("scripted/x");
    "Be brief."
}

/// With the default settings (8,000 tokens kept) on a model whose window is far smaller, a
/// compaction keeps at most half of the room for history (window less reserve), so the older
/// history is summarized rather than kept whole.
#[tokio::test]
async fn a_window_smaller_than_keep_recent_tokens_is_still_compacted() {
    // A 1,200-token window: a 300-token reserve, 900 for history, 450 kept at most.
    let model = ScriptedModel::new((0..8).map(|_| ScriptedReply::text(long("answer")))).with_context_window(1_200);
    let runtime = runtime_with(&model, [defaulted.into()]);
    let handle = runtime.init(&defaulted, "d");
    for turn in 0..6 {
        handle.send(long(&format!("q{turn}"))).await.unwrap();
    }
    let requests = model.requests();
    let summarized = requests
        .iter()
        .filter(|request| matches!(&request.messages[..], [ModelMessage::User { content, .. }] if content.starts_with("User: q0")))
        .count();
    assert_eq!(summarized, 1, "one summary of the older history");
    let last = requests.last().unwrap();
    let estimate: usize = last
        .messages
        .iter()
        .map(|message| match message {
            ModelMessage::User { content, .. } => content.len(),
            ModelMessage::Assistant { text, .. } => text.len(),
            ModelMessage::Tool { content, .. } => content.len(),
        })
        .sum::<usize>()
        / 4;
    assert!(estimate < 900, "the last call reads {estimate} estimated tokens");
}

/// Redacts every "SECRET" the model would read.
#[hook(prefilter_llm_history)]
async fn redacts(
    _state: &flue_runtime::lifecycle::ThreadState,
    mut messages: Vec<flue_runtime::lifecycle::LlmMessage>,
) -> Vec<flue_runtime::lifecycle::LlmMessage> {
    for message in &mut messages {
        if let Some(text) = message.content.as_str() {
            message.content = serde_json::Value::String(text.replace("SECRET", "[redacted]"));
        }
    }
    messages
}

#[agent(hooks = [redacts])]
fn redacting() -> &'static str {
    use_tight_model("scripted/x", 150);
    "Be brief."
}

/// Three exchanges of `agent` (a tight model in a 600-token window) whose first message
/// starts with `tag`: the third is preceded by a summary. Every request the model got, and
/// the summary call's transcript.
async fn three_exchanges<A: Agent + Copy + Into<AgentRef>>(agent: A, tag: &str) -> (Vec<ModelRequest>, String) {
    let model = ScriptedModel::new([
        ScriptedReply::text(long("one")),
        ScriptedReply::text(long("two")),
        ScriptedReply::text("The user said things."),
        ScriptedReply::text("three it is"),
    ])
    .with_context_window(600);
    let runtime = runtime_with(&model, [agent.into()]);
    let handle = runtime.init(&agent, "three");
    handle.send(format!("{tag}{}", long("first"))).await.unwrap();
    handle.send(long("second")).await.unwrap();
    handle.send(long("third")).await.unwrap();
    let requests = model.requests();
    let ModelMessage::User { content, .. } = &requests[2].messages[0] else {
        panic!("a transcript")
    };
    let transcript = content.clone();
    (requests, transcript)
}

/// The summary reads the older history as the message hooks let the model read it: a
/// redaction of `prefilter_llm_history` holds for the summary call too (and so for the
/// summary, which the model reads from then on).
#[tokio::test]
async fn the_summary_reads_the_history_as_the_message_hooks_show_it() {
    let (requests, content) = three_exchanges(redacting, "SECRET ").await;
    assert!(content.starts_with("User: [redacted] first"), "{content}");
    for request in &requests {
        for message in request.messages.iter() {
            let text = match message {
                ModelMessage::User { content, .. } => content,
                ModelMessage::Assistant { text, .. } => text,
                ModelMessage::Tool { content, .. } => content,
            };
            assert!(!text.contains("SECRET"), "the model read {text:.60}");
        }
    }
}

/// Drops every row that says "PRIVATE" from what the model reads, and adds a context row.
#[hook(filter_messages)]
async fn withholds(
    _state: &flue_runtime::lifecycle::ThreadState,
    rows: Vec<flue_runtime::lifecycle::Message>,
) -> Vec<flue_runtime::lifecycle::Message> {
    let mut kept: Vec<flue_runtime::lifecycle::Message> = rows
        .into_iter()
        .filter(|row| !row.content.as_deref().unwrap_or_default().contains("PRIVATE"))
        .collect();
    if let Some(first) = kept.first() {
        let mut context = first.clone();
        context.id = "context_row".into();
        context.content = Some("CONTEXT for this request".into());
        kept.insert(0, context);
    }
    kept
}

#[agent(hooks = [withholds])]
fn withholding() -> &'static str {
    use_tight_model("scripted/x", 150);
    "Be brief."
}

/// The summary reads the rows `filter_messages` leaves of the older history, and not the
/// context rows it adds (context for a request, not history to keep for good).
#[tokio::test]
async fn the_summary_reads_the_rows_filter_messages_leaves_and_not_those_it_adds() {
    let (_, content) = three_exchanges(withholding, "PRIVATE ").await;
    assert!(content.starts_with("Agent: one"), "{content}");
    assert!(!content.contains("PRIVATE"), "{content}");
    assert!(!content.contains("CONTEXT"), "{content}");
}

/// Keeps the newest two rows of what the model reads (the reference's `messages.slice(-20)`,
/// smaller).
#[hook(filter_messages)]
async fn newest_two(
    _state: &flue_runtime::lifecycle::ThreadState,
    rows: Vec<flue_runtime::lifecycle::Message>,
) -> Vec<flue_runtime::lifecycle::Message> {
    let from = rows.len().saturating_sub(2);
    rows[from..].to_vec()
}

#[agent(hooks = [newest_two])]
fn trimming() -> &'static str {
    use_tight_model("scripted/x", 150);
    "Be brief."
}

/// A `filter_messages` hook that keeps only the newest rows leaves nothing of the older
/// history to summarize: no summary call is made (it would carry nothing: Anthropic refuses
/// such a request; another model would summarize nothing, and that summary would stand for
/// the history for good), nothing is compacted, and the exchange goes on. It is no failure:
/// the `compaction` event says nothing changed.
#[tokio::test]
async fn a_compaction_with_nothing_left_to_summarize_makes_no_summary_call() {
    let model = ScriptedModel::new([
        ScriptedReply::text(long("one")),
        ScriptedReply::text(long("two")),
        ScriptedReply::text("three it is"),
    ])
    .with_context_window(600);
    let runtime = runtime_with(&model, [trimming.into()]);
    let mut events = runtime.observe();
    let handle = runtime.init(&trimming, "trim");
    handle.send(long("first")).await.unwrap();
    handle.send(long("second")).await.unwrap();
    let third = handle.send(long("third")).await.unwrap();
    assert_eq!(third.text, "three it is");
    let requests = model.requests();
    assert_eq!(requests.len(), 3, "no summary call among them");
    for request in &requests {
        assert!(
            request
                .system
                .as_deref()
                .is_none_or(|system| !system.contains("summar")),
            "a summary call was made: {:?}",
            request.system
        );
    }
    let batches = runtime
        .store()
        .read(&InstanceKey::new("trimming", "trim"), None)
        .await
        .unwrap();
    assert!(
        !batches
            .iter()
            .flat_map(|batch| batch.records.iter())
            .any(|record| matches!(record.body, RecordBody::Compaction { .. })),
        "no compaction was stored"
    );
    let mut reported = Vec::new();
    while let Ok(observation) = events.try_recv() {
        if let Event::Compaction {
            is_error,
            error,
            messages_before,
            messages_after,
            ..
        } = observation.event
        {
            reported.push((is_error, error.is_some(), messages_before == messages_after));
        }
    }
    assert_eq!(
        reported,
        [(false, false, true)],
        "one compaction, no failure, nothing changed"
    );
}

/// Hides what the agent said (by role, as a hook on the provider format may).
#[hook(prefilter_llm_history)]
async fn hides_the_agent(
    _state: &flue_runtime::lifecycle::ThreadState,
    mut messages: Vec<flue_runtime::lifecycle::LlmMessage>,
) -> Vec<flue_runtime::lifecycle::LlmMessage> {
    for message in &mut messages {
        if message.role == "assistant" {
            message.content = serde_json::Value::String("[hidden]".into());
        }
    }
    messages
}

#[agent(hooks = [hides_the_agent])]
fn hiding() -> &'static str {
    use_tight_model("scripted/x", 150);
    "Be brief."
}

/// `prefilter_llm_history` sees the older history in the provider format, each message in
/// its role, so a hook that works by role holds for the summary too.
#[tokio::test]
async fn a_prefilter_working_by_role_holds_for_the_summary() {
    let (_, content) = three_exchanges(hiding, "").await;
    assert!(content.contains("Agent: [hidden]"), "{content}");
    assert!(!content.contains("one one"), "{content}");
}

#[agent]
fn small_summarizer() -> &'static str {
    use_tight_model_summarized_by("scripted/x", 150, Some("small/x"));
    "Be brief."
}

/// The main model of the `small_summarizer` tests: two long answers, then a short one, in a
/// window that makes the third exchange compact.
fn three_answers() -> ScriptedModel {
    ScriptedModel::new([
        ScriptedReply::text(long("one")),
        ScriptedReply::text(long("two")),
        ScriptedReply::text("three it is"),
    ])
    .with_context_window(600)
}

/// A summarizing model (`small`) that refuses its first call as too long, then answers `text`.
fn refusing_then(text: &str) -> ScriptedModel {
    ScriptedModel::new([
        ScriptedReply::Error(ProviderError::new(
            ProviderErrorKind::ContextOverflow,
            "prompt is too long",
        )),
        ScriptedReply::text(text),
    ])
    .with_id("small")
}

/// Three exchanges of `small_summarizer` with `model`, compacted by `small` before the third.
async fn three_exchanges_summarized_by(model: &ScriptedModel, small: &ScriptedModel) {
    let mut providers = flue_runtime::provider::ProviderRegistry::new();
    providers.register(model.clone());
    providers.register(small.clone());
    let runtime = flue_runtime::Runtime::builder()
        .store(flue_runtime::store::MemoryStore::new())
        .providers(providers)
        .agent(small_summarizer)
        .build()
        .unwrap();
    let handle = runtime.init(&small_summarizer, "s");
    handle.send(long("first")).await.unwrap();
    handle.send(long("second")).await.unwrap();
    assert_eq!(handle.send(long("third")).await.unwrap().text, "three it is");
}

/// A summarizing model whose window cannot hold the whole transcript reads its newest part,
/// told that the start is left out, rather than overflowing (and leaving the session
/// uncompacted).
#[tokio::test]
async fn a_transcript_longer_than_the_summarizers_window_is_cut_to_its_newest_part() {
    let model = three_answers();
    // A 500-token window: the instructions, a short answer and about 1,100 characters of
    // transcript.
    let small = ScriptedModel::new([ScriptedReply::text("The user said two.")])
        .with_id("small")
        .with_context_window(500);
    three_exchanges_summarized_by(&model, &small).await;
    let summary = &small.requests()[0];
    let ModelMessage::User { content, .. } = &summary.messages[0] else {
        panic!("a transcript")
    };
    assert!(
        content.starts_with("[The conversation's start is left out: it does not fit the summarizing model's window.]"),
        "{content}"
    );
    assert!(content.trim_end().ends_with("second"), "the newest part: {content}");
    assert!(!content.contains("first"), "the oldest part is left out: {content}");
    // What it reads, and the answer it may give, fit its window.
    let estimate = (content.len() + summary.system.as_ref().unwrap().len()) / 4;
    let answer = summary.max_output_tokens.unwrap() as usize;
    assert!(
        estimate + answer <= 500,
        "{estimate} estimated tokens and {answer} for the answer"
    );
}

/// A summary call the summarizing model refuses as too long (its text takes more tokens than
/// four characters each, as CJK or base64 does) is planned again on a more careful estimate,
/// with less of the transcript, and the compaction goes through.
#[tokio::test]
async fn a_summary_call_refused_as_too_long_is_made_again_with_less_of_the_transcript() {
    let model = three_answers();
    let small = refusing_then("The user said two.")
        // The transcript fits at four characters a token, and is cut at two.
        .with_context_window(1_000);
    three_exchanges_summarized_by(&model, &small).await;
    let requests = small.requests();
    assert_eq!(requests.len(), 2, "refused, then made again");
    let transcript = |request: &flue_runtime::provider::ModelRequest| match &request.messages[0] {
        ModelMessage::User { content, .. } => content.len(),
        other => panic!("a transcript: {other:?}"),
    };
    assert!(
        transcript(&requests[1]) < transcript(&requests[0]),
        "{} then {} characters",
        transcript(&requests[0]),
        transcript(&requests[1])
    );
    let summarized = model
        .requests()
        .last()
        .map(|request| format!("{:?}", request.messages))
        .unwrap();
    assert!(summarized.contains("The user said two."), "{summarized}");
}

/// A summarizing model whose window nobody knows (a model of a compatible server) that
/// refuses the whole transcript as too long is asked again with its newest half: a message
/// larger than its window would otherwise fail every summary, and so every later call of the
/// conversation.
#[tokio::test]
async fn a_summarizer_of_unknown_window_refusing_the_transcript_gets_its_newest_half() {
    let longer = |word: &str| long(word).repeat(4);
    let model = ScriptedModel::new([
        ScriptedReply::text(longer("one")),
        ScriptedReply::text(longer("two")),
        ScriptedReply::text("three it is"),
    ])
    .with_context_window(1_800);
    // No window: the first call carries the transcript whole.
    let small = refusing_then("The user said two.");
    let mut providers = flue_runtime::provider::ProviderRegistry::new();
    providers.register(model.clone());
    providers.register(small.clone());
    let runtime = flue_runtime::Runtime::builder()
        .store(flue_runtime::store::MemoryStore::new())
        .providers(providers)
        .agent(small_summarizer)
        .build()
        .unwrap();
    let handle = runtime.init(&small_summarizer, "s");
    handle.send(longer("first")).await.unwrap();
    handle.send(longer("second")).await.unwrap();
    assert_eq!(handle.send(longer("third")).await.unwrap().text, "three it is");
    let requests = small.requests();
    assert_eq!(requests.len(), 2, "refused, then made again");
    let content = |request: &flue_runtime::provider::ModelRequest| match &request.messages[0] {
        ModelMessage::User { content, .. } => content.clone(),
        other => panic!("a transcript: {other:?}"),
    };
    let (whole, half) = (content(&requests[0]), content(&requests[1]));
    assert!(whole.contains("first"), "sent whole first: {whole}");
    assert!(
        half.starts_with("[The conversation's start is left out: it does not fit the summarizing model's window.]"),
        "{half}"
    );
    assert!(
        half.len() <= whole.len() / 2,
        "{} then {} characters",
        whole.len(),
        half.len()
    );
    assert!(half.trim_end().ends_with("two"), "the newest part: {half}");
    assert!(!half.contains("first"), "{half}");
    assert!(requests[1].max_output_tokens < requests[0].max_output_tokens);
    let summarized = format!("{:?}", model.requests().last().unwrap().messages);
    assert!(summarized.contains("The user said two."), "{summarized}");
}

/// A summary call refused as too long whose input a more careful estimate would not change
/// (it fits the window by any of them) is not made again, the same call, to be refused again:
/// the compaction gives up, and the session goes on.
#[tokio::test]
async fn a_refused_summary_call_no_estimate_would_change_is_not_made_again() {
    let model = three_answers();
    let small = refusing_then("never asked").with_context_window(1_000_000);
    three_exchanges_summarized_by(&model, &small).await;
    assert_eq!(small.requests().len(), 1, "the same call is not made again");
}

#[agent]
fn unbounded() -> &'static str {
    use_model_with(
        "scripted/x",
        ModelOptions {
            compaction: Compaction::Disabled,
            ..ModelOptions::default()
        },
    );
    "Be brief."
}

#[tokio::test]
async fn an_overflowing_call_compacts_and_retries_even_with_threshold_compaction_off() {
    let model = ScriptedModel::new([
        ScriptedReply::text("first answer"),
        ScriptedReply::Error(ProviderError::new(
            ProviderErrorKind::ContextOverflow,
            "prompt is too long",
        )),
        ScriptedReply::text("Summary: a first exchange."),
        ScriptedReply::text("second answer"),
    ])
    // Room for the summary call's instructions and answer (a smaller window could not
    // summarize at all).
    .with_context_window(1_000);
    let runtime = runtime_with(&model, [unbounded.into()]);
    let handle = runtime.init(&unbounded, "o");
    handle.send(long("hello")).await.unwrap();
    let reply = handle.send("and again").await.unwrap();
    assert_eq!(reply.text, "second answer");
    let requests = model.requests();
    assert_eq!(requests.len(), 4, "the overflowing call, the summary, the retry");
    let ModelMessage::User { content, .. } = &requests[3].messages[0] else {
        panic!("the summary")
    };
    assert!(content.contains("Summary: a first exchange."), "{content}");
}

#[tokio::test]
async fn an_overflow_with_nothing_older_to_summarize_fails_as_context_overflow() {
    let model = ScriptedModel::new([ScriptedReply::Error(ProviderError::new(
        ProviderErrorKind::ContextOverflow,
        "prompt is too long",
    ))]);
    let runtime = runtime_with(&model, [unbounded.into()]);
    let error = runtime.init(&unbounded, "n").send("hi").await.unwrap_err();
    let flue_runtime::RuntimeError::Run { error_type, .. } = error else {
        panic!("a run error")
    };
    assert_eq!(error_type, "context_overflow");
}

/// Reference §7.2/§7.3: every `turn_start` is closed by its `turn` (a failed call's with
/// finish reason `error`) and every assistant `message_start` by a `message_end`, before the
/// overflow recovery's `compaction_start` and the retried turn. The summarization call is a
/// `compaction`-purpose turn: `turn_request` and `turn`, without `turn_start`.
#[tokio::test]
async fn an_overflowing_turn_is_closed_by_its_turn_event_before_the_compaction() {
    let model = ScriptedModel::new([
        ScriptedReply::text("first answer"),
        ScriptedReply::Error(ProviderError::new(
            ProviderErrorKind::ContextOverflow,
            "prompt is too long",
        )),
        ScriptedReply::text("Summary: a first exchange."),
        ScriptedReply::text("second answer"),
    ])
    // Room for the summary call's instructions and answer (a smaller window could not
    // summarize at all).
    .with_context_window(1_000);
    let runtime = runtime_with(&model, [unbounded.into()]);
    let handle = runtime.init(&unbounded, "oe");
    handle.send(long("hello")).await.unwrap();
    let mut events = runtime.observe();
    handle.send("and again").await.unwrap();
    let mut seen = Vec::new();
    while let Ok(observation) = events.try_recv() {
        // The envelope names the turn each turn event names, the summarization's included.
        if let Event::TurnStart { turn_id, .. } | Event::TurnRequest { turn_id, .. } | Event::Turn { turn_id, .. } =
            &observation.event
        {
            assert_eq!(observation.turn_id.as_ref(), Some(turn_id), "{:?}", observation.event);
        }
        match observation.event {
            Event::TurnStart { step, .. } => seen.push(format!("turn_start {step}")),
            Event::TurnRequest { purpose, .. } => seen.push(format!("turn_request {purpose:?}")),
            Event::Turn {
                step,
                purpose,
                response,
                ..
            } => seen.push(format!("turn {step} {} {purpose:?}", response.finish_reason)),
            Event::MessageStart { message } if message.role() == "assistant" => seen.push("message_start".into()),
            Event::MessageEnd { message } if message.role() == "assistant" => seen.push("message_end".into()),
            Event::CompactionStart { reason, .. } => seen.push(format!("compaction_start {reason}")),
            Event::Compaction { .. } => seen.push("compaction".into()),
            _ => {}
        }
    }
    assert_eq!(
        seen,
        [
            "turn_start 1",
            "turn_request Agent",
            "message_start",
            "turn 1 error Agent",
            "message_end",
            "compaction_start overflow",
            // The summarization call: a turn of its own, without `turn_start` (§7.2).
            "turn_request Compaction",
            "turn 1 stop Compaction",
            "compaction",
            "turn_start 1",
            "turn_request Agent",
            "message_start",
            "turn 1 stop Agent",
            "message_end",
        ]
    );
}

#[agent]
fn keep_nothing() -> &'static str {
    use_model_with(
        "scripted/x",
        ModelOptions {
            compaction: Compaction::Threshold(CompactionConfig {
                reserve_tokens: Some(0),
                keep_recent_tokens: Some(0),
                model: None,
            }),
            ..ModelOptions::default()
        },
    );
    "Be brief."
}

/// Reference §8 item 4: compaction token counts accept 0. `keep_recent_tokens: 0` keeps
/// only the newest message verbatim; it must not make every compaction a no-op.
#[tokio::test]
async fn keep_recent_tokens_zero_still_compacts_the_older_history_on_overflow() {
    let model = ScriptedModel::new([
        ScriptedReply::text("first answer"),
        ScriptedReply::Error(ProviderError::new(
            ProviderErrorKind::ContextOverflow,
            "prompt is too long",
        )),
        ScriptedReply::text("Summary: a first exchange."),
        ScriptedReply::text("second answer"),
    ])
    .with_context_window(1_000_000);
    let runtime = runtime_with(&model, [keep_nothing.into()]);
    let handle = runtime.init(&keep_nothing, "k0");
    handle.send(long("hello")).await.unwrap();
    let reply = handle.send("and again").await.unwrap();
    assert_eq!(reply.text, "second answer");
    let requests = model.requests();
    assert_eq!(requests.len(), 4);
    assert_eq!(requests[3].messages.last(), Some(&ModelMessage::user("and again")));
}

/// Reference §7.2 (Compaction row): the terminal `compaction` event carries `usage?` — the
/// summarization call's usage — and, on failure, `error?` next to `isError`.
#[tokio::test]
async fn the_compaction_event_carries_the_summary_calls_usage() {
    let model = ScriptedModel::new([
        ScriptedReply::text(long("one")),
        ScriptedReply::text(long("two")),
        ScriptedReply::text("The user said one and two; the agent echoed them."),
        ScriptedReply::text("three it is"),
    ])
    .with_context_window(600);
    let runtime = runtime_with(&model, [tight.into()]);
    let handle = runtime.init(&tight, "tu");
    handle.send(long("first")).await.unwrap();
    handle.send(long("second")).await.unwrap();
    let mut events = runtime.observe();
    handle.send(long("third")).await.unwrap();
    let mut ends = Vec::new();
    while let Ok(observation) = events.try_recv() {
        if let Event::Compaction {
            is_error, error, usage, ..
        } = observation.event
        {
            ends.push((is_error, error, usage));
        }
    }
    // The scripted model counts 10 input tokens and a token per 4 bytes of its answer.
    let usage = flue_runtime::usage::Usage {
        input_tokens: 10,
        output_tokens: 12,
        ..Default::default()
    };
    assert_eq!(ends, [(false, None, Some(usage))]);
    // And the compaction record keeps it (reference §3.2: `compaction {…, usage?}`).
    let recorded: Vec<_> = runtime
        .store()
        .read(&InstanceKey::new("tight", "tu"), None)
        .await
        .unwrap()
        .iter()
        .flat_map(|batch| batch.records.iter().map(|record| record.body.clone()))
        .filter_map(|body| match body {
            RecordBody::Compaction { usage, .. } => Some(usage),
            _ => None,
        })
        .collect();
    assert_eq!(recorded, [Some(usage)]);
}

#[tokio::test]
async fn a_failed_compaction_is_reported_with_its_error_and_the_submission_goes_on_uncompacted() {
    let model = ScriptedModel::new([
        ScriptedReply::text(long("one")),
        ScriptedReply::text(long("two")),
        // The summarization call is refused.
        ScriptedReply::Error(ProviderError::new(ProviderErrorKind::BadRequest, "no summaries today")),
        ScriptedReply::text("answered uncompacted"),
    ])
    .with_context_window(600);
    let runtime = runtime_with(&model, [tight.into()]);
    let handle = runtime.init(&tight, "tf");
    handle.send(long("first")).await.unwrap();
    handle.send(long("second")).await.unwrap();
    let mut events = runtime.observe();
    // Compaction is best-effort: the submission goes on uncompacted (failing it would fail
    // every later one too, the history only growing).
    let reply = handle.send(long("third")).await.unwrap();
    assert_eq!(reply.text, "answered uncompacted");
    let mut ends = Vec::new();
    let mut turns = Vec::new();
    while let Ok(observation) = events.try_recv() {
        match observation.event {
            Event::Compaction {
                is_error, error, usage, ..
            } => ends.push((is_error, error, usage)),
            Event::Turn {
                purpose: TurnPurpose::Compaction,
                is_error,
                response,
                ..
            } => turns.push((
                is_error,
                response.finish_reason,
                response.error.map(|error| error.message),
            )),
            _ => {}
        }
    }
    // The summarization call's own turn failed first.
    assert_eq!(turns.len(), 1, "{turns:?}");
    let (is_error, stop_reason, message) = turns.remove(0);
    assert!(is_error);
    assert_eq!(stop_reason, "error");
    assert!(message.is_some_and(|message| message.contains("no summaries today")));
    assert_eq!(ends.len(), 1, "{ends:?}");
    let (is_error, error, usage) = ends.remove(0);
    assert!(is_error);
    assert_eq!(usage, None, "the call did not answer");
    let error = error.expect("the failure");
    assert_eq!(error.error_type, "compaction_failed");
    assert!(error.message.contains("no summaries today"), "{}", error.message);
}

/// A summarizer that never answers.
struct Stuck;

impl flue_runtime::provider::ModelProvider for Stuck {
    fn id(&self) -> &str {
        "stuck"
    }

    fn stream(&self, _request: &flue_runtime::provider::ModelRequest) -> flue_runtime::provider::ModelStream {
        Box::pin(futures_util::stream::pending())
    }
}

#[agent]
fn slow_summaries() -> &'static str {
    use_tight_model_summarized_by("scripted/x", 150, Some("stuck/summarizer"));
    "Be brief."
}

#[tokio::test]
async fn an_abort_during_the_summary_call_settles_the_submission_aborted() {
    let model = ScriptedModel::new([ScriptedReply::text(long("one")), ScriptedReply::text(long("two"))])
        .with_context_window(600);
    let mut providers = flue_runtime::provider::ProviderRegistry::new();
    providers.register(model.clone());
    providers.register(Stuck);
    let runtime = flue_runtime::Runtime::builder()
        .store(flue_runtime::store::MemoryStore::new())
        .providers(providers)
        .agent(slow_summaries)
        .build()
        .unwrap();
    let handle = runtime.init(&slow_summaries, "s");
    handle.send(long("first")).await.unwrap();
    handle.send(long("second")).await.unwrap();
    let mut events = runtime.observe();
    let third = tokio::spawn({
        let handle = handle.clone();
        async move { handle.send(long("third")).await }
    });
    loop {
        if let Event::CompactionStart { .. } = events.recv().await.unwrap().event {
            break;
        }
    }
    assert!(handle.abort().await.unwrap());
    harness::assert_settles_aborted(third).await;
}

/// Answers with a tool call whose usage counts 450 input tokens (tool schemas and the like,
/// which no estimate of the history sees), then summarizes and answers.
struct CountsMore {
    requests: std::sync::Mutex<Vec<flue_runtime::provider::ModelRequest>>,
}

impl flue_runtime::provider::ModelProvider for CountsMore {
    fn id(&self) -> &str {
        "counting"
    }

    fn context_window(&self, _model: &str) -> Option<u64> {
        Some(600)
    }

    fn stream(&self, request: &flue_runtime::provider::ModelRequest) -> flue_runtime::provider::ModelStream {
        use flue_runtime::provider::{ModelResponse, ModelToolCall, StopReason, StreamEvent};
        let mut requests = self.requests.lock().unwrap();
        requests.push(request.clone());
        let event = if requests.len() == 1 {
            Ok(StreamEvent::Completed(ModelResponse {
                text: String::new(),
                reasoning: String::new(),
                tool_calls: vec![ModelToolCall {
                    id: "call_1".into(),
                    name: "fetch_page".into(),
                    arguments: "{}".into(),
                }],
                stop_reason: StopReason::ToolUse,
                usage: flue_runtime::usage::Usage {
                    input_tokens: 450,
                    output_tokens: 10,
                    ..Default::default()
                },
                reasoning_blocks: Vec::new(),
            }))
        } else if request.tools.is_empty() {
            answer("A page was fetched.", StopReason::Stop)
        } else {
            answer("done", StopReason::Stop)
        };
        Box::pin(futures_util::stream::iter([event]))
    }
}

/// Fetches a page (about 100 tokens of it).
#[tool]
async fn fetch_page() -> String {
    long("page")
}

#[agent]
fn fetcher() -> &'static str {
    use_tight_model("counting/x", 10);
    use_tool(fetch_page);
    "Fetch."
}

/// The threshold goes by the latest call's own count (460 here, tool schemas and all) plus an
/// estimate of what came after its answer (a 100-token tool result): 560 passes the 500 the
/// window leaves, though neither the count alone nor an estimate of the history does.
#[tokio::test]
async fn the_threshold_counts_what_came_after_the_latest_calls_count() {
    let provider = std::sync::Arc::new(CountsMore {
        requests: Default::default(),
    });
    let mut providers = flue_runtime::provider::ProviderRegistry::new();
    providers.register_arc(provider.clone());
    let runtime = flue_runtime::Runtime::builder()
        .store(flue_runtime::store::MemoryStore::new())
        .providers(providers)
        .agent(fetcher)
        .build()
        .unwrap();
    let reply = runtime.init(&fetcher, "f").send("fetch it").await.unwrap();
    assert_eq!(reply.text, "done");
    let requests = provider.requests.lock().unwrap();
    assert_eq!(requests.len(), 3, "the call, a summarization, the call after the tool");
    assert!(requests[1].tools.is_empty(), "the second is the summarization");
}

#[agent]
fn tight_fetcher() -> &'static str {
    use_tight_model("scripted/x", 150);
    use_tool(fetch_page);
    "Be brief."
}

/// A summary that could not be made is not tried again at every step of the submission
/// (each try would cost a summary call and its retries): the later steps go on uncompacted.
#[tokio::test]
async fn after_a_failed_compaction_the_submissions_later_steps_try_no_other() {
    let model = ScriptedModel::new([
        ScriptedReply::text(long("one")),
        ScriptedReply::text(long("two")),
        ScriptedReply::Error(ProviderError::new(ProviderErrorKind::BadRequest, "no summaries today")),
        ScriptedReply::tool_call("fetch_page", serde_json::json!({})),
        ScriptedReply::text("done"),
    ])
    .with_context_window(600);
    let runtime = runtime_with(&model, [tight_fetcher.into()]);
    let handle = runtime.init(&tight_fetcher, "tf");
    handle.send(long("first")).await.unwrap();
    handle.send(long("second")).await.unwrap();
    let reply = handle.send(long("third")).await.unwrap();
    assert_eq!(reply.text, "done");
    let summaries = model
        .requests()
        .iter()
        .filter(|request| request.tools.is_empty())
        .count();
    assert_eq!(summaries, 1, "one summary attempt in the submission");
}

/// A summary that failed for a reason that passes (the provider overloaded past its retries)
/// pauses threshold compaction for a few steps, not for the rest of the submission: the step
/// after the pause summarizes. (Before, one overloaded summary call left every later step of
/// a long run uncompacted, with overflow recovery alone to fall back on.)
#[tokio::test]
async fn after_a_summary_failed_for_a_passing_reason_a_later_step_compacts_again() {
    let mut replies = vec![
        ScriptedReply::text(long("one")),
        ScriptedReply::text(long("two")),
        ScriptedReply::Error(ProviderError::new(ProviderErrorKind::Server, "overloaded")),
    ];
    // The first step, then the four the pause skips the threshold for.
    replies.extend((0..5).map(|_| ScriptedReply::tool_call("fetch_page", serde_json::json!({}))));
    replies.extend([
        ScriptedReply::text("The user asked thrice."),
        ScriptedReply::text("done"),
    ]);
    let model = ScriptedModel::new(replies).with_context_window(600);
    let options = RuntimeOptions {
        model_retries: 0,
        model_retry_delay: std::time::Duration::from_millis(1),
        ..RuntimeOptions::default()
    };
    let runtime = harness::runtime_on_with(MemoryStore::new(), &model, [tight_fetcher.into()], options);
    let handle = runtime.init(&tight_fetcher, "tf");
    handle.send(long("first")).await.unwrap();
    handle.send(long("second")).await.unwrap();
    let reply = handle.send(long("third")).await.unwrap();
    assert_eq!(reply.text, "done");
    let requests = model.requests();
    let summaries: Vec<usize> = requests
        .iter()
        .enumerate()
        .filter(|(_, request)| request.tools.is_empty())
        .map(|(at, _)| at)
        .collect();
    assert_eq!(summaries, [2, 8], "the failed summary, then one after four steps");
    assert!(
        user_texts(requests.last().unwrap())
            .iter()
            .all(|text| !text.contains("first")),
        "the last call reads the summary, not the older history"
    );
}

/// A completed answer of `text` (no calls, no usage), as a provider's stream ends it.
fn answer(
    text: &str,
    stop_reason: flue_runtime::provider::StopReason,
) -> Result<flue_runtime::provider::StreamEvent, ProviderError> {
    Ok(flue_runtime::provider::StreamEvent::Completed(
        flue_runtime::provider::ModelResponse {
            text: text.into(),
            reasoning: String::new(),
            tool_calls: Vec::new(),
            stop_reason,
            usage: Default::default(),
            reasoning_blocks: Vec::new(),
        },
    ))
}

/// A model with a 200,000-token window that overflows on its second call, then summarizes
/// (its summaries cut off at their output limit when `cuts_summaries`), then answers; it
/// records every request.
struct Overflowing {
    cuts_summaries: bool,
    requests: std::sync::Mutex<Vec<flue_runtime::provider::ModelRequest>>,
}

impl flue_runtime::provider::ModelProvider for Overflowing {
    fn id(&self) -> &str {
        "overflowing"
    }

    fn context_window(&self, _model: &str) -> Option<u64> {
        Some(200_000)
    }

    fn stream(&self, request: &flue_runtime::provider::ModelRequest) -> flue_runtime::provider::ModelStream {
        use flue_runtime::provider::StopReason;
        let mut requests = self.requests.lock().unwrap();
        requests.push(request.clone());
        let event = match requests.len() {
            1 => answer("first answer", StopReason::Stop),
            2 => Err(ProviderError::new(
                ProviderErrorKind::ContextOverflow,
                "prompt is too long",
            )),
            3 if self.cuts_summaries => answer("The user greeted the agent and", StopReason::Length),
            3 => answer("The user greeted the agent.", StopReason::Stop),
            _ => answer("second answer", StopReason::Stop),
        };
        Box::pin(futures_util::stream::iter([event]))
    }
}

#[agent]
fn overflowing() -> &'static str {
    use_model("overflowing/x");
    "Be brief."
}

#[agent]
fn overflowing_without_thinking() -> &'static str {
    use_model_with(
        "overflowing/x",
        ModelOptions {
            thinking_level: Some(ThinkingLevel::Off),
            ..ModelOptions::default()
        },
    );
    "Be brief."
}

/// Runs two exchanges of `agent` on an [`Overflowing`] model; the second's reply (or its
/// failure), the requests, and the stored records.
async fn overflow_exchanges<A: Agent + Copy + Into<AgentRef>>(
    agent: A,
    cuts_summaries: bool,
) -> (
    Result<String, flue_runtime::RuntimeError>,
    Vec<flue_runtime::provider::ModelRequest>,
    Vec<RecordBody>,
) {
    let model = std::sync::Arc::new(Overflowing {
        cuts_summaries,
        requests: std::sync::Mutex::default(),
    });
    let mut providers = flue_runtime::provider::ProviderRegistry::new();
    providers.register_arc(model.clone());
    let runtime = flue_runtime::Runtime::builder()
        .store(flue_runtime::store::MemoryStore::new())
        .providers(providers)
        .agent(agent)
        .build()
        .unwrap();
    let handle = runtime.init(&agent, "o");
    handle.send(long("hello")).await.unwrap();
    let second = handle.send("and again").await.map(|reply| reply.text);
    let stored = runtime
        .store()
        .read(&InstanceKey::new(&*agent.definition().name, "o"), None)
        .await
        .unwrap()
        .iter()
        .flat_map(|batch| batch.records.iter().map(|record| record.body.clone()))
        .collect();
    let requests = model.requests.lock().unwrap().clone();
    (second, requests, stored)
}

#[tokio::test]
async fn a_summary_may_take_four_fifths_of_the_reserve_up_to_16000_tokens_with_low_reasoning_unless_thinking_is_off() {
    let (second, requests, _) = overflow_exchanges(overflowing, false).await;
    assert_eq!(second.unwrap(), "second answer");
    let summary = &requests[2];
    assert!(summary.tools.is_empty(), "the summary call");
    // A 200,000-token window reserves 20,000 tokens by default.
    assert_eq!(summary.max_output_tokens, Some(16_000));
    assert_eq!(summary.thinking_level, ThinkingLevel::Low);

    let (second, requests, _) = overflow_exchanges(overflowing_without_thinking, false).await;
    assert_eq!(second.unwrap(), "second answer");
    assert_eq!(requests[2].thinking_level, ThinkingLevel::Off);
}

#[tokio::test]
async fn a_summary_cut_off_at_its_output_limit_does_not_replace_the_history() {
    let (second, requests, stored) = overflow_exchanges(overflowing, true).await;
    assert_eq!(requests.len(), 3, "the overflowing call, the summary, and no retry");
    let Err(flue_runtime::RuntimeError::Run { error_type, .. }) = second else {
        panic!("the overflow is the call's failure: {second:?}")
    };
    assert_eq!(error_type, "context_overflow");
    assert!(
        !stored.iter().any(|body| matches!(body, RecordBody::Compaction { .. })),
        "no compaction was recorded"
    );
}

static UPDATED_STATUSES: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());

#[hook(after_update_message)]
async fn note_updated_status(
    _state: &flue_runtime::lifecycle::ThreadState,
    message: &flue_runtime::lifecycle::Message,
) {
    UPDATED_STATUSES.lock().unwrap().push(format!("{:?}", message.status));
}

#[agent(hooks = [note_updated_status])]
fn stuck_on_overflow() -> &'static str {
    use_model_with(
        "scripted/x",
        ModelOptions {
            compaction: Compaction::Threshold(CompactionConfig {
                reserve_tokens: None,
                keep_recent_tokens: None,
                model: Some("stuck/summarizer".into()),
            }),
            ..ModelOptions::default()
        },
    );
    "Be brief."
}

#[tokio::test]
async fn an_abort_during_an_overflows_summary_gives_the_steps_row_its_failed_status() {
    // No context window: only the overflow compacts.
    let model = ScriptedModel::new([
        ScriptedReply::text(long("one")),
        ScriptedReply::Error(ProviderError::new(
            ProviderErrorKind::ContextOverflow,
            "prompt is too long",
        )),
    ]);
    let mut providers = flue_runtime::provider::ProviderRegistry::new();
    providers.register(model.clone());
    providers.register(Stuck);
    let runtime = flue_runtime::Runtime::builder()
        .store(flue_runtime::store::MemoryStore::new())
        .providers(providers)
        .agent(stuck_on_overflow)
        .build()
        .unwrap();
    let handle = runtime.init(&stuck_on_overflow, "s");
    handle.send(long("first")).await.unwrap();
    UPDATED_STATUSES.lock().unwrap().clear();
    let mut events = runtime.observe();
    let second = tokio::spawn({
        let handle = handle.clone();
        async move { handle.send("again").await }
    });
    loop {
        if let Event::CompactionStart { .. } = events.recv().await.unwrap().event {
            break;
        }
    }
    assert!(handle.abort().await.unwrap());
    harness::assert_settles_aborted(second).await;
    assert_eq!(*UPDATED_STATUSES.lock().unwrap(), ["Some(Failed)"]);
}

/// A model that overflows on its second and fifth calls and summarizes after each: `S1`, then
/// `S2`. It records every request.
struct OverflowsTwice(std::sync::Mutex<Vec<flue_runtime::provider::ModelRequest>>);

impl flue_runtime::provider::ModelProvider for OverflowsTwice {
    fn id(&self) -> &str {
        "twice"
    }

    fn stream(&self, request: &flue_runtime::provider::ModelRequest) -> flue_runtime::provider::ModelStream {
        use flue_runtime::provider::StopReason;
        let mut requests = self.0.lock().unwrap();
        requests.push(request.clone());
        let event = match requests.len() {
            2 | 5 => Err(ProviderError::new(
                ProviderErrorKind::ContextOverflow,
                "prompt is too long",
            )),
            3 => answer("S1: the user said hello.", StopReason::Stop),
            6 => answer("S2: the user said hello and again.", StopReason::Stop),
            n => answer(&format!("answer {n}"), StopReason::Stop),
        };
        Box::pin(futures_util::stream::iter([event]))
    }
}

#[agent]
fn twice() -> &'static str {
    use_model("twice/x");
    "Be brief."
}

#[tokio::test]
async fn a_later_compaction_is_given_the_earlier_summary_apart_to_carry_over() {
    let model = std::sync::Arc::new(OverflowsTwice(std::sync::Mutex::default()));
    let mut providers = flue_runtime::provider::ProviderRegistry::new();
    providers.register_arc(model.clone());
    let runtime = flue_runtime::Runtime::builder()
        .store(flue_runtime::store::MemoryStore::new())
        .providers(providers)
        .agent(twice)
        .build()
        .unwrap();
    let handle = runtime.init(&twice, "t");
    handle.send("hello").await.unwrap();
    handle.send("and again").await.unwrap();
    handle.send("once more").await.unwrap();
    let requests = model.0.lock().unwrap().clone();
    assert_eq!(requests.len(), 7);
    let input = |request: &flue_runtime::provider::ModelRequest| match &request.messages[0] {
        ModelMessage::User { content, .. } => content.clone(),
        other => panic!("a transcript: {other:?}"),
    };
    assert!(
        input(&requests[2]).starts_with("User: hello"),
        "{}",
        input(&requests[2])
    );
    let second = input(&requests[5]);
    assert!(
        second.starts_with("Earlier summary:\nS1: the user said hello.\n\nThe conversation since:\n\n"),
        "{second}"
    );
    assert!(!second.contains("<conversation-summary"), "{second}");
    assert!(
        requests[5]
            .system
            .as_deref()
            .is_some_and(|system| system.contains("carry over everything in it that still matters")),
    );
}

/// Fetches a whole site: about 10,000 tokens, more than the 8,000 an overflow recovery keeps.
#[tool]
async fn fetch_site() -> String {
    format!("{} the end", "page ".repeat(8_000))
}

/// The scripted model without threshold compaction, and `fetch_site`.
fn use_site_fetching() -> &'static str {
    use_model_with(
        "scripted/x",
        ModelOptions {
            compaction: Compaction::Disabled,
            ..ModelOptions::default()
        },
    );
    use_tool(fetch_site);
    "Fetch."
}

#[agent]
fn site_fetcher() -> &'static str {
    use_site_fetching()
}

/// A model that calls `fetch_site`, overflows on its result, summarizes, answers, and answers
/// once more.
fn overflowing_at_the_site() -> ScriptedModel {
    ScriptedModel::new([
        ScriptedReply::tool_call("fetch_site", serde_json::json!({})),
        ScriptedReply::Error(ProviderError::new(
            ProviderErrorKind::ContextOverflow,
            "prompt is too long",
        )),
        ScriptedReply::text("Summary: the site was fetched; it is pages of 'page'."),
        ScriptedReply::text("The site is all pages."),
        ScriptedReply::text("Still pages."),
    ])
    .with_context_window(1_000_000)
}

/// A tool step too big to keep is what overflows: kept verbatim, the call made again would
/// overflow too. The recovery summarizes it with what came before it (the summary reads the
/// start of the result), here the whole history, and the call made again reads the summary;
/// the stream read again (another runtime on the store) gives the model the same.
#[tokio::test]
async fn an_overflow_after_a_tool_result_too_big_to_keep_summarizes_that_step_too() {
    let model = overflowing_at_the_site();
    let store = flue_runtime::store::MemoryStore::new();
    let runtime = harness::runtime_on(store.clone(), &model, [site_fetcher.into()]);
    let handle = runtime.init(&site_fetcher, "s");
    assert_eq!(
        handle.send("fetch the site").await.unwrap().text,
        "The site is all pages."
    );
    let requests = model.requests();
    assert_eq!(
        requests.len(),
        4,
        "the call, the overflowing one, the summary, the retry"
    );
    let ModelMessage::User {
        content: transcript, ..
    } = &requests[2].messages[0]
    else {
        panic!("a transcript")
    };
    assert!(transcript.contains("fetch the site"), "{transcript}");
    assert!(transcript.contains("page page"), "the result's start: {transcript}");
    assert_eq!(requests[3].messages.len(), 1, "{:?}", requests[3].messages);
    let ModelMessage::User { content, .. } = &requests[3].messages[0] else {
        panic!("the summary")
    };
    assert!(content.contains("Summary: the site was fetched"), "{content}");
    let compacted = store
        .read(&InstanceKey::new("site_fetcher", "s"), None)
        .await
        .unwrap()
        .iter()
        .flat_map(|batch| batch.records.iter())
        .any(|record| matches!(&record.body, RecordBody::Compaction { first_kept_message_id, .. } if first_kept_message_id.is_empty()));
    assert!(compacted, "a compaction that keeps nothing");
    drop(runtime);
    let again = harness::runtime_on(store, &model, [site_fetcher.into()]);
    assert_eq!(
        again.init(&site_fetcher, "s").send("and now?").await.unwrap().text,
        "Still pages."
    );
    let read_again = &model.requests()[4];
    assert_eq!(read_again.messages.len(), 3, "{:?}", read_again.messages);
    assert!(matches!(&read_again.messages[0], ModelMessage::User { content: summary, .. } if summary == content));
    assert!(
        matches!(&read_again.messages[1], ModelMessage::Assistant { text, .. } if text == "The site is all pages.")
    );
    assert_eq!(read_again.messages[2], ModelMessage::user("and now?"));
}

/// Tags the assistant rows as they are created.
#[hook(before_create_message)]
async fn tag_assistant_rows(
    _state: &flue_runtime::lifecycle::ThreadState,
    mut message: flue_runtime::lifecycle::Message,
) -> flue_runtime::lifecycle::Message {
    if message.role == flue_runtime::lifecycle::MessageRole::Assistant {
        message.metadata.insert("tagged".into(), serde_json::json!(true));
    }
    message
}

/// Blocks any request that reads the conversation's summary.
#[hook(prefilter_llm_history)]
async fn blocks_past_a_summary(
    _state: &flue_runtime::lifecycle::ThreadState,
    messages: Vec<flue_runtime::lifecycle::LlmMessage>,
) -> Result<Vec<flue_runtime::lifecycle::LlmMessage>, flue_runtime::lifecycle::HookError> {
    let summarized = messages.iter().any(|message| {
        message
            .content
            .as_str()
            .is_some_and(|text| text.contains("Summary: a first exchange."))
    });
    if summarized {
        return Err(flue_runtime::lifecycle::HookError::block(
            "no model call past a summary",
        ));
    }
    Ok(messages)
}

#[agent(hooks = [tag_assistant_rows, blocks_past_a_summary])]
fn blocked_after_overflow() -> &'static str {
    use_model_with(
        "scripted/x",
        ModelOptions {
            compaction: Compaction::Disabled,
            ..ModelOptions::default()
        },
    );
    "Be brief."
}

/// A request made again after an overflow's compaction, and blocked by
/// `prefilter_llm_history`, stores its step as a blocked one with what the row's create
/// hooks set. (Regression: the blocked step dropped them, and left the pending row in the
/// thread.)
#[tokio::test]
async fn a_request_blocked_after_an_overflows_compaction_keeps_its_rows_created_fields() {
    let model = ScriptedModel::new([
        ScriptedReply::text("first answer"),
        ScriptedReply::Error(ProviderError::new(
            ProviderErrorKind::ContextOverflow,
            "prompt is too long",
        )),
        ScriptedReply::text("Summary: a first exchange."),
    ])
    .with_context_window(1_000);
    let runtime = runtime_with(&model, [blocked_after_overflow.into()]);
    let handle = runtime.init(&blocked_after_overflow, "b");
    handle.send(long("hello")).await.unwrap();
    handle.send("and again").await.unwrap();
    assert_eq!(
        model.requests().len(),
        3,
        "the first answer, the overflowing call, the summary"
    );
    let stored: Vec<RecordBody> = runtime
        .store()
        .read(&InstanceKey::new("blocked_after_overflow", "b"), None)
        .await
        .unwrap()
        .iter()
        .flat_map(|batch| batch.records.iter().map(|record| record.body.clone()))
        .collect();
    let blocked = stored
        .iter()
        .find_map(|body| match body {
            RecordBody::AssistantMessageCompleted {
                message_id,
                stop_reason: flue_runtime::provider::StopReason::HookBlocked,
                ..
            } => Some(message_id.clone()),
            _ => None,
        })
        .expect("the blocked step is stored");
    let tagged = stored.iter().any(|body| {
        matches!(body, RecordBody::MessageUpdated { message_id, updates }
            if *message_id == blocked && updates.get("metadata") == Some(&serde_json::json!({"tagged": true})))
    });
    assert!(tagged, "{stored:#?}");
}

static STEP_HOOK_RUNS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Injects a reminder at every step, and appends to the system message.
#[hook(after_system_message)]
async fn remind_every_step(
    state: &flue_runtime::lifecycle::ThreadState,
    system: String,
) -> Result<Option<String>, flue_runtime::lifecycle::HookError> {
    let run = STEP_HOOK_RUNS.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
    state
        .inject_message(flue_runtime::lifecycle::InjectMessage::new(
            flue_runtime::lifecycle::MessageRole::User,
            "step reminder",
        ))
        .await
        .map_err(|error| flue_runtime::lifecycle::HookError::new(error.to_string()))?;
    Ok(Some(format!("{system}\n(run {run})")))
}

#[agent(hooks = [remind_every_step])]
fn reminded() -> &'static str {
    use_model_with(
        "scripted/x",
        ModelOptions {
            compaction: Compaction::Disabled,
            ..ModelOptions::default()
        },
    );
    "Be brief."
}

/// `after_system_message` runs once per model step: the call a step makes again after an
/// overflow's compaction is sent the system message the hook made for the step, and what the
/// hook injected is stored once (it ran, and injected, a second time).
#[tokio::test]
async fn an_overflow_recovery_does_not_run_the_step_hook_again() {
    let model = ScriptedModel::new([
        ScriptedReply::text("first answer"),
        ScriptedReply::Error(ProviderError::new(
            ProviderErrorKind::ContextOverflow,
            "prompt is too long",
        )),
        ScriptedReply::text("Summary: a first exchange."),
        ScriptedReply::text("second answer"),
    ])
    .with_context_window(1_000);
    let runtime = runtime_with(&model, [reminded.into()]);
    let handle = runtime.init(&reminded, "r");
    handle.send(long("hello")).await.unwrap();
    assert_eq!(handle.send("and again").await.unwrap().text, "second answer");
    assert_eq!(
        STEP_HOOK_RUNS.load(std::sync::atomic::Ordering::SeqCst),
        2,
        "once per step"
    );
    let requests = model.requests();
    assert_eq!(requests.len(), 4, "the overflowing call, the summary, the retry");
    assert_eq!(requests[1].system, requests[3].system);
    assert!(requests[3].system.as_deref().unwrap().ends_with("(run 2)"));
    let reminders = runtime
        .store()
        .read(&InstanceKey::new("reminded", "r"), None)
        .await
        .unwrap()
        .iter()
        .flat_map(|batch| batch.records.iter())
        .filter(
            |record| matches!(&record.body, RecordBody::MessageInjected { content, .. } if content == "step reminder"),
        )
        .count();
    assert_eq!(reminders, 2, "one reminder per step");
}

static AUDIT_HOOK_RUNS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Notes an audit row the third time it runs: while the overflow's summary is made (the
/// first step's call, the overflowing call, then the summary's).
#[hook(filter_messages)]
async fn audits_the_summary(
    state: &flue_runtime::lifecycle::ThreadState,
    rows: Vec<flue_runtime::lifecycle::Message>,
) -> Vec<flue_runtime::lifecycle::Message> {
    if AUDIT_HOOK_RUNS.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 2 {
        state
            .inject_message(flue_runtime::lifecycle::InjectMessage::new(
                flue_runtime::lifecycle::MessageRole::User,
                "audit: the history was summarized",
            ))
            .await
            .unwrap();
    }
    rows
}

#[agent(hooks = [audits_the_summary])]
fn audited_site_fetcher() -> &'static str {
    use_site_fetching()
}

/// An overflow that summarizes the whole history keeps a row a hook wrote while the summary
/// was made: the summary never read it, so it stays after the summary (it was dropped with
/// the history, unread).
#[tokio::test]
async fn a_row_written_while_the_whole_history_is_summarized_is_kept_after_the_summary() {
    let model = overflowing_at_the_site();
    let store = flue_runtime::store::MemoryStore::new();
    let runtime = harness::runtime_on(store.clone(), &model, [audited_site_fetcher.into()]);
    let handle = runtime.init(&audited_site_fetcher, "s");
    assert_eq!(
        handle.send("fetch the site").await.unwrap().text,
        "The site is all pages."
    );
    let requests = model.requests();
    assert_eq!(
        requests.len(),
        4,
        "the call, the overflowing one, the summary, the retry"
    );
    let ModelMessage::User {
        content: transcript, ..
    } = &requests[2].messages[0]
    else {
        panic!("a transcript")
    };
    assert!(
        !transcript.contains("audit:"),
        "written after the summary read the rows: {transcript}"
    );
    let audit = ModelMessage::user("audit: the history was summarized");
    assert!(
        requests[3].messages.contains(&audit),
        "the retry reads the audit row: {:?}",
        requests[3].messages
    );
    // The stream read again (another runtime on the store) keeps it too.
    drop(runtime);
    let again = harness::runtime_on(store, &model, [audited_site_fetcher.into()]);
    again.init(&audited_site_fetcher, "s").send("and now?").await.unwrap();
    assert!(
        model.requests()[4].messages.contains(&audit),
        "{:?}",
        model.requests()[4].messages
    );
}

static RESTATING_RUNS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// While the third exchange's summary is made (its third run), replaces the rows the
/// compaction keeps (the second answer and the third message: the first kept row is one of
/// them) with a restatement.
#[hook(filter_messages)]
async fn restates_the_newest(
    state: &flue_runtime::lifecycle::ThreadState,
    rows: Vec<flue_runtime::lifecycle::Message>,
) -> Vec<flue_runtime::lifecycle::Message> {
    if RESTATING_RUNS.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 2 {
        for row in &rows {
            let content = row.content.as_deref().unwrap_or_default();
            if content.starts_with("two two") || content.starts_with("third third") {
                assert!(state.delete_message(&row.id).await.unwrap());
            }
        }
        state
            .inject_message(flue_runtime::lifecycle::InjectMessage::new(
                flue_runtime::lifecycle::MessageRole::User,
                "restated: the third message",
            ))
            .await
            .unwrap();
    }
    rows
}

#[agent(hooks = [restates_the_newest])]
fn restating() -> &'static str {
    use_tight_model("scripted/x", 150);
    "Be brief."
}

/// A first kept row a hook deletes while the summary is made gives way to the next row the
/// summary did not read: the compaction still takes effect (a record naming a row that is gone
/// compacted nothing, though its summary was paid for and stored).
#[tokio::test]
async fn a_first_kept_row_deleted_while_the_summary_is_made_gives_way_to_the_next_unread_row() {
    let (requests, _) = three_exchanges(restating, "").await;
    let read = format!("{:?}", requests[3].messages);
    assert!(read.contains("The user said things."), "the summary: {read}");
    assert!(!read.contains("first"), "the summarized rows are gone: {read}");
    assert!(read.contains("restated: the third message"), "{read}");
}

/// A summary is told which older messages carried images, and their ids, as the model read
/// them: the images leave the history with the messages, and the summary can say they were
/// sent (the common path, without message hooks, as with them).
#[tokio::test]
async fn the_summary_reads_which_older_messages_carried_images() {
    use base64::Engine as _;
    // The image's estimate brings the compaction sooner: whichever call makes the summary,
    // the script answers.
    let model = ScriptedModel::new([
        ScriptedReply::text(long("one")),
        ScriptedReply::text("The user sent a chart and long messages."),
        ScriptedReply::text("two"),
        ScriptedReply::text("The user sent a chart and long messages."),
        ScriptedReply::text("three it is"),
        ScriptedReply::text("three it is"),
    ])
    .with_context_window(600);
    let runtime = runtime_with(&model, [tight.into()]);
    let handle = runtime.init(&tight, "images");
    let with_chart = flue_runtime::message::DeliveredMessage::User(flue_runtime::message::UserMessage {
        body: long("first"),
        attachments: vec![flue_runtime::message::Attachment::Image {
            data: base64::engine::general_purpose::STANDARD.encode(b"\x89PNG\r\n\x1a\n chart"),
            mime_type: "image/png".into(),
            filename: Some("chart.png".into()),
        }],
    });
    handle.send(with_chart).await.unwrap();
    handle.send(long("second")).await.unwrap();
    handle.send(long("third")).await.unwrap();
    let requests = model.requests();
    let summary = requests
        .iter()
        .find(|request| {
            matches!(request.messages.first(), Some(ModelMessage::User { content, .. }) if content.starts_with("User: first"))
        })
        .expect("a summary of the history with the image");
    let ModelMessage::User { content, images } = &summary.messages[0] else {
        panic!("a transcript")
    };
    assert!(images.is_empty(), "the summary call is sent no image");
    assert!(content.starts_with("User: first"), "{content}");
    assert!(content.contains("[1 image(s)]"), "{content}");
    assert!(content.contains("mimeType=\"image/png\""), "{content}");
}

/// Orders the rows by their time (a hook merging rows from elsewhere would).
#[hook(filter_messages)]
async fn by_time(
    _state: &flue_runtime::lifecycle::ThreadState,
    mut rows: Vec<flue_runtime::lifecycle::Message>,
) -> Vec<flue_runtime::lifecycle::Message> {
    rows.sort_by_key(|row| row.created_at);
    rows
}

#[agent(hooks = [by_time])]
fn time_ordered() -> &'static str {
    use_tight_model("scripted/x", 150);
    "Be brief."
}

/// The summary row takes the time the history it summarizes began: a hook ordering rows by
/// time keeps it first, where it stands, not after the newest message (which the model would
/// then answer in place of the user's).
#[tokio::test]
async fn the_summary_row_stands_first_in_time_as_in_place() {
    let (requests, _) = three_exchanges(time_ordered, "").await;
    let answered = &requests[3];
    assert!(
        matches!(answered.messages.first(), Some(ModelMessage::User { content, .. }) if content.starts_with("<conversation-summary")),
        "{:?}",
        answered.messages
    );
    assert_eq!(answered.messages.last(), Some(&ModelMessage::user(long("third"))));
}
