//! A crash at any point of a conversation loses no accepted input, redoes no durable work,
//! and leaves nothing half done.
//!
//! Random conversations run on a runtime whose store stops answering at a random one of its
//! writes, made or not made: what is durable then is what a process killed at that moment
//! leaves. The conversations have user messages sent one after the other or while earlier ones
//! run (joining their response or queueing behind it), aborts requested meanwhile, and steps
//! of parallel tool calls that succeed, fail, are refused for their arguments or name no tool,
//! write persistent state, charge through a durable tool's step, or start a `task` child; a
//! `use_agent_finish` hook sends each answer back once to be checked. Answers stream word by
//! word and are appended as they stream, so a death can also come mid-answer. The runtime is
//! then dropped with everything it held in memory, and a fresh one starts on the same data: it
//! takes the interrupted work over (its lease has lapsed), and sends the messages the last one
//! never got to (the one in flight again, under the same idempotency key). That one may die
//! too (up to three deaths), and a last one finishes. This runs on the memory store, on SQLite
//! (reopened from its file) and, when `FLUE_TEST_POSTGRES_URL` names one (as under the
//! README's test command), on Postgres. Then, whatever the crash points:
//!
//! - every message is in the stream once, in order (one aborted before it started is not), and
//!   each got its checked answer (or a later message's that joined its response, or ended
//!   aborted where an abort was requested while it ran, or unchecked where its answer was
//!   durable when a runtime died: a taken-over response whose answer is durable settles as it
//!   is, reference §3.9), made of whole texts only (a step cut mid-stream is made again, and
//!   its piece is not part of the reply);
//! - each answer was sent back to be checked at most once, and a check that was sent is
//!   answered once (unless a message joined there or an abort ended the response);
//! - every submission settled exactly once;
//! - no model step was made twice once it was durable, each exchange made a prefix of its
//!   script's steps (all of them unless a later message joined or an abort came), and every
//!   call of every step has exactly one outcome;
//! - no tool ran twice; a call whose outcome is not the outcome-unknown repair ran exactly once
//!   (when its tool and arguments were valid); a durable call has its real result and one
//!   settled record of its step (unless an abort ended its response), whose work ran once, and
//!   again only after a death that came between the work and that record (or late, in a
//!   paused life that goes on beside the last one, below);
//! - the persistent state counts exactly the state-writing calls whose outcome committed (an
//!   interrupted call's write is absent);
//! - what was durable when a runtime died is still there, unchanged, at the head of the stream.
//!
//! On Postgres, the store several nodes share, a life may also pause at its crash point
//! instead of dying, as a suspended process or a node cut off from the database does: its
//! store calls and its tools wait, the later lives take its work over, and then it goes on
//! (the write it had not made is made late; the one it had made answers late). Either once
//! the last life finished: what it does then, its sender included, must change nothing
//! durable, neither the stream nor the ledger (every write of its attempts is fenced, and what
//! it sends again converges on what the later lives admitted). Or while the last life runs,
//! its sender gone: its runtime is then a second node on the same data, and everything above
//! must hold of what the two did. Only its durable steps may run their work again: it found
//! no record of the step before it stalled and cannot know that another node made one since
//! (durable steps run at least once across nodes that cannot tell a stalled node from a dead
//! one). A paused life may stall inside a transaction, holding the instance's row lock: the
//! server ends that transaction (the Postgres store's stalled-transaction timeout).
//!
//! The model answers from the conversation it is sent (which exchange, which step), not from a
//! queue of replies, so a step redone after the crash gets the answer the first attempt got.
#![allow(clippy::unwrap_used)] // tests assert by unwrapping

mod harness;
mod scratch;

use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use flue_runtime::prelude::*;
use flue_runtime::provider::{
    ModelMessage, ModelProvider, ModelRequest, ModelResponse, ModelStream, ModelToolCall, ProviderRegistry, StopReason,
    StreamEvent,
};
use flue_runtime::record::{Outcome, Record, RecordBody};
use flue_runtime::store::{InstanceKey, MemoryStore, SqliteStore, Store, StoreError, Submission};
use flue_runtime::{Runtime, RuntimeError, RuntimeOptions, SendRequest};
use proptest::prelude::*;
use proptest::test_runner::TestCaseError;
use serde_json::{Value, json};

/// How many times each tool call id ran (the tools count themselves).
static RUNS: Mutex<BTreeMap<String, usize>> = Mutex::new(BTreeMap::new());

/// Each life's state, by the name of its threads: whether its store froze, and (for a paused
/// life) whether it goes on.
static LIVES: Mutex<BTreeMap<String, Halt>> = Mutex::new(BTreeMap::new());

#[derive(Clone)]
struct Halt {
    frozen: tokio::sync::watch::Receiver<bool>,
    released: Option<tokio::sync::watch::Receiver<bool>>,
}

/// Where a tool's work begins: a life whose store froze runs no more of it, as a killed or
/// stalled process does not (a paused one goes on once it is released). Whether the work
/// runs late: in a paused life that was released.
async fn work_point() -> bool {
    let halt = std::thread::current()
        .name()
        .and_then(|name| LIVES.lock().unwrap_or_else(|e| e.into_inner()).get(name).cloned());
    match halt {
        Some(halt) if *halt.frozen.borrow() => {
            released(halt.released).await;
            true
        }
        _ => false,
    }
}

async fn ran(ctx: &ToolContext) {
    let _late = work_point().await;
    *RUNS
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .entry(ctx.tool_call_id().to_owned())
        .or_default() += 1;
}

fn runs() -> BTreeMap<String, usize> {
    RUNS.lock().unwrap_or_else(|e| e.into_inner()).clone()
}

/// How many times the step of each `charge` call ran its work (the tool itself may run again
/// after an interruption: it is durable).
static CHARGES: Mutex<BTreeMap<String, usize>> = Mutex::new(BTreeMap::new());

/// Of [`CHARGES`], how many ran late, in a paused life once released: it had found no record
/// of the step before it stalled, and cannot know that another node made one since. (Durable
/// steps run at least once across nodes that cannot tell a stalled node from a dead one.)
static LATE_CHARGES: Mutex<BTreeMap<String, usize>> = Mutex::new(BTreeMap::new());

fn forget_runs() {
    RUNS.lock().unwrap_or_else(|e| e.into_inner()).clear();
    CHARGES.lock().unwrap_or_else(|e| e.into_inner()).clear();
    LATE_CHARGES.lock().unwrap_or_else(|e| e.into_inner()).clear();
}

fn charged(charges: &Mutex<BTreeMap<String, usize>>, ctx: &ToolContext) {
    *charges
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .entry(ctx.tool_call_id().to_owned())
        .or_default() += 1;
}

#[derive(serde::Deserialize, schemars::JsonSchema)]
struct Pair {
    a: i64,
    b: i64,
}

#[derive(serde::Deserialize, schemars::JsonSchema)]
struct Note {
    note: String,
}

