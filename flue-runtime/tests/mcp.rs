//! MCP connections against an in-test MCP server (rmcp, streamable HTTP on loopback): tools
//! mounted as `mcp__<server>__<tool>`, calls, error results, the tool filter, the bearer token,
//! and an unreachable server failing the submission or, when optional, narrated (issue 8,
//! item 6); a result's size cap, the URL secrets kept out of connection errors, and tools whose
//! names collide.
#![allow(clippy::unwrap_used)] // tests assert by unwrapping

use std::sync::Arc;

use axum::http::StatusCode;
use flue_runtime::RuntimeError;
use flue_runtime::mcp::McpConnection;
use flue_runtime::prelude::*;
use flue_runtime::provider::ModelMessage;
use flue_runtime::testing::{ScriptedModel, ScriptedReply};
use flue_runtime::tool::Secret;
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, ContentBlock, ListToolsResult, PaginatedRequestParams,
    ServerCapabilities, ServerConfig, Tool as McpTool,
};
use rmcp::service::RequestContext;
use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
use rmcp::transport::streamable_http_server::{StreamableHttpServerConfig, StreamableHttpService};
use rmcp::{ErrorData, RoleServer, ServerHandler};
use serde_json::json;

mod harness;
use harness::{run_error, runtime_with, tool_results};

#[derive(Clone)]
struct Docs;

fn schema(value: serde_json::Value) -> Arc<serde_json::Map<String, serde_json::Value>> {
    Arc::new(value.as_object().unwrap().clone())
}

impl ServerHandler for Docs {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build())
    }

    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, ErrorData> {
        Ok(ListToolsResult::with_all_items(vec![
            McpTool::new(
                "search",
                "Search the docs.",
                schema(json!({"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]})),
            ),
            McpTool::new("fail", "Always fails.", schema(json!({"type": "object"}))),
            McpTool::new("admin.purge", "Dangerous.", schema(json!({"type": "object"}))),
            McpTool::new("hang", "Never answers.", schema(json!({"type": "object"}))),
            McpTool::new("dump", "Answers at length.", schema(json!({"type": "object"}))),
            // Two names that clean to the same mounted name.
            McpTool::new("search.issues", "Search issues.", schema(json!({"type": "object"}))),
            McpTool::new("search_issues", "Search issues too.", schema(json!({"type": "object"}))),
            // Arguments that are not an object: no model request could carry it.
            McpTool::new("listing", "Takes a list.", schema(json!({"type": "array"}))),
            McpTool::new("rude", "Fails at length.", schema(json!({"type": "object"}))),
        ]))
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        _context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, ErrorData> {
        let query = request
            .arguments
            .as_ref()
            .and_then(|arguments| arguments.get("query"))
            .and_then(|query| query.as_str())
            .unwrap_or_default()
            .to_owned();
        if &*request.name == "hang" {
            std::future::pending::<()>().await;
        }
        if &*request.name == "rude" {
            return Err(ErrorData::internal_error("€".repeat(70_000), None));
        }
        Ok(match &*request.name {
            // 3-byte characters, so that a cut by bytes has to find a character boundary.
            "dump" => CallToolResult::success(vec![ContentBlock::text("€".repeat(70_000))]),
            "search" => CallToolResult::success(vec![
                ContentBlock::text(format!("3 pages mention {query}")),
                ContentBlock::text("top: /guide/start"),
            ]),
            _ => CallToolResult::error(vec![ContentBlock::text("the index is rebuilding")]),
        }
        .into())
    }
}

/// The docs server on loopback; its URL.
async fn serve_docs() -> String {
    serve(Docs).await
}

/// An MCP server of `handler` on loopback that requires `Authorization: Bearer t0ken`; its
/// URL.
async fn serve<H: ServerHandler + Clone + Send + Sync + 'static>(handler: H) -> String {
    let service: StreamableHttpService<H, LocalSessionManager> = StreamableHttpService::new(
        move || Ok(handler.clone()),
        Default::default(),
        StreamableHttpServerConfig::default(),
    );
    let router = axum::Router::new()
        .nest_service("/mcp", service)
        .layer(axum::middleware::from_fn(
            |request: axum::extract::Request, next: axum::middleware::Next| async move {
                let authorized = request
                    .headers()
                    .get("authorization")
                    .is_some_and(|value| value == "Bearer t0ken");
                if authorized {
                    next.run(request).await
                } else {
                    axum::response::IntoResponse::into_response(StatusCode::UNAUTHORIZED)
                }
            },
        ));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });
    format!("http://{address}/mcp")
}

static URL: std::sync::OnceLock<String> = std::sync::OnceLock::new();
static TOKEN: std::sync::OnceLock<&'static str> = std::sync::OnceLock::new();

#[agent]
fn researcher() -> &'static str {
    use_model("scripted/x");
    use_mcp_connection(
        McpConnection::new("docs", URL.get().unwrap().clone())
            .auth(Secret::new(*TOKEN.get().unwrap_or(&"t0ken")))
            .tools(["search", "fail"]),
    );
    "Research with the docs server."
}

#[agent]
fn tolerant() -> &'static str {
    use_model("scripted/x");
    use_mcp_connection(McpConnection::new("docs", "http://127.0.0.1:9/mcp").optional());
    "Work without the docs if need be."
}

#[agent]
fn strict() -> &'static str {
    use_model("scripted/x");
    use_mcp_connection(McpConnection::new("docs", "http://127.0.0.1:9/mcp"));
    "Needs the docs."
}

#[tokio::test]
async fn a_servers_tools_are_mounted_called_and_filtered() {
    let url = serve_docs().await;
    let _ = URL.set(url);
    let model = ScriptedModel::new([
        ScriptedReply::tool_calls([
            ("mcp__docs__search", json!({"query": "sandbox"})),
            ("mcp__docs__fail", json!({})),
        ]),
        ScriptedReply::text("done"),
    ]);
    let runtime = runtime_with(&model, [researcher.into()]);
    runtime.init(&researcher, "r").send("find sandbox docs").await.unwrap();
    let requests = model.requests();
    let tools: Vec<(&str, &str)> = requests[0]
        .tools
        .iter()
        .filter(|tool| !flue_runtime::testing::is_framework_tool(&tool.name))
        .map(|tool| (&*tool.name, &*tool.description))
        .collect();
    assert_eq!(
        tools,
        [
            (
                "mcp__docs__search",
                "Search the docs.\n\n(MCP tool \"search\" of server \"docs\".)"
            ),
            (
                "mcp__docs__fail",
                "Always fails.\n\n(MCP tool \"fail\" of server \"docs\".)"
            )
        ],
        "the filter leaves admin.purge out"
    );
    assert_eq!(requests[0].tools[0].parameters["required"], json!(["query"]));
    assert_eq!(
        tool_results(&requests[1]),
        [
            ("3 pages mention sandbox\ntop: /guide/start".to_owned(), false),
            ("the index is rebuilding".to_owned(), true),
        ]
    );
}

static STRICT_STARTED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

#[agent]
fn strict_with_start() -> &'static str {
    use_model("scripted/x");
    use_mcp_connection(McpConnection::new("docs", "http://127.0.0.1:9/mcp"));
    use_agent_start(|_ctx| async {
        STRICT_STARTED.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Ok::<(), &str>(())
    });
    "Needs the docs."
}

/// Reference §3.7: connections are made at initialization (step 2), before the input is
/// stored (step 4) and the start seam runs (step 9).
#[tokio::test]
async fn a_required_server_that_cannot_be_reached_fails_the_submission_before_its_input_or_start_callbacks() {
    let store = flue_runtime::store::MemoryStore::new();
    let model = ScriptedModel::new([]);
    let runtime = harness::runtime_on(store.clone(), &model, [strict_with_start.into()]);
    let error = runtime.init(&strict_with_start, "s").send("go").await.unwrap_err();
    let (error_type, _) = run_error(error);
    assert_eq!(error_type, "mcp_connection_failed");
    assert_eq!(STRICT_STARTED.load(std::sync::atomic::Ordering::SeqCst), 0);
    let key = flue_runtime::store::InstanceKey::new("strict_with_start", "s");
    let batches = flue_runtime::store::Store::read(&store, &key, None).await.unwrap();
    let inputs = batches
        .iter()
        .flat_map(|batch| batch.records.iter())
        .filter(|record| {
            matches!(
                record.body,
                flue_runtime::record::RecordBody::UserMessage { .. } | flue_runtime::record::RecordBody::AgentStartRun
            )
        })
        .count();
    assert_eq!(inputs, 0, "no input record, no start seam marker");
}

