//! The command line of a user's binary: `serve`, `run` and `catalog` over a built [`Runtime`].
//!
//! ```no_run
//! use flue_runtime::cli::Cli;
//! # async fn demo(runtime: flue_runtime::Runtime) {
//! // `my-agents serve`, `my-agents run assistant --id c1 "Hello"`, `my-agents catalog`
//! if let Some(command) = Cli::from_env().command {
//!     std::process::exit(flue_runtime::cli::run(&runtime, command).await);
//! }
//! # }
//! ```
//!
//! `serve` answers everyone who reaches its address, as the reference protocol does: it
//! listens on loopback unless told otherwise, and warns when told to listen elsewhere without
//! an authorization policy. Without one it answers only requests that name it by an IP address
//! or `localhost` (a page on another site could otherwise point its own name at the address):
//! a name clients use (a container's service name, a proxy's public host) is listed with
//! `--allow-host` ([`HttpOptions::allowed_hosts`]). Give a policy (and the other
//! [`HttpOptions`]) with [`run_with`]:
//!
//! ```no_run
//! use flue_runtime::cli::Cli;
//! use flue_runtime::http::{BearerTokens, HttpOptions};
//! # async fn demo(runtime: flue_runtime::Runtime, tokens: BearerTokens) {
//! // `my-agents serve --addr 0.0.0.0:3583`
//! let options = HttpOptions::default().authorized_by(tokens);
//! if let Some(command) = Cli::from_env().command {
//!     std::process::exit(flue_runtime::cli::run_with(&runtime, command, options).await);
//! }
//! # }
//! ```
//!
//! The binary also picks the process's allocator, and a server should pick a fast one: a turn
//! allocates a few hundred times, and on glibc's `malloc` that is over a third of the
//! runtime's instructions (mimalloc takes about a fifth off them; the README's Benchmarks):
//!
//! ```no_run
//! #[global_allocator]
//! static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;
//! # fn main() {}
//! ```

use std::future::Future;
use std::io::Write;
use std::net::SocketAddr;
use std::time::Duration;

use clap::{CommandFactory, Parser, Subcommand};
use serde_json::json;

use crate::Runtime;
use crate::http::HttpOptions;

/// The command line.
#[derive(Clone, Debug, Parser)]
#[command(about = "Serve and run flue-rs agents.")]
pub struct Cli {
    /// What to do; none lets the binary do its own default.
    #[command(subcommand)]
    pub command: Option<Command>,
}

impl Cli {
    /// Parses the process's arguments (printing help or an error and exiting on bad ones).
    pub fn from_env() -> Self {
        Self::try_from_args(std::env::args_os()).unwrap_or_else(|error| error.exit())
    }

    /// Parses `args` (the first is the program name).
    pub fn try_from_args<I, T>(args: I) -> Result<Self, clap::Error>
    where
        I: IntoIterator<Item = T>,
        T: Into<std::ffi::OsString> + Clone,
    {
        let args: Vec<std::ffi::OsString> = args.into_iter().map(Into::into).collect();
        let cli = Self::try_parse_from(&args)?;
        // `run`'s message may start with `-` ("-5 is negative?"), so clap takes an unknown
        // option in its place for the message: `run assistant --verbose` would send
        // "--verbose" to the model. A message that is one option-like word is refused unless
        // it comes after `--`.
        if let Some(Command::Run { message, .. }) = &cli.command
            && looks_like_an_option(message)
            && !args.iter().any(|arg| arg == "--")
        {
            return Err(Self::command().error(
                clap::error::ErrorKind::UnknownArgument,
                format!("unexpected option '{message}' (a message that is one word starting with '-' goes after '--': run AGENT -- {message})"),
            ));
        }
        Ok(cli)
    }
}

/// An `--allow-host` value: a host name as a request's `Host` names it, without its port
/// (any port is allowed). A port, a list or a wildcard would match no request, so that every
/// request by that name would be refused without a word: they are refused here instead.
fn host_name(value: &str) -> Result<String, String> {
    let name = value.strip_suffix('.').unwrap_or(value);
    if name.is_empty() {
        return Err("give a host name".into());
    }
    if let Some(bad) = name
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '-' | '.' | '_')))
    {
        let hint = match bad {
            ':' => " (give the name without a port: every port is allowed)",
            ',' => " (repeat --allow-host for several names)",
            '*' => " (wildcards are not supported: give each name)",
            _ => "",
        };
        return Err(format!("'{value}' is not a host name: '{bad}'{hint}"));
    }
    Ok(value.to_owned())
}

