//! The command-line helper: `run`, `catalog` and `serve` over a built runtime.
#![allow(clippy::unwrap_used)] // tests assert by unwrapping

use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use flue_runtime::Runtime;
use flue_runtime::cli::{Cli, CliError, Command, execute};
use flue_runtime::prelude::*;
use flue_runtime::provider::ProviderRegistry;
use flue_runtime::store::MemoryStore;
use flue_runtime::testing::{ScriptedModel, ScriptedReply};
use serde_json::{Value, json};

/// Greets.
#[agent]
fn greeter() -> &'static str {
    use_model("scripted/g");
    let progress = use_data_writer::<String>("mood");
    use_agent_start(move |_| {
        let progress = progress.clone();
        async move { progress.write(&"cheerful".to_owned()) }
    });
    "Greet."
}

fn runtime(model: &ScriptedModel) -> Runtime {
    let mut providers = ProviderRegistry::new();
    providers.register(model.clone());
    Runtime::builder()
        .store(MemoryStore::new())
        .providers(providers)
        .agent(greeter)
        .build()
        .unwrap()
}

fn command(args: &[&str]) -> Command {
    Cli::try_from_args(std::iter::once("agents").chain(args.iter().copied()))
        .unwrap()
        .command
        .unwrap()
}

async fn output(runtime: &Runtime, args: &[&str]) -> Result<String, CliError> {
    let mut out = Vec::new();
    execute(runtime, command(args), &mut out).await?;
    Ok(String::from_utf8(out).unwrap())
}

#[tokio::test]
async fn run_prints_the_reply_text_and_with_json_the_whole_reply() {
    let model = ScriptedModel::new([ScriptedReply::text("Hello!"), ScriptedReply::text("Hello again!")]);
    let runtime = runtime(&model);
    assert_eq!(output(&runtime, &["run", "greeter", "hi"]).await.unwrap(), "Hello!\n");
    let reply: Value =
        serde_json::from_str(&output(&runtime, &["run", "greeter", "--json", "hi"]).await.unwrap()).unwrap();
    assert_eq!(reply["text"], "Hello again!");
    assert_eq!(reply["data"], json!({"mood": "cheerful"}));
    assert!(reply["submissionId"].as_str().unwrap().starts_with("sub_"));
    // Both went to the default instance id, one conversation.
    assert_eq!(model.requests()[1].messages.len(), 3);
}

#[tokio::test]
async fn run_with_an_unknown_agent_names_the_known_ones() {
    let runtime = runtime(&ScriptedModel::new([]));
    let error = output(&runtime, &["run", "nobody", "hi"]).await.unwrap_err();
    assert_eq!(error.to_string(), "no agent is named \"nobody\" (agents: greeter)");
    // A usage error, as clap's: a script tells it from a failed submission.
    assert_eq!(error.exit_code(), 2);
    let invalid = output(&runtime, &["run", "greeter", "--id", " ", "hi"])
        .await
        .unwrap_err();
    assert_eq!(invalid.exit_code(), 2, "{invalid}");
    // Last: `cli::run` gives the node's work back as the process is to exit (it admits
    // nothing after).
    assert_eq!(
        flue_runtime::cli::run(&runtime, command(&["run", "nobody", "hi"])).await,
        2
    );
}

#[tokio::test]
async fn run_of_a_failed_submission_exits_with_1() {
    use flue_runtime::provider::{ProviderError, ProviderErrorKind};
    let model = ScriptedModel::new([ScriptedReply::Error(ProviderError::new(
        ProviderErrorKind::BadRequest,
        "refused",
    ))]);
    let runtime = runtime(&model);
    let error = output(&runtime, &["run", "greeter", "hi"]).await.unwrap_err();
    assert_eq!(error.exit_code(), 1, "{error}");
}

/// Standard output whose reader went away (`… | head -1`).
struct ClosedPipe;

impl Write for ClosedPipe {
    fn write(&mut self, _: &[u8]) -> std::io::Result<usize> {
        Err(std::io::ErrorKind::BrokenPipe.into())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Err(std::io::ErrorKind::BrokenPipe.into())
    }
}

/// A run whose output's reader went away (`run … | head -c 10`) did what it was asked: it
/// ends quietly with 0, not with an error a script takes for a failed run.
#[tokio::test]
async fn a_run_whose_output_was_closed_ends_quietly_with_0() {
    let model = ScriptedModel::new([ScriptedReply::text("Hello!")]);
    let runtime = runtime(&model);
    let error = execute(&runtime, command(&["run", "greeter", "hi"]), &mut ClosedPipe)
        .await
        .unwrap_err();
    assert!(matches!(error, CliError::OutputClosed), "{error:?}");
    assert_eq!(error.exit_code(), 0);
    assert_eq!(model.requests().len(), 1, "the run was made");
    let error = execute(&runtime, command(&["catalog"]), &mut ClosedPipe)
        .await
        .unwrap_err();
    assert_eq!(error.exit_code(), 0);
}

