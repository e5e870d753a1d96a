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
/// Files `grep` and `glob` visit at most.
const MAX_WALK: usize = 20_000;

/// `text` from line `offset` (1-based), at most `limit` lines, [`MAX_LINES`] and
/// [`MAX_BYTES`], with a marker saying where to continue when lines remain.
pub(crate) fn line_window(text: &str, offset: Option<usize>, limit: Option<usize>) -> Result<String, String> {
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
                // A first line past the cap: its head, so the window still moves on (a
                // marker pointing back at this line would loop forever).
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
        match serde_json::from_value::<A>(args) {
            Ok(args) => (self.run)(&self.session, args),
            Err(error) => Box::pin(std::future::ready(ToolOutput::error(format!(
                "Tool argument validation failed: [root] {error}"
            )))),
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
        let bytes = match session.sandbox.read_file(&path).await {
            Ok(bytes) => bytes,
            Err(error) => return sandbox_error(error),
        };
        let Ok(text) = String::from_utf8(bytes) else {
            return ToolOutput::error(format!("{path} is a binary file; only text files can be read."));
        };
        match line_window(&text, args.offset, args.limit) {
            Ok(window) => ToolOutput::text(window),
            Err(message) => ToolOutput::error(message),
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
        let lock = session.lock_of(&path);
        let _guard = lock.lock().await;
        let size = args.content.len();
        match session.sandbox.write_file(&path, args.content.into_bytes()).await {
            Ok(()) => ToolOutput::text(format!("Wrote {size} bytes to {path}.")),
            Err(error) => sandbox_error(error),
        }
    })
}

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
        let lock = session.lock_of(&path);
        let _guard = lock.lock().await;
        let bytes = match session.sandbox.read_file(&path).await {
            Ok(bytes) => bytes,
            Err(error) => return sandbox_error(error),
        };
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
        let edited = if args.replace_all {
            text.replace(&args.old_string, &args.new_string)
        } else {
            text.replacen(&args.old_string, &args.new_string, 1)
        };
        match session.sandbox.write_file(&path, edited.into_bytes()).await {
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
    /// The command line (run by `sh -c` in the working directory).
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
                    None => ToolOutput::error(format!("{shown}\n\nThe command did not finish.")),
                }
            }
        }
    })
}

/// Every file under `base` (a sandbox path), depth first in name order, at most [`MAX_WALK`].
async fn walk(session: &SandboxSession, base: &str) -> Result<Vec<String>, SandboxError> {
    let mut files = Vec::new();
    let mut pending = vec![base.to_owned()];
    while let Some(directory) = pending.pop() {
        let entries = match session.sandbox.list_dir(&directory).await {
            Ok(entries) => entries,
            // The base itself may be a file.
            Err(SandboxError::Io(_)) if directory == base => return Ok(vec![base.to_owned()]),
            Err(error) if directory == base => return Err(error),
            Err(_) => continue,
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
                    return Ok(files);
                }
            }
        }
        pending.extend(directories.into_iter().rev());
    }
    Ok(files)
}

/// The search root `path` names (the working directory by default) and the files under it.
async fn files_under(session: &SandboxSession, path: Option<&str>) -> Result<(String, Vec<String>), SandboxError> {
    let base = join(&session.cwd, path.unwrap_or("."))?;
    let files = walk(session, &base).await?;
    Ok((base, files))
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
        let (base, files) = match files_under(session, args.path.as_deref()).await {
            Ok(found) => found,
            Err(error) => return sandbox_error(error),
        };
        let mut matches = Vec::new();
        let mut more = false;
        'files: for file in &files {
            let shown = relative(&base, file);
            if let Some(filter) = &filter
                && !filter.matches(shown)
                && !filter.matches(file.rsplit('/').next().unwrap_or(file))
            {
                continue;
            }
            let Ok(bytes) = session.sandbox.read_file(file).await else {
                continue;
            };
            let Ok(text) = std::str::from_utf8(&bytes) else {
                continue;
            };
            for (number, line) in text.lines().enumerate() {
                if pattern.is_match(line) {
                    if matches.len() == MAX_MATCHES {
                        more = true;
                        break 'files;
                    }
                    let line: String = line.chars().take(MAX_MATCH_CHARS).collect();
                    matches.push(format!("{file}:{}: {line}", number + 1));
                }
            }
        }
        if matches.is_empty() {
            return ToolOutput::text("No matches.");
        }
        let mut out = matches.join("\n");
        if more {
            out.push_str(&format!(
                "\n\n[Stopped at {MAX_MATCHES} matches; narrow the pattern or the path.]"
            ));
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
        let pattern = match glob::Pattern::new(&args.pattern) {
            Ok(pattern) => pattern,
            Err(error) => return ToolOutput::error(format!("Invalid glob: {error}")),
        };
        let (base, files) = match files_under(session, args.path.as_deref()).await {
            Ok(found) => found,
            Err(error) => return sandbox_error(error),
        };
        let options = glob::MatchOptions {
            require_literal_separator: true,
            ..glob::MatchOptions::default()
        };
        let matched: Vec<&str> = files
            .iter()
            .map(|file| relative(&base, file))
            .filter(|file| pattern.matches_with(file, options))
            .collect();
        if matched.is_empty() {
            return ToolOutput::text("No files matched.");
        }
        let mut out = matched.iter().take(MAX_PATHS).copied().collect::<Vec<_>>().join("\n");
        if matched.len() > MAX_PATHS {
            out.push_str(&format!(
                "\n\n[Showing {MAX_PATHS} of {} paths; narrow the pattern.]",
                matched.len()
            ));
        }
        ToolOutput::text(out)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

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