#[tokio::test]
async fn an_unreachable_server_fails_the_submission_unless_it_is_optional() {
    let model = ScriptedModel::new([]);
    let runtime = runtime_with(&model, [strict.into()]);
    let error = runtime.init(&strict, "s").send("go").await.unwrap_err();
    let (error_type, message) = run_error(error);
    assert_eq!(error_type, "mcp_connection_failed");
    assert!(
        message.starts_with("[flue] The MCP server \"docs\" could not be used: "),
        "{message}"
    );

    let model = ScriptedModel::new([ScriptedReply::text("I'll do without the docs.")]);
    let runtime = runtime_with(&model, [tolerant.into()]);
    let reply = runtime.init(&tolerant, "t").send("go").await.unwrap();
    assert_eq!(reply.text, "I'll do without the docs.");
    let request = &model.requests()[0];
    assert!(
        request
            .tools
            .iter()
            .all(|tool| flue_runtime::testing::is_framework_tool(&tool.name))
    );
    let ModelMessage::User { content, .. } = request.messages.last().unwrap() else {
        panic!("the narration")
    };
    // (Signal bodies reach the model escaped.)
    assert!(
        content.starts_with(
            "<signal type=\"resources\" resource=\"mcp\">\nThe MCP server \"docs\" is unavailable for this response ("
        ),
        "{content}"
    );
    assert!(!content.contains("WorkerTransport"), "{content}");
    assert!(content.contains("its tools are not mounted."), "{content}");
}

#[agent]
fn tolerant_noter() -> &'static str {
    use_model("scripted/x");
    use_mcp_connection(McpConnection::new("docs", "http://127.0.0.1:9/mcp").optional());
    use_tool(
        Tool::new("note")
            .description("Take a note.")
            .run(|_ctx, _: serde_json::Map<String, serde_json::Value>| async { "noted" }),
    );
    "Take notes without the docs if need be."
}

/// A re-attempt (here after its tool batch failed to commit) that finds an optional server
/// still unreachable stores no second notice of it: the response has one.
#[tokio::test]
async fn an_unreachable_optional_server_is_narrated_once_per_response_across_attempts() {
    let model = ScriptedModel::new([
        ScriptedReply::tool_call("note", serde_json::json!({})),
        ScriptedReply::text("Noted, without the docs."),
    ]);
    let store = harness::faulty::FaultyStore::on(Arc::new(flue_runtime::store::MemoryStore::new()));
    store.fail_once(harness::faulty::commits_a_tool_batch);
    let runtime = harness::runtime_on(store.clone(), &model, [tolerant_noter.into()]);
    let reply = runtime.init(&tolerant_noter, "n").send("go").await.unwrap();
    assert_eq!(reply.text, "Noted, without the docs.");
    assert_eq!(
        store.failures.load(std::sync::atomic::Ordering::SeqCst),
        1,
        "the batch failed once"
    );
    let batches = flue_runtime::store::Store::read(
        &store,
        &flue_runtime::store::InstanceKey::new("tolerant_noter", "n"),
        None,
    )
    .await
    .unwrap();
    let notices = batches
        .iter()
        .flat_map(|batch| batch.records.iter())
        .filter(|record| {
            matches!(&record.body, flue_runtime::record::RecordBody::Signal { body, .. }
                if body.contains("is unavailable for this response"))
        })
        .count();
    assert_eq!(notices, 1, "{batches:#?}");
}

static HANG_URL: std::sync::OnceLock<String> = std::sync::OnceLock::new();

#[agent]
fn patient() -> &'static str {
    use_model("scripted/x");
    // No timeout set: the default must still bound a call.
    use_mcp_connection(
        McpConnection::new("docs", HANG_URL.get().unwrap().clone())
            .auth(Secret::new("t0ken"))
            .tools(["hang"]),
    );
    "Research with the docs server."
}

#[tokio::test]
async fn a_call_to_a_server_that_never_answers_ends_as_an_error_result() {
    let _ = HANG_URL.set(serve_docs().await);
    let model = ScriptedModel::new([
        ScriptedReply::tool_call("mcp__docs__hang", json!({})),
        ScriptedReply::text("done"),
    ]);
    let runtime = runtime_with(&model, [patient.into()]);
    let reply = tokio::time::timeout(
        std::time::Duration::from_secs(90),
        runtime.init(&patient, "h").send("go"),
    )
    .await
    .expect("the response hung on the MCP call")
    .unwrap();
    assert_eq!(reply.text, "done");
    let results = tool_results(&model.requests()[1]);
    assert_eq!(
        results,
        [("The MCP server did not answer within 60 s.".to_owned(), true)]
    );
}

static DUMP_URL: std::sync::OnceLock<String> = std::sync::OnceLock::new();

#[agent]
fn reader() -> &'static str {
    use_model("scripted/x");
    use_mcp_connection(
        McpConnection::new("docs", DUMP_URL.get().unwrap().clone())
            .auth(Secret::new("t0ken"))
            .tools(["dump"]),
    );
    "Read what the docs server dumps."
}

#[tokio::test]
async fn a_tool_result_is_cut_to_the_sandbox_output_cap_and_says_so() {
    let _ = DUMP_URL.set(serve_docs().await);
    let model = ScriptedModel::new([
        ScriptedReply::tool_call("mcp__docs__dump", json!({})),
        ScriptedReply::text("done"),
    ]);
    let runtime = runtime_with(&model, [reader.into()]);
    runtime.init(&reader, "d").send("go").await.unwrap();
    let results = tool_results(&model.requests()[1]);
    let [(text, false)] = results.as_slice() else {
        panic!("one successful result: {results:?}")
    };
    assert!(text.len() <= 50 * 1024 + 200, "{} bytes", text.len());
    assert!(text.starts_with("€€€"), "{}", &text[..30]);
    let kept = text.matches('€').count();
    assert_eq!(kept, 50 * 1024 / 3, "whole characters up to the cap");
    assert!(
        text.ends_with(&format!(
            "\n[Output truncated: the first {} of 210000 bytes.]",
            kept * 3
        )),
        "{}",
        &text[text.len() - 80..]
    );
}

static CLASH_URL: std::sync::OnceLock<String> = std::sync::OnceLock::new();

#[agent]
fn clashing() -> &'static str {
    use_model("scripted/x");
    use_mcp_connection(
        McpConnection::new("docs", CLASH_URL.get().unwrap().clone())
            .auth(Secret::new("t0ken"))
            .tools(["search", "search.issues", "search_issues"]),
    );
    "Search the issues."
}

#[agent]
fn clashing_optional() -> &'static str {
    use_model("scripted/x");
    use_mcp_connection(
        McpConnection::new("docs", CLASH_URL.get().unwrap().clone())
            .auth(Secret::new("t0ken"))
            .tools(["search", "search.issues", "search_issues"])
            .optional(),
    );
    "Search the issues."
}

#[tokio::test]
async fn tools_whose_names_clean_to_the_same_name_refuse_the_server_naming_both() {
    let _ = CLASH_URL.set(serve_docs().await);
    let model = ScriptedModel::new([]);
    let runtime = runtime_with(&model, [clashing.into()]);
    let error = runtime.init(&clashing, "c").send("go").await.unwrap_err();
    let (error_type, message) = run_error(error);
    assert_eq!(error_type, "mcp_connection_failed", "{message}");
    assert_eq!(
        message,
        "[flue] The MCP server \"docs\" could not be used: its tools \"search.issues\" and \
         \"search_issues\" would both be mounted as \"mcp__docs__search_issues\"; list only one \
         of them in the connection's tools"
    );

    // Optional, the server is left out for the response, every time, and the model told why.
    let model = ScriptedModel::new([ScriptedReply::text("no issues then")]);
    let runtime = runtime_with(&model, [clashing_optional.into()]);
    let reply = runtime.init(&clashing_optional, "o").send("go").await.unwrap();
    assert_eq!(reply.text, "no issues then");
    let request = &model.requests()[0];
    assert!(
        request
            .tools
            .iter()
            .all(|tool| flue_runtime::testing::is_framework_tool(&tool.name))
    );
    let ModelMessage::User { content, .. } = request.messages.last().unwrap() else {
        panic!("the narration")
    };
    assert!(content.contains("would both be mounted as"), "{content}");
}

