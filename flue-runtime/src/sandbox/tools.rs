//! The sandbox tools: `read`, `write`, `edit`, `bash`, `grep`, `glob`, bound to one
//! submission's [`SandboxSession`].

use std::sync::Arc;

use flue_core::data::SchemaSource;
use flue_core::sandbox::{ExecRequest, SandboxError};
use flue_core::tool::{ToolContext, ToolDefinition, ToolHandler, ToolOutput};
use flue_core::{BoxFuture, Tool};
use schemars::JsonSchema;
use serde::Deserialize;
use serde::de::DeserializeOwned;
use serde_json::Value;

use super::{SandboxSession, join};

/// Lines `read` and `bash` return at most.
pub const MAX_LINES: usize = 2000;
/// Bytes `read` and `bash` return at most.
pub const MAX_BYTES: usize = 50 * 1024;
/// Matches `grep` returns at most.
pub const MAX_MATCHES: usize = 100;
/// Characters of a matching line `grep` shows.
pub const MAX_MATCH_CHARS: usize = 500;
/// Paths `glob` returns at most.
pub const MAX_PATHS: usize = 1000;
/// Files and directories `grep` and `glob` visit at most.
const MAX_WALK: usize = 20_000;
/// Bytes `read` skips at most to reach its window: a larger offset is refused rather than
/// read to (a file growing as fast as it is read would never be reached). The unit tests
/// bound at a MiB, to reach the bound quickly.
const MAX_SKIPPED_BYTES: usize = if cfg!(test) { 1 << 20 } else { 256 << 20 };
/// Bytes one `grep` call reads at most, over all its files (a MiB in the unit tests).
const MAX_GREP_BYTES: usize = if cfg!(test) { 1 << 20 } else { 256 << 20 };

/// Bytes `read` goes on reading past its window, to count the file's lines (and the length of
/// a first line longer than the window) for its marker: an ordinary file gets exact counts, a
/// huge one is not read to its end ("more than" counts).
const LOOK_AHEAD: usize = 1024 * 1024;
/// Bytes of a window `read` keeps while reading: the byte cap, plus one `\r` for each line
/// (the cap counts lines without their `\r\n`), plus the separators. A line cut at this
/// length is past the cap wherever it starts in the window.
const KEEP: usize = MAX_BYTES + 2 * MAX_LINES + 8;
/// Bytes of one line `grep` reads at most: the line's head is searched, and the rest of the
/// file is not (a file with lines this long is data, not text).
const MAX_GREP_LINE: usize = 1024 * 1024;

/// A count: exact when the read reached the end of the file, or a lower bound when it stopped
/// before.
#[derive(Clone, Copy, Debug)]
enum Count {
    Exact(usize),
    MoreThan(usize),
}

impl std::fmt::Display for Count {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Exact(count) => write!(f, "{count}"),
            Self::MoreThan(count) => write!(f, "more than {count}"),
        }
    }
}

/// Checks that bytes given a piece at a time are UTF-8 (a character may span two pieces).
#[derive(Default)]
struct Utf8Check {
    /// The start of a character the last piece cut.
    carry: Vec<u8>,
}

impl Utf8Check {
    /// Whether `piece` continues valid UTF-8.
    fn feed(&mut self, mut piece: &[u8]) -> bool {
        while !self.carry.is_empty() {
            let Some((&byte, rest)) = piece.split_first() else {
                return true;
            };
            self.carry.push(byte);
            piece = rest;
            match std::str::from_utf8(&self.carry) {
                Ok(_) => self.carry.clear(),
                Err(error) if error.error_len().is_some() => return false,
                Err(_) => {}
            }
        }
        match std::str::from_utf8(piece) {
            Ok(_) => true,
            Err(error) if error.error_len().is_none() => {
                self.carry = piece[error.valid_up_to()..].to_vec();
                true
            }
            Err(_) => false,
        }
    }

    /// Whether the text ended on a whole character.
    fn finished(&self) -> bool {
        self.carry.is_empty()
    }
}

/// The longest UTF-8 start of `bytes` (checked already: only a cut character at the end).
fn utf8_head(bytes: &[u8]) -> &str {
    match std::str::from_utf8(bytes) {
        Ok(text) => text,
        Err(error) => std::str::from_utf8(&bytes[..error.valid_up_to()]).unwrap_or_default(),
    }
}

/// Why a `read` window has no text.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum WindowError {
    /// The file is not UTF-8.
    Binary,
    /// The offset is past the end (the message).
    Offset(String),
}

/// `read`'s window of a file given a piece at a time ([`WindowReader::feed`]): the lines
/// before the window are counted, not kept; the window's bytes are kept up to [`KEEP`]; past
/// the window the read goes on only for the look-ahead, counting lines.
pub(crate) struct WindowReader {
    /// The window's first line (0-based) and how many lines it shows at most.
    start: usize,
    wanted: usize,
    look_ahead: usize,
    /// Line ends (`\n`) so far.
    newlines: usize,
    /// The last byte so far.
    last: Option<u8>,
    /// The file from the window's first line on, at most [`KEEP`] bytes, and its line ends.
    kept: Vec<u8>,
    kept_newlines: usize,
    /// The bytes of the window's first line so far (with a `\r` before its end), and
    /// whether it ended.
    first_len: usize,
    first_ended: bool,
    /// Bytes read past the window.
    past: usize,
    /// Whether the read stopped before the end of the file.
    stopped: bool,
    /// Bytes skipped before the window.
    skipped: usize,
    /// The window lies past [`MAX_SKIPPED_BYTES`].
    too_far: bool,
    utf8: Utf8Check,
    binary: bool,
}

impl WindowReader {
    /// A window from line `offset` (1-based), at most `limit` lines and [`MAX_LINES`], reading
    /// at most `look_ahead` bytes past the window.
    pub(crate) fn new(offset: Option<usize>, limit: Option<usize>, look_ahead: usize) -> Self {
        Self {
            start: offset.unwrap_or(1).max(1) - 1,
            wanted: limit.unwrap_or(MAX_LINES).min(MAX_LINES),
            look_ahead,
            newlines: 0,
            last: None,
            kept: Vec::new(),
            kept_newlines: 0,
            first_len: 0,
            first_ended: false,
            past: 0,
            stopped: false,
            skipped: 0,
            too_far: false,
            utf8: Utf8Check::default(),
            binary: false,
        }
    }