/// Whether `message` reads as a command-line option (`-v`, `--verbose`, `--id=x`) rather
/// than text.
fn looks_like_an_option(message: &str) -> bool {
    let name = message.strip_prefix("--").or_else(|| message.strip_prefix('-'));
    name.and_then(|name| name.split('=').next()).is_some_and(|name| {
        name.starts_with(|c: char| c.is_ascii_alphabetic())
            && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
    })
}

/// A command.
#[derive(Clone, Debug, Subcommand)]
pub enum Command {
    /// Serve every agent over HTTP (the streaming protocol) until Ctrl-C (or SIGTERM).
    Serve {
        /// The address to listen on.
        #[arg(long, default_value = "127.0.0.1:3583")]
        addr: SocketAddr,
        /// A host name clients reach the server by, besides IP addresses and `localhost`
        /// (repeat it for several): without an authorization policy, requests naming any
        /// other host are refused.
        #[arg(long = "allow-host", value_name = "NAME", value_parser = host_name)]
        allow_hosts: Vec<String>,
    },
    /// Send one message to an agent instance and print its reply.
    Run {
        /// The agent's name.
        agent: String,
        /// The instance id.
        #[arg(long, default_value = "cli")]
        id: String,
        /// The message (it may start with `-`; one word that reads as an option goes after
        /// `--`).
        #[arg(allow_hyphen_values = true)]
        message: String,
        /// Print the whole reply (text, data, metadata, submission id) as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Print the agents, their tools, hooks and parent-hook requirements as JSON.
    Catalog,
}

/// How long `serve` waits, once interrupted, for open responses to end.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);

/// Serves every agent of `runtime` over HTTP ([`crate::http::router`]) on `listener` until
/// `stop` completes; then shuts the runtime down ([`Runtime::shutdown`]: no new admissions,
/// live reads end) and returns once every open response has ended, or after `grace` (the
/// responses still open then end with the process, or when their clients leave), having
/// given the submissions still running back to the queue ([`Runtime::release`]).
pub async fn serve(
    runtime: &Runtime,
    listener: tokio::net::TcpListener,
    stop: impl Future<Output = ()> + Send + 'static,
    grace: Duration,
) -> std::io::Result<()> {
    serve_with(runtime, listener, HttpOptions::default(), stop, grace).await
}

/// [`serve`] with `options` ([`crate::http::router_with`], [`crate::http::serve`]): an
/// authorization policy, the timing of live reads, the limits on connections and requests.
pub async fn serve_with(
    runtime: &Runtime,
    listener: tokio::net::TcpListener,
    options: HttpOptions,
    stop: impl Future<Output = ()> + Send + 'static,
    grace: Duration,
) -> std::io::Result<()> {
    let (stopping, stopped) = tokio::sync::oneshot::channel();
    let stopping_runtime = runtime.clone();
    let signal = async move {
        stop.await;
        stopping_runtime.shutdown();
        let _ = stopping.send(());
    };
    let router = crate::http::router_with(runtime, options.clone());
    let server = crate::http::serve(listener, router, &options, signal);
    let grace_over = async {
        if stopped.await.is_err() {
            // The server ended without being asked to: its own result decides.
            std::future::pending::<()>().await;
        }
        tokio::time::sleep(grace).await;
    };
    let served = tokio::select! {
        result = server => result,
        () = grace_over => Ok(()),
    };
    // What still runs (work dispatched in the background, responses past the grace) goes back
    // to the queue: the next process, or another node, resumes it at once.
    runtime.release().await;
    served
}

/// Runs `command`, printing to stdout (errors to stderr); the process exit code: 0, 2 for
/// what the command line asked wrong ([`CliError::exit_code`], as clap's own usage errors),
/// 130 when Ctrl-C interrupted `run` (143 for SIGTERM), 1 for the rest. The process is to exit next: what still runs then is given back to the
/// queue ([`Runtime::release`]).
///
/// The runtime's warnings and errors are logged to stderr (among them the cause of every 500
/// a server answers, under the `ref` the response carries), at the level `FLUE_LOG` names
/// (`error`, `warn` (the default), `info`, `debug`, `trace`, `off`; another value is named
/// on stderr and the default kept), unless the binary installed a `tracing` subscriber of its
/// own. What the runtime logged while it was built (opening the store may warn) reached
/// stderr only if the binary called [`log_to_stderr`] (or installed its own subscriber)
/// before building it.
pub async fn run(runtime: &Runtime, command: Command) -> i32 {
    run_with(runtime, command, HttpOptions::default()).await
}

/// [`run`], serving with `options` (an authorization policy, the timing of live reads).
pub async fn run_with(runtime: &Runtime, command: Command, options: HttpOptions) -> i32 {
    log_to_stderr();
    let stdout = std::io::stdout();
    // On a terminal, what the model or a server wrote is shown, not obeyed: an escape
    // sequence in a reply could rewrite the screen, make a false link or set the clipboard.
    let result = if std::io::IsTerminal::is_terminal(&stdout) {
        execute_with(runtime, command, options, &mut Printable(stdout)).await
    } else {
        execute_with(runtime, command, options, &mut { stdout }).await
    };
    // The process exits next: work the background scan took over meanwhile (another
    // instance's, which a `run` does not wait for) goes back to the queue rather than wait
    // out its lease.
    runtime.release().await;
    // What a response given back left running in a sandbox dies with the process (which
    // `std::process::exit` ends without dropping the calls that would kill it).
    crate::sandbox::kill_running_commands();
    match result {
        Ok(()) | Err(CliError::OutputClosed) => 0,
        Err(error) => {
            let said = error.to_string();
            let said = if std::io::IsTerminal::is_terminal(&std::io::stderr()) {
                printable(&said).into_owned()
            } else {
                said
            };
            say(&format!("error: {said}"));
            error.exit_code()
        }
    }
}

/// Writes `line` to the standard error, if it can be written: a closed one (`2>&-`, a reader
/// that went away) is no reason to panic, as `eprintln!` would.
fn say(line: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "{line}");
}