/// A server listing one good tool, one whose arguments are not an object, one whose schema is
/// larger than a tool's may be, one with a description longer than a tool keeps and one with a
/// name of 100,000 characters and no description.
#[derive(Clone)]
struct Mixed;

/// An object schema of about 100 KiB: a thousand documented properties.
fn huge_schema() -> serde_json::Value {
    let properties: serde_json::Map<String, serde_json::Value> = (0..1000)
        .map(|i| {
            (
                format!("p{i}"),
                json!({"type": "string", "description": "x".repeat(64)}),
            )
        })
        .collect();
    json!({"type": "object", "properties": properties})
}

impl ServerHandler for Mixed {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build())
    }

    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, ErrorData> {
        Ok(ListToolsResult::with_all_items(vec![
            McpTool::new("search", "Search the docs.", schema(json!({"type": "object"}))),
            McpTool::new("listing", "Takes a list.", schema(json!({"type": "array"}))),
            McpTool::new("huge", "Takes everything.", schema(huge_schema())),
            McpTool::new("wordy", "é".repeat(5000), schema(json!({"type": "object"}))),
            McpTool::new("n".repeat(100_000), "", schema(json!({"type": "object"}))),
        ]))
    }
}

static MIXED_URL: std::sync::OnceLock<String> = std::sync::OnceLock::new();

#[agent]
fn unfiltered() -> &'static str {
    use_model("scripted/x");
    use_mcp_connection(McpConnection::new("mixed", MIXED_URL.get().unwrap().clone()).auth(Secret::new("t0ken")));
    "Use whatever it has."
}

#[tokio::test]
async fn a_tool_the_connection_does_not_name_is_left_out_when_its_schema_is_unusable_and_a_long_description_is_cut() {
    let logs = harness::logs::capture();
    let _ = MIXED_URL.set(serve(Mixed).await);
    let model = ScriptedModel::new([ScriptedReply::text("ok")]);
    let runtime = runtime_with(&model, [unfiltered.into()]);
    runtime.init(&unfiltered, "u").send("go").await.unwrap();
    let names: Vec<String> = model.requests()[0]
        .tools
        .iter()
        .map(|tool| tool.name.to_string())
        .filter(|name| name.starts_with("mcp__"))
        .collect();
    assert_eq!(names, ["mcp__mixed__search", "mcp__mixed__wordy"]);
    let lines = logs.all();
    assert!(
        lines.iter().any(|line| line.contains("leaving out tool \"listing\"")),
        "{lines:?}"
    );
    assert!(
        lines
            .iter()
            .any(|line| line.contains("leaving out tool \"huge\"")
                && line.contains("more than the 65536 a tool's may be")),
        "{lines:?}"
    );
    // 10,000 bytes of two-byte characters, cut on a character boundary at 8 KiB.
    let wordy = model.requests()[0]
        .tools
        .iter()
        .find(|tool| tool.name == "mcp__mixed__wordy")
        .map(|tool| tool.description.to_string())
        .unwrap();
    assert_eq!(
        wordy,
        format!("{}…\n\n(MCP tool \"wordy\" of server \"mixed\".)", "é".repeat(4096))
    );
    assert!(
        lines.iter().any(|line| line.contains("description is 10000 bytes")),
        "{lines:?}"
    );
    // The long name (a tool that says nothing of itself would be described by it) is left out,
    // and quoted cut.
    assert!(
        lines.iter().any(
            |line| line.contains(&format!("leaving out tool \"{}…\"", "n".repeat(100)))
                && line.contains("its name is 100000 characters, more than the 128 an MCP tool's may be")
        ),
        "{lines:?}"
    );
    assert!(
        lines.iter().all(|line| !line.contains(&"n".repeat(101))),
        "no log line quotes it whole"
    );
    let declared = serde_json::to_string(&model.requests()[0].tools).unwrap();
    assert!(!declared.contains(&"n".repeat(101)), "no declaration carries it");
}

static HUGE_URL: std::sync::OnceLock<String> = std::sync::OnceLock::new();

#[agent]
fn huge_user() -> &'static str {
    use_model("scripted/x");
    use_mcp_connection(
        McpConnection::new("mixed", HUGE_URL.get().unwrap().clone())
            .auth(Secret::new("t0ken"))
            .tools(["huge"]),
    );
    "Use the huge one."
}

#[tokio::test]
async fn a_named_tool_whose_schema_is_too_large_refuses_the_server() {
    let _ = HUGE_URL.set(serve(Mixed).await);
    let model = ScriptedModel::new([]);
    let runtime = runtime_with(&model, [huge_user.into()]);
    let error = runtime.init(&huge_user, "h").send("go").await.unwrap_err();
    let (error_type, message) = run_error(error);
    assert_eq!(error_type, "mcp_connection_failed", "{message}");
    assert!(
        message.contains("tool \"huge\": its input schema is ") && message.contains("more than the 65536"),
        "{message}"
    );
    assert!(model.requests().is_empty(), "no model request was made");
}

static VERBOSE_URL: std::sync::OnceLock<String> = std::sync::OnceLock::new();

/// A server whose tools listing fails with a megabyte of error text.
#[derive(Clone)]
struct Verbose;

impl ServerHandler for Verbose {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build())
    }

    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, ErrorData> {
        Err(ErrorData::internal_error(
            format!("the index broke: {}", "x".repeat(1 << 20)),
            None,
        ))
    }
}

#[agent]
fn verbose_user() -> &'static str {
    use_model("scripted/x");
    use_mcp_connection(McpConnection::new("verbose", VERBOSE_URL.get().unwrap().clone()).auth(Secret::new("t0ken")));
    "Use it."
}

/// A required server's failure is said in a line, however long the server's error: the
/// settlement's message (stored, served over HTTP, printed) does not carry a megabyte.
#[tokio::test]
async fn a_required_servers_megabyte_error_fails_the_submission_in_a_line() {
    let _ = VERBOSE_URL.set(serve(Verbose).await);
    let model = ScriptedModel::new([]);
    let runtime = runtime_with(&model, [verbose_user.into()]);
    let error = runtime.init(&verbose_user, "v").send("go").await.unwrap_err();
    let (error_type, message) = run_error(error);
    assert_eq!(error_type, "mcp_connection_failed");
    assert!(message.contains("the index broke: xxx"), "{message}");
    assert!(message.len() < 1_000, "{} bytes", message.len());
}

/// Each test's own server (a server lives on its test's runtime).
static LISTING_URL: std::sync::OnceLock<String> = std::sync::OnceLock::new();
static RUDE_URL: std::sync::OnceLock<String> = std::sync::OnceLock::new();

#[agent]
fn listing() -> &'static str {
    use_model("scripted/x");
    use_mcp_connection(
        McpConnection::new("docs", LISTING_URL.get().unwrap().clone())
            .auth(Secret::new("t0ken"))
            .tools(["search", "listing"]),
    );
    "List."
}

#[tokio::test]
async fn a_tool_whose_schema_root_is_not_an_object_refuses_the_server() {
    let _ = LISTING_URL.set(serve_docs().await);
    let model = ScriptedModel::new([]);
    let runtime = runtime_with(&model, [listing.into()]);
    let error = runtime.init(&listing, "l").send("go").await.unwrap_err();
    let (error_type, message) = run_error(error);
    assert_eq!(error_type, "mcp_connection_failed", "{message}");
    assert_eq!(
        message,
        "[flue] The MCP server \"docs\" could not be used: tool \"listing\": MCP tool input \
         must be a top-level object schema."
    );
    assert!(model.requests().is_empty(), "no model request was made");
}

#[agent]
fn rude_reader() -> &'static str {
    use_model("scripted/x");
    use_mcp_connection(
        McpConnection::new("docs", RUDE_URL.get().unwrap().clone())
            .auth(Secret::new("t0ken"))
            .tools(["rude"]),
    );
    "Read."
}

#[tokio::test]
async fn a_failed_calls_error_text_is_cut_to_the_output_cap() {
    let _ = RUDE_URL.set(serve_docs().await);
    let model = ScriptedModel::new([
        ScriptedReply::tool_call("mcp__docs__rude", json!({})),
        ScriptedReply::text("done"),
    ]);
    let runtime = runtime_with(&model, [rude_reader.into()]);
    runtime.init(&rude_reader, "r").send("go").await.unwrap();
    let results = tool_results(&model.requests()[1]);
    let [(text, true)] = results.as_slice() else {
        panic!("one error result: {results:?}")
    };
    assert!(text.starts_with("The MCP server failed the call: "), "{}", &text[..40]);
    assert!(text.len() <= 50 * 1024 + 200, "{} bytes", text.len());
    assert!(text.ends_with(" bytes.]"), "{}", &text[text.len() - 60..]);
}