    /// The next piece of the file; `false` when no more is wanted.
    pub(crate) fn feed(&mut self, mut piece: &[u8]) -> bool {
        if !self.utf8.feed(piece) {
            self.binary = true;
            return false;
        }
        while !piece.is_empty() {
            let taken = if self.newlines < self.start {
                // Before the window: up to the next line end, and no further than the bound.
                if self.skipped >= MAX_SKIPPED_BYTES {
                    self.too_far = true;
                    return false;
                }
                let taken = memchr::memchr(b'\n', piece).map_or(piece.len(), |end| end + 1);
                self.skipped += taken;
                taken
            } else if self.kept.len() < KEEP && self.kept_newlines < self.wanted {
                let taken = piece.len().min(KEEP - self.kept.len());
                self.kept.extend_from_slice(&piece[..taken]);
                self.kept_newlines += memchr::memchr_iter(b'\n', &piece[..taken]).count();
                taken
            } else if self.past < self.look_ahead {
                let taken = piece.len().min(self.look_ahead - self.past);
                self.past += taken;
                taken
            } else {
                self.stopped = true;
                return false;
            };
            let (now, rest) = piece.split_at(taken);
            if self.newlines >= self.start && !self.first_ended {
                match memchr::memchr(b'\n', now) {
                    Some(end) => {
                        self.first_len += end;
                        self.first_ended = true;
                        // `\r\n` ends a line as `\n` does.
                        let before = if end > 0 { now.get(end - 1).copied() } else { self.last };
                        if before == Some(b'\r') {
                            self.first_len -= 1;
                        }
                    }
                    None => self.first_len += now.len(),
                }
            }
            self.newlines += memchr::memchr_iter(b'\n', now).count();
            self.last = now.last().copied().or(self.last);
            piece = rest;
        }
        true
    }

    /// The window, with a marker saying where to continue when lines remain.
    pub(crate) fn finish(self) -> Result<String, WindowError> {
        if self.too_far {
            return Err(WindowError::Offset(format!(
                "Line {} lies more than {} MB into the file, past what read skips; use bash (tail, sed) for it.",
                self.start + 1,
                MAX_SKIPPED_BYTES / (1024 * 1024)
            )));
        }
        if self.binary || (!self.stopped && !self.utf8.finished()) {
            return Err(WindowError::Binary);
        }
        let total = if self.stopped {
            Count::MoreThan(self.newlines)
        } else {
            Count::Exact(self.newlines + usize::from(self.last.is_some_and(|last| last != b'\n')))
        };
        // At least this many lines exist.
        let known = match total {
            Count::Exact(count) => count,
            Count::MoreThan(count) => count + 1,
        };
        let start = self.start;
        if let Count::Exact(count) = total
            && start >= count
            && count > 0
        {
            return Err(WindowError::Offset(format!(
                "Offset {} is past the end of the file ({count} lines).",
                start + 1
            )));
        }
        // The kept bytes are all the window has when the read neither went past them nor
        // stopped; otherwise their last line may be cut.
        let whole = self.past == 0 && !self.stopped;
        let text = utf8_head(&self.kept);
        let mut pieces: Vec<&str> = text.split('\n').collect();
        let cut_last = !whole && pieces.len() > self.kept_newlines;
        if pieces.last() == Some(&"") && (whole || !cut_last) {
            pieces.pop();
        }
        let ended = pieces.len().min(self.kept_newlines);
        let mut out = String::new();
        let mut shown = 0;
        for (index, piece) in pieces.iter().enumerate().take(self.wanted) {
            let complete = index < ended || whole;
            let line = if index < ended {
                piece.strip_suffix('\r').unwrap_or(piece)
            } else {
                piece
            };
            if !complete || out.len() + line.len() + 1 > MAX_BYTES {
                if shown == 0 {
                    // A first line past the cap: its head, so the window still moves on (a
                    // marker pointing back at this line would loop forever).
                    let mut end = MAX_BYTES.min(line.len());
                    while !line.is_char_boundary(end) {
                        end -= 1;
                    }
                    let length = if self.first_ended {
                        Count::Exact(self.first_len)
                    } else if self.stopped {
                        Count::MoreThan(self.first_len)
                    } else {
                        Count::Exact(self.first_len)
                    };
                    out.push_str(&line[..end]);
                    out.push_str(&format!(
                        "\n\n[Line {} is {length} bytes; only its first {MAX_BYTES} are shown.]",
                        start + 1
                    ));
                    shown = 1;
                }
                break;
            }
            if shown > 0 {
                out.push('\n');
            }
            out.push_str(line);
            shown += 1;
        }
        let next = start + shown;
        if next < known {
            out.push_str(&format!(
                "\n\n[Showing lines {}-{} of {total}. Continue with offset {}.]",
                start + 1,
                next,
                next + 1
            ));
        }
        Ok(out)
    }
}

/// `text` from line `offset` (1-based), at most `limit` lines, [`MAX_LINES`] and
/// [`MAX_BYTES`], with a marker saying where to continue when lines remain.
pub(crate) fn line_window(text: &str, offset: Option<usize>, limit: Option<usize>) -> Result<String, String> {
    let mut window = WindowReader::new(offset, limit, usize::MAX);
    window.feed(text.as_bytes());
    window.finish().map_err(|error| match error {
        WindowError::Offset(message) => message,
        // Text is UTF-8.
        WindowError::Binary => "The text is not UTF-8.".to_owned(),
    })
}

/// `grep`'s search of one file given a piece at a time ([`LineSearch::feed`]): a line at a
/// time, at most [`MAX_GREP_LINE`] bytes of one, until `room` matches are found.
struct LineSearch<'p> {
    pattern: &'p regex::Regex,
    room: usize,
    /// The current line so far (at most [`MAX_GREP_LINE`] bytes) and its number (1-based).
    line: Vec<u8>,
    number: usize,
    /// Matching lines: their numbers and their text (cut to [`MAX_MATCH_CHARS`]).
    matches: Vec<(usize, String)>,
    utf8: Utf8Check,
    binary: bool,
    stopped: bool,
}

impl<'p> LineSearch<'p> {
    fn new(pattern: &'p regex::Regex, room: usize) -> Self {
        Self {
            pattern,
            room,
            line: Vec::new(),
            number: 1,
            matches: Vec::new(),
            utf8: Utf8Check::default(),
            binary: false,
            stopped: false,
        }
    }

    /// Searches the current line, then starts the next; `false` when no more is wanted.
    fn end_line(&mut self) -> bool {
        let bytes = self.line.strip_suffix(b"\r").unwrap_or(&self.line);
        let line = utf8_head(bytes);
        if self.pattern.is_match(line) {
            self.matches
                .push((self.number, line.chars().take(MAX_MATCH_CHARS).collect()));
        }
        self.line.clear();
        self.number += 1;
        self.matches.len() < self.room
    }

    /// The next piece of the file; `false` when no more is wanted.
    fn feed(&mut self, mut piece: &[u8]) -> bool {
        if !self.utf8.feed(piece) {
            self.binary = true;
            return false;
        }
        while !piece.is_empty() {
            let end = memchr::memchr(b'\n', piece);
            let part = &piece[..end.unwrap_or(piece.len())];
            let room = MAX_GREP_LINE - self.line.len();
            self.line.extend_from_slice(&part[..part.len().min(room)]);
            if part.len() > room {
                // A line this long: its head is searched, the rest of the file is not.
                self.end_line();
                self.stopped = true;
                return false;
            }
            let Some(end) = end else { break };
            if !self.end_line() {
                self.stopped = true;
                return false;
            }
            piece = &piece[end + 1..];
        }
        true
    }

    /// Ends the search where the reading stopped (a budget ran out): what was read is all
    /// that is searched, and the line it cut (maybe inside a character) is not.
    fn cut(&mut self) {
        self.line.clear();
        self.stopped = true;
    }

    /// The matches, or `None` for a file that is not UTF-8.
    fn finish(mut self) -> Option<Vec<(usize, String)>> {
        if self.binary || (!self.stopped && !self.utf8.finished()) {
            return None;
        }
        if !self.stopped && !self.line.is_empty() {
            self.end_line();
        }
        Some(self.matches)
    }
}

