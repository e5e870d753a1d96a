//! `#[tool]` beyond the seeds: generics and where-clauses, terminate, durable, names, unit returns.
#![allow(clippy::unwrap_used)] // tests assert by unwrapping

use flue_runtime::prelude::*;
use flue_runtime::testing::poll_ready;
use serde::Deserialize;
use serde_json::json;

/// Where a generic tool looks things up.
trait Catalog: Send + Sync + 'static {
    fn price(item: &str) -> u32;
}

struct Fixed;

impl Catalog for Fixed {
    fn price(item: &str) -> u32 {
        item.len() as u32 * 100
    }
}

#[derive(Deserialize, schemars::JsonSchema)]
struct PriceQuery {
    /// The item to price
    item: String,
}

/// Price an item in the catalog.
#[tool(name = "price_item")]
async fn price<C>(_ctx: &ToolContext, args: PriceQuery) -> String
where
    C: Catalog,
{
    format!("{} costs {} cents", args.item, C::price(&args.item))
}

/// Price an item, naming the context's lifetime in the catalog's bounds.
#[tool(name = "price_item_for")]
async fn price_for<'c, C>(ctx: &'c ToolContext, args: PriceQuery) -> String
where
    C: Catalog + 'c,
{
    format!(
        "{}: {} costs {} cents",
        ctx.tool_call_id(),
        args.item,
        C::price(&args.item)
    )
}

/// What an unsized type (a `str`, a trait object) tells a generic tool.
trait Label: Send + Sync + 'static {
    fn label() -> &'static str;
}

impl Label for str {
    fn label() -> &'static str {
        "text"
    }
}

/// Label an item, by a type parameter that need not be sized.
#[tool(name = "label_item")]
async fn label<L: ?Sized + Label, C: Catalog>(args: PriceQuery) -> String {
    format!("{}: {} at {}", L::label(), args.item, C::price(&args.item))
}

/// Hand the conversation to a person.
#[tool(terminate)]
async fn escalate(
    /// Why a person is needed
    reason: String,
) -> ToolOutput {
    ToolOutput::text(format!("Escalated: {reason}"))
}

/// Record that the customer was greeted.
#[tool]
async fn mark_greeted() {}

/// Send the customer a receipt.
#[tool(durable)]
async fn send_receipt(ctx: &ToolContext, order: String) -> Result<String, ToolError> {
    let sent: String = ctx.step("send", async { format!("receipt for {order}") }).await?;
    Ok(sent)
}

#[derive(Deserialize, schemars::JsonSchema)]
struct Search {
    /// Words to search for
    #[serde(rename = "q")]
    query: String,
}

/// Search the issues, naming the progress argument by its Rust name.
#[tool(progress_argument = "query")]
async fn search_by_rust_name(args: Search) -> String {
    args.query
}

#[test]
fn a_generic_tool_carries_its_generics_and_where_clause() {
    let tool = price::<Fixed>::new().into_tool();
    assert_eq!(tool.name(), "price_item");
    let output = poll_ready(tool.call(ToolContext::new(&tool, "c"), json!({"item": "lamp"})));
    assert_eq!(output.to_text(), "lamp costs 400 cents");
    assert_eq!(
        tool.input_schema().json()["properties"]["item"]["description"],
        "The item to price"
    );
}

#[test]
fn a_generic_tool_whose_type_parameters_outlive_its_lifetimes_runs_with_them() {
    let tool = price_for::<Fixed>::new().into_tool();
    let output = poll_ready(tool.call(ToolContext::new(&tool, "c-7"), json!({"item": "desk"})));
    assert_eq!(output.to_text(), "c-7: desk costs 400 cents");
}

#[test]
fn a_generic_tool_may_take_an_unsized_type_parameter() {
    let tool = label::<str, Fixed>::new().into_tool();
    let output = poll_ready(tool.call(ToolContext::new(&tool, "c"), json!({"item": "pen"})));
    assert_eq!(output.to_text(), "text: pen at 300");
}