/// The `task` child: it answers at once.
fn helper(_: AgentProps<'_>) -> &'static str {
    "You help with one thing."
}

/// An agent whose instruction shows its persistent state, with tools that answer, fail, and
/// write the state, and a `task` subagent.
#[agent]
fn keeper() -> String {
    use_model("played/x");
    use_tool(
        Tool::new("add")
            .description("Add two numbers.")
            .run(|ctx, Pair { a, b }| async move {
                ran(&ctx).await;
                Ok::<_, ToolError>((a + b).to_string())
            }),
    );
    use_tool(
        Tool::new("divide")
            .description("Divide a by b.")
            .run(|ctx, Pair { a, b }| async move {
                ran(&ctx).await;
                a.checked_div(b)
                    .map(|quotient| quotient.to_string())
                    .ok_or_else(|| ToolError::new(format!("cannot divide {a} by {b}")))
            }),
    );
    let (count, set_count) = use_persistent_state("count", 0u32);
    use_tool(
        Tool::new("tally")
            .description("Count one more.")
            .run(move |ctx, Note { note }| {
                let set_count = set_count.clone();
                async move {
                    ran(&ctx).await;
                    set_count.update(|n| n + 1)?;
                    Ok::<_, ToolError>(format!("counted: {note}"))
                }
            }),
    );
    use_tool(
        Tool::new("charge")
            .description("Charge once.")
            .durable()
            .run(|ctx, Note { note }| async move {
                let receipt: String = ctx
                    .step("issue", async {
                        if work_point().await {
                            charged(&LATE_CHARGES, &ctx);
                        }
                        charged(&CHARGES, &ctx);
                        format!("receipt {note}")
                    })
                    .await?;
                Ok::<_, ToolError>(format!("charged: {receipt}"))
            }),
    );
    use_subagent(Subagent::new(
        "helper",
        "Helps with one thing; say what in the prompt.",
        FnAgent::new(AgentDefinition::new("helper"), helper),
    ));
    // Each answer to a message is checked once: the would-stop point after it sends the model
    // back with a signal, and the one after the checked answer lets the response end.
    let answering_a_message = matches!(*use_delivery(), DeliveredMessage::User(_));
    use_agent_finish(move |ctx| async move {
        if answering_a_message {
            ctx.append(Signal::new("check", CHECK))?;
        }
        Ok::<_, Box<dyn std::error::Error + Send + Sync>>(())
    });
    format!("You keep a tally; it stands at {count}.")
}

/// What the finish check's signal says.
const CHECK: &str = "Check your answer.";

/// The final answer to a message once it was checked.
fn checked(answer: &str) -> String {
    format!("checked: {answer}")
}

/// One call of a step: to a tool that answers, fails, or writes state; with arguments the
/// tool's schema refuses; to a tool the agent does not have; or to `task`.
fn call() -> impl Strategy<Value = (String, Value)> {
    prop_oneof![
        1 => (-5i64..5, -5i64..5).prop_map(|(a, b)| ("add".to_owned(), json!({"a": a, "b": b}))),
        1 => (-5i64..5, 0i64..2).prop_map(|(a, b)| ("divide".to_owned(), json!({"a": a, "b": b}))),
        2 => (0u8..10).prop_map(|n| ("tally".to_owned(), json!({"note": format!("n{n}")}))),
        1 => (0u8..10).prop_map(|n| ("charge".to_owned(), json!({"note": format!("n{n}")}))),
        1 => Just(("add".to_owned(), json!({"a": "two"}))),
        1 => Just(("nope".to_owned(), json!({}))),
        1 => (0u8..10).prop_map(|n| ("task".to_owned(), json!({"agent": "helper", "prompt": format!("job {n}")}))),
    ]
}

/// One exchange: the model's steps of calls and its answer to the user's message, which is
/// sent once the exchanges before it settled, or (`overlap`) while they run: it then joins
/// their response at its next turn boundary (and the model goes on with this exchange's
/// script there), or waits its turn. With `abort`, an abort of the instance is requested once
/// it is admitted: it and the exchanges before it that have not settled then end aborted.
#[derive(Clone, Debug)]
struct Exchange {
    steps: Vec<Vec<(String, Value)>>,
    answer: String,
    overlap: bool,
    abort: bool,
}

/// Whether exchange `n` may have been aborted: an abort was requested once it, or a later
/// exchange sent while it ran (every one between overlapping), was admitted.
fn may_abort(exchanges: &[Exchange], n: usize) -> bool {
    exchanges[n].abort
        || exchanges[n + 1..]
            .iter()
            .take_while(|exchange| exchange.overlap)
            .any(|exchange| exchange.abort)
}

fn exchange() -> impl Strategy<Value = Exchange> {
    (
        prop::collection::vec(prop::collection::vec(call(), 1..4), 0..3),
        0u8..100,
        prop::bool::weighted(0.3),
        prop::bool::weighted(0.15),
    )
        .prop_map(|(steps, answer, overlap, abort)| Exchange {
            steps,
            answer: format!("answer {answer}"),
            overlap,
            abort,
        })
}

/// The message of exchange `n`: the model finds its place in the script by it.
fn message(n: usize) -> String {
    format!("#{n} go on")
}

/// Which exchange a user message starts, if it is one of [`message`]'s.
fn exchange_of(text: &str) -> Option<usize> {
    text.strip_prefix('#')?.split_once(' ')?.0.parse().ok()
}

/// The model: answers from the request alone. A `task` child gets `done: <prompt>`; the
/// keeper, in the exchange its latest user message starts, the calls of the first step it has
/// not made yet (with ids made of the exchange and step), then the answer.
#[derive(Clone)]
struct Played {
    exchanges: Arc<Vec<Exchange>>,
}

impl ModelProvider for Played {
    fn id(&self) -> &str {
        "played"
    }

    fn stream(&self, request: &ModelRequest) -> ModelStream {
        let system = request.system.clone().unwrap_or_default();
        let mut users = request
            .messages
            .iter()
            .enumerate()
            .filter_map(|(at, message)| match message {
                ModelMessage::User { content, .. } => Some((at, content.as_str())),
                _ => None,
            });
        let response = if system.contains("You help with one thing.") {
            let prompt = users.next_back().map(|(_, content)| content).unwrap_or_default();
            text(format!("done: {prompt}"))
        } else {
            let (start, n) = users
                .rev()
                .find_map(|(at, content)| Some((at, exchange_of(content)?)))
                .expect("the keeper's request has an exchange's message");
            let step = request.messages[start..]
                .iter()
                .filter(
                    |message| matches!(message, ModelMessage::Assistant { tool_calls, .. } if !tool_calls.is_empty()),
                )
                .count();
            let exchange = &self.exchanges[n];
            let checking =
                matches!(request.messages.last(), Some(ModelMessage::User { content, .. }) if content.contains(CHECK));
            match exchange.steps.get(step) {
                _ if checking => text(checked(&exchange.answer)),
                Some(calls) => calls_of(n, step, calls),
                None => text(exchange.answer.clone()),
            }
        };
        let mut events = Vec::new();
        for (index, call) in response.tool_calls.iter().enumerate() {
            events.push(Ok(StreamEvent::ToolCallStarted {
                index,
                id: call.id.clone(),
                name: call.name.clone(),
            }));
            events.push(Ok(StreamEvent::ToolCallArguments {
                index,
                delta: call.arguments.clone(),
            }));
        }
        for word in response.text.split_inclusive(' ') {
            events.push(Ok(StreamEvent::TextDelta(word.to_owned())));
        }
        events.push(Ok(StreamEvent::Completed(response)));
        // Each event after a yield, as from a network: the runtime appends what streamed so
        // far at each chance ([`options`]), so a death can come mid-answer.
        Box::pin(futures_util::StreamExt::then(
            futures_util::stream::iter(events),
            |event| async {
                tokio::task::yield_now().await;
                event
            },
        ))
    }
}

fn text(text: String) -> ModelResponse {
    ModelResponse {
        text,
        reasoning: String::new(),
        reasoning_blocks: Vec::new(),
        tool_calls: Vec::new(),
        stop_reason: StopReason::Stop,
        usage: Default::default(),
    }
}

/// The id of call `index` of step `step` of exchange `n`.
fn call_id(n: usize, step: usize, index: usize) -> String {
    format!("c{n}_{step}_{index}")
}

fn calls_of(n: usize, step: usize, calls: &[(String, Value)]) -> ModelResponse {
    ModelResponse {
        tool_calls: calls
            .iter()
            .enumerate()
            .map(|(index, (name, arguments))| ModelToolCall {
                id: call_id(n, step, index),
                name: name.clone(),
                arguments: arguments.to_string(),
            })
            .collect(),
        stop_reason: StopReason::ToolUse,
        ..text(String::new())
    }
}

/// Where the store stops answering: at its `at`-th write (0-based), which is made first when
/// `made` (then its answer is lost), or not at all. (A crash at a read leaves what a crash at
/// the next write, not made, leaves: all the dying life held in memory goes either way.)
///
/// With `paused`, the life does not die there but stalls, as a node the database cannot hear
/// or a suspended process does: its store calls and its tools wait (the write not made is
/// made late, the answer of the one made comes late) until it is released, and then it goes
/// on. Its lease was taken over meanwhile, so every write of its attempts is fenced. It is
/// released once every later life has finished, its sender going on too (what it sends then
/// must change nothing durable); or, with `release`, when the last life has made that many
/// writes (at its end if it makes fewer): then its sender is gone (the client gave up), and
/// the runtime goes on beside the last one, as a second node on the same data.
#[derive(Clone, Copy, Debug)]
struct Crash {
    at: usize,
    made: bool,
    paused: bool,
    release: Option<usize>,
}

/// A store that counts its writes and, from the crash point on, never answers a call again:
/// the process "died" there (`frozen` turns true then). With `later`, it also reads leases
/// as that much later than they are: a later life finds the dead one's expired at once. With
/// `released` (a paused life, see [`Crash`]), its calls wait for that to turn true, then go
/// through. At each of its `releases` (a count of its writes) it releases a paused life, and
/// from then on both read leases as they are: two live nodes, neither taking the other's
/// leases over. The leases of the attempts it claimed itself (`own`) it reads as they are: a
/// row its worker just claimed, and does not run yet, is not lapsed to its own scan.
struct Dying {
    inner: Arc<dyn Store>,
    own: Mutex<BTreeSet<String>>,
    writes: Arc<AtomicUsize>,
    crash: Option<Crash>,
    frozen: tokio::sync::watch::Sender<bool>,
    later: std::sync::atomic::AtomicU64,
    released: Option<tokio::sync::watch::Receiver<bool>>,
    releases: Vec<(usize, Release)>,
}

/// Releases a paused life ([`Crash`]).
type Release = Arc<tokio::sync::watch::Sender<bool>>;

enum Gate {
    Pass,
    Dead,
    /// Made, then dead.
    Last,
}

impl Dying {
    fn new(inner: Arc<dyn Store>, crash: Option<Crash>) -> Self {
        Self {
            inner,
            own: Mutex::default(),
            writes: Arc::default(),
            crash,
            frozen: tokio::sync::watch::Sender::new(false),
            later: 0.into(),
            released: None,
            releases: Vec::new(),
        }
    }

    /// How much later than they are leases read: not at all once this life was released.
    fn later(&self) -> u64 {
        if self.released.as_ref().is_some_and(|released| *released.borrow()) {
            0
        } else {
            self.later.load(Ordering::SeqCst)
        }
    }

    /// Notes an attempt this life claims.
    fn own(&self, claim: &flue_runtime::store::Claim) {
        self.own
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(claim.attempt_id.clone());
    }

    /// The rows `expired` read (their leases read `later`), but those of this life's own
    /// attempts only when their leases lapsed indeed by `now_ms`.
    fn lapsed(&self, rows: Vec<flue_runtime::store::Submission>, now_ms: u64) -> Vec<flue_runtime::store::Submission> {
        let own = self.own.lock().unwrap_or_else(|e| e.into_inner());
        rows.into_iter()
            .filter(|row| {
                row.attempt_id.as_ref().is_none_or(|attempt| !own.contains(attempt))
                    || (row.lease_until_ms > 0 && row.lease_until_ms < now_ms)
            })
            .collect()
    }

    /// Until the paused life goes on: never, for a life that died.
    fn until_released(&self) -> impl Future<Output = ()> + Send + 'static {
        released(self.released.clone())
    }

    fn gate(&self, write: bool) -> Gate {
        if *self.frozen.borrow() {
            return Gate::Dead;
        }
        if !write {
            return Gate::Pass;
        }
        let at = self.writes.fetch_add(1, Ordering::SeqCst);
        for (_, release) in self.releases.iter().filter(|(count, _)| *count == at) {
            self.later.store(0, Ordering::SeqCst);
            release.send_replace(true);
        }
        match self.crash {
            Some(crash) if at == crash.at => {
                self.frozen.send_replace(true);
                if crash.made { Gate::Last } else { Gate::Dead }
            }
            _ => Gate::Pass,
        }
    }
}