/// The end of `text`: at most [`MAX_LINES`] lines and [`MAX_BYTES`], with a marker when cut.
fn tail(text: &str) -> String {
    let lines: Vec<&str> = text.lines().collect();
    let mut kept: Vec<&str> = Vec::new();
    let mut bytes = 0;
    for line in lines.iter().rev() {
        if kept.len() == MAX_LINES || bytes + line.len() + 1 > MAX_BYTES {
            break;
        }
        bytes += line.len() + 1;
        kept.push(line);
    }
    kept.reverse();
    if kept.is_empty()
        && let Some(last) = lines.last()
    {
        // A last line past the cap: its end, rather than nothing at all.
        let mut start = last.len().saturating_sub(MAX_BYTES);
        while !last.is_char_boundary(start) {
            start += 1;
        }
        return format!(
            "[Output truncated: the last {} of {} bytes of the last of {} lines.]\n{}",
            last.len() - start,
            last.len(),
            lines.len(),
            &last[start..]
        );
    }
    let mut out = kept.join("\n");
    if kept.len() < lines.len() {
        out.insert_str(
            0,
            &format!(
                "[Output truncated: the last {} of {} lines.]\n",
                kept.len(),
                lines.len()
            ),
        );
    }
    out
}

fn sandbox_error(error: SandboxError) -> ToolOutput {
    ToolOutput::error(error.to_string())
}

/// A sandbox tool: typed arguments, run against the session.
struct SandboxTool<A> {
    definition: ToolDefinition,
    session: Arc<SandboxSession>,
    run: for<'a> fn(&'a SandboxSession, A) -> BoxFuture<'a, ToolOutput>,
}

impl<A: DeserializeOwned + Send + 'static> ToolHandler for SandboxTool<A> {
    fn definition(&self) -> &ToolDefinition {
        &self.definition
    }

    fn call(&self, _ctx: ToolContext, args: Value) -> BoxFuture<'_, ToolOutput> {
        match flue_core::tool::parse_arguments::<A>(args) {
            Ok(args) => (self.run)(&self.session, args),
            Err(invalid) => Box::pin(std::future::ready(invalid)),
        }
    }
}

fn tool<A: DeserializeOwned + JsonSchema + Send + 'static>(
    session: &Arc<SandboxSession>,
    name: &'static str,
    description: &'static str,
    run: for<'a> fn(&'a SandboxSession, A) -> BoxFuture<'a, ToolOutput>,
) -> Tool {
    Tool::from_handler(SandboxTool {
        definition: ToolDefinition::from_checked(
            name,
            description,
            SchemaSource::Typed(flue_core::data::tool_input_schema_of::<A>),
            None,
            &[],
            false,
        ),
        session: session.clone(),
        run,
    })
}

/// The six tools over `session`.
pub(crate) fn tools(session: &Arc<SandboxSession>) -> Vec<Tool> {
    vec![
        tool(
            session,
            "read",
            "Read a text file (at most 2000 lines / 50 KB per call; use offset and limit for more).",
            read,
        ),
        tool(
            session,
            "write",
            "Create or replace a file with the given content (parent directories are created).",
            write,
        ),
        tool(
            session,
            "edit",
            "Replace an exact piece of a file's text: old_string must occur once (or set replace_all).",
            edit,
        ),
        tool(
            session,
            "bash",
            "Run a shell command in the working directory (output: the last 2000 lines / 50 KB).",
            bash,
        ),
        tool(
            session,
            "grep",
            "Search file contents with a regular expression (at most 100 matching lines).",
            grep,
        ),
        tool(
            session,
            "glob",
            "List files whose paths match a glob pattern such as **/*.rs (at most 1000 paths).",
            glob,
        ),
    ]
}

/// `read`'s arguments.
#[derive(Deserialize, JsonSchema)]
struct ReadArgs {
    /// The file (relative to the working directory, or absolute in the sandbox).
    path: String,
    /// The line to start from (1-based).
    #[serde(default)]
    #[schemars(range(min = 1))]
    offset: Option<usize>,
    /// How many lines to read at most.
    #[serde(default)]
    #[schemars(range(min = 1))]
    limit: Option<usize>,
}

fn read(session: &SandboxSession, args: ReadArgs) -> BoxFuture<'_, ToolOutput> {
    Box::pin(async move {
        let path = match join(&session.cwd, &args.path) {
            Ok(path) => path,
            Err(error) => return sandbox_error(error),
        };
        // Read a piece at a time, only as far as the window (and its look-ahead).
        let mut window = WindowReader::new(args.offset, args.limit, LOOK_AHEAD);
        let mut visit = |piece: &[u8]| window.feed(piece);
        if let Err(error) = session.sandbox.read_file_with(&path, &mut visit).await {
            return sandbox_error(error);
        }
        match window.finish() {
            Ok(window) => ToolOutput::text(window),
            Err(WindowError::Binary) => {
                ToolOutput::error(format!("{path} is a binary file; only text files can be read."))
            }
            Err(WindowError::Offset(message)) => ToolOutput::error(message),
        }
    })
}

/// `write`'s arguments.
#[derive(Deserialize, JsonSchema)]
struct WriteArgs {
    /// The file (relative to the working directory, or absolute in the sandbox).
    path: String,
    /// The whole new content.
    content: String,
}

fn write(session: &SandboxSession, args: WriteArgs) -> BoxFuture<'_, ToolOutput> {
    Box::pin(async move {
        let path = match join(&session.cwd, &args.path) {
            Ok(path) => path,
            Err(error) => return sandbox_error(error),
        };
        let guard = session.lock_of(&path).await.lock_owned().await;
        let size = args.content.len();
        match write_holding(session, &path, args.content.into_bytes(), guard).await {
            Ok(()) => ToolOutput::text(format!("Wrote {size} bytes to {path}.")),
            Err(error) => sandbox_error(error),
        }
    })
}

/// Writes `contents` at `path` holding the file's lock (`guard`) until the write has ended,
/// even when the tool is dropped meanwhile (an abort, a deadline): the write goes on to its
/// end (a local sandbox's runs on a blocking thread, which nothing stops), and the next write
/// of the file waits for it, not only for the tool that started it (also in the next
/// submission, whose session shares the locks: see [`Sandbox::files_identity`]).
async fn write_holding(
    session: &SandboxSession,
    path: &str,
    contents: Vec<u8>,
    guard: tokio::sync::OwnedMutexGuard<()>,
) -> Result<(), SandboxError> {
    // The locks too: a session that starts once this one's are gone would make new ones.
    let (sandbox, path, locks) = (session.sandbox.clone(), path.to_owned(), session.locks.clone());
    let write = tokio::spawn(async move {
        let written = sandbox.write_file(&path, contents).await;
        drop(guard);
        drop(locks);
        written
    });
    write
        .await
        .unwrap_or_else(|_| Err(SandboxError::Io("the write panicked".into())))
}

/// The largest file `edit` reads or writes.
const MAX_EDIT_BYTES: usize = 16 * 1024 * 1024;