/// `text` with its control characters written out as JSON writes them (`\u001b`, `\u009d`:
/// inside `--json` output's strings, still JSON) but for line feeds and tabs: what a terminal
/// would act on instead of showing. For a binary that prints a model's text itself: an escape
/// sequence in a reply could otherwise rewrite the screen, make a false link or set the
/// clipboard.
pub fn printable(text: &str) -> std::borrow::Cow<'_, str> {
    let shown = |c: char| !c.is_control() || c == '\n' || c == '\t';
    if text.chars().all(shown) {
        return std::borrow::Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 8);
    for c in text.chars() {
        match c {
            c if shown(c) => out.push(c),
            c => out.push_str(&format!("\\u{:04x}", c as u32)),
        }
    }
    std::borrow::Cow::Owned(out)
}

/// A writer that shows what it is given ([`printable`]): a terminal's standard output.
struct Printable<W>(W);

impl<W: Write> Write for Printable<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        // Formatted output comes in whole strings; bytes that are not UTF-8 are shown lossily.
        let text = String::from_utf8_lossy(buf);
        self.0.write_all(printable(&text).as_bytes())?;
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.0.flush()
    }
}

/// Installs a subscriber writing the runtime's `tracing` events to stderr, when none is set,
/// as [`run`] does: for a binary that drives its runtime itself. `FLUE_LOG` sets the level
/// (`error`, `warn`, `info`, `debug`, `trace` or `off`; unset: `warn`). The MCP client
/// library's own events are left out: they quote an MCP server's URL and its error bodies
/// whole, credentials included (the runtime reports the same failures with them removed).
/// Call it before building the runtime: opening the store may warn.
pub fn log_to_stderr() {
    if tracing::dispatcher::has_been_set() {
        return;
    }
    let (level, refused) = log_level(std::env::var("FLUE_LOG").ok().as_deref());
    if let Some(refused) = refused {
        say(&refused);
    }
    let subscriber = cli_subscriber(level, std::io::stderr);
    // Another thread may have set one meanwhile: it is kept.
    let _ = tracing::subscriber::set_global_default(subscriber);
}

/// The level `FLUE_LOG` names (`error`, `warn`, `info`, `debug`, `trace` or `off`, in any
/// case; unset: `warn`), and what to tell the user when it names none: the log then stays at
/// `warn`, and says so rather than quietly ignoring the setting.
fn log_level(setting: Option<&str>) -> (tracing::level_filters::LevelFilter, Option<String>) {
    use tracing::level_filters::LevelFilter;
    let Some(setting) = setting.map(str::trim).filter(|setting| !setting.is_empty()) else {
        return (LevelFilter::WARN, None);
    };
    match setting.parse::<LevelFilter>() {
        Ok(level) => (level, None),
        Err(_) => (
            LevelFilter::WARN,
            Some(format!(
                "[flue] FLUE_LOG={:?} is not a level (error, warn, info, debug, trace or off): logging warnings and errors.",
                printable(setting)
            )),
        ),
    }
}