/// Waits for `released` to turn true (or its sender to go); forever without one.
async fn released(released: Option<tokio::sync::watch::Receiver<bool>>) {
    match released {
        Some(mut released) => {
            let _gone = released.wait_for(|released| *released).await;
        }
        None => std::future::pending().await,
    }
}

/// An argument of a store call that a paused life makes late: kept, owned, until then.
trait Late<'a>: Sized {
    type Kept: Send + Sync + 'static;
    fn keep(self) -> Self::Kept;
    fn lend(kept: &'a Self::Kept) -> Self;
}

impl<'a, T: ?Sized + ToOwned> Late<'a> for &'a T
where
    T::Owned: Send + Sync + 'static,
{
    type Kept = T::Owned;

    fn keep(self) -> T::Owned {
        self.to_owned()
    }

    fn lend(kept: &'a T::Owned) -> &'a T {
        std::borrow::Borrow::borrow(kept)
    }
}

impl<'a, T: Clone + Send + Sync + 'static> Late<'a> for Option<&'a T> {
    type Kept = Option<T>;

    fn keep(self) -> Option<T> {
        self.cloned()
    }

    fn lend(kept: &'a Option<T>) -> Self {
        kept.as_ref()
    }
}

macro_rules! late_by_value {
    ($($ty:ty),+) => {
        $(
            impl Late<'_> for $ty {
                type Kept = $ty;

                fn keep(self) -> $ty {
                    self
                }

                fn lend(kept: &$ty) -> $ty {
                    kept.clone()
                }
            }
        )+
    };
}

late_by_value!(
    u64,
    Option<u64>,
    i64,
    Arc<[Record]>,
    Vec<Record>,
    Outcome,
    Option<flue_runtime::record::SettlementError>,
    Option<Value>,
    flue_runtime::store::Admission,
    flue_runtime::store::AttachmentPut
);