/// A server whose output's reader went away (a dead log pipe) serves all the same: ended
/// quietly with 0, a supervisor restarting it on failure would not.
#[tokio::test]
async fn serve_whose_output_was_closed_serves_all_the_same() {
    let runtime = runtime(&ScriptedModel::new([]));
    let server = {
        let runtime = runtime.clone();
        tokio::spawn(
            async move { execute(&runtime, command(&["serve", "--addr", "127.0.0.1:0"]), &mut ClosedPipe).await },
        )
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!server.is_finished(), "serve ended: {:?}", server.await);
    server.abort();
}

#[tokio::test]
async fn catalog_prints_the_agents_as_json() {
    let runtime = runtime(&ScriptedModel::new([]));
    let catalog: Value = serde_json::from_str(&output(&runtime, &["catalog"]).await.unwrap()).unwrap();
    assert_eq!(catalog["agents"][0]["name"], "greeter");
    assert_eq!(catalog["agents"][0]["model"], "scripted/g");
}

#[test]
fn bad_arguments_are_refused_as_errors() {
    for args in [
        &["run"][..],
        &["run", "greeter"],
        &["serve", "--addr", "not-an-address"],
        // A port, a list or a wildcard would match no request: refused, not silently kept.
        &["serve", "--allow-host", "api.example.com:8080"],
        &["serve", "--allow-host", "a.example.com,b.example.com"],
        &["serve", "--allow-host", "*.example.com"],
        &["serve", "--allow-host", ""],
        &["launch"],
    ] {
        let error = Cli::try_from_args(std::iter::once("agents").chain(args.iter().copied())).unwrap_err();
        assert!(error.use_stderr(), "{args:?} is refused as an error: {error}");
    }
    assert!(
        Cli::try_from_args(["agents"]).unwrap().command.is_none(),
        "no command: the binary's default"
    );
}

/// `run`'s message may start with `-`, but an option `run` does not have is not taken for
/// the message (it would be sent to the model): one option-like word goes after `--`.
#[test]
fn an_unknown_option_in_runs_message_place_is_refused_unless_after_a_double_dash() {
    let parse = |args: &[&str]| Cli::try_from_args(std::iter::once("agents").chain(args.iter().copied()));
    for args in [
        &["run", "greeter", "--verbose"][..],
        &["run", "greeter", "-v"],
        &["run", "greeter", "--jsno=1"],
    ] {
        let error = parse(args).unwrap_err();
        assert_eq!(error.kind(), clap::error::ErrorKind::UnknownArgument, "{args:?}");
        assert!(error.to_string().contains("goes after '--'"), "{error}");
    }
    for (args, message) in [
        (&["run", "greeter", "--", "--verbose"][..], "--verbose"),
        (&["run", "greeter", "-5 is negative?"], "-5 is negative?"),
        (&["run", "greeter", "-42"], "-42"),
    ] {
        let Some(Command::Run { message: parsed, .. }) = parse(args).unwrap().command else {
            panic!("a run")
        };
        assert_eq!(parsed, message);
    }
}

/// A `Write` the test can read while `serve` runs.
#[derive(Clone, Default)]
struct Shared(Arc<Mutex<Vec<u8>>>);

