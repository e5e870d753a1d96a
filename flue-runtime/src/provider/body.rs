//! A model call's request body, written in parts.
//!
//! Most of a long conversation's body is its history, whose messages are encoded once and kept
//! with it (see [`Messages`](super::Messages)). The kept encodings join a body as shared,
//! reference-counted parts instead of being copied into it: a call writes only its new bytes
//! (its head, the messages not kept yet, its fields), and the connection writes every part to
//! the socket from where it lies (vectored writes). What a call costs then no longer grows
//! with the conversation beyond sending its bytes.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Frame, SizeHint};

/// A request body being written: bytes of its own, with shared parts in between.
#[derive(Debug, Default)]
pub(crate) struct BodyWriter {
    parts: Vec<Bytes>,
    buf: Vec<u8>,
    /// The capacity of the buffer that follows a shared part.
    then: usize,
}

impl BodyWriter {
    /// A body whose first bytes of its own take about `head` bytes, and those after a shared
    /// part about `tail`.
    pub(crate) fn with_capacity(head: usize, tail: usize) -> Self {
        Self {
            parts: Vec::new(),
            buf: Vec::with_capacity(head),
            then: tail,
        }
    }

    /// Where the next bytes of the body's own are written.
    pub(crate) fn buf(&mut self) -> &mut Vec<u8> {
        &mut self.buf
    }

    /// Appends `parts`, shared rather than copied (unless they are short: copying a few KiB
    /// costs less than sending the body in parts).
    pub(crate) fn share(&mut self, parts: &[Bytes]) {
        let len: usize = parts.iter().map(Bytes::len).sum();
        if len < COPIED_BELOW {
            self.buf.reserve(len + self.then);
            parts.iter().for_each(|part| self.buf.extend_from_slice(part));
            return;
        }
        let parts = parts.iter().filter(|part| !part.is_empty());
        if !self.buf.is_empty() {
            let capacity = std::mem::take(&mut self.then);
            let written = std::mem::replace(&mut self.buf, Vec::with_capacity(capacity));
            self.parts.push(Bytes::from(written));
        }
        self.parts.extend(parts.cloned());
    }

    /// The body.
    pub(crate) fn finish(mut self) -> Payload {
        if !self.buf.is_empty() {
            self.parts.push(Bytes::from(self.buf));
        }
        let len = self.parts.iter().map(Bytes::len).sum();
        Payload {
            parts: self.parts,
            len,
            whole: false,
        }
    }

    /// Every byte written so far, shared parts included, as one buffer (tests).
    #[cfg(test)]
    pub(crate) fn to_vec(&self) -> Vec<u8> {
        let mut all: Vec<u8> = self.parts.concat();
        all.extend_from_slice(&self.buf);
        all
    }
}

/// Below this many bytes, kept parts are copied into a body rather than shared with it.
const COPIED_BELOW: usize = 16 * 1024;

/// A written request body, cheap to clone (a retried call sends it again).
#[derive(Clone, Debug, Default)]
pub(crate) struct Payload {
    parts: Vec<Bytes>,
    len: usize,
    /// Sent in one part reqwest can send again, however long ([`Self::joined`]).
    whole: bool,
}

impl Payload {
    /// The body's length in bytes.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Its parts, in order (tests).
    #[cfg(test)]
    pub(crate) fn parts(&self) -> &[Bytes] {
        &self.parts
    }

    /// The body as one buffer (tests and the bodies they compare).
    #[cfg(test)]
    pub(crate) fn to_vec(&self) -> Vec<u8> {
        self.parts.concat()
    }

    /// Whether the body goes in parts (then reqwest cannot send it again by itself, as it
    /// does to follow a 307 or 308 redirect): a body of several parts, or one long enough to
    /// be sent in watched frames ([`Self::to_body`]).
    pub(crate) fn in_parts(&self) -> bool {
        !self.whole && (self.parts.len() > 1 || self.len > WATCHED_ABOVE)
    }

    /// Whether the body goes in watched frames ([`Self::to_body`]).
    pub(crate) fn watched(&self) -> bool {
        !self.whole && self.len > WATCHED_ABOVE
    }