/// Each listed method (a `read` or a `write`) through [`Dying::gate`]: made and answered,
/// not made (until a paused life goes on: then made late), or made with its answer lost (or
/// given late).
macro_rules! gated {
    ($( $kind:ident fn $name:ident(&$me:ident $(, $arg:ident: $ty:ty)*) -> $out:ty $(=> $before:block)?; )+) => {
        $(
            fn $name(&$me $(, $arg: $ty)*) -> flue_runtime::BoxFuture<'_, Result<$out, StoreError>> {
                $($before)?
                match $me.gate(stringify!($kind) == "write") {
                    Gate::Pass => $me.inner.$name($($arg),*),
                    Gate::Dead => {
                        let released = $me.until_released();
                        $(let $arg = <$ty as Late>::keep($arg);)*
                        Box::pin(async move {
                            released.await;
                            $me.inner.$name($(<$ty as Late>::lend(&$arg)),*).await
                        })
                    }
                    Gate::Last => {
                        let call = $me.inner.$name($($arg),*);
                        let released = $me.until_released();
                        Box::pin(async move {
                            let answer = call.await;
                            released.await;
                            answer
                        })
                    }
                }
            }
        )+
    };
}

impl Store for Dying {
    gated! {
        write fn admit(&self, a: flue_runtime::store::Admission) -> flue_runtime::store::Admitted;
        read fn instance(&self, k: &InstanceKey) -> Option<flue_runtime::store::InstanceInfo>;
        read fn submission(&self, id: &str) -> Option<flue_runtime::store::Submission>;
        read fn has_queued(&self, k: &InstanceKey) -> bool;
        write fn claim_next(&self, k: &InstanceKey, c: &flue_runtime::store::Claim) -> Option<flue_runtime::store::Submission> => {
            self.own(c);
        };
        write fn renew_leases(&self, o: &str, a: &[String], l: u64) -> u64;
        read fn aborts_requested(&self, a: &[String]) -> Vec<String>;
        read fn instances_with_queued(&self) -> Vec<InstanceKey>;
        write fn claim_joinable(&self, h: &flue_runtime::store::AttemptRef) -> Vec<flue_runtime::store::Submission>;
        write fn finalize_join(&self, h: &flue_runtime::store::AttemptRef, id: &str) -> bool;
        write fn revert_joins(&self, h: &flue_runtime::store::AttemptRef) -> usize;
        write fn settle(
            &self,
            h: &flue_runtime::store::AttemptRef,
            o: Outcome,
            e: Option<flue_runtime::record::SettlementError>,
            r: Vec<Record>
        ) -> bool;
        write fn requeue(&self, a: &flue_runtime::store::AttemptRef) -> bool;
        write fn request_abort(&self, k: &InstanceKey) -> Vec<String>;
        write fn append(&self, k: &InstanceKey, r: Arc<[Record]>, a: Option<&flue_runtime::store::AttemptRef>) -> u64;
        write fn create_child(
            &self,
            p: &InstanceKey,
            l: Arc<[Record]>,
            c: &InstanceKey,
            b: Arc<[Record]>,
            a: Option<&flue_runtime::store::AttemptRef>
        ) -> u64;
        read fn read(&self, k: &InstanceKey, after: Option<u64>) -> Vec<flue_runtime::record::Batch>;
        read fn last_offset(&self, k: &InstanceKey) -> Option<u64>;
        write fn put_attachment(&self, k: &InstanceKey, a: flue_runtime::store::AttachmentPut) -> ();
        read fn attachment(&self, k: &InstanceKey, id: &str) -> Option<flue_runtime::store::StoredAttachment>;
        read fn user_value(&self, user_id: &str, key: &str) -> Option<flue_runtime::lifecycle::UserValue>;
        write fn set_user_value(&self, user_id: &str, key: &str, value: Option<Value>, updated_at: i64) -> ();
        read fn list_user_values(
            &self,
            user_id: &str,
            query: &flue_runtime::lifecycle::UserValuesQuery
        ) -> flue_runtime::lifecycle::UserValuePage;
    }

    fn expired(
        &self,
        now_ms: u64,
    ) -> flue_runtime::BoxFuture<'_, Result<Vec<flue_runtime::store::Submission>, StoreError>> {
        let pass = matches!(self.gate(false), Gate::Pass);
        let released = self.until_released();
        Box::pin(async move {
            if !pass {
                released.await;
            }
            let rows = self.inner.expired(now_ms + self.later()).await?;
            Ok(self.lapsed(rows, now_ms))
        })
    }

    fn reclaim(
        &self,
        id: &str,
        stale: &str,
        claim: &flue_runtime::store::Claim,
        now_ms: u64,
    ) -> flue_runtime::BoxFuture<'_, Result<Option<flue_runtime::store::Submission>, StoreError>> {
        self.own(claim);
        match self.gate(true) {
            Gate::Pass => self.inner.reclaim(id, stale, claim, now_ms + self.later()),
            Gate::Dead => {
                let released = self.until_released();
                let (id, stale, claim) = (id.to_owned(), stale.to_owned(), claim.clone());
                Box::pin(async move {
                    released.await;
                    self.inner.reclaim(&id, &stale, &claim, now_ms + self.later()).await
                })
            }
            Gate::Last => {
                let call = self.inner.reclaim(id, stale, claim, now_ms + self.later());
                let released = self.until_released();
                Box::pin(async move {
                    let answer = call.await;
                    released.await;
                    answer
                })
            }
        }
    }

    fn shared(&self) -> bool {
        self.inner.shared()
    }
}

/// A short lease (which a later life reads as lapsed, see [`Dying`]), heartbeats and scans
/// often, and streamed text appended at every chance.
fn options() -> RuntimeOptions {
    RuntimeOptions {
        lease: Duration::from_millis(150),
        heartbeat: Duration::from_millis(30),
        scan_interval: Duration::from_millis(30),
        // Streamed text is appended at every chance: answers are durable in pieces.
        text_flush: Some(Duration::ZERO),
        ..RuntimeOptions::default()
    }
}

fn runtime_on(store: Dying, model: &Played) -> Runtime {
    let mut providers = ProviderRegistry::new();
    providers.register(model.clone());
    Runtime::builder()
        .agent(keeper)
        .providers(providers)
        .store(store)
        .options(options())
        .build()
        .unwrap()
}

const INSTANCE: &str = "k";

/// Exchange `n`'s message, under an idempotency key of its own (so a retry after the crash
/// converges on the submission the dead life admitted, if it did).
fn request(n: usize) -> SendRequest {
    SendRequest::new(INSTANCE, message(n)).idempotency_key(format!("message-{n}"))
}

/// What the lives so far did.
#[derive(Clone, Debug, Default)]
struct Lives {
    /// The exchanges admitted (their receipts returned), with their submission ids.
    admitted: Vec<(usize, String)>,
    /// The first exchange not admitted yet (the one in flight when a life died, if any: the
    /// next life sends it again, under the same idempotency key).
    next: usize,
    /// How many writes the first life made (all of a whole run's when it did not die).
    writes: usize,
    /// Each death, in order.
    deaths: Vec<Death>,
    /// What the last life read back for each admitted exchange, in `admitted`'s order.
    replies: Vec<Reply>,
}

/// A life's death: where, the instance's records then, and how often each charge's step had
/// run by then.
#[derive(Clone, Debug)]
struct Death {
    crash: Crash,
    durable: Vec<Record>,
    charges: BTreeMap<String, usize>,
}

/// How an exchange's submission ended, as its sender reads it.
#[derive(Clone, Debug)]
enum Reply {
    Answer(String),
    Aborted,
    Failed(String),
}

