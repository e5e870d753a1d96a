//! The live feed of one instance: its newest batches projected and serialized once, shared by
//! every SSE reader that has caught up with the stream. A thousand readers of a busy instance
//! cost one store read and one projection per batch, not a thousand.
//!
//! A reader behind the feed's window (it connected from an old offset, or it fell far behind)
//! projects for itself until it reaches the window.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};

use axum::body::Bytes;
use serde_json::Value;
use tokio::sync::OwnedSemaphorePermit;

use super::projection::{Projection, READ_PAGE};
use super::reads::{DataFrames, FoldRoom};
use super::updates_cache::{ReadFailure, UpdatesCache};
use crate::record::Batch;
use crate::runtime::RuntimeInner;
use crate::store::InstanceKey;

/// How many of the newest batches' frames a feed keeps.
const WINDOW: usize = 1024;
/// How many bytes of frames a feed keeps at most (beyond its newest frame, kept whatever its
/// size): a batch that resets the conversation (a compaction, an edited row) carries the
/// whole transcript, and a window of those would hold a thousand transcripts. A reader the
/// window no longer covers projects for itself.
const WINDOW_BYTES: usize = 8 * 1024 * 1024;
/// How many bytes of frames the feeds of one router keep together (beyond each one's newest
/// frame): each feed's window fits [`WINDOW_BYTES`], but a server following a thousand busy
/// instances would hold a thousand windows. Past it, a feed that takes a frame drops its
/// oldest ones (its readers that fall behind project for themselves).
const FEEDS_BYTES: usize = 256 * 1024 * 1024;

/// The SSE data frames of one batch's `chunks` (none when the batch projects to nothing),
/// split as a reader catching up gets them ([`DataFrames`]): a batch of several large chunks
/// (a step's parallel tool outputs) is more than one event, none past what a client buffers.
pub(super) fn data_frame(chunks: Vec<Value>) -> Option<String> {
    let mut frames = DataFrames::default();
    for chunk in &chunks {
        frames.push(&chunk.to_string());
    }
    Some(frames.finish()).filter(|frames| !frames.is_empty())
}

/// What the feed holds: the fold of the stream through `offset`, and the frames of the
/// newest batches.
struct State {
    projection: Projection,
    /// Room for `projection` among the readers' folds ([`FoldRoom`]), for as long as the feed
    /// is followed.
    room: Option<OwnedSemaphorePermit>,
    /// The last batch folded; `None` before the first read.
    offset: Option<u64>,
    started: bool,
    /// The instance's append count when the feed last read the store: while it has not
    /// moved, there is nothing new to read (unless other nodes append too).
    seen_appends: u64,
    /// When the feed last read the store.
    last_read: tokio::time::Instant,
    /// `(batch offset, its data frame)`, oldest first; empty frames for batches that project
    /// to nothing.
    frames: VecDeque<(u64, Bytes)>,
    /// The bytes of `frames`.
    frame_bytes: usize,
}

/// One instance's feed.
pub(super) struct Feed {
    key: InstanceKey,
    state: tokio::sync::Mutex<State>,
    /// The bytes of frames its router's feeds keep, this one's included.
    all_bytes: Arc<AtomicUsize>,
}

impl Drop for Feed {
    fn drop(&mut self) {
        self.all_bytes
            .fetch_sub(self.state.get_mut().frame_bytes, Ordering::Relaxed);
    }
}

/// Frames for a reader.
pub(super) enum Delivery {
    /// The frames after the reader's offset, and the offset they reach.
    Frames(Vec<Bytes>, Option<u64>),
    /// The reader is behind the window: it must project for itself.
    Behind,
}

