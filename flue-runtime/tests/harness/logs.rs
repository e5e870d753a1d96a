//! Log capture: every line the runtime logs in one test binary, for the tests that assert
//! on a warning or a `[Hooks] ✗` line.

use std::sync::{Arc, Mutex, OnceLock};

use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Metadata, Subscriber};

#[derive(Clone, Default)]
pub struct Capture(Arc<Mutex<Vec<Line>>>);

/// One logged event: its message, and its other fields as `name=value`.
#[derive(Clone, Default)]
struct Line {
    message: String,
    fields: Vec<String>,
}

impl Visit for Line {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            self.message = format!("{value:?}");
        } else {
            self.fields.push(format!("{}={value:?}", field.name()));
        }
    }
}

impl Subscriber for Capture {
    fn enabled(&self, _: &Metadata<'_>) -> bool {
        true
    }
    fn new_span(&self, _: &Attributes<'_>) -> Id {
        Id::from_u64(1)
    }
    fn record(&self, _: &Id, _: &Record<'_>) {}
    fn record_follows_from(&self, _: &Id, _: &Id) {}
    fn event(&self, event: &Event<'_>) {
        let mut line = Line::default();
        event.record(&mut line);
        self.0.lock().unwrap().push(line);
    }
    fn enter(&self, _: &Id) {}
    fn exit(&self, _: &Id) {}
}

impl Capture {
    /// Every line captured so far (its message).
    pub fn all(&self) -> Vec<String> {
        self.0.lock().unwrap().iter().map(|line| line.message.clone()).collect()
    }

    /// The fields (`name=value`, values as `Debug` shows them) of every line whose message is
    /// `message`.
    pub fn fields_of(&self, message: &str) -> Vec<Vec<String>> {
        self.0
            .lock()
            .unwrap()
            .iter()
            .filter(|line| line.message == message)
            .map(|line| line.fields.clone())
            .collect()
    }

    /// The captured `[Hooks]` lines that mention `text`.
    pub fn lines(&self, text: &str) -> Vec<String> {
        self.all()
            .into_iter()
            .filter(|line| line.starts_with("[Hooks]") && line.contains(text))
            .collect()
    }
}

/// Every log line of this test binary (one global subscriber: a per-thread one races with the
/// callsite interest cache when tests run in parallel). Tests look for lines unique to them.
pub fn capture() -> Capture {
    static CAPTURE: OnceLock<Capture> = OnceLock::new();
    CAPTURE
        .get_or_init(|| {
            let capture = Capture::default();
            tracing::subscriber::set_global_default(capture.clone()).expect("the only global subscriber");
            capture
        })
        .clone()
}
