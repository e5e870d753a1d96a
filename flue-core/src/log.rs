//! Progress logging from tools and event-hook callbacks to the runtime's observers.

use std::fmt;
use std::sync::Arc;

/// Severity of a [`Logger`] line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogLevel {
    /// Diagnostic detail.
    Debug,
    /// Progress.
    Info,
    /// Something unexpected that did not stop the work.
    Warn,
    /// A failure.
    Error,
}

/// Where [`Logger`] lines go; implemented by the runtime.
pub trait LogSink: Send + Sync {
    /// Records one line.
    fn log(&self, level: LogLevel, message: &str);
}

/// Emits progress lines to the runtime's observers: each is a `log` event of
/// `Runtime::observe()`, live only (nothing is stored in the conversation, and HTTP clients
/// reading its stream do not see them). The model never sees them. A tool's lines are cleaned
/// of its secrets, as its output is.
///
/// A logger with no sink (tests, bare renders) discards its lines.
#[derive(Clone, Default)]
pub struct Logger {
    sink: Option<Arc<dyn LogSink>>,
}

impl Logger {
    /// A logger writing to `sink`.
    pub fn new(sink: Arc<dyn LogSink>) -> Self {
        Self { sink: Some(sink) }
    }

    /// A logger that discards everything.
    pub fn discard() -> Self {
        Self::default()
    }

    /// Logs `message` at `level`.
    pub fn log(&self, level: LogLevel, message: impl AsRef<str>) {
        if let Some(sink) = &self.sink {
            sink.log(level, message.as_ref());
        }
    }

    /// Logs at [`LogLevel::Debug`].
    pub fn debug(&self, message: impl AsRef<str>) {
        self.log(LogLevel::Debug, message);
    }

    /// Logs at [`LogLevel::Info`].
    pub fn info(&self, message: impl AsRef<str>) {
        self.log(LogLevel::Info, message);
    }

    /// Logs at [`LogLevel::Warn`].
    pub fn warn(&self, message: impl AsRef<str>) {
        self.log(LogLevel::Warn, message);
    }

    /// Logs at [`LogLevel::Error`].
    pub fn error(&self, message: impl AsRef<str>) {
        self.log(LogLevel::Error, message);
    }
}

impl fmt::Debug for Logger {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Logger")
            .field("has_sink", &self.sink.is_some())
            .finish()
    }
}