/// `edit`'s arguments.
#[derive(Deserialize, JsonSchema)]
struct EditArgs {
    /// The file (relative to the working directory, or absolute in the sandbox).
    path: String,
    /// The exact text to replace.
    old_string: String,
    /// What replaces it.
    new_string: String,
    /// Replace every occurrence (otherwise old_string must occur exactly once).
    #[serde(default)]
    replace_all: bool,
}

fn edit(session: &SandboxSession, args: EditArgs) -> BoxFuture<'_, ToolOutput> {
    Box::pin(async move {
        let path = match join(&session.cwd, &args.path) {
            Ok(path) => path,
            Err(error) => return sandbox_error(error),
        };
        if args.old_string.is_empty() {
            return ToolOutput::error("old_string must not be empty.");
        }
        let guard = session.lock_of(&path).await.lock_owned().await;
        // Read no further than an editable file goes: a huge file is refused, not held.
        let mut bytes = Vec::new();
        let mut visit = |piece: &[u8]| {
            bytes.extend_from_slice(&piece[..piece.len().min(MAX_EDIT_BYTES + 1 - bytes.len())]);
            bytes.len() <= MAX_EDIT_BYTES
        };
        if let Err(error) = session.sandbox.read_file_with(&path, &mut visit).await {
            return sandbox_error(error);
        }
        if bytes.len() > MAX_EDIT_BYTES {
            return ToolOutput::error(format!(
                "{path} is larger than {} MB; edit can only change smaller files (use bash for this one).",
                MAX_EDIT_BYTES / (1024 * 1024)
            ));
        }
        let Ok(text) = String::from_utf8(bytes) else {
            return ToolOutput::error(format!("{path} is a binary file; only text files can be edited."));
        };
        let count = text.matches(&args.old_string).count();
        if count == 0 {
            return ToolOutput::error(format!("old_string was not found in {path}."));
        }
        if count > 1 && !args.replace_all {
            return ToolOutput::error(format!(
                "old_string occurs {count} times in {path}; include more context to make it unique, or set replace_all."
            ));
        }
        // What the file would grow to, before it is built: an edit cannot blow a file up past
        // what edit may change (replace_all of one character by ten, ten times over, would).
        let grown = (count as u128) * (args.new_string.len() as u128);
        if text.len() as u128 - (count as u128) * (args.old_string.len() as u128) + grown > MAX_EDIT_BYTES as u128 {
            return ToolOutput::error(format!(
                "The edit would make {path} larger than {} MB; it was not made.",
                MAX_EDIT_BYTES / (1024 * 1024)
            ));
        }
        let edited = if args.replace_all {
            text.replace(&args.old_string, &args.new_string)
        } else {
            text.replacen(&args.old_string, &args.new_string, 1)
        };
        match write_holding(session, &path, edited.into_bytes(), guard).await {
            Ok(()) => ToolOutput::text(format!(
                "Edited {path} ({count} replacement{}).",
                if count == 1 { "" } else { "s" }
            )),
            Err(error) => sandbox_error(error),
        }
    })
}

/// `bash`'s arguments.
#[derive(Deserialize, JsonSchema)]
struct BashArgs {
    /// The command line (run by `bash -c` in the working directory; `sh -c` where bash is not
    /// installed).
    command: String,
    /// Seconds the command may run (default 120).
    #[serde(default)]
    #[schemars(range(min = 1, max = 3600))]
    timeout_seconds: Option<u64>,
}

fn bash(session: &SandboxSession, args: BashArgs) -> BoxFuture<'_, ToolOutput> {
    Box::pin(async move {
        let request = ExecRequest {
            command: args.command,
            cwd: Some(session.cwd.clone()),
            timeout: args.timeout_seconds.map(std::time::Duration::from_secs),
        };
        match session.sandbox.exec(request).await {
            Err(error) => sandbox_error(error),
            Ok(output) => {
                let mut combined = output.stdout;
                if !output.stderr.is_empty() {
                    if !combined.is_empty() && !combined.ends_with('\n') {
                        combined.push('\n');
                    }
                    combined.push_str(&output.stderr);
                }
                let shown = tail(combined.trim_end());
                let shown = if shown.is_empty() {
                    "(no output)".to_owned()
                } else {
                    shown
                };
                match output.exit_code {
                    Some(0) => ToolOutput::text(shown),
                    Some(code) => ToolOutput::text(format!("{shown}\n\nThe command exited with code {code}.")),
                    // Killed: by its timeout or by a signal, which the output says.
                    None => ToolOutput::error(format!("{shown}\n\nThe command did not exit with a code.")),
                }
            }
        }
    })
}

/// Every file under `base` (a sandbox path), depth first in name order, visiting at most
/// [`MAX_WALK`] files and directories (a million empty directories cost as much as a million
/// files).
async fn walk(session: &SandboxSession, base: &str) -> Result<Walked, SandboxError> {
    let mut files = Vec::new();
    let mut pending = vec![base.to_owned()];
    let mut visited = 0usize;
    let mut unlisted = Unlisted::default();
    while let Some(directory) = pending.pop() {
        visited += 1;
        if visited + files.len() > MAX_WALK {
            return Ok(Walked {
                files,
                cut: true,
                unlisted,
            });
        }
        let entries = match session.sandbox.list_dir(&directory).await {
            Ok(entries) => entries,
            // The base itself may be a file: it is one when it reads as one. Any other
            // failure to list it (a directory too large or not readable, a remote sandbox's
            // error) is the call's, not a walk that found nothing.
            Err(error @ SandboxError::Io(_)) if directory == base => {
                let mut peek = |_: &[u8]| false;
                if session.sandbox.read_file_with(base, &mut peek).await.is_ok() {
                    return Ok(Walked {
                        files: vec![base.to_owned()],
                        cut: false,
                        unlisted,
                    });
                }
                return Err(error);
            }
            Err(error) if directory == base => return Err(error),
            // A directory that cannot be listed (too large, too deep, not readable) is not
            // searched, which the answer says: silence would read as "nothing there".
            Err(error) => {
                unlisted.count += 1;
                unlisted.first.get_or_insert_with(|| (directory, error.to_string()));
                continue;
            }
        };
        let mut directories = Vec::new();
        for entry in entries {
            if entry.name.starts_with('.') && matches!(entry.name.as_str(), ".git" | ".flue") {
                continue;
            }
            let path = if directory == "/" {
                format!("/{}", entry.name)
            } else {
                format!("{directory}/{}", entry.name)
            };
            if entry.is_dir {
                directories.push(path);
            } else {
                files.push(path);
                if files.len() >= MAX_WALK {
                    return Ok(Walked {
                        files,
                        cut: true,
                        unlisted,
                    });
                }
            }
        }
        pending.extend(directories.into_iter().rev());
    }
    Ok(Walked {
        files,
        cut: false,
        unlisted,
    })
}

/// The files a walk found, whether it stopped at [`MAX_WALK`] before the end, and the
/// directories it could not list.
struct Walked {
    files: Vec<String>,
    cut: bool,
    unlisted: Unlisted,
}

/// The directories a walk could not list: how many, and the first with why.
#[derive(Default)]
struct Unlisted {
    count: usize,
    first: Option<(String, String)>,
}