/// The CLI's log, written to `writer`: every event at `level` or above, but none of `rmcp`.
fn cli_subscriber<W>(level: tracing::level_filters::LevelFilter, writer: W) -> impl tracing::Subscriber + Send + Sync
where
    W: for<'w> tracing_subscriber::fmt::MakeWriter<'w> + Send + Sync + 'static,
{
    use tracing_subscriber::layer::SubscriberExt as _;
    let quiet = tracing_subscriber::filter::Targets::new()
        .with_default(level)
        .with_target("rmcp", tracing::level_filters::LevelFilter::OFF);
    tracing_subscriber::fmt()
        .with_writer(writer)
        .with_max_level(level)
        .finish()
        .with(quiet)
}

/// Runs `command`, writing its output to `out`.
pub async fn execute(runtime: &Runtime, command: Command, out: &mut (dyn Write + Send)) -> Result<(), CliError> {
    execute_with(runtime, command, HttpOptions::default(), out).await
}

/// [`execute`], serving with `options`.
pub async fn execute_with(
    runtime: &Runtime,
    command: Command,
    options: HttpOptions,
    out: &mut (dyn Write + Send),
) -> Result<(), CliError> {
    match command {
        Command::Serve { addr, allow_hosts } => {
            let mut options = options;
            options.allowed_hosts.extend(allow_hosts);
            let listener = tokio::net::TcpListener::bind(addr)
                .await
                .map_err(|error| CliError::Io(format!("cannot listen on {addr}: {error}")))?;
            let local = listener.local_addr().map_err(|error| CliError::Io(error.to_string()))?;
            if options.authorization.is_none() && !local.ip().is_loopback() {
                tracing::warn!(
                    "serving on {local} without an authorization policy: anyone who reaches it can run \
                     the agents (on your model keys), read their conversations and abort them; give one \
                     with `cli::run_with` and `HttpOptions::authorized_by`. Until then it answers only \
                     requests that name it by an IP address, `localhost` or a name given with `--allow-host`"
                );
            }
            // Listening for the stop signals from here, before any work resumes: a SIGTERM sent
            // once the server says it serves (or while it starts) stops it gracefully.
            let stop = StopSignals::install();
            // Work a previous process left unfinished resumes now.
            runtime.start().await;
            // Said if it can be: a server whose output's reader went away serves all the same
            // (a closed stdout ends `run` and `catalog` quietly, whose work is done by then).
            let _ = writeln!(
                out,
                "serving {} on http://{local} (agents: {})",
                plural(runtime.agent_names().len(), "agent"),
                runtime.agent_names().join(", ")
            )
            .and_then(|()| out.flush());
            let interrupted = async move {
                stop.requested().await;
                // A second Ctrl-C stops waiting for open responses.
                tokio::spawn(async {
                    if tokio::signal::ctrl_c().await.is_ok() {
                        say("interrupted again: exiting now");
                        crate::sandbox::kill_running_commands();
                        std::process::exit(130);
                    }
                });
            };
            serve_with(runtime, listener, options, interrupted, SHUTDOWN_GRACE)
                .await
                .map_err(|error| CliError::Io(error.to_string()))?;
            let _ = writeln!(out, "stopped");
            Ok(())
        }
        Command::Run {
            agent,
            id,
            message,
            json,
        } => {
            let names = runtime.agent_names();
            if !names.contains(&agent.as_str()) {
                return Err(CliError::UnknownAgent {
                    agent,
                    known: names.join(", "),
                });
            }
            let stop = StopSignals::install();
            runtime.start().await;
            let stopped = async {
                let signal = stop.requested().await;
                // A second Ctrl-C stops waiting for the abort.
                tokio::spawn(async {
                    if tokio::signal::ctrl_c().await.is_ok() {
                        say("interrupted again: exiting now");
                        crate::sandbox::kill_running_commands();
                        std::process::exit(130);
                    }
                });
                signal
            };
            let reply = send_until(runtime, &agent, id, message, stopped).await?;
            if json {
                let reply = json!({
                    "text": reply.text,
                    "data": reply.data,
                    "metadata": reply.metadata,
                    "submissionId": reply.submission_id,
                });
                writeln!(out, "{reply:#}")?;
            } else {
                writeln!(out, "{}", reply.text)?;
            }
            Ok(())
        }
        Command::Catalog => {
            writeln!(out, "{:#}", crate::http::catalog_of(runtime))?;
            Ok(())
        }
    }
}