/// Sends the exchanges from `lives.next` on to the instance, each once those before it settled
/// or, when it overlaps, at once (requesting an abort after it when it says so), then waits
/// for every one sent to settle.
/// A paused life's calls may fail once it goes on (the server ended the transaction it stalled
/// in): the error is returned, and only a paused life's is ignored.
async fn drive(runtime: &Runtime, exchanges: &[Exchange], lives: &Mutex<Lives>) -> Result<(), RuntimeError> {
    let handle = runtime.init(&keeper, INSTANCE);
    let mut running: Vec<String> = Vec::new();
    let next = || lives.lock().unwrap_or_else(|e| e.into_inner()).next;
    while let Some(exchange) = exchanges.get(next()) {
        if !exchange.overlap {
            for id in running.drain(..) {
                settled(&handle, &id).await;
            }
        }
        let n = next();
        let id = runtime.dispatch_request("keeper", request(n)).await?.submission_id;
        {
            let mut lives = lives.lock().unwrap_or_else(|e| e.into_inner());
            lives.admitted.push((n, id.clone()));
            lives.next = n + 1;
        }
        running.push(id);
        if exchange.abort {
            handle.abort().await?;
        }
    }
    for id in running {
        settled(&handle, &id).await;
    }
    Ok(())
}

/// Waits until the submission `id` settled, however it did: a store error while waiting (a
/// connection the server dropped) is no answer, and it reads again. A store that keeps failing
/// does not hang the test: the life ends at its 60 s bound (see [`life`]), its replies short.
async fn settled(handle: &flue_runtime::AgentHandle, id: &str) {
    while let Err(RuntimeError::Store(_)) = handle.read(id).await {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// One life of the runtime over the store `open` opens: it takes over what earlier lives left
/// (its store reads leases a lease later than they are, so theirs have lapsed), waits for
/// their exchanges, and sends the rest ([`drive`]), until all are answered or its store dies at
/// `crash`. The last life (no `crash`) also reads every reply. The runtime runs on a thread and
/// a tokio runtime of its own (threads named after the life, see [`work_point`]), both gone
/// when the life ends, with every task the runtime had and every connection the store opened.
/// The tokio runtime has two workers, as a server's does: the runtime's tasks run in parallel
/// with each other and with the driving code. Returns what the lives did then, and whether
/// this one died; and for a life paused at `crash`, the life, still running, to release later.
fn life<'scope, F: Future<Output = Arc<dyn Store>>>(
    scope: &'scope std::thread::Scope<'scope, '_>,
    open: &'scope (impl Fn() -> F + Sync),
    model: &'scope Played,
    crash: Option<Crash>,
    lives: Lives,
    releases: Vec<(usize, Release)>,
    done: tokio::sync::watch::Receiver<bool>,
) -> (Lives, bool, Option<Paused<'scope>>) {
    static LIFE: AtomicUsize = AtomicUsize::new(0);
    let name = format!("life-{}", LIFE.fetch_add(1, Ordering::Relaxed));
    let (release, released) = tokio::sync::watch::channel(false);
    let release = Arc::new(release);
    let released = crash.filter(|crash| crash.paused).map(|_| released);
    let (report, reported) = std::sync::mpsc::channel();
    let thread = std::thread::Builder::new()
        .name(name.clone())
        .spawn_scoped(scope, move || {
            let tokio = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .thread_name(name.clone())
                .enable_all()
                .build()
                .unwrap();
            tokio.block_on(async {
                let store = Dying {
                    later: (options().lease.as_millis() as u64).into(),
                    released: released.clone(),
                    releases,
                    ..Dying::new(open().await, crash)
                };
                let mut frozen = store.frozen.subscribe();
                LIVES.lock().unwrap_or_else(|e| e.into_inner()).insert(
                    name.clone(),
                    Halt {
                        frozen: frozen.clone(),
                        released: released.clone(),
                    },
                );
                let writes = store.writes.clone();
                let runtime = runtime_on(store, model);
                let first = lives.deaths.is_empty();
                let lives = Mutex::new(lives);
                let lived = async {
                    runtime.start().await;
                    let handle = runtime.init(&keeper, INSTANCE);
                    let admitted = lives.lock().unwrap_or_else(|e| e.into_inner()).admitted.clone();
                    for (_, id) in admitted {
                        settled(&handle, &id).await;
                    }
                    drive(&runtime, &model.exchanges, &lives).await?;
                    if crash.is_none() {
                        let admitted = lives.lock().unwrap_or_else(|e| e.into_inner()).admitted.clone();
                        for (_, id) in &admitted {
                            let reply = tokio::time::timeout(Duration::from_secs(20), handle.read(id)).await;
                            let reply = match reply {
                                Ok(Ok(reply)) => Reply::Answer(reply.text),
                                Ok(Err(RuntimeError::Run {
                                    outcome: "was aborted", ..
                                })) => Reply::Aborted,
                                Ok(Err(error)) => Reply::Failed(error.to_string()),
                                Err(_) => Reply::Failed("it never settled".into()),
                            };
                            lives.lock().unwrap_or_else(|e| e.into_inner()).replies.push(reply);
                        }
                    }
                    Ok::<_, RuntimeError>(())
                };
                let mut lived = Box::pin(lived);
                // A life that hangs ends here: a submission that never settles leaves the
                // last life's replies short, which `check` reports.
                let died = tokio::select! {
                    lived = &mut lived => {
                        lived.unwrap();
                        false
                    }
                    _ = frozen.wait_for(|frozen| *frozen) => true,
                    () = tokio::time::sleep(Duration::from_secs(60)) => false,
                };
                let mut then = lives.lock().unwrap_or_else(|e| e.into_inner()).clone();
                if first {
                    then.writes = writes.load(Ordering::SeqCst);
                }
                report.send((then, died)).unwrap();
                if died && let Some(released) = released {
                    // Paused: it goes on once released, with whatever it held…
                    self::released(Some(released)).await;
                    if crash.is_some_and(|crash| crash.release.is_some()) {
                        // …beside the last life, its sender gone: its runtime alone goes on,
                        // until the last life has finished.
                        drop(lived);
                        self::released(Some(done)).await;
                    } else {
                        // …after the last life, until what it sends is answered (the later
                        // lives answered it).
                        let _ = tokio::time::timeout(Duration::from_secs(20), &mut lived).await;
                    }
                    // Its tasks have had their chance to write.
                    tokio::time::sleep(options().lease).await;
                }
                LIVES.lock().unwrap_or_else(|e| e.into_inner()).remove(&name);
            })
        })
        .unwrap();
    let (lives, died) = reported.recv().unwrap();
    if let Some(crash) = crash.filter(|crash| died && crash.paused) {
        return (lives, true, Some(Paused { crash, release, thread }));
    }
    thread.join().unwrap();
    (lives, died, None)
}

/// A life paused at its crash point, still running ([`life`]).
struct Paused<'scope> {
    crash: Crash,
    release: Release,
    thread: std::thread::ScopedJoinHandle<'scope, ()>,
}