    /// The body in one part (copied): one reqwest can send again to follow a redirect.
    pub(crate) fn joined(&self) -> Self {
        Self {
            parts: vec![Bytes::from(self.parts.concat())],
            len: self.len,
            whole: true,
        }
    }

    /// The body for one attempt of the call, of known length (so sent with a
    /// `Content-Length`).
    ///
    /// A body longer than [`WATCHED_ABOVE`] (a conversation with images, say) goes in frames of
    /// at most [`WATCHED_FRAME`] bytes, each marking `progress` (when given) as the connection
    /// takes it: on a
    /// slow uplink its upload takes a while, and the time allowed for the answer to start
    /// counts from the last frame taken, not from the call. A [joined](Self::joined) body goes
    /// as it is, in one part reqwest can send again.
    pub(crate) fn to_body(&self, progress: Option<&Progress>) -> reqwest::Body {
        match self.parts.as_slice() {
            [] => reqwest::Body::from(Bytes::new()),
            [one] if self.whole || self.len <= WATCHED_ABOVE => reqwest::Body::from(one.clone()),
            parts if self.len <= WATCHED_ABOVE => reqwest::Body::wrap(Parts {
                parts: parts.iter().cloned().collect(),
                remaining: self.len as u64,
                progress: None,
            }),
            parts => reqwest::Body::wrap(Parts {
                parts: parts.iter().flat_map(framed).collect(),
                remaining: self.len as u64,
                progress: progress.cloned(),
            }),
        }
    }
}

/// Bodies longer than this are sent in watched frames (see [`Payload::to_body`]). Shorter ones
/// go up in well under the time allowed for an answer to start, on any link.
pub(crate) const WATCHED_ABOVE: usize = 256 * 1024;

/// The longest frame of a watched body: the connection takes the next one once it wrote about
/// as much, so the marks follow the upload.
const WATCHED_FRAME: usize = 64 * 1024;

/// `part` in frames of at most [`WATCHED_FRAME`] bytes (slices of it, not copies).
fn framed(part: &Bytes) -> impl Iterator<Item = Bytes> + '_ {
    (0..part.len())
        .step_by(WATCHED_FRAME)
        .map(|start| part.slice(start..part.len().min(start + WATCHED_FRAME)))
}

/// When the upload of a watched body last moved on: when the connection last took one of its
/// frames, or when it was made.
#[derive(Clone, Debug)]
pub(crate) struct Progress {
    base: tokio::time::Instant,
    /// Nanoseconds from `base` to the last mark.
    last: Arc<AtomicU64>,
}

impl Progress {
    pub(crate) fn new() -> Self {
        Self {
            base: tokio::time::Instant::now(),
            last: Arc::new(AtomicU64::new(0)),
        }
    }

    fn mark(&self) {
        let elapsed = u64::try_from(self.base.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.last.fetch_max(elapsed, Ordering::Relaxed);
    }

    /// The last mark.
    pub(crate) fn last(&self) -> tokio::time::Instant {
        self.base + std::time::Duration::from_nanos(self.last.load(Ordering::Relaxed))
    }
}

/// The frames of a body in parts.
struct Parts {
    parts: VecDeque<Bytes>,
    remaining: u64,
    /// Marked as each frame is taken, for a watched body.
    progress: Option<Progress>,
}

impl http_body::Body for Parts {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        let this = self.get_mut();
        if let Some(progress) = &this.progress {
            progress.mark();
        }
        Poll::Ready(this.parts.pop_front().map(|part| {
            this.remaining -= part.len() as u64;
            Ok(Frame::data(part))
        }))
    }

    fn is_end_stream(&self) -> bool {
        self.parts.is_empty()
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::with_exact(self.remaining)
    }
}