/// Sends `message` to `agent`'s instance `id` and waits for its reply, unless `stop` comes
/// first: then the command ends as [`CliError::Interrupted`] (or [`CliError::Terminated`],
/// for SIGTERM), and a stop before the message was sent sends nothing. A stop that came after
/// the answer was durable (while finish callbacks ran) ends nothing: the reply is returned.
///
/// A stop after it aborts the instance's unsettled work, what the user meant by stopping (a
/// later process would otherwise finish it, spending model and tool calls): on a store of this
/// process alone, that work is this command's, unless the instance held work before it was
/// sent (messages a stopped `serve` gave back to the queue, or a crashed process left
/// running). Then, and on a [shared](crate::store::Store::shared) store (several nodes on one
/// Postgres), it may be other clients' messages too, and an abort is instance-wide (reference
/// §3.10), so nothing is aborted: the message is given back to the queue as the process
/// stops, for the next process that runs the instance.
async fn send_until(
    runtime: &Runtime,
    agent: &str,
    id: String,
    message: String,
    stop: impl Future<Output = StopSignal>,
) -> Result<crate::AgentReply, CliError> {
    use futures_util::FutureExt as _;
    // Looked at only where a stop would abort (not on a shared store).
    let others =
        !runtime.store().shared() && holds_work(runtime, &crate::store::InstanceKey::new(agent, id.clone())).await;
    let handle = runtime.handle(agent, id)?;
    let send = handle.send(message);
    tokio::pin!(send, stop);
    if let Some(signal) = stop.as_mut().now_or_never() {
        return Err(signal.into());
    }
    let signal = tokio::select! {
        biased;
        signal = &mut stop => signal,
        reply = &mut send => return Ok(reply?),
    };
    if runtime.store().shared() {
        tracing::warn!(
            "stopped: on a shared store the message is not aborted (the instance may hold other clients' messages); it is left queued for the next node that runs the instance"
        );
        return Err(signal.into());
    }
    if others {
        tracing::warn!(
            "stopped: the message is not aborted, since the instance held other messages when it was sent (an abort would end them too); it is left queued for the next process that runs the instance"
        );
        return Err(signal.into());
    }
    // Aborted while the send is still alive, so its admission (which may be committing) and
    // its processing end here, settled, rather than being given back to the queue; asked
    // again while it has not settled, for an admission that committed after the first ask.
    for _ in 0..10 {
        if let Err(error) = handle.abort().await {
            tracing::warn!(%error, "aborting the interrupted message failed");
        }
        if let Ok(settled) = tokio::time::timeout(Duration::from_millis(500), &mut send).await {
            // The abort lost the race to the response's end (its answer was durable before the
            // abort came): the message completed, and its reply is the command's.
            if let Ok(reply) = settled {
                tracing::warn!("stopped too late: the message had been answered already; its reply follows");
                return Ok(reply);
            }
            break;
        }
    }
    Err(signal.into())
}

/// Whether the instance `key` holds unsettled work: queued messages, or running ones (leased
/// by a process that stopped or crashed, or already taken up by this one's workers). A store
/// that cannot tell counts as holding some.
async fn holds_work(runtime: &Runtime, key: &crate::store::InstanceKey) -> bool {
    let store = runtime.store();
    if store.has_queued(key).await.unwrap_or(true) {
        return true;
    }
    // Every running row: a lease ends before the latest time the stores keep (signed 64-bit).
    store
        .expired(i64::MAX as u64)
        .await
        .map_or(true, |running| running.iter().any(|submission| submission.key == *key))
}

/// Which stop signal came.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum StopSignal {
    /// Ctrl-C (SIGINT).
    Interrupt,
    /// SIGTERM (Unix).
    Terminate,
}

impl From<StopSignal> for CliError {
    fn from(signal: StopSignal) -> Self {
        match signal {
            StopSignal::Interrupt => Self::Interrupted,
            StopSignal::Terminate => Self::Terminated,
        }
    }
}

/// Ctrl-C, or (on Unix) SIGTERM, which `docker stop`, systemd and Kubernetes send to stop a
/// server. On Unix the handlers are installed when made, so a signal that comes before anyone
/// waits is not missed (nor kills the process); elsewhere Ctrl-C is heard once waited for.
struct StopSignals {
    #[cfg(unix)]
    interrupt: Option<tokio::signal::unix::Signal>,
    #[cfg(unix)]
    terminate: Option<tokio::signal::unix::Signal>,
}