impl Feed {
    /// The frames of every batch after `after`, reading and projecting what the store has
    /// beyond the feed first. `Err` when the store fails.
    ///
    /// `appends` is the instance's append count, read before this call: while it has not
    /// moved since the feed's last read, nothing was appended on this node. On a shared store
    /// (other nodes append too) the feed reads again once `poll` has passed since its last
    /// read, however many readers ask meanwhile.
    ///
    /// The feed's fold takes room for its weight among the readers' folds (`room`: the
    /// router's room, and what the asking reader holds of it), as it grows: a feed that starts
    /// takes the asking reader's room when it serves that reader from here on (the reader lets
    /// its own fold go then, so the conversation is counted once), and what more it needs.
    /// Without that room the feed stops, and this is `Err(Busy)`.
    pub(super) async fn after(
        &self,
        runtime: &RuntimeInner,
        after: Option<u64>,
        appends: u64,
        poll: std::time::Duration,
        cache: (&UpdatesCache, &str),
        room: (&FoldRoom, &mut Option<OwnedSemaphorePermit>),
    ) -> Result<Delivery, ReadFailure> {
        let (folds, held) = room;
        let mut state = self.state.lock().await;
        let polled_recently = !runtime.store.shared() || state.last_read.elapsed() < poll;
        let unchanged = state.started && appends == state.seen_appends && polled_recently;
        if !unchanged {
            state.last_read = tokio::time::Instant::now();
        }
        if unchanged {
            // Another reader already read what this wake-up announced.
        } else if !state.started {
            // Start from the fold of everything there is now, which the updates cache
            // (`cache`: it and the instance's incarnation) holds or makes; frames start with
            // the batches after it.
            let (cache, incarnation) = cache;
            if let Some((projection, offset)) = cache
                .fold_at_head(
                    runtime.store.as_ref(),
                    &self.key,
                    Some(incarnation).filter(|i| !i.is_empty()),
                )
                .await?
            {
                (state.projection, state.offset) = (projection, offset);
            }
            let serves = after >= state.offset;
            if serves {
                state.room = held.take();
            }
            if !state.hold_room(folds) {
                if serves {
                    // Unchanged by the refusal: the reader's own again.
                    *held = state.room.take();
                }
                state.stop(&self.key, &self.all_bytes);
                return Err(ReadFailure::Busy);
            }
            state.started = true;
        } else {
            // What was appended since, a store page at a time.
            loop {
                let batches = runtime.store.read_page(&self.key, state.offset, READ_PAGE).await?;
                state.push(&batches, &self.all_bytes);
                if !state.hold_room(folds) {
                    state.stop(&self.key, &self.all_bytes);
                    return Err(ReadFailure::Busy);
                }
                if batches.len() < READ_PAGE {
                    break;
                }
            }
        }
        // Counted as seen only once read: a read that failed (or was dropped with its reader)
        // leaves the next reader to read what the appends announced.
        state.seen_appends = appends;
        if after >= state.offset {
            return Ok(Delivery::Frames(Vec::new(), after));
        }
        // Covered when the window starts right after `after` (or earlier).
        let first = state.frames.front().map(|(offset, _)| *offset);
        let covered = first.is_some_and(|first| after.map_or(first == 0, |after| first <= after + 1));
        if !covered {
            return Ok(Delivery::Behind);
        }
        let frames = state
            .frames
            .iter()
            .filter(|(offset, _)| after.is_none_or(|after| *offset > after))
            .map(|(_, frame)| frame.clone())
            .filter(|frame| !frame.is_empty())
            .collect();
        Ok(Delivery::Frames(frames, state.offset))
    }
}

impl State {
    /// Holds room for the fold as it is now, and no more: false when the router has not that
    /// much left.
    fn hold_room(&mut self, folds: &FoldRoom) -> bool {
        folds.fit(&mut self.room, self.projection.weight())
    }

    /// Back to a feed not started, holding nothing: its next reader starts it again.
    fn stop(&mut self, key: &InstanceKey, all_bytes: &AtomicUsize) {
        all_bytes.fetch_sub(self.frame_bytes, Ordering::Relaxed);
        *self = State::new(key);
    }

    fn new(key: &InstanceKey) -> Self {
        Self {
            projection: Projection::new(&key.stream_path()),
            room: None,
            offset: None,
            started: false,
            seen_appends: 0,
            last_read: tokio::time::Instant::now(),
            frames: VecDeque::new(),
            frame_bytes: 0,
        }
    }

    /// Projects `batches` into frames, kept within the window and, with the router's other
    /// feeds (`all_bytes`), within [`FEEDS_BYTES`].
    fn push(&mut self, batches: &[Batch], all_bytes: &AtomicUsize) {
        for batch in batches {
            let mut chunks = Vec::new();
            self.projection.apply(batch, Some(&mut chunks));
            self.offset = Some(batch.offset);
            let frame = data_frame(chunks).map(Bytes::from).unwrap_or_default();
            self.frame_bytes += frame.len();
            all_bytes.fetch_add(frame.len(), Ordering::Relaxed);
            self.frames.push_back((batch.offset, frame));
            let window = Window {
                count: WINDOW,
                bytes: WINDOW_BYTES,
                all_bytes: FEEDS_BYTES,
            };
            keep_within(&mut self.frames, &mut self.frame_bytes, all_bytes, window);
        }
    }
}

/// What a feed keeps at most: `count` frames of `bytes` bytes, and its router's feeds
/// `all_bytes` together.
#[derive(Clone, Copy)]
struct Window {
    count: usize,
    bytes: usize,
    all_bytes: usize,
}

/// Drops the oldest frames until at most `window.count` frames of at most `window.bytes`
/// bytes are left and the router's feeds (`all_bytes`) keep at most `window.all_bytes` (the
/// newest frame stays whatever its size).
fn keep_within(frames: &mut VecDeque<(u64, Bytes)>, frame_bytes: &mut usize, all_bytes: &AtomicUsize, window: Window) {
    while frames.len() > window.count
        || (frames.len() > 1 && (*frame_bytes > window.bytes || all_bytes.load(Ordering::Relaxed) > window.all_bytes))
    {
        let Some((_, dropped)) = frames.pop_front() else { break };
        *frame_bytes -= dropped.len();
        all_bytes.fetch_sub(dropped.len(), Ordering::Relaxed);
    }
}