#[agent]
fn indiscreet() -> &'static str {
    use_model("scripted/x");
    use_mcp_connection(McpConnection::new(
        "docs",
        "http://user:pw-s3cret@127.0.0.1:9/mcp?token=q-s3cret&x=1#f-s3cret",
    ));
    "Needs the docs."
}

#[tokio::test]
async fn a_connection_error_quotes_no_userinfo_query_fragment_or_path_of_the_url() {
    let model = ScriptedModel::new([]);
    let runtime = runtime_with(&model, [indiscreet.into()]);
    let error = runtime.init(&indiscreet, "i").send("go").await.unwrap_err();
    let (_, message) = run_error(error);
    assert!(
        message.starts_with("[flue] The MCP server \"docs\" could not be used: "),
        "{message}"
    );
    assert!(!message.contains("s3cret"), "{message}");
    assert!(!message.contains("user"), "{message}");
    // The path goes too: some hosted servers take their key as a path segment.
    assert!(message.contains("(http://127.0.0.1:9/…)"), "{message}");
}

static ECHOING_URL: std::sync::OnceLock<String> = std::sync::OnceLock::new();

#[agent]
fn echoed() -> &'static str {
    use_model("scripted/x");
    use_mcp_connection(
        McpConnection::new("docs", ECHOING_URL.get().unwrap().clone())
            .auth(Secret::new("tok_live_abc123"))
            .header("X-Api-Key", "Key key/live-xyz789"),
    );
    "Needs the docs."
}

/// A server that refuses the credentials it was sent and quotes them back (as JSON, so the
/// `/` of the escaped form shows too): its error reaches the settlement, the model, the
/// records and the log, none of which may show them.
#[tokio::test]
async fn a_refusal_that_quotes_the_connections_credentials_back_is_redacted() {
    let router = axum::Router::new().route(
        "/mcp",
        axum::routing::any(|headers: axum::http::HeaderMap| async move {
            let said = |name: &str| headers.get(name).and_then(|v| v.to_str().ok()).unwrap_or("").to_owned();
            let body = json!({"error": format!(
                "invalid credentials: {} / {}",
                said("authorization"),
                said("x-api-key")
            )});
            (StatusCode::FORBIDDEN, body.to_string())
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });
    let _ = ECHOING_URL.set(format!("http://{address}/mcp"));
    let model = ScriptedModel::new([]);
    let runtime = runtime_with(&model, [echoed.into()]);
    let error = runtime.init(&echoed, "e").send("go").await.unwrap_err();
    let (_, message) = run_error(error);
    assert!(
        message.contains("invalid credentials"),
        "the server's words are kept: {message}"
    );
    for secret in ["tok_live_abc123", "key/live-xyz789", "key\\/live-xyz789", "live-xyz789"] {
        assert!(!message.contains(secret), "{secret} in {message}");
    }
    assert!(message.contains("[redacted]"), "{message}");
}

/// A server whose tools list comes in pages and whose results carry resources, images and
/// structured content.
#[derive(Clone)]
struct Library {
    /// The cursor its last page names again (a server that would be listed for ever).
    repeats_cursor: bool,
}

impl ServerHandler for Library {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build())
    }

    async fn list_tools(
        &self,
        request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, ErrorData> {
        let cursor = request.and_then(|request| request.cursor);
        let (tool, next) = match cursor.as_deref() {
            None => (
                // No `type`, no `properties`: an object's schema with none.
                McpTool::new("fetch", "Fetch a page.", schema(json!({}))),
                Some("page-2"),
            ),
            Some("page-2") => (
                McpTool::new("look", "Look at a picture.", schema(json!({"type": "object"}))),
                self.repeats_cursor.then_some("page-2"),
            ),
            Some(other) => return Err(ErrorData::invalid_params(format!("no cursor {other}"), None)),
        };
        let mut result = ListToolsResult::with_all_items(vec![
            tool,
            // Not a JSON Schema at all: left out when the connection does not name it.
            McpTool::new(
                format!("broken-{}", cursor.as_deref().unwrap_or("page-1")),
                "Broken.",
                schema(json!({"type": "object", "properties": {"n": {"type": "int"}}})),
            ),
        ]);
        result.next_cursor = next.map(str::to_owned);
        Ok(result)
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        _context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, ErrorData> {
        let mut result = match &*request.name {
            "fetch" => CallToolResult::success(vec![
                ContentBlock::embedded_text("https://example.org/guide", "Chapter one."),
                ContentBlock::resource_link(
                    rmcp::model::Resource::new("https://example.org/next", "next chapter")
                        .with_description("Chapter two."),
                ),
            ]),
            _ => CallToolResult::success(vec![ContentBlock::image("aGVsbG8=", "image/png")]),
        };
        if &*request.name == "look" {
            result.structured_content = Some(json!({"faces": 2}));
        }
        Ok(result.into())
    }
}

static LIBRARY_URL: std::sync::OnceLock<String> = std::sync::OnceLock::new();
static LOOPING_URL: std::sync::OnceLock<String> = std::sync::OnceLock::new();

#[agent]
fn librarian() -> &'static str {
    use_model("scripted/x");
    use_mcp_connection(McpConnection::new("library", LIBRARY_URL.get().unwrap().clone()).auth(Secret::new("t0ken")));
    "Read."
}

#[tokio::test]
async fn every_page_of_tools_is_mounted_and_resources_images_and_structured_content_reach_the_model() {
    let _ = LIBRARY_URL.set(serve(Library { repeats_cursor: false }).await);
    let model = ScriptedModel::new([
        ScriptedReply::tool_calls([("mcp__library__fetch", json!({})), ("mcp__library__look", json!({}))]),
        ScriptedReply::text("done"),
    ]);
    let runtime = runtime_with(&model, [librarian.into()]);
    runtime.init(&librarian, "l").send("read").await.unwrap();
    let requests = model.requests();
    let mounted: Vec<&str> = requests[0]
        .tools
        .iter()
        .map(|tool| &*tool.name)
        .filter(|name| name.starts_with("mcp__"))
        .collect();
    // Both pages; the tools whose schemas are not JSON Schemas left out.
    assert_eq!(mounted, ["mcp__library__fetch", "mcp__library__look"]);
    assert_eq!(
        *requests[0].tools[0].parameters,
        json!({"type": "object", "properties": {}}),
        "a schema without type or properties is an object's with none"
    );
    assert_eq!(
        tool_results(&requests[1]),
        [
            (
                "[resource https://example.org/guide]\nChapter one.\n[resource link next chapter (https://example.org/next): Chapter two.]"
                    .to_owned(),
                false
            ),
            (
                "[image content: image/png, 8 bytes of base64]\n{\"faces\":2}".to_owned(),
                false
            ),
        ]
    );
}

#[agent]
fn looping() -> &'static str {
    use_model("scripted/x");
    use_mcp_connection(McpConnection::new("library", LOOPING_URL.get().unwrap().clone()).auth(Secret::new("t0ken")));
    "Read."
}

#[tokio::test]
async fn a_server_that_repeats_a_tools_list_cursor_is_refused() {
    let _ = LOOPING_URL.set(serve(Library { repeats_cursor: true }).await);
    let model = ScriptedModel::new([]);
    let runtime = runtime_with(&model, [looping.into()]);
    let error = runtime.init(&looping, "l").send("read").await.unwrap_err();
    let (error_type, message) = run_error(error);
    assert_eq!(error_type, "mcp_connection_failed", "{message}");
    assert_eq!(
        message,
        "[flue] The MCP server \"library\" could not be used: it repeated the tools/list cursor \"page-2\" while its tools were listed"
    );
}

/// A server that lists tools without end: a new page after every page, or ever more tools on
/// its one page.
#[derive(Clone)]
struct Endless {
    /// How many tools its one page lists; `None`: one tool a page, pages without end.
    tools: Option<usize>,
    /// How long each tool's description is (0: a short one).
    describing: usize,
    /// How long each cursor is, past its page number.
    cursor_bytes: usize,
}