impl StopSignals {
    fn install() -> Self {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{SignalKind, signal};
            Self {
                interrupt: signal(SignalKind::interrupt()).ok(),
                terminate: signal(SignalKind::terminate()).ok(),
            }
        }
        #[cfg(not(unix))]
        Self {}
    }

    /// Completes at the first stop signal, with which it was.
    async fn requested(self) -> StopSignal {
        #[cfg(unix)]
        {
            let wait = |signal: Option<tokio::signal::unix::Signal>| async move {
                match signal {
                    Some(mut signal) => {
                        signal.recv().await;
                    }
                    // No handler could be installed: the other signal stops it.
                    None => std::future::pending::<()>().await,
                }
            };
            tokio::select! {
                () = wait(self.interrupt) => StopSignal::Interrupt,
                () = wait(self.terminate) => StopSignal::Terminate,
            }
        }
        #[cfg(not(unix))]
        {
            let _ = tokio::signal::ctrl_c().await;
            StopSignal::Interrupt
        }
    }
}

fn plural(count: usize, noun: &str) -> String {
    if count == 1 {
        format!("1 {noun}")
    } else {
        format!("{count} {noun}s")
    }
}

/// Why a command failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CliError {
    /// The runtime refused or the submission did not complete.
    #[error(transparent)]
    Runtime(#[from] crate::RuntimeError),
    /// `run` named an agent the runtime does not have.
    #[error("no agent is named \"{agent}\" (agents: {known})")]
    UnknownAgent {
        /// The name given.
        agent: String,
        /// The registered names.
        known: String,
    },
    /// Listening or writing failed.
    #[error("{0}")]
    Io(String),
    /// `run` was interrupted (Ctrl-C) before the reply came: the message was aborted (given
    /// back to the queue on a shared store, or when the instance held other messages before
    /// it), or not sent when the stop came first.
    #[error(
        "interrupted before the reply: the message, if it was sent, was aborted (or, on a shared store or behind other messages, left queued)"
    )]
    Interrupted,
    /// As [`CliError::Interrupted`], by SIGTERM.
    #[error(
        "terminated before the reply: the message, if it was sent, was aborted (or, on a shared store or behind other messages, left queued)"
    )]
    Terminated,
    /// The standard output was closed by its reader (`my-agents run … | head -1`): what the
    /// command did stands, and it ends quietly, with exit code 0.
    #[error("the standard output was closed")]
    OutputClosed,
}

impl CliError {
    /// The process exit code this error ends a command with: 2 when the command line asked
    /// for something that cannot be (an agent that does not exist, an invalid instance id or
    /// message), as clap's usage errors do; when a stop signal interrupted `run`, 128 plus
    /// its number, as a shell reports a process the signal ended (130 for Ctrl-C, 143 for
    /// SIGTERM); 1 for a failure (the submission failed or was aborted, the store or the
    /// network failed).
    pub fn exit_code(&self) -> i32 {
        use crate::RuntimeError as R;
        match self {
            Self::UnknownAgent { .. }
            | Self::Runtime(R::UnknownAgent(_) | R::InvalidRequest(_) | R::InvalidMessage(_)) => 2,
            Self::OutputClosed => 0,
            Self::Interrupted => 130,
            Self::Terminated => 143,
            _ => 1,
        }
    }
}