#[derive(Deserialize, schemars::JsonSchema)]
struct Line {
    /// How many
    quantity: i32,
}

/// Total the lines.
#[tool]
async fn total(
    /// The order's lines
    lines: Vec<Line>,
) -> String {
    lines.iter().map(|line| line.quantity).sum::<i32>().to_string()
}

#[test]
fn arguments_the_schema_passes_but_the_type_refuses_are_named_where_they_fail() {
    let tool = total.into_tool();
    let output = poll_ready(tool.call(
        ToolContext::new(&tool, "c"),
        json!({"lines": [{"quantity": 1}, {"quantity": 3_000_000_000u64}]}),
    ));
    assert!(output.is_error);
    let text = output.to_text();
    assert!(
        text.starts_with("Tool argument validation failed: [/lines/1/quantity] invalid value: integer `3000000000`"),
        "{text}"
    );
}

#[test]
fn terminate_marks_the_definition_and_plain_parameters_become_required_fields() {
    let tool = escalate.into_tool();
    assert!(tool.definition().terminate);
    assert_eq!(tool.input_schema().json()["required"], json!(["reason"]));
    let output = poll_ready(tool.call(ToolContext::new(&tool, "c"), json!({"reason": "refund over limit"})));
    assert_eq!(output.to_text(), "Escalated: refund over limit");
}

#[test]
fn durable_marks_the_definition_and_its_steps_just_run_standalone() {
    let tool = send_receipt.into_tool();
    assert!(tool.definition().durable);
    assert!(!escalate.into_tool().definition().durable);
    let output = poll_ready(tool.call(ToolContext::new(&tool, "c"), json!({"order": "o-1"})));
    assert_eq!(output.to_text(), "receipt for o-1");
}

#[test]
fn a_tool_without_parameters_takes_an_empty_object_and_returns_empty_text() {
    let tool = mark_greeted.into_tool();
    assert_eq!(tool.input_schema().json()["type"], "object");
    let output = poll_ready(tool.call(ToolContext::new(&tool, "c"), json!({})));
    assert_eq!(output, ToolOutput::text(""));
}

#[test]
fn a_tool_item_is_zero_sized_and_mounts_by_its_name() {
    assert_eq!(std::mem::size_of_val(&escalate), 0);
    let agent = FnAgent::new(AgentDefinition::new("desk"), |_| {
        use_model("openai/gpt-4o-mini");
        use_tool(escalate);
        use_tool(price::<Fixed>::new());
    });
    let rendered = flue_runtime::render_bare(&agent).unwrap();
    assert_eq!(
        rendered.tools.iter().map(Tool::name).collect::<Vec<_>>(),
        ["escalate", "price_item"]
    );
}

#[test]
fn the_progress_argument_of_an_argument_struct_is_checked_by_its_json_name_when_mounted() {
    // Only the schema knows a field's JSON name (serde may rename it), so `use_tool` checks it.
    let tool = search_by_rust_name.into_tool();
    assert_eq!(
        tool.definition().validate_input_schema("use_tool()"),
        Err(
            "[flue] use_tool() \"search_by_rust_name\" progress_argument \"query\" is not one of its arguments."
                .to_owned()
        )
    );
}

/// Look up an order.
///
/// Finds it by:
/// - its number
///   - as printed on the receipt
///   - or without the leading `#`
/// - the customer's email
///
/// Call it as:
///
///     lookup_order {"number": 7}
#[tool]
async fn lookup_order(number: u64) -> String {
    number.to_string()
}

///   Look up a refund.
///
///       lookup_refund {"number": 7}
#[doc = concat!("Refunds are ", "numbered like orders.")]
#[tool]
async fn lookup_refund(number: u64) -> String {
    number.to_string()
}

#[test]
fn a_description_keeps_the_relative_indentation_of_its_doc_comment() {
    assert_eq!(
        lookup_order.into_tool().definition().description,
        "Look up an order.\n\nFinds it by:\n- its number\n  - as printed on the receipt\n  - or without the leading `#`\n- the customer's email\n\nCall it as:\n\n    lookup_order {\"number\": 7}"
    );
}

