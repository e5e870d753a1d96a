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
        Payload { parts: self.parts, len }
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
    /// does to follow a 307 or 308 redirect).
    pub(crate) fn in_parts(&self) -> bool {
        self.parts.len() > 1
    }

    /// The body in one part (copied): one reqwest can send again to follow a redirect.
    pub(crate) fn joined(&self) -> Self {
        Self {
            parts: vec![Bytes::from(self.parts.concat())],
            len: self.len,
        }
    }

    /// The body for one attempt of the call, of known length (so sent with a
    /// `Content-Length`).
    pub(crate) fn to_body(&self) -> reqwest::Body {
        match self.parts.as_slice() {
            [] => reqwest::Body::from(Bytes::new()),
            [one] => reqwest::Body::from(one.clone()),
            parts => reqwest::Body::wrap(Parts {
                parts: parts.iter().cloned().collect(),
                remaining: self.len as u64,
            }),
        }
    }
}

/// The frames of a body in parts.
struct Parts {
    parts: VecDeque<Bytes>,
    remaining: u64,
}

impl http_body::Body for Parts {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        let this = self.get_mut();
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
        let body = payload.to_body();
        assert_eq!(http_body::Body::size_hint(&body).exact(), Some(whole.len() as u64));
        let collected = body.collect().await.expect("infallible").to_bytes();
        assert_eq!(collected.as_ref(), whole.as_bytes());
        // And again, for a retried call.
        let again = payload.to_body().collect().await.expect("infallible").to_bytes();
        assert_eq!(again, collected);
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