impl ServerHandler for Endless {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build())
    }

    async fn list_tools(
        &self,
        request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, ErrorData> {
        let page: usize = request
            .and_then(|request| request.cursor)
            .map_or(0, |cursor| cursor.split('-').next().unwrap().parse().unwrap());
        let description = match self.describing {
            0 => "A tool.".to_owned(),
            bytes => "d".repeat(bytes),
        };
        let tools = (0..self.tools.unwrap_or(1))
            .map(|n| {
                McpTool::new(
                    format!("t{page}_{n}"),
                    description.clone(),
                    schema(json!({"type": "object"})),
                )
            })
            .collect();
        let mut result = ListToolsResult::with_all_items(tools);
        result.next_cursor = self
            .tools
            .is_none()
            .then(|| format!("{}-{}", page + 1, "c".repeat(self.cursor_bytes)));
        Ok(result)
    }
}

static ENDLESS_URL: std::sync::Mutex<Option<String>> = std::sync::Mutex::new(None);

#[agent]
fn endless() -> &'static str {
    use_model("scripted/x");
    use_mcp_connection(
        McpConnection::new("endless", ENDLESS_URL.lock().unwrap().clone().unwrap()).auth(Secret::new("t0ken")),
    );
    "Read."
}

/// A server listing tools without end (pages after pages, one page of ever more tools, or
/// pages of ever more bytes) is refused past a bound, not listed until memory runs out; one
/// that would mount more than every model request could declare is refused too, instead of
/// failing every call of the agent.
#[tokio::test]
async fn a_server_listing_tools_without_end_is_refused() {
    let bytes = "its tools' names, descriptions and input schemas, and its listing's cursors, take more than 16 MiB";
    for (tools, describing, cursor_bytes, says) in [
        (None, 0, 0, "it lists its tools in more than 100 pages"),
        (Some(1001), 0, 0, "it lists more than 1000 tools"),
        (None, 1024 * 1024, 0, bytes),
        // Cursors the client keeps (to refuse a repeated one) and sends back.
        (None, 0, 1024 * 1024, bytes),
        // Listed within bounds, but more than every model request could declare.
        (
            Some(129),
            0,
            0,
            "it would mount 129 tools, more than the 128 a model request may declare; name the ones to use in the connection's tools",
        ),
        (
            Some(128),
            10_000,
            0,
            "more than the 1048576 one server's may; name the ones to use in the connection's tools",
        ),
    ] {
        *ENDLESS_URL.lock().unwrap() = Some(
            serve(Endless {
                tools,
                describing,
                cursor_bytes,
            })
            .await,
        );
        let runtime = runtime_with(&ScriptedModel::new([]), [endless.into()]);
        let error = runtime.init(&endless, "e").send("read").await.unwrap_err();
        let (error_type, message) = run_error(error);
        assert_eq!(error_type, "mcp_connection_failed", "{message}");
        assert!(message.ends_with(says), "{message}");
    }
}

static ALLOWLIST_URL: std::sync::OnceLock<String> = std::sync::OnceLock::new();
static ALLOWLIST: std::sync::Mutex<Vec<&'static str>> = std::sync::Mutex::new(Vec::new());

#[agent]
fn picky() -> &'static str {
    use_model("scripted/x");
    use_mcp_connection(
        McpConnection::new("docs", ALLOWLIST_URL.get().unwrap().clone())
            .auth(Secret::new("t0ken"))
            .tools(ALLOWLIST.lock().unwrap().clone()),
    );
    "Research."
}

#[tokio::test]
async fn a_tools_list_mounts_in_its_order_and_a_name_the_server_lacks_or_named_twice_refuses_the_server() {
    let _ = ALLOWLIST_URL.set(serve_docs().await);
    let refusal = |names: Vec<&'static str>| async move {
        *ALLOWLIST.lock().unwrap() = names;
        let model = ScriptedModel::new([ScriptedReply::text("ok")]);
        let runtime = runtime_with(&model, [picky.into()]);
        let outcome = runtime.init(&picky, "p").send("go").await;
        (outcome, model)
    };

    let (outcome, model) = refusal(vec!["fail", "search"]).await;
    outcome.unwrap();
    let mounted: Vec<String> = model.requests()[0]
        .tools
        .iter()
        .map(|tool| tool.name.to_string())
        .filter(|name| name.starts_with("mcp__"))
        .collect();
    assert_eq!(mounted, ["mcp__docs__fail", "mcp__docs__search"], "the list's order");

    for (names, expected) in [
        (
            vec!["search", "serach"],
            "[flue] The MCP server \"docs\" could not be used: it has no tool named \"serach\" (named in the connection's tools list); it lists: search, fail, admin.purge, hang, dump, search.issues, search_issues, listing, rude",
        ),
        (
            vec!["search", "fail", "search"],
            "[flue] The MCP server \"docs\" could not be used: the connection's tools list names \"search\" more than once",
        ),
        (
            vec!["search", "fail", "search", "fail", "search"],
            "[flue] The MCP server \"docs\" could not be used: the connection's tools list names \"search\", \"fail\" more than once",
        ),
    ] {
        let (outcome, model) = refusal(names).await;
        let (error_type, message) = run_error(outcome.unwrap_err());
        assert_eq!(error_type, "mcp_connection_failed", "{message}");
        assert_eq!(message, expected);
        assert!(model.requests().is_empty(), "no model request was made");
    }
}

/// A server with one tool, `ping` (answering `pong`), that counts the sessions clients open
/// with it (their `initialize` requests) and, given a barrier, answers `initialize` only once
/// every server of the barrier was asked: a runtime connecting its servers one after the other
/// would never get the first answer.
#[derive(Clone, Default)]
struct Pinging {
    sessions: Arc<std::sync::atomic::AtomicUsize>,
    together: Option<Arc<tokio::sync::Barrier>>,
}

impl ServerHandler for Pinging {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build())
    }

    async fn initialize(
        &self,
        request: rmcp::model::InitializeRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<rmcp::model::InitializeResult, ErrorData> {
        self.sessions.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        if let Some(together) = &self.together {
            together.wait().await;
        }
        if context.peer.peer_info().is_none() {
            context.peer.set_peer_info(request);
        }
        Ok(self.get_info())
    }

    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, ErrorData> {
        Ok(ListToolsResult::with_all_items(vec![McpTool::new(
            "ping",
            "Ping.",
            schema(json!({"type": "object"})),
        )]))
    }

    async fn call_tool(
        &self,
        _request: CallToolRequestParams,
        _context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, ErrorData> {
        Ok(CallToolResult::success(vec![ContentBlock::text("pong")]).into())
    }
}

/// A gateway that writes its caller's token into a tool's description.
#[derive(Clone)]
struct Quoting;

impl ServerHandler for Quoting {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build())
    }

    async fn initialize(
        &self,
        request: rmcp::model::InitializeRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<rmcp::model::InitializeResult, ErrorData> {
        if context.peer.peer_info().is_none() {
            context.peer.set_peer_info(request);
        }
        Ok(self.get_info())
    }

    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, ErrorData> {
        Ok(ListToolsResult::with_all_items(vec![McpTool::new(
            "whoami",
            "Answers for the caller authenticated as t0ken.",
            schema(json!({"type": "object"})),
        )]))
    }

    async fn call_tool(
        &self,
        _request: CallToolRequestParams,
        _context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, ErrorData> {
        Ok(CallToolResult::success(vec![ContentBlock::text("you")]).into())
    }
}

static QUOTING_URL: std::sync::OnceLock<String> = std::sync::OnceLock::new();

#[agent]
fn quoted() -> &'static str {
    use_model("scripted/x");
    use_mcp_connection(McpConnection::new("gateway", QUOTING_URL.get().unwrap().clone()).auth(Secret::new("t0ken")));
    "Q"
}

/// What a server lists is declared to the model in every request: a credential of the
/// connection written into a tool's description is kept out of it, as from its results.
/// (Regression: only results and errors were redacted.)
#[tokio::test]
async fn a_listed_tools_description_is_kept_free_of_the_connections_credentials() {
    let _ = QUOTING_URL.set(serve(Quoting).await);
    let model = ScriptedModel::new([ScriptedReply::text("ok")]);
    let runtime = runtime_with(&model, [quoted.into()]);
    runtime.init(&quoted, "q").send("hi").await.unwrap();
    let tools = &model.requests()[0].tools;
    let whoami = tools
        .iter()
        .find(|tool| tool.name.contains("whoami"))
        .expect("the gateway's tool");
    assert!(!whoami.description.contains("t0ken"), "{}", whoami.description);
    assert!(whoami.description.contains("as [redacted]."), "{}", whoami.description);
}