impl Write for Shared {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Waits for `serve` to announce its address on `out`.
async fn announced(out: &Shared) -> String {
    for _ in 0..500 {
        let text = String::from_utf8(out.0.lock().unwrap().clone()).unwrap();
        if let Some(address) = text
            .strip_prefix("serving 1 agent on ")
            .and_then(|rest| rest.split_whitespace().next())
        {
            return address.to_owned();
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("serve did not announce its address")
}

/// `serve` of `runtime` on a free loopback port: its base URL, and the task serving.
async fn serving(runtime: &Runtime) -> (String, tokio::task::JoinHandle<Result<(), CliError>>) {
    let out = Shared::default();
    let server = {
        let (runtime, mut out) = (runtime.clone(), out.clone());
        tokio::spawn(async move { execute(&runtime, command(&["serve", "--addr", "127.0.0.1:0"]), &mut out).await })
    };
    (announced(&out).await, server)
}

#[tokio::test]
async fn serve_listens_and_serves_the_protocol() {
    let runtime = runtime(&ScriptedModel::new([ScriptedReply::text("Hello over HTTP!")]));
    let (base, server) = serving(&runtime).await;
    let client = flue_runtime::client::Client::new(&base).unwrap();
    let reply = client.instance("greeter", "web").prompt("hi").await.unwrap();
    assert_eq!(reply.text, "Hello over HTTP!");
    assert_eq!(reply.data["mood"], "cheerful");
    server.abort();
}

/// A model's tool call whose arguments nest 126 levels is stored and projected a few levels
/// deeper still: the client reads such a conversation (its reply, its stream, its history),
/// as browsers do, rather than stop at serde_json's own 128 levels for good.
#[tokio::test]
async fn the_client_reads_a_conversation_holding_arguments_nested_126_levels() {
    let deep = format!("{}1{}", r#"{"a":"#.repeat(126), "}".repeat(126));
    let runtime = runtime(&ScriptedModel::new([
        ScriptedReply::ToolCalls {
            text: String::new(),
            calls: vec![("nowhere".to_owned(), deep)],
        },
        ScriptedReply::text("Deep, but read."),
    ]));
    let (base, server) = serving(&runtime).await;
    let instance = flue_runtime::client::Client::new(&base)
        .unwrap()
        .instance("greeter", "deep");
    let reply = instance.prompt("go deep").await.unwrap();
    assert_eq!(reply.text, "Deep, but read.");
    let history = instance.history().await.unwrap();
    let mut input = &history["messages"][1]["parts"][0]["input"];
    let mut depth = 0;
    while let Some(inner) = input.get("a") {
        input = inner;
        depth += 1;
    }
    assert_eq!((depth, input), (126, &json!(1)), "{}", history["messages"][1]);
    server.abort();
}

/// Reports the weather as a value.
#[tool]
async fn forecast() -> Value {
    json!({"temperature": 21, "sky": "clear"})
}

#[agent]
fn forecaster() -> &'static str {
    use_model("scripted/g");
    use_tool(forecast);
    "Forecast."
}

/// A tool that answers a JSON value: the model reads it as text, and clients get the value as
/// the call's `output` (in the history and in the stream's `tool-output`), as the reference
/// serves it.
#[tokio::test]
async fn a_tools_json_answer_reaches_clients_as_its_value_and_the_model_as_text() {
    let model = ScriptedModel::new([
        ScriptedReply::tool_call("forecast", json!({})),
        ScriptedReply::text("Clear, 21 degrees."),
    ]);
    let mut providers = ProviderRegistry::new();
    providers.register(model.clone());
    let runtime = Runtime::builder()
        .store(MemoryStore::new())
        .providers(providers)
        .agent(forecaster)
        .build()
        .unwrap();
    let (base, server) = serving(&runtime).await;
    let instance = flue_runtime::client::Client::new(&base)
        .unwrap()
        .instance("forecaster", "f");
    assert_eq!(instance.prompt("weather?").await.unwrap().text, "Clear, 21 degrees.");
    let value = json!({"temperature": 21, "sky": "clear"});
    let history = instance.history().await.unwrap();
    assert_eq!(history["messages"][1]["parts"][0]["output"], value, "{history}");
    let updates: Value = reqwest::get(format!("{base}/agents/forecaster/f?view=updates&offset=-1"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let output = updates
        .as_array()
        .unwrap()
        .iter()
        .find(|chunk| chunk["type"] == "tool-output")
        .unwrap();
    assert_eq!(output["output"], value);
    let flue_runtime::provider::ModelMessage::Tool { content, .. } = &model.requests()[1].messages[2] else {
        panic!("the tool's result")
    };
    assert_eq!(*content, serde_json::to_string_pretty(&value).unwrap());
    server.abort();
}

#[tokio::test]
async fn serve_with_an_authorization_policy_refuses_requests_without_a_token() {
    use flue_runtime::http::{Access, BearerTokens, HttpOptions};
    let runtime = runtime(&ScriptedModel::new([ScriptedReply::text("Hello, you.")]));
    let options = HttpOptions::default().authorized_by(BearerTokens::new().allow("s3cret-token", Access::All));
    let out = Shared::default();
    let server = {
        let (runtime, mut out) = (runtime.clone(), out.clone());
        tokio::spawn(async move {
            flue_runtime::cli::execute_with(
                &runtime,
                command(&["serve", "--addr", "127.0.0.1:0"]),
                options,
                &mut out,
            )
            .await
        })
    };
    let base = announced(&out).await;
    let anonymous = flue_runtime::client::Client::new(&base).unwrap();
    let refused = anonymous.catalog().await.unwrap_err();
    assert!(
        matches!(refused, flue_runtime::client::ClientError::Api { status: 401, .. }),
        "{refused}"
    );
    let client = flue_runtime::client::Client::new(&base)
        .unwrap()
        .with_bearer_token("s3cret-token");
    let reply = client.instance("greeter", "web").prompt("hi").await.unwrap();
    assert_eq!(reply.text, "Hello, you.");
    server.abort();
}

#[tokio::test]
async fn run_takes_a_message_that_starts_with_a_dash() {
    let model = ScriptedModel::new([ScriptedReply::text("It is.")]);
    let runtime = runtime(&model);
    assert_eq!(
        output(&runtime, &["run", "greeter", "-5 is negative?"]).await.unwrap(),
        "It is.\n"
    );
    assert_eq!(
        model.requests()[0].messages.last(),
        Some(&flue_runtime::provider::ModelMessage::user("-5 is negative?"))
    );
}

#[tokio::test]
async fn serve_ends_open_live_reads_and_returns_once_stopped() {
    let model = ScriptedModel::new([ScriptedReply::text("Hello!")]);
    let runtime = runtime(&model);
    runtime.init(&greeter, "t1").send("hi").await.unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    // A grace far longer than the test's guard: the server must end because its responses
    // ended, not because it stopped waiting for them.
    let server = tokio::spawn({
        let runtime = runtime.clone();
        async move {
            let stop = async {
                let _ = stopped.await;
            };
            flue_runtime::cli::serve(&runtime, listener, stop, Duration::from_secs(3600)).await
        }
    });
    let client = reqwest::Client::new();
    let base = format!("http://{addr}/agents/greeter/t1");
    let head = client
        .get(format!("{base}?view=updates&offset=-1"))
        .send()
        .await
        .unwrap()
        .headers()["stream-next-offset"]
        .to_str()
        .unwrap()
        .to_owned();
    let mut sse = client
        .get(format!("{base}?view=updates&offset=-1&live=sse"))
        .send()
        .await
        .unwrap();
    assert!(sse.chunk().await.unwrap().is_some(), "the stream's first frames");
    let mut events = client.get(format!("{base}/events")).send().await.unwrap();
    assert_eq!(events.status(), 200);
    let long_poll = tokio::spawn(
        client
            .get(format!("{base}?view=updates&offset={head}&live=long-poll"))
            .send(),
    );
    // The long poll is waiting at the head before the server is stopped.
    tokio::time::sleep(Duration::from_millis(200)).await;
    stop.send(()).unwrap();
    // Guarded against a hang, not timed: every read ends on its own, then the server.
    tokio::time::timeout(Duration::from_secs(60), async {
        while sse.chunk().await.unwrap().is_some() {}
        while events.chunk().await.unwrap().is_some() {}
        let answered = long_poll.await.unwrap().unwrap();
        assert_eq!(answered.status(), 200);
        assert_eq!(answered.headers()["stream-next-offset"].to_str().unwrap(), head);
        server.await.unwrap().unwrap();
    })
    .await
    .expect("the open reads and the server end once it is stopped");
    assert!(
        runtime.init(&greeter, "t1").send("again").await.is_err(),
        "a stopped server's runtime admits nothing"
    );
}

/// Without an authorization policy `serve` answers only requests that name it by an IP
/// address, `localhost` or a name given with `--allow-host`.
#[tokio::test]
async fn serve_answers_the_names_given_with_allow_host_and_refuses_others() {
    let runtime = runtime(&ScriptedModel::new([]));
    let out = Shared::default();
    let server = {
        let (runtime, mut out) = (runtime.clone(), out.clone());
        tokio::spawn(async move {
            execute(
                &runtime,
                command(&["serve", "--addr", "127.0.0.1:0", "--allow-host", "agents.internal"]),
                &mut out,
            )
            .await
        })
    };
    let base = announced(&out).await;
    let port = base.rsplit(':').next().unwrap().to_owned();
    let catalog = |host: String| {
        reqwest::Client::new()
            .get(format!("{base}/agents"))
            .header("host", host)
            .send()
    };
    assert_eq!(
        catalog(format!("agents.internal:{port}"))
            .await
            .unwrap()
            .status()
            .as_u16(),
        200
    );
    assert_eq!(
        catalog(format!("localhost:{port}")).await.unwrap().status().as_u16(),
        200
    );
    assert_eq!(
        catalog(format!("elsewhere.example:{port}"))
            .await
            .unwrap()
            .status()
            .as_u16(),
        403
    );
    server.abort();
}