/// The feeds of one router's instances, alive while a reader holds them.
#[derive(Default)]
pub(super) struct Feeds {
    feeds: Mutex<HashMap<InstanceKey, Weak<Feed>>>,
    /// The bytes of frames the feeds keep together.
    bytes: Arc<AtomicUsize>,
}

impl Feeds {
    /// The feed of `key`, created when no reader holds one.
    pub(super) fn of(&self, key: &InstanceKey) -> Arc<Feed> {
        let mut feeds = self.feeds.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some(feed) = feeds.get(key).and_then(Weak::upgrade) {
            return feed;
        }
        let feed = Arc::new(Feed {
            key: key.clone(),
            state: tokio::sync::Mutex::new(State::new(key)),
            all_bytes: self.bytes.clone(),
        });
        // Forget the feeds no reader holds any more, as the map grows.
        if feeds.len() >= 64 && feeds.len().is_power_of_two() {
            feeds.retain(|_, feed| feed.strong_count() > 0);
        }
        feeds.insert(key.clone(), Arc::downgrade(&feed));
        feed
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests assert by unwrapping
mod tests {
    use super::*;

    /// A batch of several large chunks (a step's parallel tool outputs) reaches live readers
    /// in several data events, each a whole number of chunks and none past what a client
    /// buffers for one unless a chunk alone is that large; small batches stay one event.
    #[test]
    fn a_batch_of_large_chunks_is_several_data_events_of_whole_chunks() {
        let output =
            |fill: char| serde_json::json!({"type": "tool-output", "output": fill.to_string().repeat(600 * 1024)});
        let frames = data_frame(vec![output('a'), output('b'), output('c')]).unwrap();
        let events: Vec<&str> = frames.split_terminator("\n\n").collect();
        assert_eq!(events.len(), 3, "one event per 600 KiB chunk");
        for (event, fill) in events.iter().zip(['a', 'b', 'c']) {
            let data = event.strip_prefix("event: data\ndata:").unwrap();
            let chunks: Vec<Value> = serde_json::from_str(data).unwrap();
            assert_eq!(chunks, [output(fill)]);
        }
        let small = data_frame(vec![serde_json::json!({"type": "a"}), serde_json::json!({"type": "b"})]).unwrap();
        assert_eq!(small, "event: data\ndata:[{\"type\":\"a\"},{\"type\":\"b\"}]\n\n");
        assert_eq!(data_frame(Vec::new()), None);
    }

    fn window(sizes: &[usize]) -> (VecDeque<(u64, Bytes)>, usize) {
        let frames: VecDeque<(u64, Bytes)> = sizes
            .iter()
            .enumerate()
            .map(|(offset, size)| (offset as u64, Bytes::from(vec![b'x'; *size])))
            .collect();
        let bytes = sizes.iter().sum();
        (frames, bytes)
    }

    #[test]
    fn the_window_keeps_the_newest_frames_within_its_count_and_bytes() {
        let offsets = |frames: &VecDeque<(u64, Bytes)>| frames.iter().map(|(offset, _)| *offset).collect::<Vec<_>>();
        let within = |count, bytes| Window {
            count,
            bytes,
            all_bytes: usize::MAX,
        };
        let keep = |sizes: &[usize], window: Window| {
            let (mut frames, mut bytes) = self::window(sizes);
            let all = AtomicUsize::new(bytes);
            keep_within(&mut frames, &mut bytes, &all, window);
            assert_eq!(all.load(Ordering::Relaxed), bytes, "the router's count follows");
            (offsets(&frames), bytes)
        };
        assert_eq!(keep(&[10, 10, 10, 10], within(3, 100)), (vec![1, 2, 3], 30));
        // Two whole transcripts do not fit: the older goes.
        assert_eq!(keep(&[5, 60, 60], within(10, 100)), (vec![2], 60));
        // The newest frame stays however large.
        assert_eq!(keep(&[5, 500], within(10, 100)), (vec![1], 500));
    }

    /// The feeds of a router keep their frames within a budget together: past it, a feed that
    /// takes a frame drops its oldest, whatever room its own window has.
    #[test]
    fn the_feeds_of_a_router_keep_their_frames_within_one_budget() {
        let (mut frames, mut bytes) = window(&[10, 10, 10, 10]);
        // Other feeds keep 75 bytes: with this one's 40, 115 against a budget of 90.
        let all = AtomicUsize::new(75 + bytes);
        let window = Window {
            count: 100,
            bytes: 1000,
            all_bytes: 90,
        };
        keep_within(&mut frames, &mut bytes, &all, window);
        assert_eq!((frames.len(), bytes, all.load(Ordering::Relaxed)), (1, 10, 85));
    }
}