static TOGETHER_URLS: std::sync::OnceLock<[String; 2]> = std::sync::OnceLock::new();

#[agent]
fn two_servers() -> &'static str {
    use_model("scripted/x");
    let [first, second] = TOGETHER_URLS.get().unwrap().clone();
    // Long timeouts: one after the other, the first connection would wait its whole timeout.
    use_mcp_connection(
        McpConnection::new("first", first)
            .auth(Secret::new("t0ken"))
            .timeout(std::time::Duration::from_secs(600)),
    );
    use_mcp_connection(
        McpConnection::new("second", second)
            .auth(Secret::new("t0ken"))
            .timeout(std::time::Duration::from_secs(600)),
    );
    "Use both."
}

#[tokio::test]
async fn a_responses_servers_are_connected_together() {
    let barrier = Arc::new(tokio::sync::Barrier::new(2));
    let together = |barrier| Pinging {
        together: Some(barrier),
        ..Pinging::default()
    };
    let _ = TOGETHER_URLS.set([serve(together(barrier.clone())).await, serve(together(barrier)).await]);
    let model = ScriptedModel::new([ScriptedReply::text("ok")]);
    let runtime = runtime_with(&model, [two_servers.into()]);
    tokio::time::timeout(
        std::time::Duration::from_secs(120),
        runtime.init(&two_servers, "t").send("go"),
    )
    .await
    .expect("both servers answered: they were connected together")
    .unwrap();
    let mounted: Vec<String> = model.requests()[0]
        .tools
        .iter()
        .map(|tool| tool.name.to_string())
        .filter(|name| name.starts_with("mcp__"))
        .collect();
    assert_eq!(mounted, ["mcp__first__ping", "mcp__second__ping"]);
}

static SILENT_URL: std::sync::OnceLock<String> = std::sync::OnceLock::new();

/// A loopback address that accepts connections and never answers; its URL.
async fn silent_server() -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((socket, _)) = listener.accept().await {
            held.push(socket);
        }
    });
    format!("http://{address}/mcp")
}

#[agent]
fn waiting() -> &'static str {
    use_model("scripted/x");
    use_mcp_connection(
        McpConnection::new("silent", SILENT_URL.get().unwrap().clone()).timeout(std::time::Duration::from_secs(600)),
    );
    "Wait."
}

#[tokio::test]
async fn an_abort_stops_a_response_connecting_its_servers() {
    let _ = SILENT_URL.set(silent_server().await);
    let model = ScriptedModel::new([]);
    let runtime = runtime_with(&model, [waiting.into()]);
    let handle = runtime.init(&waiting, "w");
    let sending = tokio::spawn({
        let handle = handle.clone();
        async move { handle.send("go").await }
    });
    // Wait until the submission runs (it is connecting), then abort it.
    let mut events = runtime.observe();
    loop {
        let observation = events.recv().await.unwrap();
        if matches!(observation.event, flue_runtime::events::Event::SubmissionRunning { .. }) {
            break;
        }
    }
    handle.abort().await.unwrap();
    let outcome = tokio::time::timeout(std::time::Duration::from_secs(120), sending)
        .await
        .expect("the abort ended the connecting")
        .unwrap();
    let Err(RuntimeError::Run { error_type, .. }) = outcome else {
        panic!("an aborted run: {outcome:?}")
    };
    assert_eq!(error_type, "submission_aborted");
    assert!(model.requests().is_empty());
    // The response itself ended at the abort: it was not given up on after its grace.
    while let Ok(observation) = events.try_recv() {
        assert!(
            !matches!(
                observation.event,
                flue_runtime::events::Event::SubmissionRecovery {
                    operation: flue_runtime::events::RecoveryOperation::EnforceDeadline,
                    ..
                }
            ),
            "{:?}",
            observation.event
        );
    }
}

#[tokio::test]
async fn an_optional_server_that_cannot_be_used_is_a_warning_to_observers() {
    let model = ScriptedModel::new([ScriptedReply::text("ok")]);
    let runtime = runtime_with(&model, [tolerant.into()]);
    let mut events = runtime.observe();
    runtime.init(&tolerant, "t").send("go").await.unwrap();
    let mut warnings = Vec::new();
    while let Ok(observation) = events.try_recv() {
        if let flue_runtime::events::Event::Log { level, message, .. } = observation.event
            && level == "warn"
        {
            warnings.push(message);
        }
    }
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert!(
        warnings[0].starts_with(
            "[flue] The optional MCP server \"docs\" could not be used; its tools are not mounted for this response: "
        ),
        "{warnings:?}"
    );
}

static COUNTING_URL: std::sync::OnceLock<String> = std::sync::OnceLock::new();

#[agent]
fn pinger() -> &'static str {
    use_model("scripted/x");
    use_mcp_connection(McpConnection::new("counting", COUNTING_URL.get().unwrap().clone()).auth(Secret::new("t0ken")));
    "Ping."
}

#[tokio::test]
async fn an_instances_later_responses_reuse_its_connection_and_other_instances_open_their_own() {
    let sessions = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let _ = COUNTING_URL.set(
        serve(Pinging {
            sessions: sessions.clone(),
            together: None,
        })
        .await,
    );
    let model = ScriptedModel::new([
        ScriptedReply::tool_call("mcp__counting__ping", json!({})),
        ScriptedReply::text("one"),
        ScriptedReply::tool_call("mcp__counting__ping", json!({})),
        ScriptedReply::text("two"),
        ScriptedReply::text("three"),
    ]);
    let runtime = runtime_with(&model, [pinger.into()]);
    let handle = runtime.init(&pinger, "a");
    handle.send("ping").await.unwrap();
    handle.send("ping again").await.unwrap();
    assert_eq!(
        tool_results(&model.requests()[3]),
        [("pong".to_owned(), false), ("pong".to_owned(), false)],
        "the kept connection still calls"
    );
    assert_eq!(
        sessions.load(std::sync::atomic::Ordering::SeqCst),
        1,
        "one session for the instance"
    );
    runtime.init(&pinger, "b").send("ping").await.unwrap();
    assert_eq!(
        sessions.load(std::sync::atomic::Ordering::SeqCst),
        2,
        "another instance, its own session"
    );
}

static FLEETING_URL: std::sync::OnceLock<String> = std::sync::OnceLock::new();

#[agent]
fn fleeting() -> &'static str {
    use_model("scripted/x");
    use_mcp_connection(
        McpConnection::new("counting", FLEETING_URL.get().unwrap().clone())
            .auth(Secret::new("t0ken"))
            .optional(),
    );
    "Ping if you can."
}

#[tokio::test]
async fn a_kept_connection_to_a_server_that_went_away_is_not_reused() {
    let sessions = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let handler = Pinging {
        sessions: sessions.clone(),
        together: None,
    };
    let service: StreamableHttpService<Pinging, LocalSessionManager> = StreamableHttpService::new(
        move || Ok(handler.clone()),
        Default::default(),
        StreamableHttpServerConfig::default(),
    );
    let router = axum::Router::new().nest_service("/mcp", service);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let server = tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });
    let _ = FLEETING_URL.set(format!("http://{address}/mcp"));
    let model = ScriptedModel::new([ScriptedReply::text("pinged"), ScriptedReply::text("without it")]);
    let runtime = runtime_with(&model, [fleeting.into()]);
    let handle = runtime.init(&fleeting, "f");
    handle.send("one").await.unwrap();
    assert_eq!(sessions.load(std::sync::atomic::Ordering::SeqCst), 1);
    // The server goes away (its connections with it) before the next message.
    server.abort();
    let _ = server.await;
    handle.send("two").await.unwrap();
    let requests = model.requests();
    assert!(
        requests[1].tools.iter().all(|tool| !tool.name.starts_with("mcp__")),
        "the dead server's tools are not mounted"
    );
    let told = requests[1].messages.iter().any(|message| {
        matches!(message, ModelMessage::User { content, .. }
            if content.contains("The MCP server \"counting\" is unavailable for this response"))
    });
    assert!(told, "{:?}", requests[1].messages);
}

static REDEPLOYED_URL: std::sync::OnceLock<String> = std::sync::OnceLock::new();

#[agent]
fn redeployed() -> &'static str {
    use_model("scripted/x");
    use_mcp_connection(
        McpConnection::new("counting", REDEPLOYED_URL.get().unwrap().clone())
            .timeout(std::time::Duration::from_secs(5)),
    );
    "Ping."
}