/// What `grep` and `glob` add to their answer when the walk under them stopped early or left
/// directories out: a silent cut would read as "nothing else is there".
fn walk_notes(cut: bool, unlisted: &Unlisted) -> String {
    let mut notes = String::new();
    if cut {
        notes.push_str(&format!(
            "\n\n[Stopped after visiting {MAX_WALK} files and directories; narrow the path.]"
        ));
    }
    if let Some((directory, why)) = &unlisted.first {
        let others = match unlisted.count - 1 {
            0 => String::new(),
            1 => " and 1 other".to_owned(),
            more => format!(" and {more} others"),
        };
        notes.push_str(&format!(
            "\n\n[Not searched: {directory}{others}, which could not be listed ({why}).]"
        ));
    }
    notes
}

/// The search root `path` names (the working directory by default) and the files under it.
async fn files_under(session: &SandboxSession, path: Option<&str>) -> Result<(String, Walked), SandboxError> {
    let base = join(&session.cwd, path.unwrap_or("."))?;
    let walked = walk(session, &base).await?;
    Ok((base, walked))
}

fn relative<'a>(base: &str, path: &'a str) -> &'a str {
    let prefix_len = if base == "/" { 1 } else { base.len() + 1 };
    path.get(prefix_len..)
        .filter(|_| path.starts_with(base))
        .unwrap_or(path)
}

/// `grep`'s arguments.
#[derive(Deserialize, JsonSchema)]
struct GrepArgs {
    /// A regular expression (Rust `regex` syntax).
    pattern: String,
    /// The directory or file to search (default: the working directory).
    #[serde(default)]
    path: Option<String>,
    /// Only files whose paths (relative to `path`) match this glob, e.g. `*.rs`.
    #[serde(default)]
    glob: Option<String>,
    /// Match case-insensitively.
    #[serde(default)]
    ignore_case: bool,
}

fn grep(session: &SandboxSession, args: GrepArgs) -> BoxFuture<'_, ToolOutput> {
    Box::pin(async move {
        let pattern = match regex::RegexBuilder::new(&args.pattern)
            .case_insensitive(args.ignore_case)
            .size_limit(1 << 20)
            .build()
        {
            Ok(pattern) => pattern,
            Err(error) => return ToolOutput::error(format!("Invalid pattern: {error}")),
        };
        let filter = match args.glob.as_deref().map(glob::Pattern::new).transpose() {
            Ok(filter) => filter,
            Err(error) => return ToolOutput::error(format!("Invalid glob: {error}")),
        };
        let (base, Walked { files, cut, unlisted }) = match files_under(session, args.path.as_deref()).await {
            Ok(found) => found,
            Err(error) => return sandbox_error(error),
        };
        let mut matches = Vec::new();
        let mut more = false;
        // What this call may still read, over all its files.
        let mut budget = MAX_GREP_BYTES;
        let mut read_out = false;
        'files: for file in &files {
            let shown = relative(&base, file);
            if let Some(filter) = &filter
                && !filter.matches(shown)
                && !filter.matches(file.rsplit('/').next().unwrap_or(file))
            {
                continue;
            }
            // A file left to search, and nothing left to read it with.
            if budget == 0 {
                read_out = true;
                break;
            }
            // Read a piece at a time, only until one match more than can be shown.
            let mut search = LineSearch::new(&pattern, MAX_MATCHES + 1 - matches.len());
            // Whether the file had more than the budget let this call read.
            let mut starved = false;
            let mut visit = |piece: &[u8]| {
                starved = piece.len() > budget;
                let piece = &piece[..piece.len().min(budget)];
                budget -= piece.len();
                search.feed(piece) && !starved
            };
            if session.sandbox.read_file_with(file, &mut visit).await.is_err() {
                continue;
            }
            if starved {
                search.cut();
            }
            if let Some(found) = search.finish() {
                for (number, line) in found {
                    if matches.len() == MAX_MATCHES {
                        more = true;
                        break 'files;
                    }
                    matches.push(format!("{file}:{number}: {line}"));
                }
            }
            if starved {
                read_out = true;
                break;
            }
        }
        let mut out = if matches.is_empty() {
            "No matches.".to_owned()
        } else {
            matches.join("\n")
        };
        if more {
            out.push_str(&format!(
                "\n\n[Stopped at {MAX_MATCHES} matches; narrow the pattern or the path.]"
            ));
        } else if read_out {
            out.push_str(&format!(
                "\n\n[Stopped after reading {} MB; narrow the path or the glob.]",
                MAX_GREP_BYTES / (1024 * 1024)
            ));
        } else {
            out.push_str(&walk_notes(cut, &unlisted));
        }
        ToolOutput::text(out)
    })
}

/// `glob`'s arguments.
#[derive(Deserialize, JsonSchema)]
struct GlobArgs {
    /// A glob over paths relative to `path`, e.g. `**/*.md` or `src/*.rs`.
    pattern: String,
    /// The directory to search (default: the working directory).
    #[serde(default)]
    path: Option<String>,
}