#[test]
fn a_description_partly_written_by_a_macro_unindents_its_literal_lines_the_same_way() {
    assert_eq!(
        lookup_refund.into_tool().definition().description,
        "Look up a refund.\n\n    lookup_refund {\"number\": 7}\nRefunds are numbered like orders."
    );
}

/// Search the issues by their title.
#[tool(progress_argument = "q")]
async fn search_titles(
    /// Words from the title
    #[serde(rename = "q")]
    query: String,
    /// How many issues to return, all of them when 0
    #[serde(default)]
    #[schemars(range(max = 100))]
    limit: u32,
) -> String {
    format!("{query}: {limit}")
}

#[test]
fn serde_and_schemars_attributes_on_plain_parameters_shape_the_schema_and_the_parsing() {
    let tool = search_titles.into_tool();
    let schema = tool.input_schema().json().clone();
    assert_eq!(schema["required"], json!(["q"]), "{schema}");
    assert_eq!(
        schema["properties"]["q"]["description"], "Words from the title",
        "{schema}"
    );
    assert!(schema["properties"].get("query").is_none(), "{schema}");
    assert_eq!(schema["properties"]["limit"]["maximum"], 100, "{schema}");
    assert_eq!(tool.definition().progress_argument.as_deref(), Some("q"));
    tool.definition().validate_input_schema("use_tool()").unwrap();
    let output = poll_ready(tool.call(ToolContext::new(&tool, "c"), json!({"q": "crash"})));
    assert_eq!(output, ToolOutput::text("crash: 0"));
    let output = poll_ready(tool.call(ToolContext::new(&tool, "c"), json!({"q": "crash", "limit": 3})));
    assert_eq!(output, ToolOutput::text("crash: 3"));
}

/// Refund an order.
#[tool]
async fn refund(order: String) -> Result<String, String> {
    if order.starts_with("o-") {
        Ok(format!("refunded {order}"))
    } else {
        Err(format!("no order {order}"))
    }
}

#[test]
fn a_string_error_is_an_error_result_with_its_text() {
    let tool = refund.into_tool();
    let output = poll_ready(tool.call(ToolContext::new(&tool, "c"), json!({"order": "x-1"})));
    assert_eq!(output, ToolOutput::error("no order x-1"));
    let output = poll_ready(tool.call(ToolContext::new(&tool, "c"), json!({"order": "o-1"})));
    assert_eq!(output, ToolOutput::text("refunded o-1"));
}

/// An error that displays but is no `std::error::Error`, as `anyhow::Error` is, and, as it
/// does, shows its cause only in its alternate form (`{:#}`).
#[derive(Debug)]
struct OpaqueError(&'static str);

impl std::fmt::Display for OpaqueError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "opaque: {}", self.0)?;
        if f.alternate() {
            f.write_str(": the ledger is offline")?;
        }
        Ok(())
    }
}

/// Void an order.
#[tool]
async fn void_order(order: String) -> Result<String, OpaqueError> {
    if order.starts_with("o-") {
        Ok(format!("voided {order}"))
    } else {
        Err(OpaqueError("no such order"))
    }
}

/// Look an order up.
#[tool]
async fn look_up(order: String) -> Result<serde_json::Value, Box<dyn std::error::Error + Send + Sync>> {
    let number: u32 = order.trim_start_matches("o-").parse()?;
    Ok(json!({"order": number}))
}

/// Count an order's lines.
#[tool]
async fn count_lines(order: String) -> Result<String, std::io::Error> {
    Err(std::io::Error::other(format!("{order} is archived")))
}