/// A kept session that a redeployed server no longer knows, and answers with an error for no
/// request (a 400 with `"id": null`, as the MCP TypeScript SDK's example does), is connected
/// afresh at once. (Regression: rmcp dropped that answer, the relisting waited out the
/// connection's timeout, and the message failed.)
#[tokio::test]
async fn a_kept_session_the_server_forgot_is_connected_afresh_at_once() {
    use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
    static FORGOT: AtomicBool = AtomicBool::new(false);
    static KNOWN: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());
    let sessions = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let handler = Pinging {
        sessions: sessions.clone(),
        together: None,
    };
    let service: StreamableHttpService<Pinging, LocalSessionManager> = StreamableHttpService::new(
        move || Ok(handler.clone()),
        Default::default(),
        StreamableHttpServerConfig::default(),
    );
    // Until the redeploy, the sessions it sees; after, it answers them as unknown.
    let forgetful = axum::middleware::from_fn(
        |request: axum::extract::Request, next: axum::middleware::Next| async move {
            let session = request
                .headers()
                .get("mcp-session-id")
                .and_then(|id| id.to_str().ok())
                .map(str::to_owned);
            if let Some(session) = session {
                let mut known = KNOWN.lock().unwrap();
                if !FORGOT.load(SeqCst) {
                    known.push(session);
                } else if known.contains(&session) {
                    let body = json!({
                        "jsonrpc": "2.0",
                        "error": {"code": -32000, "message": "Bad Request: No valid session ID provided"},
                        "id": null
                    });
                    return axum::response::IntoResponse::into_response((StatusCode::BAD_REQUEST, axum::Json(body)));
                }
            }
            next.run(request).await
        },
    );
    let router = axum::Router::new().nest_service("/mcp", service).layer(forgetful);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });
    let _ = REDEPLOYED_URL.set(format!("http://{address}/mcp"));
    let model = ScriptedModel::new([ScriptedReply::text("one"), ScriptedReply::text("two")]);
    let runtime = runtime_with(&model, [redeployed.into()]);
    let handle = runtime.init(&redeployed, "r");
    handle.send("one").await.unwrap();
    assert_eq!(sessions.load(SeqCst), 1);
    FORGOT.store(true, SeqCst);
    handle.send("two").await.unwrap();
    assert_eq!(sessions.load(SeqCst), 2, "connected afresh");
    let requests = model.requests();
    assert!(
        requests[1]
            .tools
            .iter()
            .any(|tool| tool.name.starts_with("mcp__counting")),
        "{:?}",
        requests[1].tools
    );
}

/// A server whose tool list the test changes between messages.
#[derive(Clone, Default)]
struct Changing {
    sessions: Arc<std::sync::atomic::AtomicUsize>,
    tools: Arc<std::sync::Mutex<Vec<&'static str>>>,
}

impl ServerHandler for Changing {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build())
    }

    async fn initialize(
        &self,
        request: rmcp::model::InitializeRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<rmcp::model::InitializeResult, ErrorData> {
        self.sessions.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        if context.peer.peer_info().is_none() {
            context.peer.set_peer_info(request);
        }
        Ok(self.get_info())
    }

    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, ErrorData> {
        let tools = self.tools.lock().unwrap().clone();
        // The list says it keeps for a minute (`ttlMs`): the runtime lists afresh at each
        // message all the same, so a change (or the server's going away) is seen at once.
        Ok(ListToolsResult::with_all_items(
            tools
                .into_iter()
                .map(|name| McpTool::new(name, "A tool.", schema(json!({"type": "object"}))))
                .collect(),
        )
        .with_ttl_ms(60_000))
    }
}

static CHANGING_URL: std::sync::OnceLock<String> = std::sync::OnceLock::new();

#[agent]
fn changing() -> &'static str {
    use_model("scripted/x");
    use_mcp_connection(McpConnection::new("changing", CHANGING_URL.get().unwrap().clone()).auth(Secret::new("t0ken")));
    "Use what there is."
}

/// Reference §3.7: each submission's init connects its servers, so a later message sees the
/// tools the server lists then, though the instance keeps its connection (one session).
#[tokio::test]
async fn a_kept_connection_mounts_the_tools_the_server_lists_at_each_message() {
    let handler = Changing::default();
    *handler.tools.lock().unwrap() = vec!["a"];
    let _ = CHANGING_URL.set(serve(handler.clone()).await);
    let model = ScriptedModel::new([ScriptedReply::text("one"), ScriptedReply::text("two")]);
    let runtime = runtime_with(&model, [changing.into()]);
    let handle = runtime.init(&changing, "c");
    handle.send("one").await.unwrap();
    *handler.tools.lock().unwrap() = vec!["b"];
    handle.send("two").await.unwrap();
    let mounted = |at: usize| {
        model.requests()[at]
            .tools
            .iter()
            .map(|tool| tool.name.to_string())
            .filter(|name| name.starts_with("mcp__"))
            .collect::<Vec<_>>()
    };
    assert_eq!(mounted(0), ["mcp__changing__a"]);
    assert_eq!(
        mounted(1),
        ["mcp__changing__b"],
        "the second message sees the server's new list"
    );
    assert_eq!(
        handler.sessions.load(std::sync::atomic::Ordering::SeqCst),
        1,
        "on the kept connection"
    );
}

/// A server with one tool whose `tools/list` the test makes answer an error.
#[derive(Clone, Default)]
struct RefusingList {
    sessions: Arc<std::sync::atomic::AtomicUsize>,
    refusing: Arc<std::sync::atomic::AtomicBool>,
}

impl ServerHandler for RefusingList {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build())
    }

    async fn initialize(
        &self,
        request: rmcp::model::InitializeRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<rmcp::model::InitializeResult, ErrorData> {
        self.sessions.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        if context.peer.peer_info().is_none() {
            context.peer.set_peer_info(request);
        }
        Ok(self.get_info())
    }

    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, ErrorData> {
        if self.refusing.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(ErrorData::internal_error("the tool index is rebuilding", None));
        }
        Ok(ListToolsResult::with_all_items(vec![McpTool::new(
            "a",
            "A tool.",
            schema(json!({"type": "object"})),
        )]))
    }
}

static REFUSING_URL: std::sync::OnceLock<String> = std::sync::OnceLock::new();

#[agent]
fn refused_listing() -> &'static str {
    use_model("scripted/x");
    use_mcp_connection(
        McpConnection::new("refusing", REFUSING_URL.get().unwrap().clone())
            .auth(Secret::new("t0ken"))
            .optional(),
    );
    "Use a."
}

/// A kept connection whose server answers its listing with an error is unavailable for that
/// response, and kept: a new session would be asked the same after its handshake, so none is
/// opened, and the next response lists on the kept one again.
#[tokio::test]
async fn a_kept_connection_whose_listing_fails_is_not_connected_again() {
    let handler = RefusingList::default();
    let _ = REFUSING_URL.set(serve(handler.clone()).await);
    let model = ScriptedModel::new([
        ScriptedReply::text("one"),
        ScriptedReply::text("two"),
        ScriptedReply::text("three"),
    ]);
    let runtime = runtime_with(&model, [refused_listing.into()]);
    let handle = runtime.init(&refused_listing, "r");
    handle.send("one").await.unwrap();
    handler.refusing.store(true, std::sync::atomic::Ordering::SeqCst);
    handle.send("two").await.unwrap();
    handler.refusing.store(false, std::sync::atomic::Ordering::SeqCst);
    handle.send("three").await.unwrap();
    let mounted = |at: usize| {
        model.requests()[at]
            .tools
            .iter()
            .filter(|tool| tool.name.starts_with("mcp__"))
            .count()
    };
    assert_eq!((mounted(0), mounted(1), mounted(2)), (1, 0, 1));
    assert_eq!(
        handler.sessions.load(std::sync::atomic::Ordering::SeqCst),
        1,
        "one session throughout"
    );
}

static NAMING_URL: std::sync::OnceLock<String> = std::sync::OnceLock::new();

#[agent]
fn naming() -> &'static str {
    use_model("scripted/x");
    use_mcp_connection(
        McpConnection::new("naming", NAMING_URL.get().unwrap().clone())
            .auth(Secret::new("t0ken"))
            .tools(["a"])
            .optional(),
    );
    "Use a."
}

