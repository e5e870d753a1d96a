//! A conversation read back from its stream is the conversation the runtime kept in memory.
//!
//! Random conversations (user messages, some with an image, steps of parallel tool calls that
//! succeed, fail, are refused for invalid arguments or name no tool, persistent state and data
//! parts written by a tool, `task` children, model calls that fail and are retried, response
//! metadata, final answers) run on the memory store, and again on SQLite (and on Postgres when
//! `FLUE_TEST_POSTGRES_URL` names one, as the README's test command does), each both with the
//! runtime's conversation cache kept and with a fresh runtime for every exchange (which folds
//! the conversation again from the store). The model must be sent the very same requests, the
//! sender get the same replies and an observer see the same events (ids, times and durations
//! aside), every way: what the records keep, a serialization round trip and a fold from the
//! stream lose nothing the model, the sender or an observer sees.
#![allow(clippy::unwrap_used)] // tests assert by unwrapping

mod harness;
mod scratch;

use std::future::Future;

use flue_runtime::AgentReply;
use flue_runtime::events::Observation;
use flue_runtime::message::{Attachment, DeliveredMessage, UserMessage};
use flue_runtime::prelude::*;
use flue_runtime::provider::{ModelMessage, ModelRequest, ProviderError, ProviderErrorKind};
use flue_runtime::store::{MemoryStore, SqliteStore, Store};
use flue_runtime::testing::{ScriptedModel, ScriptedReply};
use proptest::prelude::*;
use proptest::test_runner::TestCaseError;
use serde_json::{Value, json};

/// Add two numbers.
#[tool]
async fn add(a: i64, b: i64) -> String {
    (a + b).to_string()
}

/// Divide two numbers.
#[tool]
async fn divide(dividend: i64, divisor: i64) -> Result<String, String> {
    dividend
        .checked_div(divisor)
        .map(|quotient| quotient.to_string())
        .ok_or_else(|| format!("cannot divide {dividend} by {divisor}"))
}

/// The data part the tally writes. Every call of a step writes it, and the reply keeps the
/// last write: the calls of a batch start in call order, so that is the step's last tally.
#[derive(serde::Serialize, schemars::JsonSchema)]
struct Tally {
    before: u32,
    note: String,
}