#[test]
fn an_error_that_only_displays_is_an_error_result_with_its_text() {
    let tool = void_order.into_tool();
    let output = poll_ready(tool.call(ToolContext::new(&tool, "c"), json!({"order": "x-1"})));
    assert_eq!(
        output,
        ToolOutput::error("opaque: no such order: the ledger is offline"),
        "its alternate form, with the cause, as anyhow::Error shows its causes"
    );
    let output = poll_ready(tool.call(ToolContext::new(&tool, "c"), json!({"order": "o-1"})));
    assert_eq!(output, ToolOutput::text("voided o-1"));
    // A boxed error (what `?` makes of any error), and a JSON success beside it.
    let tool = look_up.into_tool();
    let output = poll_ready(tool.call(ToolContext::new(&tool, "c"), json!({"order": "o-x"})));
    assert_eq!(output, ToolOutput::error("invalid digit found in string"));
    let output = poll_ready(tool.call(ToolContext::new(&tool, "c"), json!({"order": "o-7"})));
    assert_eq!(output, ToolOutput::json(json!({"order": 7})));
    // A `std::error::Error` still converts through `ToolError`.
    let tool = count_lines.into_tool();
    let output = poll_ready(tool.call(ToolContext::new(&tool, "c"), json!({"order": "o-2"})));
    assert_eq!(output, ToolOutput::error("o-2 is archived"));
}

// Items declared by a `macro_rules!` whose return and parameter types come from its fragments:
// the expansions' own locals must still resolve (they are the attributes', not the fragments').
macro_rules! echo_items {
    ($tool:ident, $hook:ident, $agent:ident, $text:ty, $props:ty) => {
        /// Echo.
        #[tool]
        async fn $tool(q: $text) -> $text {
            q
        }

        #[hook(after_system_message)]
        fn $hook(_state: &ThreadState, system: $text) -> $text {
            system
        }

        #[agent]
        fn $agent(props: $props) -> $text {
            use_tool($tool);
            format!("{}", props.id())
        }
    };
}

echo_items!(macro_echo, macro_hook, macro_agent, String, AgentProps);

// The same with the types passed as `ident` and `tt` fragments, whose tokens keep the
// invoking code's hygiene (a `ty` fragment arrives as a group of the macro's own).
macro_rules! echo_items_by_token {
    ($tool:ident, $hook:ident, $agent:ident, $text:ident, $props:tt) => {
        /// Echo.
        #[tool]
        async fn $tool(q: $text) -> $text {
            q
        }

        #[hook(after_system_message)]
        fn $hook(_state: &ThreadState, system: $text) -> $text {
            system
        }

        #[agent(initial_data = $text, hooks = [$hook])]
        fn $agent(props: $props) -> $text {
            use_tool($tool);
            format!("{}", props.id())
        }
    };
}

echo_items_by_token!(token_echo, token_hook, token_agent, String, AgentProps);

#[test]
fn items_declared_by_a_macro_rules_with_fragment_types_expand() {
    let tool = macro_echo.into_tool();
    let output = poll_ready(tool.call(ToolContext::new(&tool, "c"), json!({"q": "hi"})));
    assert_eq!(output, ToolOutput::text("hi"));
    assert_eq!(macro_hook.id(), "macro_hook");
    let rendered = flue_runtime::render(&macro_agent, &RenderState::root("inbox-1")).unwrap();
    assert_eq!(rendered.instruction.as_deref(), Some("inbox-1"));
    let tool = token_echo.into_tool();
    let output = poll_ready(tool.call(ToolContext::new(&tool, "c"), json!({"q": "hi"})));
    assert_eq!(output, ToolOutput::text("hi"));
    assert_eq!(token_hook.id(), "token_hook");
    let rendered = flue_runtime::render(&token_agent, &RenderState::root("inbox-2")).unwrap();
    assert_eq!(rendered.instruction.as_deref(), Some("inbox-2"));
}

/// Hand the conversation over.
#[tool(terminate = true, durable = false)]
async fn hand_over() -> &'static str {
    "handed over"
}

/// Keep going.
#[tool(terminate = false, durable = true)]
async fn keep_going() -> &'static str {
    "kept"
}

#[test]
fn flag_options_also_take_a_boolean() {
    let tool = hand_over.into_tool();
    assert!(tool.definition().terminate && !tool.definition().durable);
    let tool = keep_going.into_tool();
    assert!(!tool.definition().terminate && tool.definition().durable);
}