impl From<std::io::Error> for CliError {
    fn from(error: std::io::Error) -> Self {
        if error.kind() == std::io::ErrorKind::BrokenPipe {
            return Self::OutputClosed;
        }
        Self::Io(error.to_string())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // tests assert by unwrapping

    use super::*;

    #[test]
    fn flue_log_names_a_level_or_is_refused_aloud() {
        use tracing::level_filters::LevelFilter;
        for (setting, level) in [
            (None, LevelFilter::WARN),
            (Some(""), LevelFilter::WARN),
            (Some("info"), LevelFilter::INFO),
            (Some(" DEBUG "), LevelFilter::DEBUG),
            (Some("off"), LevelFilter::OFF),
            (Some("trace"), LevelFilter::TRACE),
        ] {
            assert_eq!(log_level(setting), (level, None), "{setting:?}");
        }
        for setting in ["flue_runtime=debug", "verbose", "warn\u{1b}[2J"] {
            let (level, refused) = log_level(Some(setting));
            assert_eq!(level, LevelFilter::WARN, "{setting}");
            let refused = refused.expect("a value that is no level is refused aloud");
            assert!(
                refused.contains("is not a level (error, warn, info, debug, trace or off)"),
                "{refused}"
            );
            assert!(
                !refused.contains('\u{1b}'),
                "shown without its control characters: {refused}"
            );
        }
    }

    /// The CLI's log leaves the MCP client library's events out (they quote a server's URL
    /// and error bodies whole, credentials included), and shows the runtime's.
    #[test]
    fn the_cli_log_leaves_the_mcp_librarys_events_out() {
        #[derive(Clone, Default)]
        struct Captured(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);
        impl std::io::Write for Captured {
            fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
                self.0.lock().unwrap().extend_from_slice(bytes);
                Ok(bytes.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let captured = Captured::default();
        let writer = captured.clone();
        let subscriber = cli_subscriber(tracing::level_filters::LevelFilter::WARN, move || writer.clone());
        tracing::subscriber::with_default(subscriber, || {
            tracing::error!(target: "rmcp::transport::worker", "POST https://mcp.example/?api_key=sk-123 failed");
            tracing::error!(target: "flue_runtime::mcp", "the MCP server is unreachable");
            tracing::info!(target: "flue_runtime::mcp", "below the level");
        });
        let logged = String::from_utf8(captured.0.lock().unwrap().clone()).unwrap();
        assert!(logged.contains("the MCP server is unreachable"), "{logged}");
        assert!(!logged.contains("sk-123"), "{logged}");
        assert!(!logged.contains("below the level"), "{logged}");
    }
    use crate::prelude::*;
    use crate::testing::{ScriptedModel, ScriptedReply};

    /// A reply (or an error quoting a server) printed to a terminal shows its escape
    /// sequences instead of running them: it cannot rewrite the screen, fake a link (OSC 8)
    /// or set the clipboard (OSC 52). Lines and tabs stay.
    #[test]
    fn a_terminal_is_shown_control_characters_not_made_to_obey_them() {
        assert!(matches!(
            printable("plain text\n\tindented"),
            std::borrow::Cow::Borrowed(_)
        ));
        assert_eq!(
            printable("a\x1b[2K\x1b[1Ab\u{9d}52;c;Zm9v\x07 \r\x00"),
            "a\\u001b[2K\\u001b[1Ab\\u009d52;c;Zm9v\\u0007 \\u000d\\u0000"
        );
        // `--json` output stays JSON: serde_json leaves DEL and the C1 controls as they are.
        let json = serde_json::json!({"text": "a\u{7f}b\u{9b}c"}).to_string();
        let shown: serde_json::Value = serde_json::from_str(&printable(&json)).unwrap();
        assert_eq!(shown["text"], "a\u{7f}b\u{9b}c");
        let mut shown = Printable(Vec::new());
        let reply = "\x1b]8;;https://evil.example\x07click\x1b]8;;\x07";
        writeln!(shown, "reply: {reply}").unwrap();
        assert_eq!(
            String::from_utf8(shown.0).unwrap(),
            "reply: \\u001b]8;;https://evil.example\\u0007click\\u001b]8;;\\u0007\n"
        );
    }

    /// Never answers.
    #[crate::tool(crate = "crate")]
    async fn wait_forever() -> String {
        std::future::pending::<String>().await
    }

    #[crate::agent(crate = "crate")]
    fn waiter() -> &'static str {
        use_model("scripted/w");
        use_tool(wait_forever);
        "Wait."
    }

    /// Stopping `run` (Ctrl-C, SIGTERM) before the reply aborts the message rather than leave
    /// it for a later process to finish, and ends the command with 128 plus the signal's
    /// number.
    #[tokio::test]
    async fn a_run_stopped_before_its_reply_aborts_its_message() {
        for (signal, code) in [(StopSignal::Interrupt, 130), (StopSignal::Terminate, 143)] {
            a_run_stopped_by(signal, code).await;
        }
    }

    /// On a shared store (several nodes), the instance may hold other clients' messages, and
    /// an abort is instance-wide: stopping `run` aborts none of them, its own included (given
    /// back to the queue, another node finishes it).
    #[tokio::test]
    async fn a_run_stopped_on_a_shared_store_aborts_no_message_of_the_instance() {
        a_run_stopped_beside_another_message(crate::store::MemoryStore::new().pretending_shared()).await;
    }

    /// On a store of its own, an instance holding a message before `run` sent its own (one a
    /// stopped `serve` gave back to the queue) holds another client's: stopping `run` aborts
    /// neither.
    #[tokio::test]
    async fn a_run_stopped_behind_a_message_it_did_not_send_aborts_no_message_of_the_instance() {
        a_run_stopped_beside_another_message(crate::store::MemoryStore::new()).await;
    }

    async fn a_run_stopped_beside_another_message(store: crate::store::MemoryStore) {
        let model = ScriptedModel::new([ScriptedReply::tool_call("wait_forever", serde_json::json!({}))]);
        let mut providers = crate::provider::ProviderRegistry::new();
        providers.register(model.clone());
        let runtime = Runtime::builder()
            .store(store.clone())
            .providers(providers)
            .agent(waiter)
            .build()
            .unwrap();
        // Another client's message, queued on the instance.
        let key = crate::store::InstanceKey::new("waiter", "w");
        let admission = crate::store::Admission {
            key,
            submission_id: "sub_other".into(),
            keyed: false,
            kind: crate::store::SubmissionKind::Dispatch,
            message: flue_core::message::DeliveredMessage::user("another client's"),
            initial_data: None,
            uid: crate::store::UidCondition::Any,
            max_attempts: 1,
            timeout_ms: 60_000,
            claim: None,
            trace: None,
        };
        let other = crate::store::Store::admit(&store, admission).await.unwrap();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let stopping = async move {
            while model.requests().is_empty() {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            let _ = stop.send(());
        };
        let (result, ()) = tokio::join!(
            send_until(&runtime, "waiter", "w".into(), "go".into(), async {
                let _ = stopped.await;
                StopSignal::Interrupt
            }),
            stopping
        );
        assert_eq!(result.unwrap_err().exit_code(), 130);
        let row = crate::store::Store::submission(&store, &other.submission.id)
            .await
            .unwrap()
            .unwrap();
        assert!(!row.abort_requested, "another client's message is not aborted");
    }

    /// Tells [`STOP_NOW`] at the would-stop point, then takes a while.
    #[crate::agent(crate = "crate")]
    fn slow_finisher() -> &'static str {
        use_model("scripted/f");
        use_agent_finish(|_ctx| async {
            STOP_NOW.notify_one();
            tokio::time::sleep(Duration::from_millis(300)).await;
            Ok::<_, Box<dyn std::error::Error + Send + Sync>>(())
        });
        "Finish slowly."
    }

    static STOP_NOW: tokio::sync::Notify = tokio::sync::Notify::const_new();

    /// A stop that comes once the answer is durable (while finish callbacks run) loses the race
    /// to completion: the message completes, and `run` answers its reply, not "aborted".
    #[tokio::test]
    async fn a_run_stopped_after_its_answer_was_durable_answers_the_reply() {
        let model = ScriptedModel::new([ScriptedReply::text("done")]);
        let mut providers = crate::provider::ProviderRegistry::new();
        providers.register(model);
        let runtime = Runtime::builder()
            .store(crate::store::MemoryStore::new())
            .providers(providers)
            .agent(slow_finisher)
            .build()
            .unwrap();
        let reply = send_until(&runtime, "slow_finisher", "f".into(), "go".into(), async {
            STOP_NOW.notified().await;
            StopSignal::Interrupt
        })
        .await
        .unwrap();
        assert_eq!(reply.text, "done");
    }

    async fn a_run_stopped_by(signal: StopSignal, code: i32) {
        let model = ScriptedModel::new([ScriptedReply::tool_call("wait_forever", serde_json::json!({}))]);
        let mut providers = crate::provider::ProviderRegistry::new();
        providers.register(model.clone());
        let runtime = Runtime::builder()
            .store(crate::store::MemoryStore::new())
            .providers(providers)
            .agent(waiter)
            .build()
            .unwrap();
        let mut events = runtime.observe();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let stopping = async move {
            // Stopped once the tool runs.
            while model.requests().is_empty() {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            let _ = stop.send(());
        };
        let (result, ()) = tokio::join!(
            send_until(&runtime, "waiter", "w".into(), "go".into(), async {
                let _ = stopped.await;
                signal
            }),
            stopping
        );
        let error = result.unwrap_err();
        assert_eq!(error.exit_code(), code, "{error}");
        let settled = tokio::time::timeout(Duration::from_secs(10), async {
            loop {
                if let Ok(observation) = events.recv().await
                    && let crate::events::Event::SubmissionSettled { outcome, .. } = observation.event
                {
                    return outcome;
                }
            }
        })
        .await
        .expect("the message settles");
        assert_eq!(settled, crate::record::Outcome::Aborted);
    }
}