fn glob(session: &SandboxSession, args: GlobArgs) -> BoxFuture<'_, ToolOutput> {
    Box::pin(async move {
        // Matched in linear time (see `glob_match`): the `glob` crate's own matcher can take
        // exponential time on a crafted pattern, on a thread no abort reaches.
        let pattern = match super::glob_match::GlobMatcher::new(&args.pattern) {
            Ok(pattern) => pattern,
            Err(error) => return ToolOutput::error(format!("Invalid glob: {error}")),
        };
        let (base, Walked { files, cut, unlisted }) = match files_under(session, args.path.as_deref()).await {
            Ok(found) => found,
            Err(error) => return sandbox_error(error),
        };
        let matched: Vec<&str> = files
            .iter()
            // A file given as `path` is matched (and named) by its name.
            .map(|file| match file == &base {
                true => file.rsplit('/').next().unwrap_or(file),
                false => relative(&base, file),
            })
            .filter(|file| pattern.matches(file))
            .collect();
        let mut out = if matched.is_empty() {
            "No files matched.".to_owned()
        } else {
            matched.iter().take(MAX_PATHS).copied().collect::<Vec<_>>().join("\n")
        };
        if matched.len() > MAX_PATHS {
            out.push_str(&format!(
                "\n\n[Showing {MAX_PATHS} of {} paths; narrow the pattern.]",
                matched.len()
            ));
        }
        out.push_str(&walk_notes(cut, &unlisted));
        ToolOutput::text(out)
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests assert by unwrapping
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use flue_core::sandbox::{DirEntry, ExecOutput, Sandbox};

    use super::*;

    /// The methods of a test sandbox that only reads: it refuses writes, removals and
    /// commands.
    macro_rules! refuses_changes {
        () => {
            fn write_file(&self, _: &str, _: Vec<u8>) -> BoxFuture<'_, Result<(), SandboxError>> {
                Box::pin(std::future::ready(Err(SandboxError::Unsupported("writes"))))
            }

            fn remove(&self, _: &str) -> BoxFuture<'_, Result<(), SandboxError>> {
                Box::pin(std::future::ready(Err(SandboxError::Unsupported("removals"))))
            }

            fn exec(&self, _: ExecRequest) -> BoxFuture<'_, Result<ExecOutput, SandboxError>> {
                Box::pin(std::future::ready(Err(SandboxError::Unsupported("commands"))))
            }
        };
    }

    /// A sandbox whose writes go on after their futures are dropped (as a local sandbox's
    /// blocking writes do), each until `release` gives it a permit; `log` says when each
    /// started and ended.
    struct SlowWrites {
        log: Arc<std::sync::Mutex<Vec<String>>>,
        release: Arc<tokio::sync::Semaphore>,
    }

    impl Sandbox for SlowWrites {
        fn read_file(&self, path: &str) -> BoxFuture<'_, Result<Vec<u8>, SandboxError>> {
            Box::pin(std::future::ready(Err(SandboxError::NotFound(path.to_owned()))))
        }

        fn write_file(&self, _: &str, contents: Vec<u8>) -> BoxFuture<'_, Result<(), SandboxError>> {
            let (log, release) = (self.log.clone(), self.release.clone());
            let text = String::from_utf8_lossy(&contents).into_owned();
            log.lock().unwrap().push(format!("start {text}"));
            let (done, ended) = tokio::sync::oneshot::channel();
            tokio::spawn(async move {
                release.acquire().await.unwrap().forget();
                log.lock().unwrap().push(format!("end {text}"));
                let _ = done.send(());
            });
            Box::pin(async move { ended.await.map_err(|_| SandboxError::Io("the write was lost".into())) })
        }

        fn remove(&self, _: &str) -> BoxFuture<'_, Result<(), SandboxError>> {
            Box::pin(std::future::ready(Err(SandboxError::Unsupported("removals"))))
        }

        fn list_dir(&self, path: &str) -> BoxFuture<'_, Result<Vec<DirEntry>, SandboxError>> {
            Box::pin(std::future::ready(Err(SandboxError::NotFound(path.to_owned()))))
        }

        fn exec(&self, _: ExecRequest) -> BoxFuture<'_, Result<ExecOutput, SandboxError>> {
            Box::pin(std::future::ready(Err(SandboxError::Unsupported("commands"))))
        }

        fn files_identity(&self) -> Option<String> {
            Some(format!("slow:{:p}", std::ptr::from_ref(self)))
        }
    }

    /// A write whose tool is dropped (an abort) holds its file's lock until the write itself
    /// ends: the next write of the file, by the next submission, starts after it, not beside
    /// it. (Regression: the lock went with the tool, while a local sandbox's blocking write
    /// went on; and each submission had locks of its own.)
    #[tokio::test]
    async fn a_write_dropped_mid_way_holds_its_files_lock_until_the_write_ends() {
        let sandbox = Arc::new(SlowWrites {
            log: Arc::default(),
            release: Arc::new(tokio::sync::Semaphore::new(0)),
        });
        let session = SandboxSession::new(sandbox.clone(), None).unwrap();
        let log = || sandbox.log.lock().unwrap().clone();
        let args = |content: &str| WriteArgs {
            path: "notes.txt".into(),
            content: content.into(),
        };
        let mut first = write(&session, args("first"));
        while log().is_empty() {
            tokio::select! {
                _ = &mut first => panic!("the first write ended"),
                () = tokio::time::sleep(std::time::Duration::from_millis(5)) => {}
            }
        }
        drop(first);
        drop(session);
        // The next submission's session, over the same files.
        let next = SandboxSession::new(sandbox.clone(), None).unwrap();
        let mut second = write(&next, args("second"));
        tokio::select! {
            _ = &mut second => panic!("the second write ended before the first"),
            () = tokio::time::sleep(std::time::Duration::from_millis(50)) => {}
        }
        assert_eq!(log(), ["start first"], "the second write waits for the first");
        sandbox.release.add_permits(2);
        let (text, is_error) = text_of(second.await);
        assert!(!is_error, "{text}");
        assert_eq!(log(), ["start first", "end first", "start second", "end second"]);
    }

    /// A sandbox with one endless file, `/big.txt` (`line 1`, `line 2`, …): read whole, it
    /// never ends; read a piece at a time, it counts the bytes given.
    #[derive(Default)]
    struct Endless {
        given: AtomicUsize,
        /// Text after each line's number (`line 1{suffix}`).
        suffix: &'static str,
    }

    impl Sandbox for Endless {
        fn read_file(&self, _path: &str) -> BoxFuture<'_, Result<Vec<u8>, SandboxError>> {
            Box::pin(std::future::ready(Err(SandboxError::Io(
                "the whole endless file was read".into(),
            ))))
        }

        fn read_file_with<'a>(
            &'a self,
            _path: &str,
            visit: &'a mut (dyn FnMut(&[u8]) -> bool + Send),
        ) -> BoxFuture<'a, Result<(), SandboxError>> {
            Box::pin(async move {
                let mut line = 0;
                loop {
                    let piece: String = (0..100)
                        .map(|_| {
                            line += 1;
                            format!("line {line}{}\n", self.suffix)
                        })
                        .collect();
                    self.given.fetch_add(piece.len(), Ordering::Relaxed);
                    if !visit(piece.as_bytes()) {
                        return Ok(());
                    }
                    if self.given.load(Ordering::Relaxed) > 1 << 30 {
                        return Err(SandboxError::Io("a gigabyte of the endless file was read".into()));
                    }
                }
            })
        }

        refuses_changes!();

        fn list_dir(&self, path: &str) -> BoxFuture<'_, Result<Vec<DirEntry>, SandboxError>> {
            let error = if path == "/" {
                Ok(vec![DirEntry {
                    name: "big.txt".into(),
                    is_dir: false,
                    size: u64::MAX,
                }])
            } else {
                Err(SandboxError::Io(format!("{path} is not a directory")))
            };
            Box::pin(std::future::ready(error))
        }
    }

    /// A sandbox whose root holds 25,000 empty directories.
    struct Forest;

    impl Sandbox for Forest {
        fn read_file(&self, _path: &str) -> BoxFuture<'_, Result<Vec<u8>, SandboxError>> {
            Box::pin(std::future::ready(Err(SandboxError::Io("no files".into()))))
        }

        refuses_changes!();

        fn list_dir(&self, path: &str) -> BoxFuture<'_, Result<Vec<DirEntry>, SandboxError>> {
            let entries = if path == "/" {
                (0..25_000)
                    .map(|n| DirEntry {
                        name: format!("d{n:05}"),
                        is_dir: true,
                        size: 0,
                    })
                    .collect()
            } else {
                Vec::new()
            };
            Box::pin(std::future::ready(Ok(entries)))
        }
    }

    /// A sandbox whose root lists a file and two directories it cannot list.
    struct Partly;

    impl Sandbox for Partly {
        fn read_file(&self, _: &str) -> BoxFuture<'_, Result<Vec<u8>, SandboxError>> {
            Box::pin(std::future::ready(Ok(b"x marks it".to_vec())))
        }

        refuses_changes!();

        fn list_dir(&self, path: &str) -> BoxFuture<'_, Result<Vec<DirEntry>, SandboxError>> {
            let entry = |name: &str, is_dir| DirEntry {
                name: name.to_owned(),
                is_dir,
                size: 0,
            };
            Box::pin(std::future::ready(match path {
                "/" => Ok(vec![entry("deep", true), entry("locked", true), entry("top.md", false)]),
                _ => Err(SandboxError::Io(format!("{path} cannot be listed"))),
            }))
        }
    }

    /// A directory under the search that cannot be listed (too deep, unreadable) is not
    /// searched, and the answer says so: silence would read as nothing being there.
    #[tokio::test]
    async fn glob_and_grep_name_the_directories_they_could_not_list() {
        let session = SandboxSession::new(Arc::new(Partly), None).unwrap();
        let globbed = glob(
            &session,
            GlobArgs {
                pattern: "**/*.md".into(),
                path: None,
            },
        )
        .await;
        let grepped = grep(
            &session,
            GrepArgs {
                pattern: "x".into(),
                path: None,
                glob: None,
                ignore_case: false,
            },
        )
        .await;
        for (tool, output, found) in [("glob", globbed, "top.md"), ("grep", grepped, "/top.md:1: x marks it")] {
            let (text, is_error) = text_of(output);
            assert!(!is_error, "{tool}: {text}");
            assert!(text.starts_with(found), "{tool}: {text}");
            assert!(
                text.ends_with(
                    "\n\n[Not searched: /deep and 1 other, which could not be listed (/deep cannot be listed).]"
                ),
                "{tool}: {text}"
            );
        }
    }

    /// A sandbox whose root cannot be listed (nor read, being a directory).
    struct Locked;

    impl Sandbox for Locked {
        fn read_file(&self, path: &str) -> BoxFuture<'_, Result<Vec<u8>, SandboxError>> {
            Box::pin(std::future::ready(Err(SandboxError::Io(format!(
                "{path} is a directory"
            )))))
        }

        refuses_changes!();

        fn list_dir(&self, _: &str) -> BoxFuture<'_, Result<Vec<DirEntry>, SandboxError>> {
            Box::pin(std::future::ready(Err(SandboxError::Io(
                "Permission denied (os error 13)".into(),
            ))))
        }
    }

    /// A search directory that cannot be listed fails the call, saying why. (Regression: any
    /// failure to list it was taken for the base being a file, whose read failed silently:
    /// the answer was "No matches.")
    #[tokio::test]
    async fn glob_and_grep_fail_saying_why_when_their_directory_cannot_be_listed() {
        let session = SandboxSession::new(Arc::new(Locked), None).unwrap();
        let globbed = glob(
            &session,
            GlobArgs {
                pattern: "*.md".into(),
                path: None,
            },
        )
        .await;
        let grepped = grep(
            &session,
            GrepArgs {
                pattern: "x".into(),
                path: None,
                glob: None,
                ignore_case: false,
            },
        )
        .await;
        for (tool, output) in [("glob", globbed), ("grep", grepped)] {
            let (text, is_error) = text_of(output);
            assert!(is_error && text.contains("Permission denied"), "{tool}: {text}");
        }
    }

    #[tokio::test]
    async fn glob_and_grep_say_when_their_walk_stopped_at_its_bound() {
        let session = SandboxSession::new(Arc::new(Forest), None).unwrap();
        let note = "[Stopped after visiting 20000 files and directories; narrow the path.]";
        let globbed = glob(
            &session,
            GlobArgs {
                pattern: "**/*.md".into(),
                path: None,
            },
        )
        .await;
        assert_eq!(text_of(globbed), (format!("No files matched.\n\n{note}"), false));
        let grepped = grep(
            &session,
            GrepArgs {
                pattern: "x".into(),
                path: None,
                glob: None,
                ignore_case: false,
            },
        )
        .await;
        assert_eq!(text_of(grepped), (format!("No matches.\n\n{note}"), false));
    }

    /// A file given as `glob`'s path is matched by its name (its path relative to itself is
    /// nothing a pattern matches).
    #[tokio::test]
    async fn glob_over_a_file_matches_it_by_its_name() {
        let (_, session) = endless();
        for (pattern, found) in [("*.txt", "big.txt"), ("*.md", "No files matched.")] {
            let globbed = glob(
                &session,
                GlobArgs {
                    pattern: pattern.into(),
                    path: Some("/big.txt".into()),
                },
            )
            .await;
            assert_eq!(text_of(globbed), (found.to_owned(), false), "{pattern}");
        }
    }

    fn endless() -> (Arc<Endless>, SandboxSession) {
        endless_with(Endless::default())
    }

    fn endless_with(sandbox: Endless) -> (Arc<Endless>, SandboxSession) {
        let sandbox = Arc::new(sandbox);
        let session = SandboxSession::new(sandbox.clone(), None).unwrap();
        (sandbox, session)
    }

    fn text_of(output: ToolOutput) -> (String, bool) {
        let flue_core::tool::ToolContent::Text(text) = output.content else {
            panic!("a text result")
        };
        (text, output.is_error)
    }

    /// The window as computed before `read` read files a piece at a time: from the whole
    /// text.
    fn whole_text_window(text: &str, offset: Option<usize>, limit: Option<usize>) -> Result<String, String> {
        let lines: Vec<&str> = text.lines().collect();
        let start = offset.unwrap_or(1).max(1) - 1;
        if start >= lines.len() && !lines.is_empty() {
            return Err(format!(
                "Offset {} is past the end of the file ({} lines).",
                start + 1,
                lines.len()
            ));
        }
        let wanted = limit.unwrap_or(MAX_LINES).min(MAX_LINES);
        let mut out = String::new();
        let mut shown = 0;
        for line in lines.iter().skip(start).take(wanted) {
            if out.len() + line.len() + 1 > MAX_BYTES {
                if shown == 0 {
                    let mut end = MAX_BYTES;
                    while !line.is_char_boundary(end) {
                        end -= 1;
                    }
                    out.push_str(&line[..end]);
                    out.push_str(&format!(
                        "\n\n[Line {} is {} bytes; only its first {MAX_BYTES} are shown.]",
                        start + 1,
                        line.len()
                    ));
                    shown = 1;
                }
                break;
            }
            if shown > 0 {
                out.push('\n');
            }
            out.push_str(line);
            shown += 1;
        }
        let next = start + shown;
        if next < lines.len() {
            out.push_str(&format!(
                "\n\n[Showing lines {}-{} of {}. Continue with offset {}.]",
                start + 1,
                next,
                lines.len(),
                next + 1
            ));
        }
        Ok(out)
    }

    #[test]
    fn a_window_read_in_pieces_is_the_window_of_the_whole_text() {
        let wide = "w".repeat(MAX_BYTES + 10);
        let accented = format!("{}é\nnext\n", "a".repeat(MAX_BYTES - 1));
        let short_lines: String = (1..=3000).map(|n| format!("l{n}\r\n")).collect();
        let long_lines: String = (1..=60).map(|n| format!("{}{n}\n", "z".repeat(1000))).collect();
        let texts = [
            String::new(),
            "\n".to_owned(),
            "one".to_owned(),
            "one\ntwo\n".to_owned(),
            "one\r\ntwo\r".to_owned(),
            "a\n\n\nb\n\n".to_owned(),
            format!("{wide}\nsecond\n"),
            format!("first\n{wide}\nthird"),
            accented,
            short_lines,
            long_lines,
        ];
        for text in &texts {
            for offset in [None, Some(1), Some(2), Some(3), Some(52), Some(2999), Some(4000)] {
                for limit in [None, Some(1), Some(2), Some(5000)] {
                    let expected = whole_text_window(text, offset, limit);
                    for size in [1, 7, 4096, usize::MAX] {
                        let mut window = WindowReader::new(offset, limit, usize::MAX);
                        for piece in text.as_bytes().chunks(size.min(text.len().max(1))) {
                            if !window.feed(piece) {
                                break;
                            }
                        }
                        let got = window.finish().map_err(|error| match error {
                            WindowError::Offset(message) => message,
                            WindowError::Binary => "binary".to_owned(),
                        });
                        assert_eq!(
                            got,
                            expected,
                            "text of {} bytes, offset {offset:?}, limit {limit:?}, pieces of {size}",
                            text.len()
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn a_file_cut_inside_a_character_or_not_utf8_is_binary() {
        let mut window = WindowReader::new(None, None, usize::MAX);
        let text = "héllo".as_bytes();
        assert!(window.feed(&text[..2]) && window.feed(&text[2..]));
        assert_eq!(window.finish(), Ok("héllo".to_owned()));
        let mut window = WindowReader::new(None, None, usize::MAX);
        assert!(!window.feed(b"ok\n\xff\n"));
        assert_eq!(window.finish(), Err(WindowError::Binary));
        let mut window = WindowReader::new(None, None, usize::MAX);
        window.feed(&text[..2]);
        assert_eq!(window.finish(), Err(WindowError::Binary));
    }

    #[test]
    fn grep_finds_the_lines_of_a_file_read_in_pieces() {
        let pattern = regex::Regex::new("needle").unwrap();
        let text = "a\r\nneedle é\r\nno\nneedle";
        for size in [1, 2, 5, text.len()] {
            let mut search = LineSearch::new(&pattern, MAX_MATCHES + 1);
            for piece in text.as_bytes().chunks(size) {
                assert!(search.feed(piece));
            }
            assert_eq!(
                search.finish(),
                Some(vec![(2, "needle é".to_owned()), (4, "needle".to_owned())]),
                "pieces of {size}"
            );
        }
        let mut search = LineSearch::new(&pattern, MAX_MATCHES + 1);
        assert!(!search.feed(b"needle\n\xff"));
        assert_eq!(search.finish(), None, "a file that is not UTF-8 is skipped");
    }

    #[tokio::test]
    async fn read_stops_at_its_window_in_a_huge_file() {
        let (sandbox, session) = endless();
        let args = ReadArgs {
            path: "big.txt".into(),
            offset: Some(11),
            limit: Some(3),
        };
        let (text, is_error) = text_of(read(&session, args).await);
        assert!(!is_error, "{text}");
        assert!(
            text.starts_with("line 11\nline 12\nline 13\n\n[Showing lines 11-13 of more than "),
            "{text}"
        );
        assert!(text.contains(". Continue with offset 14.]"), "{text}");
        let given = sandbox.given.load(Ordering::Relaxed);
        assert!(given < 4 << 20, "{given} bytes read for a window of three lines");
    }

    #[tokio::test]
    async fn grep_stops_at_its_match_cap_in_a_huge_file() {
        let (sandbox, session) = endless();
        let args = GrepArgs {
            pattern: "^line".into(),
            path: None,
            glob: None,
            ignore_case: false,
        };
        let (text, is_error) = text_of(grep(&session, args).await);
        assert!(!is_error, "{text}");
        assert!(text.contains("/big.txt:100: line 100"), "{text}");
        assert!(!text.contains("/big.txt:101:"), "{text}");
        assert!(text.contains("[Stopped at 100 matches"), "{text}");
        let given = sandbox.given.load(Ordering::Relaxed);
        assert!(given < 1 << 20, "{given} bytes read for 100 matches");
    }

    #[tokio::test]
    async fn read_refuses_a_window_further_into_the_file_than_it_skips() {
        let (sandbox, session) = endless();
        let args = ReadArgs {
            path: "big.txt".into(),
            offset: Some(10_000_000),
            limit: Some(3),
        };
        let (text, is_error) = text_of(read(&session, args).await);
        assert!(is_error, "{text}");
        assert_eq!(
            text,
            "Line 10000000 lies more than 1 MB into the file, past what read skips; use bash (tail, sed) for it."
        );
        let given = sandbox.given.load(Ordering::Relaxed);
        assert!(given < 2 << 20, "{given} bytes read before refusing");
    }

    #[tokio::test]
    async fn grep_stops_after_reading_its_byte_budget_and_says_so() {
        let (sandbox, session) = endless();
        let args = GrepArgs {
            pattern: "never there".into(),
            path: None,
            glob: None,
            ignore_case: false,
        };
        let (text, is_error) = text_of(grep(&session, args).await);
        assert!(!is_error, "{text}");
        assert_eq!(
            text,
            "No matches.\n\n[Stopped after reading 1 MB; narrow the path or the glob.]"
        );
        let given = sandbox.given.load(Ordering::Relaxed);
        assert!(given < 2 << 20, "{given} bytes read for a budget of 1 MB");
    }

    /// The budget ends in the middle of a character: the matches found before it are kept
    /// (the file is no less text for being cut), and the cut line is not searched.
    #[tokio::test]
    async fn grep_keeps_the_matches_of_a_file_its_byte_budget_cuts_inside_a_character() {
        let (_, session) = endless_with(Endless {
            given: AtomicUsize::new(0),
            suffix: " 東京の天気は晴れです",
        });
        let args = GrepArgs {
            pattern: "^line 7 ".into(),
            path: None,
            glob: None,
            ignore_case: false,
        };
        let (text, is_error) = text_of(grep(&session, args).await);
        assert!(!is_error, "{text}");
        assert_eq!(
            text,
            "/big.txt:7: line 7 東京の天気は晴れです\n\n[Stopped after reading 1 MB; narrow the path or the glob.]"
        );
    }

    #[test]
    fn tail_keeps_the_end_and_says_so() {
        let text: String = (1..=2500).map(|n| format!("line {n}\n")).collect();
        let shown = tail(text.trim_end());
        assert!(shown.starts_with("[Output truncated: the last 2000 of 2500 lines.]\nline 501\n"));
        assert!(shown.ends_with("line 2500"));
        assert_eq!(tail("short"), "short");
    }

    #[test]
    fn a_last_line_past_the_byte_cap_shows_its_end() {
        let text = format!("first\n{}é{}", "a".repeat(MAX_BYTES), "z".repeat(10));
        let shown = tail(&text);
        assert!(shown.ends_with("zzzzzzzzzz"), "{}", &shown[..200]);
        assert!(shown.len() > MAX_BYTES / 2, "the output was dropped: {shown}");
        assert!(shown.len() <= MAX_BYTES + 200);
    }

    #[test]
    fn a_window_stops_at_the_byte_cap_with_a_marker() {
        let line = "x".repeat(1000);
        let text: String = (0..100).map(|_| format!("{line}\n")).collect();
        let Ok(window) = line_window(&text, None, None) else {
            panic!("a window")
        };
        assert!(window.len() <= MAX_BYTES + 100);
        assert!(
            window.ends_with("[Showing lines 1-51 of 100. Continue with offset 52.]"),
            "{}",
            &window[window.len() - 80..]
        );
    }
}