/// Appends `part` to the kept `parts`, merging it with those before it no larger than it
/// (a binary counter): `n` kept bytes stay in O(log n) parts, and each byte is copied
/// O(log n) times over the conversation's life instead of once per call.
pub(crate) fn keep(parts: &mut Vec<Bytes>, part: Bytes) {
    parts.push(part);
    while let [.., before, last] = parts.as_slice()
        && before.len() <= last.len()
    {
        let mut merged = Vec::with_capacity(before.len() + last.len());
        merged.extend_from_slice(before);
        merged.extend_from_slice(last);
        parts.truncate(parts.len() - 2);
        parts.push(Bytes::from(merged));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;

    #[test]
    fn kept_parts_stay_few_and_in_order() {
        let mut parts = Vec::new();
        let mut all = Vec::new();
        for n in 0..1000u32 {
            let part = format!(",{n}");
            all.extend_from_slice(part.as_bytes());
            keep(&mut parts, Bytes::from(part));
            // Sizes strictly decrease, so there are at most log2(total) + 1 of them.
            assert!(parts.windows(2).all(|pair| pair[0].len() > pair[1].len()));
        }
        assert!(parts.len() <= 13, "{} parts", parts.len());
        assert_eq!(parts.concat(), all);
    }

    #[tokio::test]
    async fn a_body_in_parts_streams_every_part_in_order_with_its_exact_length() {
        let (a, b) = ("a".repeat(COPIED_BELOW), "b".repeat(7));
        let kept = [Bytes::from(a.clone()), Bytes::from(b.clone())];
        let mut writer = BodyWriter::with_capacity(8, 8);
        writer.buf().extend_from_slice(b"[");
        writer.share(&kept);
        writer.buf().extend_from_slice(b"]");
        let payload = writer.finish();
        let whole = format!("[{a}{b}]");
        assert_eq!(payload.to_vec(), whole.as_bytes());
        assert_eq!(payload.len(), whole.len());
        assert_eq!(payload.parts().len(), 4, "two written, two shared");
        assert_eq!(payload.parts()[1].as_ptr(), kept[0].as_ptr(), "shared, not copied");
        let body = payload.to_body(None);
        assert_eq!(http_body::Body::size_hint(&body).exact(), Some(whole.len() as u64));
        let collected = body.collect().await.expect("infallible").to_bytes();
        assert_eq!(collected.as_ref(), whole.as_bytes());
        // And again, for a retried call.
        let again = payload.to_body(None).collect().await.expect("infallible").to_bytes();
        assert_eq!(again, collected);
    }

    #[tokio::test(start_paused = true)]
    async fn a_long_body_goes_in_short_frames_each_marking_progress_and_joined_goes_whole() {
        let long = "l".repeat(WATCHED_ABOVE);
        let mut writer = BodyWriter::with_capacity(8, 8);
        writer.buf().extend_from_slice(b"[");
        writer.share(&[Bytes::from(long.clone())]);
        writer.buf().extend_from_slice(b"]");
        let payload = writer.finish();
        let whole = format!("[{long}]");
        assert!(payload.in_parts());
        let progress = Progress::new();
        let started = progress.last();
        assert!(payload.watched());
        let mut body = payload.to_body(Some(&progress));
        assert_eq!(http_body::Body::size_hint(&body).exact(), Some(whole.len() as u64));
        let mut frames = Vec::new();
        while let Some(frame) = body.frame().await {
            let data = frame.expect("infallible").into_data().expect("a data frame");
            assert!(data.len() <= WATCHED_FRAME, "a frame of {} bytes", data.len());
            frames.push(data);
            // Each frame taken marks the upload's progress.
            tokio::time::advance(std::time::Duration::from_secs(1)).await;
        }
        assert_eq!(frames.concat(), whole.as_bytes());
        assert!(frames.len() > WATCHED_ABOVE / WATCHED_FRAME, "{} frames", frames.len());
        assert_eq!(
            progress.last() - started,
            std::time::Duration::from_secs(frames.len() as u64)
        );
        // Joined (to follow a redirect), it goes in one part reqwest can send again.
        let joined = payload.joined();
        assert!(!joined.in_parts());
        assert!(!joined.watched());
        let body = joined.to_body(None);
        assert!(body.as_bytes().is_some_and(|bytes| bytes == whole.as_bytes()));
    }

    #[test]
    fn short_kept_parts_are_copied_into_one_buffer() {
        let mut writer = BodyWriter::with_capacity(4, 4);
        writer.buf().extend_from_slice(b"{");
        writer.share(&[Bytes::new(), Bytes::from_static(b"\"a\":1")]);
        writer.buf().extend_from_slice(b"}");
        let payload = writer.finish();
        assert_eq!(payload.parts.len(), 1);
        assert_eq!(payload.to_vec(), b"{\"a\":1}");
    }
}