/// A kept connection whose server now lists tools the connection cannot mount (the tool it
/// names is gone) is unavailable for that response, and is kept: the next response lists
/// again on it, with no new session.
#[tokio::test]
async fn a_kept_connection_whose_new_list_cannot_be_mounted_is_kept_for_the_next_response() {
    let handler = Changing::default();
    *handler.tools.lock().unwrap() = vec!["a"];
    let _ = NAMING_URL.set(serve(handler.clone()).await);
    let model = ScriptedModel::new([
        ScriptedReply::text("one"),
        ScriptedReply::text("two"),
        ScriptedReply::text("three"),
    ]);
    let runtime = runtime_with(&model, [naming.into()]);
    let handle = runtime.init(&naming, "p");
    handle.send("one").await.unwrap();
    *handler.tools.lock().unwrap() = vec!["b"];
    handle.send("two").await.unwrap();
    *handler.tools.lock().unwrap() = vec!["a"];
    handle.send("three").await.unwrap();
    let mounted = |at: usize| {
        model.requests()[at]
            .tools
            .iter()
            .map(|tool| tool.name.to_string())
            .filter(|name| name.starts_with("mcp__"))
            .collect::<Vec<_>>()
    };
    assert_eq!(mounted(0), ["mcp__naming__a"]);
    assert!(mounted(1).is_empty(), "unavailable while its list lacks a");
    assert_eq!(mounted(2), ["mcp__naming__a"]);
    assert_eq!(
        handler.sessions.load(std::sync::atomic::Ordering::SeqCst),
        1,
        "the connection was kept throughout"
    );
}

static IDLING_URL: std::sync::OnceLock<String> = std::sync::OnceLock::new();

#[agent]
fn idler() -> &'static str {
    use_model("scripted/x");
    use_mcp_connection(McpConnection::new("counting", IDLING_URL.get().unwrap().clone()));
    "Ping."
}

/// A session no response used for `mcp_session_idle` is closed by the node's scan (the
/// server's session ends: nothing stays open for an idle instance), and the instance's next
/// response connects afresh.
#[tokio::test]
async fn an_idle_instances_mcp_session_is_closed_and_its_next_response_connects_afresh() {
    let sessions = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let handler = Pinging {
        sessions: sessions.clone(),
        together: None,
    };
    let manager = Arc::new(LocalSessionManager::default());
    let service: StreamableHttpService<Pinging, LocalSessionManager> = StreamableHttpService::new(
        move || Ok(handler.clone()),
        manager.clone(),
        StreamableHttpServerConfig::default(),
    );
    let router = axum::Router::new().nest_service("/mcp", service);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });
    let _ = IDLING_URL.set(format!("http://{address}/mcp"));
    let model = ScriptedModel::new([ScriptedReply::text("one"), ScriptedReply::text("two")]);
    let options = flue_runtime::RuntimeOptions {
        mcp_session_idle: std::time::Duration::from_millis(1000),
        scan_interval: std::time::Duration::from_millis(20),
        ..flue_runtime::RuntimeOptions::default()
    };
    let runtime = harness::runtime_on_with(flue_runtime::store::MemoryStore::new(), &model, [idler.into()], options);
    let handle = runtime.init(&idler, "i");
    handle.send("one").await.unwrap();
    assert_eq!(sessions.load(std::sync::atomic::Ordering::SeqCst), 1);
    assert_eq!(manager.sessions.read().await.len(), 1, "the instance keeps its session");
    // The scan closes it: the client ends the session on the server.
    for _ in 0..1000 {
        if manager.sessions.read().await.is_empty() {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    assert!(manager.sessions.read().await.is_empty(), "the idle session was closed");
    handle.send("two").await.unwrap();
    assert_eq!(
        sessions.load(std::sync::atomic::Ordering::SeqCst),
        2,
        "the next response connected afresh"
    );
}

/// [`Pinging`] whose second listing never answers (a session stuck behind a handler).
#[derive(Clone, Default)]
struct StuckOnce {
    pinging: Pinging,
    listings: Arc<std::sync::atomic::AtomicUsize>,
}

impl ServerHandler for StuckOnce {
    fn get_info(&self) -> ServerConfig {
        self.pinging.get_info()
    }

    async fn initialize(
        &self,
        request: rmcp::model::InitializeRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<rmcp::model::InitializeResult, ErrorData> {
        self.pinging.initialize(request, context).await
    }

    async fn list_tools(
        &self,
        request: Option<PaginatedRequestParams>,
        context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, ErrorData> {
        if self.listings.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 1 {
            std::future::pending::<()>().await;
        }
        self.pinging.list_tools(request, context).await
    }
}

static STUCK_URL: std::sync::OnceLock<String> = std::sync::OnceLock::new();

#[agent]
fn stuck() -> &'static str {
    use_model("scripted/x");
    use_mcp_connection(
        McpConnection::new("stuck", STUCK_URL.get().unwrap().clone())
            .auth(Secret::new("t0ken"))
            .timeout(std::time::Duration::from_millis(300))
            .optional(),
    );
    "Ping if you can."
}

/// A kept session whose listing does not answer in time is unavailable for that response and
/// not kept: the next response connects afresh (before, the stuck session was kept, and
/// every later response waited its timeout on it).
#[tokio::test]
async fn a_kept_session_whose_listing_times_out_is_not_kept() {
    let handler = StuckOnce::default();
    let sessions = handler.pinging.sessions.clone();
    let _ = STUCK_URL.set(serve(handler).await);
    let model = ScriptedModel::new([
        ScriptedReply::text("one"),
        ScriptedReply::text("two"),
        ScriptedReply::text("three"),
    ]);
    let runtime = runtime_with(&model, [stuck.into()]);
    let handle = runtime.init(&stuck, "s");
    handle.send("one").await.unwrap();
    handle.send("two").await.unwrap();
    let second = &model.requests()[1];
    assert!(
        second.tools.iter().all(|tool| tool.name != "mcp__stuck__ping"),
        "unavailable while stuck"
    );
    handle.send("three").await.unwrap();
    assert_eq!(
        sessions.load(std::sync::atomic::Ordering::SeqCst),
        2,
        "connected afresh"
    );
    let third = &model.requests()[2];
    assert!(third.tools.iter().any(|tool| tool.name == "mcp__stuck__ping"));
}

static MALFORMED_URL: std::sync::OnceLock<String> = std::sync::OnceLock::new();

/// A bare streamable-HTTP MCP server (no rmcp under it, so it can answer what rmcp's server
/// would not): it lists a tool without the `inputSchema` every MCP tool has. Its URL.
async fn malformed_server() -> String {
    async fn answer(body: axum::Json<serde_json::Value>) -> axum::response::Response {
        use axum::response::IntoResponse;
        let id = body.get("id").cloned();
        let result = match body["method"].as_str().unwrap_or_default() {
            "initialize" => json!({
                "protocolVersion": body["params"]["protocolVersion"],
                "capabilities": {"tools": {}},
                "serverInfo": {"name": "malformed", "version": "1"}
            }),
            "tools/list" => json!({"tools": [
                {"name": "good", "inputSchema": {"type": "object"}},
                {"name": "bad"}
            ]}),
            // A notification: nothing to answer.
            _ if id.is_none() => return StatusCode::ACCEPTED.into_response(),
            _ => json!({}),
        };
        axum::Json(json!({"jsonrpc": "2.0", "id": id, "result": result})).into_response()
    }
    let router = axum::Router::new().route(
        "/mcp",
        axum::routing::post(answer).get(|| async { StatusCode::METHOD_NOT_ALLOWED }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });
    format!("http://{address}/mcp")
}

#[agent]
fn malformed() -> &'static str {
    use_model("scripted/x");
    use_mcp_connection(McpConnection::new("malformed", MALFORMED_URL.get().unwrap().clone()));
    "Read."
}

/// A listing the MCP client cannot read (one tool without an input schema fails the whole
/// page) is the server's answer, not a failed transport: the server is refused with a reason
/// that says what was wrong with its answer. (Before, the reason was "Unexpected response
/// type", and a kept session was dropped and connected afresh at each response, as after a
/// network failure.)
#[tokio::test]
async fn a_tools_list_the_client_cannot_read_refuses_the_server_saying_so() {
    let _ = MALFORMED_URL.set(malformed_server().await);
    let runtime = runtime_with(&ScriptedModel::new([]), [malformed.into()]);
    let error = runtime.init(&malformed, "m").send("read").await.unwrap_err();
    let (error_type, message) = run_error(error);
    assert_eq!(error_type, "mcp_connection_failed", "{message}");
    assert!(
        message.contains("its tools/list answer is not a page of tools as MCP's schema reads one"),
        "{message}"
    );
}