/// The exchanges on the store `open` opens (again each time: the same data), through a life
/// dying (or pausing) at each of `crashes` in turn and a last one; then what the last one
/// read back and the instance's stream must say what the module's doc says. Then the paused
/// lives go on, and must change nothing durable.
async fn crash_and_recover<F: Future<Output = Arc<dyn Store>>>(
    store: &str,
    open: impl Fn() -> F + Sync,
    exchanges: &[Exchange],
    crashes: &[Crash],
) -> Result<(), TestCaseError> {
    forget_runs();
    let model = model_of(exchanges);
    // A store of one process (memory, SQLite) has no other node that could take a paused
    // one's work over: there its lives die instead.
    let shared = open().await.shared();
    let crashes: Vec<Crash> = crashes
        .iter()
        .map(|crash| Crash {
            paused: crash.paused && shared,
            ..*crash
        })
        .collect();
    let failed = |lives: &Lives, error: TestCaseError| {
        let deaths: Vec<Crash> = lives.deaths.iter().map(|death| death.crash).collect();
        TestCaseError::fail(format!("{store}, dying at {deaths:?}: {error}\n{lives:?}"))
    };
    // On a thread of its own, outside the caller's tokio runtime: this one reads the store
    // between lives (with runtimes of its own), and the scope's other threads are the lives;
    // the scope ends when the paused ones have gone on and ended.
    std::thread::scope(|scope| {
        scope
            .spawn(|| {
                let tokio = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .unwrap();
                let mut lives = Lives::default();
                let mut paused: Vec<Paused<'_>> = Vec::new();
                // Turns true when the last life has finished.
                let (finish, done) = tokio::sync::watch::channel(false);
                for crash in &crashes {
                    let (then, died, pause) = life(scope, &open, &model, Some(*crash), lives, Vec::new(), done.clone());
                    lives = then;
                    paused.extend(pause);
                    if died {
                        lives.deaths.push(Death {
                            crash: *crash,
                            durable: tokio.block_on(async { stream(&*open().await).await }),
                            charges: CHARGES.lock().unwrap_or_else(|e| e.into_inner()).clone(),
                        });
                    }
                }
                let releases = paused
                    .iter()
                    .filter_map(|life| Some((life.crash.release?, life.release.clone())))
                    .collect();
                let (lives, _, _) = life(scope, &open, &model, None, lives, releases, done);
                finish.send_replace(true);
                let ((records, closings), rows) = tokio.block_on(async {
                    let store = open().await;
                    (stream_and_closings(&*store).await, ledger(&*store, &lives).await)
                });
                let checked = check(&lives, (&records, &closings), exchanges);
                // The paused lives not released yet go on (the runs they make now are theirs
                // alone, not counted)…
                for life in &paused {
                    life.release.send_replace(true);
                }
                for life in paused {
                    life.thread.join().unwrap();
                }
                checked.map_err(|error| failed(&lives, error))?;
                // …and change nothing durable: every write of their attempts is fenced, and what
                // they send again converges on what the later lives admitted.
                let (after, rows_after) = tokio.block_on(async {
                    let store = open().await;
                    (stream(&*store).await, ledger(&*store, &lives).await)
                });
                let json = |records: &[Record]| serde_json::to_value(records).unwrap();
                if json(&after) != json(&records) {
                    let error = format!("the paused lives changed the stream, to {after:#?}");
                    return Err(failed(&lives, TestCaseError::fail(error)));
                }
                if !same_ledger(&rows_after, &rows) {
                    let error = format!("the paused lives changed the ledger: {rows:#?} became {rows_after:#?}");
                    return Err(failed(&lives, TestCaseError::fail(error)));
                }
                Ok(())
            })
            .join()
            .unwrap()
    })
}

/// The admitted submissions' rows, and whether the instance has queued work.
async fn ledger(store: &dyn Store, lives: &Lives) -> (Vec<Option<Submission>>, bool) {
    let mut rows = Vec::new();
    for (_, id) in &lives.admitted {
        rows.push(store.submission(id).await.unwrap());
    }
    let queued = store.has_queued(&InstanceKey::new("keeper", INSTANCE)).await.unwrap();
    (rows, queued)
}

/// Whether two reads of the ledger (each by a store opened afresh) say the same. Postgres
/// gives a row's times on the node's clock, shifted by that store's estimate of the clock
/// offset, which two stores may make a millisecond or two apart: times this near are the
/// same time.
fn same_ledger(a: &(Vec<Option<Submission>>, bool), b: &(Vec<Option<Submission>>, bool)) -> bool {
    let near = |x: u64, y: u64| x.abs_diff(y) <= 5;
    a.1 == b.1
        && a.0.len() == b.0.len()
        && a.0.iter().zip(&b.0).all(|(a, b)| match (a, b) {
            (Some(a), Some(b)) => {
                let mut b = b.clone();
                let times = near(a.timeout_at_ms, b.timeout_at_ms) && near(a.lease_until_ms, b.lease_until_ms);
                (b.timeout_at_ms, b.lease_until_ms) = (a.timeout_at_ms, a.lease_until_ms);
                times && *a == b
            }
            (a, b) => a == b,
        })
}

/// What [`crash_and_recover`] checks.
/// Checks what the lives read back and the instance's stream (`records`, and the markers of
/// the batches settlements closed, see [`stream_and_closings`]).
fn check(
    lives: &Lives,
    (records, closings): (&[Record], &BTreeSet<String>),
    exchanges: &[Exchange],
) -> Result<(), TestCaseError> {
    for ((n, _), reply) in lives.admitted.iter().zip(&lives.replies) {
        match reply {
            // Its own answer checked (after the response's earlier texts), or a later
            // exchange's that joined its response. Unchecked only after a death: a response
            // whose final answer was durable settles as it is when taken over, without its
            // would-stop phase (reference §3.9: `completed`); or where an abort was requested:
            // an abort that lost the race to a durable answer ends the response as it is,
            // without its finish cycle (reference §3.10).
            Reply::Answer(text) => {
                let unchecked = !lives.deaths.is_empty() || may_abort(exchanges, *n);
                prop_assert!(
                    exchanges[*n..]
                        .iter()
                        .any(|exchange| text.ends_with(&checked(&exchange.answer))
                            || (unchecked && text.ends_with(&exchange.answer))),
                    "exchange {}'s answer: {:?}",
                    n,
                    text
                );
                // Whole texts only: a step a death cut mid-stream (its pieces durable) is
                // made again, and its piece is not part of what the sender reads.
                for part in text.split("\n\n") {
                    prop_assert!(
                        exchanges
                            .iter()
                            .any(|exchange| part == exchange.answer || part == checked(&exchange.answer)),
                        "exchange {}'s answer has the part {:?}: {:?}",
                        n,
                        part,
                        text
                    );
                }
            }
            Reply::Aborted => prop_assert!(may_abort(exchanges, *n), "exchange {} was aborted", n),
            Reply::Failed(error) => prop_assert!(false, "exchange {} failed: {}", n, error),
        }
    }
    prop_assert_eq!(
        lives.replies.len(),
        exchanges.len(),
        "every exchange was admitted and read back"
    );
    // What was durable when each life died is all still there, unchanged.
    let ids = |records: &[Record]| records.iter().map(|record| record.id.clone()).collect::<Vec<_>>();
    for death in &lives.deaths {
        prop_assert!(
            records.len() >= death.durable.len() && ids(&records[..death.durable.len()]) == ids(&death.durable),
            "the stream goes on from what the life that died at {:?} left",
            death.crash
        );
    }
    check_stream((records, closings), &lives.deaths, exchanges, &lives.admitted)
}

/// The instance's records, in order.
async fn stream(store: &dyn Store) -> Vec<Record> {
    stream_and_closings(store).await.0
}