/// The `task` child: it answers at once.
fn helper(_: AgentProps<'_>) -> &'static str {
    "You help with one thing."
}

/// An agent whose instruction reads its persistent state, with a tool that writes the state
/// and a data part, a `task` subagent, and response metadata from its start and finish.
#[agent]
fn keeper() -> String {
    use_model("scripted/x");
    use_tool(add);
    use_tool(divide);
    let (count, set_count) = use_persistent_state("count", 0u32);
    let tally = use_data_writer::<Tally>("tally");
    use_tool(Tool::new("tally").description("Count one more.").run(
        move |_ctx, arguments: serde_json::Map<String, Value>| {
            let (set_count, tally) = (set_count.clone(), tally.clone());
            async move {
                let note = arguments.get("note").and_then(Value::as_str).unwrap_or("").to_owned();
                set_count.update(|n| n + 1)?;
                tally.write(&Tally {
                    before: count,
                    note: note.clone(),
                })?;
                Ok::<_, ToolError>(format!("counted after {count}: {note}"))
            }
        },
    ));
    use_subagent(Subagent::new(
        "helper",
        "Helps with one thing; say what in the prompt.",
        FnAgent::new(AgentDefinition::new("helper"), helper),
    ));
    use_response_start(|_| json!({"channel": "fold"}));
    use_response_finish(|ctx| json!({"calls": ctx.response.tool_calls.len()}));
    format!("You keep a tally; it stands at {count}.")
}

/// Texts that make a serializer work: quotes, escapes, markup, non-ASCII, an empty one.
const TEXTS: [&str; 6] = [
    "2 + 3?",
    "say \"hi\"\n\tthen \\stop",
    "<b>bold</b> & <signal>",
    "héllo wörld ✓ 日本",
    "",
    "emoji 🦀 and\u{7f}control",
];

fn text() -> impl Strategy<Value = String> {
    (0..TEXTS.len()).prop_map(|at| TEXTS[at].to_owned())
}

/// One call of a step: to a tool that answers, fails, or writes state; with arguments the
/// tool's schema refuses; to a tool the agent does not have; or to `task`, starting a child
/// (refused when its prompt is empty).
fn call() -> impl Strategy<Value = (String, Value)> {
    prop_oneof![
        (-5i64..5, -5i64..5).prop_map(|(a, b)| ("add".to_owned(), json!({"a": a, "b": b}))),
        (-5i64..5, 0i64..2)
            .prop_map(|(dividend, divisor)| ("divide".to_owned(), json!({"dividend": dividend, "divisor": divisor}))),
        text().prop_map(|note| ("tally".to_owned(), json!({"note": note}))),
        Just(("add".to_owned(), json!({"a": "two"}))),
        Just(("nope".to_owned(), json!({}))),
        text().prop_map(|prompt| ("task".to_owned(), json!({"agent": "helper", "prompt": prompt}))),
    ]
}

/// The prompt of a `task` call that starts a child (one with an empty prompt is refused for
/// its arguments).
fn delegated(call: &(String, Value)) -> Option<&str> {
    let prompt = call.1["prompt"].as_str()?;
    (call.0 == "task" && !prompt.is_empty()).then_some(prompt)
}

/// What the child answers to `prompt`.
fn helped(prompt: &str) -> String {
    format!("helped with {prompt}")
}

/// A step of calls with at most one child started (children of one step run concurrently, so
/// the order they took the model's next replies in would be theirs to race for).
fn step() -> impl Strategy<Value = Vec<(String, Value)>> {
    prop::collection::vec(call(), 1..4).prop_map(|mut calls| {
        let mut children = 0;
        for call in &mut calls {
            if delegated(call).is_some() {
                children += 1;
                if children > 1 {
                    *call = ("add".to_owned(), json!({"a": 1, "b": 1}));
                }
            }
        }
        calls
    })
}

/// Images a user message may carry (base64 of a PNG's and a GIF's first bytes).
const IMAGES: [(&str, &str); 2] = [("image/png", "iVBORw0KGgo="), ("image/gif", "R0lGODlhAQABAAAAACw=")];

/// One exchange: the user's message (with an image, or not), the model's steps of calls, its
/// answer, and how many times the model call of each step (and of the answer) fails with a
/// server error before it answers (the runtime retries them).
#[derive(Clone, Debug)]
struct Exchange {
    message: String,
    image: Option<usize>,
    steps: Vec<Vec<(String, Value)>>,
    answer: String,
    failures: Vec<u8>,
}

fn exchange() -> impl Strategy<Value = Exchange> {
    (
        text(),
        prop::option::weighted(0.25, 0..IMAGES.len()),
        prop::collection::vec(step(), 0..3),
        text(),
        prop::collection::vec(prop_oneof![6 => Just(0u8), 1 => Just(1u8), 1 => Just(2u8)], 3),
    )
        .prop_map(|(message, image, steps, answer, failures)| Exchange {
            message,
            image,
            steps,
            answer,
            failures,
        })
}

impl Exchange {
    fn input(&self) -> DeliveredMessage {
        DeliveredMessage::User(UserMessage {
            body: self.message.clone(),
            attachments: self
                .image
                .map(|at| Attachment::Image {
                    data: IMAGES[at].1.into(),
                    mime_type: IMAGES[at].0.into(),
                    filename: Some(format!("picture-{at}")),
                })
                .into_iter()
                .collect(),
        })
    }
}

/// The model's script for `exchanges`, in order.
fn script(exchanges: &[Exchange]) -> ScriptedModel {
    let model = ScriptedModel::new([]);
    for exchange in exchanges {
        // Each step's reply, then its child's answer (the child calls the model while the
        // step's calls run).
        let replies = exchange
            .steps
            .iter()
            .map(|step| {
                let child = step
                    .iter()
                    .find_map(delegated)
                    .map(|prompt| ScriptedReply::text(helped(prompt)));
                (ScriptedReply::tool_calls(step.iter().cloned()), child)
            })
            .chain([(ScriptedReply::text(exchange.answer.clone()), None)]);
        for (at, (reply, child)) in replies.enumerate() {
            for _ in 0..exchange.failures.get(at).copied().unwrap_or(0) {
                model.push(ScriptedReply::Error(ProviderError::new(
                    ProviderErrorKind::Server,
                    "the model is busy",
                )));
            }
            model.push(reply);
            if let Some(child) = child {
                model.push(child);
            }
        }
    }
    model
}

/// What a run shows: every request the model was sent, and each reply's text, data and
/// metadata (submission ids are generated, so not compared).
type Seen = (Vec<ModelRequest>, Vec<(String, Value, Value)>, Vec<Vec<Value>>);

fn seen(model: &ScriptedModel, replies: Vec<AgentReply>, events: Vec<Vec<Value>>) -> Seen {
    let replies = replies
        .into_iter()
        .map(|reply| (reply.text, json!(reply.data), json!(reply.metadata)))
        .collect();
    let mut requests = model.requests();
    requests.iter_mut().for_each(number_attachment_ids);
    (requests, replies, events)
}

/// `request` with the attachment ids its user messages list (they derive from submission ids,
/// which differ from run to run) numbered `att#<n>` in order of first appearance.
fn number_attachment_ids(request: &mut ModelRequest) {
    const ID: &str = "<image id=\"";
    let mut ids: Vec<String> = Vec::new();
    let mut messages = request.messages.to_vec();
    for message in &mut messages {
        let ModelMessage::User { content, .. } = message else {
            continue;
        };
        let mut numbered = String::with_capacity(content.len());
        let mut rest = content.as_str();
        while let Some(at) = rest.find(ID) {
            let (before, after) = rest.split_at(at + ID.len());
            let end = after.find('"').unwrap();
            let id = &after[..end];
            let n = ids.iter().position(|seen| seen == id).unwrap_or_else(|| {
                ids.push(id.to_owned());
                ids.len() - 1
            });
            numbered.push_str(before);
            numbered.push_str(&format!("att#{n}"));
            rest = &after[end..];
        }
        numbered.push_str(rest);
        *content = numbered;
    }
    request.messages = messages.into();
}

/// The events an exchange was observed to emit, as JSON, without what differs from run to
/// run: generated ids become `<prefix>#<n>` in order of first appearance (so an event still
/// names the same message as the one before it), and times, durations and the runtime's
/// event counter go. The root session's events come first, then each `task` child's (in the
/// order the children started): a child runs concurrently with the other calls of its step,
/// so how its events interleave with theirs is scheduling, not semantics (see [`in_lanes`]
/// for the calls within a part). Each part numbers its ids on its own.
fn observed(events: &mut tokio::sync::broadcast::Receiver<Observation>) -> Vec<Value> {
    fn generated(text: &str) -> Option<&str> {
        let (prefix, tail) = text.rsplit_once('_')?;
        (tail.len() == 26
            && tail
                .bytes()
                .all(|byte| byte.is_ascii_digit() || byte.is_ascii_uppercase()))
        .then_some(prefix)
    }
    fn normalize(value: &mut Value, ids: &mut Vec<String>) {
        match value {
            Value::String(text) => {
                if let Some(prefix) = generated(text) {
                    let at = ids.iter().position(|id| id == text).unwrap_or_else(|| {
                        ids.push(text.clone());
                        ids.len() - 1
                    });
                    *text = format!("{prefix}#{at}");
                }
            }
            Value::Array(values) => values.iter_mut().for_each(|value| normalize(value, ids)),
            Value::Object(fields) => {
                for volatile in ["eventIndex", "timestamp", "durationMs", "startedAt", "endedAt"] {
                    fields.remove(volatile);
                }
                fields.values_mut().for_each(|value| normalize(value, ids));
            }
            _ => {}
        }
    }
    let mut parts: Vec<(Option<String>, Vec<Value>)> = vec![(None, Vec::new())];
    for observation in std::iter::from_fn(|| events.try_recv().ok()) {
        let task = observation.task_id.clone();
        let value = serde_json::to_value(observation).unwrap();
        match parts.iter_mut().find(|(part, _)| *part == task) {
            Some((_, values)) => values.push(value),
            None => parts.push((task, vec![value])),
        }
    }
    parts
        .into_iter()
        .flat_map(|(_, values)| {
            let mut ids = Vec::new();
            let mut values = in_lanes(values);
            values.iter_mut().for_each(|value| normalize(value, &mut ids));
            values
        })
        .collect()
}

/// A part's events with those of each tool call (and each `task`) taken out of the order they
/// came in and put after the rest, call by call: the calls of a step run concurrently, so
/// whether one call's end came before another's is scheduling. Each call's own events keep
/// their order, and so do the others.
fn in_lanes(values: Vec<Value>) -> Vec<Value> {
    #[derive(PartialEq, Eq, PartialOrd, Ord)]
    enum Lane {
        Main,
        /// A tool call, by its (scripted, so stable) id.
        Call(String),
        /// A task, by the order tasks started in.
        Task(usize),
    }
    let mut tasks: Vec<String> = Vec::new();
    let mut lanes: Vec<(Lane, Value)> = values
        .into_iter()
        .map(|value| {
            let event = &value["event"];
            let call = event["toolCallId"]
                .as_str()
                .or(event["message"]["tool_call_id"].as_str());
            let lane = match (call, event["taskId"].as_str()) {
                (Some(call), _) => Lane::Call(call.to_owned()),
                (None, Some(task)) => Lane::Task(tasks.iter().position(|seen| seen == task).unwrap_or_else(|| {
                    tasks.push(task.to_owned());
                    tasks.len() - 1
                })),
                (None, None) => Lane::Main,
            };
            (lane, value)
        })
        .collect();
    // Stable: each lane keeps its events' order.
    lanes.sort_by(|(a, _), (b, _)| a.cmp(b));
    lanes.into_iter().map(|(_, value)| value).collect()
}

/// The exchanges on one runtime over `store`, its conversation cache kept throughout.
async fn kept(store: impl flue_runtime::store::Store, exchanges: &[Exchange]) -> Seen {
    let model = script(exchanges);
    let runtime = harness::runtime_on(store, &model, [keeper.into()]);
    let handle = runtime.init(&keeper, "k");
    let mut events = runtime.observe();
    let (mut replies, mut emitted) = (Vec::new(), Vec::new());
    for exchange in exchanges {
        replies.push(handle.send(exchange.input()).await.unwrap());
        emitted.push(observed(&mut events));
    }
    // The sender's reply (built from what its task committed) is the one read back.
    for reply in &replies {
        assert_eq!(&handle.read(&reply.submission_id).await.unwrap(), reply);
    }
    seen(&model, replies, emitted)
}

/// The exchanges each on a fresh runtime over the store `open` opens again (the same data).
async fn refolded<S: Store, F: Future<Output = S>>(open: impl Fn() -> F, exchanges: &[Exchange]) -> Seen {
    let model = script(exchanges);
    let (mut replies, mut emitted) = (Vec::new(), Vec::new());
    for exchange in exchanges {
        let runtime = harness::runtime_on(open().await, &model, [keeper.into()]);
        let mut events = runtime.observe();
        replies.push(runtime.init(&keeper, "k").send(exchange.input()).await.unwrap());
        emitted.push(observed(&mut events));
        runtime.shutdown();
    }
    seen(&model, replies, emitted)
}

/// Fails naming the first request (or reply) `seen` differs in from the memory store's.
fn alike(way: &str, seen: &Seen, memory: &Seen) -> Result<(), TestCaseError> {
    prop_assert_eq!(seen.0.len(), memory.0.len(), "{}: not as many model calls", way);
    for (at, (theirs, ours)) in seen.0.iter().zip(&memory.0).enumerate() {
        if theirs != ours {
            let what = if (&theirs.system, &theirs.messages) == (&ours.system, &ours.messages) {
                "its tools or settings"
            } else {
                "its system prompt or messages"
            };
            return Err(TestCaseError::fail(format!(
                "{way}: request {at} differs in {what} from the memory store's.\n\
                 memory store: {:?}\n{:#?}\n{way}: {:?}\n{:#?}",
                ours.system, ours.messages, theirs.system, theirs.messages
            )));
        }
    }
    prop_assert_eq!(&seen.1, &memory.1, "{}: the replies differ", way);
    for (at, (theirs, ours)) in seen.2.iter().zip(&memory.2).enumerate() {
        for (index, (their, our)) in theirs.iter().zip(ours).enumerate() {
            prop_assert_eq!(their, our, "{}: exchange {}'s event {} differs", way, at, index);
        }
        prop_assert_eq!(
            theirs.len(),
            ours.len(),
            "{}: exchange {} emitted as many events",
            way,
            at
        );
    }
    Ok(())
}

#[test]
fn a_conversation_read_back_from_its_stream_sends_the_model_what_the_kept_one_sends() {
    harness::check_property(
        64,
        &prop::collection::vec(exchange(), 1..5),
        "conversation",
        async |exchanges| {
            let memory = kept(MemoryStore::new(), &exchanges).await;
            let sqlite = kept(
                SqliteStore::open(scratch::dir("kept").join("flue.db")).unwrap(),
                &exchanges,
            )
            .await;
            alike("SQLite, its conversation cached", &sqlite, &memory)?;
            let path = scratch::dir("fold").join("flue.db");
            let open = || async { SqliteStore::open(&path).unwrap() };
            alike(
                "SQLite, folded again each exchange",
                &refolded(open, &exchanges).await,
                &memory,
            )?;
            #[cfg(feature = "postgres")]
            if let Some(url) = harness::postgres_url("the fold model on Postgres") {
                use flue_runtime::store::PostgresStore;
                let schema = harness::fresh_schema("flue_fold");
                let open = || async { PostgresStore::connect_with_schema(&url, &schema).await.unwrap() };
                alike(
                    "Postgres, its conversation cached",
                    &kept(open().await, &exchanges).await,
                    &memory,
                )?;
                let (url, schema) = (url.clone(), format!("{schema}_again"));
                let open = || async { PostgresStore::connect_with_schema(&url, &schema).await.unwrap() };
                alike(
                    "Postgres, folded again each exchange",
                    &refolded(open, &exchanges).await,
                    &memory,
                )?;
            }
            Ok(())
        },
    );
}