/// The instance's records, in order, and the ids of the batch markers a settlement wrote: a
/// batch that no attempt committed, closed with its submission (the outcomes its calls
/// recorded stand; their state writes are absent, reference §3.3).
async fn stream_and_closings(store: &dyn Store) -> (Vec<Record>, BTreeSet<String>) {
    let batches = store.read(&InstanceKey::new("keeper", INSTANCE), None).await.unwrap();
    let mut closings = BTreeSet::new();
    for batch in &batches {
        let settles = batch
            .records
            .iter()
            .any(|record| matches!(record.body, RecordBody::SubmissionSettled { .. }));
        closings.extend(
            batch
                .records
                .iter()
                .filter(|record| settles && matches!(record.body, RecordBody::ToolResultsCommitted { .. }))
                .map(|record| record.id.clone()),
        );
    }
    let records = batches.iter().flat_map(|batch| batch.records.iter().cloned()).collect();
    (records, closings)
}

/// The outcome-unknown result a repaired call gets.
fn repaired(content: &str) -> bool {
    content.starts_with(r#"{"type":"interrupted""#)
}

/// Whether a call runs its tool: a tool the agent has, with arguments its schema takes.
fn runs_its_tool(name: &str, arguments: &Value) -> bool {
    match name {
        "add" | "divide" => arguments["a"].is_i64() && arguments["b"].is_i64(),
        "tally" => arguments["note"].is_string(),
        _ => false,
    }
}

fn check_stream(
    (records, closings): (&[Record], &BTreeSet<String>),
    deaths: &[Death],
    exchanges: &[Exchange],
    submissions: &[(usize, String)],
) -> Result<(), TestCaseError> {
    // Every message in the stream once, in order.
    let inputs: Vec<&str> = records
        .iter()
        .filter_map(|record| match &record.body {
            RecordBody::UserMessage { body, .. } => Some(body.as_str()),
            _ => None,
        })
        .collect();
    // (A submission aborted before it started never puts its message in the stream.)
    let sent: Vec<String> = (0..exchanges.len())
        .filter(|n| !may_abort(exchanges, *n) || inputs.contains(&message(*n).as_str()))
        .map(message)
        .collect();
    prop_assert_eq!(inputs, sent, "the stream's user messages");
    // Each answer to a message was checked once: a check signal follows an answer, never a
    // checked answer or another signal (a finish seam that committed does not run again), and
    // the answer after it is the checked one (a continuation that committed is answered, and
    // once), unless a message joined there or an abort ended the response.
    let interleaved = exchanges.iter().any(|exchange| exchange.overlap || exchange.abort);
    let (mut previous, mut checking): (Option<&str>, Option<&str>) = (None, None);
    for record in records {
        match &record.body {
            RecordBody::Signal { signal_type, .. } if signal_type == "check" => {
                prop_assert!(
                    previous.is_some_and(|text| text.starts_with("answer ")),
                    "a check signal after {:?}",
                    previous
                );
                checking = previous;
                previous = Some(CHECK);
            }
            RecordBody::AssistantMessageCompleted { text, .. } if !text.is_empty() => {
                if let Some(answer) = checking.take() {
                    prop_assert!(
                        *text == checked(answer) || interleaved,
                        "{:?} after the check of {:?}",
                        text,
                        answer
                    );
                } else {
                    prop_assert!(!text.starts_with("checked: "), "{:?} after {:?}", text, previous);
                }
                previous = Some(text);
            }
            _ => {}
        }
    }
    prop_assert!(
        checking.is_none() || interleaved,
        "the check of {:?} was never answered",
        checking
    );
    // Every submission settled once: completed, or aborted if an abort was requested.
    let mut settlements: BTreeMap<&str, Vec<Outcome>> = BTreeMap::new();
    for record in records {
        if let RecordBody::SubmissionSettled { outcome, .. } = &record.body {
            settlements
                .entry(record.submission_id.as_deref().unwrap_or_default())
                .or_default()
                .push(*outcome);
        }
    }
    prop_assert_eq!(
        settlements.keys().copied().collect::<Vec<_>>(),
        submissions
            .iter()
            .map(|(_, id)| id.as_str())
            .collect::<BTreeSet<_>>()
            .into_iter()
            .collect::<Vec<_>>(),
        "the submissions settled"
    );
    for (n, id) in submissions {
        let outcomes = &settlements[id.as_str()];
        let aborted = may_abort(exchanges, *n) && outcomes == &[Outcome::Aborted];
        prop_assert!(
            outcomes == &[Outcome::Completed] || aborted,
            "exchange {}'s settlements: {:?}",
            n,
            outcomes
        );
    }
    // Every scripted step made once, and each of its calls answered once.
    let mut calls: BTreeMap<&str, (&str, Value)> = BTreeMap::new();
    let mut outcomes: BTreeMap<&str, Vec<(bool, &str)>> = BTreeMap::new();
    // Which attempt appended each call's outcome (as its tool ended, or with the commit), and
    // which committed each step's batch: a tool's state writes go with its attempt's commit,
    // not with the marker a settlement closes the batch with (an abort during the batch).
    let mut answered_by: BTreeMap<&str, (&str, Option<&str>)> = BTreeMap::new();
    let mut committed_by: BTreeMap<&str, Option<&str>> = BTreeMap::new();
    for record in records {
        match &record.body {
            RecordBody::ToolOutcome {
                tool_call_id,
                assistant_message_id,
                ..
            } => {
                answered_by
                    .entry(tool_call_id)
                    .or_insert((assistant_message_id, record.attempt_id.as_deref()));
            }
            RecordBody::ToolResultsCommitted { assistant_message_id } if !closings.contains(&record.id) => {
                committed_by.insert(assistant_message_id, record.attempt_id.as_deref());
            }
            _ => {}
        }
    }
    for record in records {
        match &record.body {
            RecordBody::AssistantToolCall {
                tool_call_id,
                name,
                arguments,
                ..
            } => {
                let arguments = serde_json::from_str(arguments).unwrap();
                prop_assert!(
                    calls.insert(tool_call_id, (name, arguments)).is_none(),
                    "call {} was made twice: a durable step was redone",
                    tool_call_id
                );
            }
            RecordBody::ToolOutcome {
                tool_call_id,
                is_error,
                content,
                ..
            } => outcomes.entry(tool_call_id).or_default().push((*is_error, content)),
            _ => {}
        }
    }
    // Every call is one the script made, and the steps of each exchange are a prefix of its
    // script, each whole: all of them unless the next exchange overlapped (its message may
    // then have joined this exchange's response, and the model went on with its script).
    let mut made: BTreeMap<(usize, usize), Vec<usize>> = BTreeMap::new();
    for (id, (name, arguments)) in &calls {
        let place: Vec<usize> = id[1..].split('_').map(|part| part.parse().unwrap()).collect();
        let (n, step, index) = (place[0], place[1], place[2]);
        let scripted = &exchanges[n].steps[step][index];
        prop_assert_eq!((*name, arguments), (scripted.0.as_str(), &scripted.1), "call {}", id);
        made.entry((n, step)).or_default().push(index);
    }
    for (n, exchange) in exchanges.iter().enumerate() {
        let steps = made.range((n, 0)..(n + 1, 0)).count();
        for (step, calls) in exchange.steps.iter().enumerate().take(steps) {
            let indices = made.get(&(n, step)).cloned().unwrap_or_default();
            prop_assert_eq!(
                indices,
                (0..calls.len()).collect::<Vec<_>>(),
                "the calls of exchange {}'s step {}",
                n,
                step
            );
        }
        if exchanges.get(n + 1).is_none_or(|next| !next.overlap) && !may_abort(exchanges, n) {
            prop_assert_eq!(steps, exchange.steps.len(), "the steps exchange {} made", n);
        }
    }
    let charges = CHARGES.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let late_charges = LATE_CHARGES.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let mut settled_steps: BTreeMap<&str, usize> = BTreeMap::new();
    for record in records {
        if let RecordBody::ToolStepSettled { tool_call_id, .. } = &record.body {
            *settled_steps.entry(tool_call_id).or_default() += 1;
        }
    }
    let runs = runs();
    let mut counted = 0;
    for (id, (name, arguments)) in &calls {
        let answers = outcomes.get(id).map(Vec::as_slice).unwrap_or_default();
        prop_assert_eq!(answers.len(), 1, "call {}'s outcomes: {:?}", id, answers);
        let (is_error, content) = answers[0];
        let times = runs.get(*id).copied().unwrap_or(0);
        prop_assert!(times <= 1, "call {} ran {} times", id, times);
        // A call of a response an abort ended may have been cut short (an error result) or
        // left without an outcome for the next response to repair (an aborted response does
        // not resume, so not even a durable call runs again).
        let aborted = may_abort(exchanges, id[1..].split('_').next().unwrap().parse().unwrap()) && is_error;
        if *name == "charge" {
            // Durable: an interrupted call runs again, and its step's recorded value stands.
            let expected = format!("charged: receipt {}", arguments["note"].as_str().unwrap_or_default());
            prop_assert!(
                (is_error, content) == (false, expected.as_str()) || aborted,
                "charge call {}'s result: {}",
                id,
                content
            );
            // Its step's work ran once, or again after a crash before the step's record was
            // durable; never again once it was, but late in a paused life released.
            let charged = charges.get(*id).copied().unwrap_or(0);
            let late = late_charges.get(*id).copied().unwrap_or(0);
            prop_assert!(
                (1..=1 + deaths.len()).contains(&charged) || (aborted && charged == 0),
                "charge call {} charged {} times",
                id,
                charged
            );
            for death in deaths {
                let recorded = death.durable.iter().any(
                    |record| matches!(&record.body, RecordBody::ToolStepSettled { tool_call_id, .. } if tool_call_id == id),
                );
                let then = death.charges.get(*id).copied().unwrap_or(0);
                prop_assert!(
                    !recorded || charged - late == then,
                    "charge call {} charged {} times ({} late), {} when its step was recorded and a life died at {:?}",
                    id,
                    charged,
                    late,
                    then,
                    death.crash
                );
            }
            prop_assert!(
                settled_steps.get(*id).copied() == Some(1) || (aborted && !settled_steps.contains_key(*id)),
                "charge call {}'s settled steps: {:?}",
                id,
                settled_steps.get(*id)
            );
        } else if *name == "task" {
            let prompt = arguments["prompt"].as_str().unwrap_or_default();
            if !is_error {
                prop_assert!(
                    content.contains(&format!("done: {prompt}")),
                    "task call {}'s result: {}",
                    id,
                    content
                );
            }
        } else if repaired(content) {
            prop_assert!(is_error, "call {}'s repair is an error result", id);
        } else if !aborted {
            let runs_it = runs_its_tool(name, arguments);
            prop_assert_eq!(times, usize::from(runs_it), "how often call {} ran", id);
            if *name == "tally" && runs_it {
                prop_assert!(!is_error, "tally call {} failed: {}", id, content);
                // Its outcome stands once appended; its state write only if the attempt that
                // ran it also committed the batch (else the batch was settled by a later one).
                let (step, attempt) = answered_by[*id];
                if committed_by.get(step) == Some(&attempt) {
                    counted += 1;
                }
            }
        }
    }
    // The durable state: its last write (none: still the initial 0).
    let count = records
        .iter()
        .rev()
        .find_map(|record| match &record.body {
            RecordBody::StateWrite { name, value } if name == "count" => value.as_u64(),
            _ => None,
        })
        .unwrap_or(0);
    prop_assert_eq!(
        count,
        counted,
        "the state counts the tally calls their attempt committed"
    );
    Ok(())
}

/// A case: the exchanges, and where the store dies in each life but the last (a fraction of
/// the writes a whole run makes, which a later life, with less left to do, may not reach), with
/// whether that write is made, whether the life pauses there rather than dies, and when the
/// last life releases it (also a fraction of the whole run's writes; none: once it finished).
type Crashes = Vec<(f64, bool, bool, Option<f64>)>;

fn case() -> impl Strategy<Value = (Vec<Exchange>, Crashes)> {
    (
        prop::collection::vec(exchange(), 1..4),
        prop::collection::vec(
            (
                0.0..1.0f64,
                any::<bool>(),
                prop::bool::weighted(0.4),
                // The last life has less left to do: early in it.
                prop::option::weighted(0.5, 0.0..0.5f64),
            ),
            1..4,
        ),
    )
}

fn model_of(exchanges: &[Exchange]) -> Played {
    Played {
        exchanges: Arc::new(exchanges.to_vec()),
    }
}

/// Opens the memory store `store` (again: the same data).
fn memory(store: &MemoryStore) -> impl Fn() -> std::future::Ready<Arc<dyn Store>> + Sync {
    move || std::future::ready(Arc::new(store.clone()))
}

#[test]
fn a_crash_at_any_store_write_loses_no_input_and_redoes_no_durable_work() {
    harness::check_property(64, &case(), "case", async |(exchanges, deaths)| {
        // A whole run, to count the writes it makes (and check it too).
        forget_runs();
        let store = MemoryStore::new();
        let model = model_of(&exchanges);
        let open = memory(&store);
        let done = tokio::sync::watch::channel(true).1;
        let whole = std::thread::scope(|scope| life(scope, &open, &model, None, Lives::default(), Vec::new(), done).0);
        let (records, closings) = stream_and_closings(&store).await;
        check(&whole, (&records, &closings), &exchanges)?;
        // Truncating: each crash is at one of the writes the whole run made.
        #[allow(
            clippy::cast_possible_truncation,
            clippy::cast_sign_loss,
            clippy::cast_precision_loss
        )]
        let crashes: Vec<Crash> = deaths
            .iter()
            .map(|(fraction, made, paused, release)| Crash {
                at: (fraction * whole.writes as f64) as usize,
                made: *made,
                paused: *paused,
                release: release.map(|fraction| (fraction * whole.writes as f64) as usize),
            })
            .collect();
        crash_and_recover("memory store", memory(&MemoryStore::new()), &exchanges, &crashes).await?;
        let path = scratch::dir("crash").join("flue.db");
        let sqlite = || async { Arc::new(SqliteStore::open(&path).unwrap()) as Arc<dyn Store> };
        crash_and_recover("SQLite", sqlite, &exchanges, &crashes).await?;
        #[cfg(feature = "postgres")]
        if let Some(url) = harness::postgres_url("the crash model on Postgres") {
            use flue_runtime::store::PostgresStore;
            let schema = harness::fresh_schema("flue_crash");
            let postgres = || async {
                // A paused life may stall inside a transaction: the server ends it after this
                // (the store's own default, 10 s, is for a 30 s lease; a live life's
                // statements on a loaded machine must not be cut short).
                let store = PostgresStore::connect_with_schema(&url, &schema).await.unwrap();
                Arc::new(store.with_stalled_transaction_timeout(Duration::from_secs(1))) as Arc<dyn Store>
            };
            crash_and_recover("Postgres", postgres, &exchanges, &crashes).await?;
        }
        Ok(())
    });
}
