//! What `view=updates` reads (JSON and long-poll) answer, kept per instance so a read costs
//! what is new after the last one, not a fold of the whole stream.
//!
//! Batches are append-only and a batch projects against the fold of the batches before it,
//! so once projected its chunks never change. An instance's entry keeps the fold through the
//! newest batch any read saw and the serialized chunks of the newest batches: a window bounded
//! in batches and bytes, which starts no earlier than the offset of the read that filled it
//! (a first read near the head projects little more than it answers). A read after an offset
//! inside the window reads from the store only the batches after the entry's fold, folds them
//! in and answers with the window's chunks; a read before the window (or of an instance the
//! cache does not hold) folds the whole stream, as without the cache.
//!
//! `view=history` reads bring the same fold up to the head and snapshot it, and SSE readers
//! catch up from the window while it holds their offset.
//!
//! The entries are few and bounded in bytes (least recently read evicted first; a fold is
//! weighed as it grows, see [`Projection::weight`]) and tied to the incarnation they folded:
//! a read that finds another incarnation folds from the start again. No lock on an entry is
//! held while the store is read, so readers of one instance do not wait for each other's
//! reads, and a long-poll read waits for new batches outside the cache. Only a read that
//! fills an instance's entry waits for another filling it: the readers who connect at once to
//! a conversation no entry holds (after a restart, or once its entry was evicted) fold it
//! once, not once each.
//!
//! A fold a read makes from the start of the stream (filling an entry, or answering a read
//! before the window) takes room for its weight as it grows, from the router's room for
//! readers' folds ([`HttpOptions::max_reader_fold_bytes`](super::HttpOptions::max_reader_fold_bytes)),
//! and lets it go once kept or answered: a read that finds no room fails
//! ([`ReadFailure::Busy`], answered 503) rather than hold one more copy of a conversation.
//! A live feed's fold is made here without room ([`UpdatesCache::fold_at_head`]) and then
//! takes room itself, for as long as the instance is followed (see
//! [`Feed::after`](super::feed::Feed::after)).

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use axum::body::Bytes;
use serde_json::Value;
use tokio::sync::OwnedSemaphorePermit;

use super::error::ApiError;
use super::projection::{Projection, READ_PAGE, checkpoint};
use super::reads::FoldRoom;
use crate::record::Batch;
use crate::store::{InstanceKey, Store, StoreError};

/// Why a read of the cache failed.
#[derive(Debug)]
pub(super) enum ReadFailure {
    /// Reading the store failed.
    Store(StoreError),
    /// The read had to fold the stream and found no room for the fold among those readers
    /// hold at once.
    Busy,
}

impl From<StoreError> for ReadFailure {
    fn from(error: StoreError) -> Self {
        Self::Store(error)
    }
}

impl From<ReadFailure> for ApiError {
    fn from(failure: ReadFailure) -> Self {
        match failure {
            ReadFailure::Store(error) => ApiError::internal(&error),
            ReadFailure::Busy => ApiError::readers_busy(),
        }
    }
}

/// The most batches one updates response covers.
pub(super) const BATCHES_PER_READ: usize = 100;

/// The serialized chunk bytes after which an updates response takes no further batch: a
/// batch that resets the conversation carries its whole snapshot, so a hundred of them could
/// make a response of a hundred transcripts. A response holds at least one batch, however
/// large, so a reader always moves on.
pub(super) const PAGE_BYTES: usize = 4 * 1024 * 1024;

/// Whether a page of `projected` batches holding `bytes` of chunks takes no further batch.
// A read's page, by count, is within one store page.
const _: () = assert!(READ_PAGE > BATCHES_PER_READ);

pub(super) fn page_is_full(projected: usize, bytes: usize) -> bool {
    projected == BATCHES_PER_READ || (projected > 0 && bytes >= PAGE_BYTES)
}

/// How many of the newest batches' chunks an entry keeps.
const WINDOW_BATCHES: usize = 1024;

/// The most serialized chunk bytes an entry keeps (the newest batches' first): enough for a
/// poller's usual distance behind the head, small enough that a full cache of the default
/// 256 entries keeps at most 64 MiB of chunks — and at most [`NEWEST_KEPT`] times that when
/// each holds one larger batch alone.
const WINDOW_BYTES: usize = 256 * 1024;

/// How many times its window's bytes an entry's newest batch may take and still be kept
/// alone (a reset of a long conversation carries its whole snapshot): a reader at the
/// previous head reads it from the window instead of folding the stream from the start.
const NEWEST_KEPT: usize = 4;

/// One updates response's projection: the chunks of the batches after the read's offset.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct Page {
    /// Per batch with chunks, its chunks serialized and joined by commas (no brackets).
    pub(super) chunks: Vec<Bytes>,
    /// The offset of the last batch projected (the read's own when none was).
    pub(super) next: Option<u64>,
    /// Whether the page reaches the head.
    pub(super) up_to_date: bool,
}

impl Page {
    /// The response body: the checkpoint, then every chunk, as one JSON array.
    pub(super) fn body(&self, incarnation: &str) -> Vec<u8> {
        let checkpoint = checkpoint(incarnation).to_string();
        let size = self.chunks.iter().map(|chunks| chunks.len() + 1).sum::<usize>();
        let mut body = Vec::with_capacity(checkpoint.len() + size + 2);
        body.push(b'[');
        body.extend_from_slice(checkpoint.as_bytes());
        for chunks in &self.chunks {
            body.push(b',');
            body.extend_from_slice(chunks);
        }
        body.push(b']');
        body
    }
}

/// What a read finds.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Lookup {
    /// The instance has no stream.
    Missing,
    /// The offset is past the head (which this is).
    Gone(Option<u64>),
    /// The updates after the offset.
    Page(Page),
}

/// `chunks` serialized and joined by commas: what goes between a JSON array's brackets.
fn serialize(chunks: Vec<Value>) -> Bytes {
    if chunks.is_empty() {
        return Bytes::new();
    }
    let array = Value::Array(chunks).to_string();
    let inner = array
        .strip_prefix('[')
        .and_then(|rest| rest.strip_suffix(']'))
        .unwrap_or_default();
    Bytes::copy_from_slice(inner.as_bytes())
}

/// One instance's fold and the chunks of its newest batches.
struct Entry {
    /// The incarnation folded.
    incarnation: String,
    /// The fold through `offset`.
    projection: Projection,
    /// The last batch folded.
    offset: Option<u64>,
    /// The last batch folded before the window's first (`None`: the window starts with the
    /// stream): reads after an offset from `base` to `offset` are answered from the window.
    base: Option<u64>,
    /// `(batch offset, its chunks)`, oldest first, contiguous through `offset`.
    window: VecDeque<(u64, Bytes)>,
    /// The bytes of the window's chunks.
    bytes: usize,
}

impl Entry {
    /// Roughly the bytes the entry holds: its fold and its window's chunks.
    fn weight(&self) -> usize {
        self.projection.weight() + self.bytes
    }

    fn new(key: &InstanceKey, incarnation: &str) -> Self {
        Self {
            incarnation: incarnation.to_owned(),
            projection: Projection::new(&key.stream_path()),
            offset: None,
            base: None,
            window: VecDeque::new(),
            bytes: 0,
        }
    }

    /// The page after `after`; `None` when `after` is before the window.
    fn page(&self, after: Option<u64>) -> Option<Page> {
        if after < self.base || after > self.offset {
            return None;
        }
        let start = self
            .window
            .partition_point(|(offset, _)| after.is_some_and(|after| *offset <= after));
        let mut page = Page {
            chunks: Vec::new(),
            next: after,
            up_to_date: true,
        };
        let mut bytes = 0;
        for (projected, (offset, chunks)) in self.window.range(start..).enumerate() {
            if page_is_full(projected, bytes) {
                page.up_to_date = false;
                break;
            }
            bytes += chunks.len();
            if !chunks.is_empty() {
                page.chunks.push(chunks.clone());
            }
            page.next = Some(*offset);
        }
        Some(page)
    }
}

/// What an instance's entry answers a read.
enum Served {
    /// The updates (or that the offset is past the head).
    Answered(Lookup),
    /// No entry of the read's incarnation is held.
    NoEntry,
    /// The offset is before the entry's window.
    BeforeWindow,
}

/// An instance's entry, `None` until a read fills it.
#[derive(Default)]
struct SlotState {
    entry: tokio::sync::Mutex<Option<Entry>>,
    /// Held by the read that fills the entry: the others that find none wait for it, and read
    /// what it made instead of each folding the stream.
    filling: tokio::sync::Mutex<()>,
}

type Slot = Arc<SlotState>;

/// An entry the cache holds.
struct Held {
    /// When last read.
    read: u64,
    slot: Slot,
    /// Its weight when last folded ([`Entry::weight`]).
    weight: usize,
}

/// The least recently read entries, by instance.
#[derive(Default)]
struct Entries {
    map: HashMap<InstanceKey, Held>,
    /// The read count, which orders the entries.
    clock: u64,
    /// The entries' weights.
    weight: usize,
}

impl Entries {
    /// Counts a read of `key`; its slot, marked read now, when one is held.
    fn read(&mut self, key: &InstanceKey) -> Option<Slot> {
        self.clock += 1;
        let now = self.clock;
        self.map.get_mut(key).map(|held| {
            held.read = now;
            Arc::clone(&held.slot)
        })
    }

    /// Stops holding the least recently read entry other than `keep`'s; `false` when there is
    /// none.
    fn evict_oldest(&mut self, keep: Option<&InstanceKey>) -> bool {
        let Some(oldest) = self
            .map
            .iter()
            .filter(|(key, _)| Some(*key) != keep)
            .min_by_key(|(_, held)| held.read)
            .map(|(key, _)| key.clone())
        else {
            return false;
        };
        if let Some(held) = self.map.remove(&oldest) {
            self.weight -= held.weight;
        }
        true
    }
}

/// The per-instance cache of updates reads of one router.
pub(super) struct UpdatesCache {
    /// The most instances held (0: no caching).
    capacity: usize,
    /// The most bytes the entries hold, their folds and windows together (roughly): past it
    /// the least recently read go, all but the one just folded.
    capacity_bytes: usize,
    window_batches: usize,
    window_bytes: usize,
    entries: Mutex<Entries>,
    /// The router's room for readers' folds: a fold from the start of the stream takes its
    /// weight from it while it is made.
    room: FoldRoom,
    /// How many batches reads folded, cached or not (what the tests count).
    folded: AtomicU64,
}

impl UpdatesCache {
    /// A cache of at most `capacity` instances (0 caches nothing) holding at most about
    /// `capacity_bytes`, whose reads' folds take room from `room`.
    pub(super) fn new(capacity: usize, capacity_bytes: usize, room: FoldRoom) -> Self {
        Self::with_window(capacity, capacity_bytes, room, WINDOW_BATCHES, WINDOW_BYTES)
    }

    /// A cache whose entries keep the chunks of at most `batches` batches and `bytes` bytes.
    fn with_window(capacity: usize, capacity_bytes: usize, room: FoldRoom, batches: usize, bytes: usize) -> Self {
        Self {
            capacity,
            capacity_bytes,
            window_batches: batches,
            window_bytes: bytes,
            entries: Mutex::default(),
            room,
            folded: AtomicU64::new(0),
        }
    }

    /// How many batches reads have folded so far.
    #[cfg(test)]
    fn folded(&self) -> u64 {
        self.folded.load(Ordering::Relaxed)
    }

    /// The entry slot of `key`, marked read now; the least recently read one goes when the
    /// cache is full.
    fn slot(&self, key: &InstanceKey) -> Slot {
        let mut entries = self.entries.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some(slot) = entries.read(key) {
            return slot;
        }
        if entries.map.len() >= self.capacity {
            entries.evict_oldest(None);
        }
        let slot = Arc::default();
        let now = entries.clock;
        entries.map.insert(
            key.clone(),
            Held {
                read: now,
                slot: Arc::clone(&slot),
                weight: 0,
            },
        );
        slot
    }

    /// Notes `weight` as the weight of `key`'s entry in `slot` (just folded), when the cache
    /// still holds that slot, and lets the least recently read others go while the entries
    /// weigh more than the cache's bytes. The entry just folded stays, however heavy: its
    /// reader is served from it, and the next read of another instance weighs it again.
    fn weigh(&self, key: &InstanceKey, slot: &SlotState, weight: usize) {
        let mut entries = self.entries.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let Entries { map, weight: total, .. } = &mut *entries;
        let Some(held) = map.get_mut(key).filter(|held| std::ptr::eq(&*held.slot, slot)) else {
            return;
        };
        *total = *total - held.weight + weight;
        held.weight = weight;
        while entries.weight > self.capacity_bytes && entries.evict_oldest(Some(key)) {}
    }

    /// The entry slot of `key` when one is held (marked read now): a lookup that will not fill
    /// it takes no room from the entries held.
    fn held_slot(&self, key: &InstanceKey) -> Option<Slot> {
        self.entries
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .read(key)
    }

    /// The updates of `key` after `after`. `incarnation` is the instance's, read before
    /// (`None` when the store has no such instance: nothing is cached then).
    pub(super) async fn updates(
        &self,
        store: &dyn Store,
        key: &InstanceKey,
        incarnation: Option<&str>,
        after: Option<u64>,
    ) -> Result<Lookup, ReadFailure> {
        match self.filled(store, key, incarnation, after).await? {
            Some(lookup) => Ok(lookup),
            None => self.fresh(store, key, after).await,
        }
    }

    /// The updates of `key` after `after` as far as the cache answers them, filling the
    /// instance's entry when none is held and its window would hold `after`: `None` when it
    /// does not (`after` is further back, the instance has no incarnation, or the cache holds
    /// nothing), for a reader that folds on its own then ([`Self::updates`] folds afresh). What a
    /// new live reader asks: an instance followed only live is read through its feed, which
    /// keeps no entry, so its entry may be gone when another reader connects; filled again,
    /// the readers after it read the window instead of each folding the stream.
    pub(super) async fn filled(
        &self,
        store: &dyn Store,
        key: &InstanceKey,
        incarnation: Option<&str>,
        after: Option<u64>,
    ) -> Result<Option<Lookup>, ReadFailure> {
        let Some(incarnation) = incarnation.filter(|_| self.capacity > 0) else {
            return Ok(None);
        };
        let slot = match self.held_slot(key) {
            Some(slot) => slot,
            None => {
                // A lookup that will not fill an entry (a read before the window it would
                // hold, or past the head) takes no place from the entries held.
                let Some(head) = store.last_offset(key).await? else {
                    return Ok(Some(Lookup::Missing));
                };
                if after > Some(head) {
                    return Ok(Some(Lookup::Gone(Some(head))));
                }
                if after < self.window_base(head) {
                    return Ok(None);
                }
                self.slot(key)
            }
        };
        let mut filling = None;
        loop {
            match self.answer_from_entry(store, key, incarnation, &slot, after).await? {
                Served::Answered(lookup) => return Ok(Some(lookup)),
                Served::BeforeWindow => return Ok(None),
                Served::NoEntry if filling.is_some() => {
                    return self.fill(store, key, incarnation, &slot, after).await;
                }
                // The entry is filled by one read at a time: once this one holds the filling,
                // the entry another read filled meanwhile answers it.
                Served::NoEntry => filling = Some(slot.filling.lock().await),
            }
        }
    }

    /// The updates of `key` after `after` as far as its entry answers them (brought up to the
    /// head first): `None` when no entry of `incarnation` is held or `after` is before its
    /// window. What a reader that folds on its own when the cache cannot serve it asks.
    pub(super) async fn cached(
        &self,
        store: &dyn Store,
        key: &InstanceKey,
        incarnation: Option<&str>,
        after: Option<u64>,
    ) -> Result<Option<Lookup>, ReadFailure> {
        let Some(incarnation) = incarnation.filter(|_| self.capacity > 0) else {
            return Ok(None);
        };
        let Some(slot) = self.held_slot(key) else {
            return Ok(None);
        };
        Ok(
            match self.answer_from_entry(store, key, incarnation, &slot, after).await? {
                Served::Answered(lookup) => Some(lookup),
                Served::NoEntry | Served::BeforeWindow => None,
            },
        )
    }

    /// The `view=history` snapshot of `key` at its head, with the head's offset (`None` when
    /// it has no stream): see [`Self::at_head`].
    pub(super) async fn history(
        &self,
        store: &dyn Store,
        key: &InstanceKey,
        incarnation: Option<&str>,
    ) -> Result<Option<(Value, String)>, ReadFailure> {
        self.at_head(store, key, incarnation, true, |projection, _| {
            (projection.snapshot(), projection.offset())
        })
        .await
    }

    /// A copy of the fold of `key` at its head, and the offset it reaches (`None` when it has
    /// no stream): see [`Self::at_head`]. What a new live feed starts from: a reader that
    /// reconnects to a conversation nobody else follows makes a new feed, which would read
    /// and fold the whole stream again without it.
    pub(super) async fn fold_at_head(
        &self,
        store: &dyn Store,
        key: &InstanceKey,
        incarnation: Option<&str>,
    ) -> Result<Option<(Projection, Option<u64>)>, ReadFailure> {
        // Without room here: the feed takes room for what this returns, the room of the
        // reader it serves from then on when that reader holds some.
        self.at_head(store, key, incarnation, false, |projection, offset| {
            (projection.clone(), offset)
        })
        .await
    }

    /// `answer` of the fold of `key` at its head and the offset it reaches (`None` when it has
    /// no stream): the entry of `incarnation`'s fold brought up to the head, or, without an
    /// entry, a fold of the whole stream (taking room for it, when `charged`) that becomes the
    /// entry (its window empty: it starts at the head).
    async fn at_head<T>(
        &self,
        store: &dyn Store,
        key: &InstanceKey,
        incarnation: Option<&str>,
        charged: bool,
        answer: impl Fn(&Projection, Option<u64>) -> T,
    ) -> Result<Option<T>, ReadFailure> {
        let slot = incarnation
            .filter(|_| self.capacity > 0)
            .map(|incarnation| (incarnation, self.slot(key)));
        // Held until the fold is kept (see [`Self::filled`]).
        let mut filling = None;
        if let Some((incarnation, slot)) = &slot {
            loop {
                if self.bring_up_to_date(store, key, incarnation, slot).await?
                    && let Some(entry) = slot
                        .entry
                        .lock()
                        .await
                        .as_ref()
                        .filter(|entry| entry.incarnation == *incarnation)
                {
                    return Ok(Some(answer(&entry.projection, entry.offset)));
                }
                if filling.is_some() {
                    break;
                }
                filling = Some(slot.filling.lock().await);
            }
        }
        let mut projection = Projection::new(&key.stream_path());
        // Held until the fold is kept: then the cache's bytes bound it.
        let mut room = if charged { self.fold_room()? } else { None };
        let (head, fits) = projection
            .fold_stream_within(store, key, u64::MAX, |bytes| {
                !charged || self.room.hold(&mut room, bytes)
            })
            .await?;
        if !fits {
            return Err(ReadFailure::Busy);
        }
        let Some(head) = head else {
            return Ok(None);
        };
        // Offsets count from 0: a fold from the start folded `head + 1` batches.
        self.count_folded(head.saturating_add(1));
        let answered = answer(&projection, Some(head));
        if let Some((incarnation, slot)) = &slot {
            let mut entry = Entry::new(key, incarnation);
            entry.projection = projection;
            entry.offset = Some(head);
            entry.base = Some(head);
            self.keep(key, slot, entry).await;
        }
        Ok(Some(answered))
    }

    /// What the entry of `incarnation` answers after `after`, once the batches appended since
    /// its fold are folded in.
    async fn answer_from_entry(
        &self,
        store: &dyn Store,
        key: &InstanceKey,
        incarnation: &str,
        slot: &SlotState,
        after: Option<u64>,
    ) -> Result<Served, StoreError> {
        if !self.bring_up_to_date(store, key, incarnation, slot).await? {
            return Ok(Served::NoEntry);
        }
        let guard = slot.entry.lock().await;
        // Another read may have filled it again meanwhile, with another incarnation.
        if let Some(entry) = guard.as_ref().filter(|entry| entry.incarnation == incarnation) {
            if after > entry.offset {
                return Ok(Served::Answered(Lookup::Gone(entry.offset)));
            }
            if let Some(page) = entry.page(after) {
                return Ok(Served::Answered(Lookup::Page(page)));
            }
        }
        Ok(Served::BeforeWindow)
    }

    /// Folds what was appended since the entry of `incarnation` last read into it, a store
    /// page at a time (the lock is not held while the store reads); `false` when `slot` holds
    /// no entry of `incarnation` (or another read replaced it meanwhile).
    async fn bring_up_to_date(
        &self,
        store: &dyn Store,
        key: &InstanceKey,
        incarnation: &str,
        slot: &SlotState,
    ) -> Result<bool, StoreError> {
        let held = |guard: &Option<Entry>| {
            guard
                .as_ref()
                .filter(|entry| entry.incarnation == incarnation)
                .map(|entry| entry.offset)
        };
        let Some(mut folded) = held(&*slot.entry.lock().await) else {
            return Ok(false);
        };
        loop {
            let page = store.read_page(key, folded, READ_PAGE).await?;
            let mut guard = slot.entry.lock().await;
            let Some(entry) = guard.as_mut().filter(|entry| entry.incarnation == incarnation) else {
                return Ok(false);
            };
            let before = entry.offset;
            self.extend(entry, page.iter().filter(|batch| Some(batch.offset) > before));
            let (weight, offset) = (entry.weight(), entry.offset);
            drop(guard);
            self.weigh(key, slot, weight);
            if page.len() < READ_PAGE {
                return Ok(true);
            }
            folded = offset;
        }
    }

    /// Holds `entry` in `slot` (`key`'s), unless the entry held is of the same incarnation
    /// and folded further.
    async fn keep(&self, key: &InstanceKey, slot: &SlotState, entry: Entry) {
        let mut guard = slot.entry.lock().await;
        let further = guard
            .as_ref()
            .is_some_and(|held| held.incarnation == entry.incarnation && held.offset > entry.offset);
        if !further {
            let weight = entry.weight();
            *guard = Some(entry);
            drop(guard);
            self.weigh(key, slot, weight);
        }
    }

    /// Folds `batches` into `entry`, keeping their chunks in its window within its bounds.
    fn extend<'a>(&self, entry: &mut Entry, batches: impl Iterator<Item = &'a Batch>) {
        for batch in batches {
            let mut chunks = Vec::new();
            entry.projection.apply(batch, Some(&mut chunks));
            self.folded.fetch_add(1, Ordering::Relaxed);
            entry.offset = Some(batch.offset);
            let chunks = serialize(chunks);
            entry.bytes += chunks.len();
            entry.window.push_back((batch.offset, chunks));
            // The newest batch stays when it is larger than the window but not past
            // [`NEWEST_KEPT`] times it: a reader at the previous head (a long poll, a client
            // following the stream) is served from the window, where evicting it would send
            // every such reader to fold the stream from the start.
            let newest_kept = entry
                .window
                .back()
                .is_none_or(|(_, newest)| newest.len() <= self.window_bytes.saturating_mul(NEWEST_KEPT));
            while (entry.window.len() > 1 || !newest_kept)
                && (entry.window.len() > self.window_batches || entry.bytes > self.window_bytes)
            {
                let Some((offset, chunks)) = entry.window.pop_front() else {
                    break;
                };
                entry.bytes -= chunks.len();
                entry.base = Some(offset);
            }
        }
    }

    /// The offset just before the first batch a window filled at `head` would hold (counting
    /// only the batch bound: the byte bound may keep fewer, and then the read is answered
    /// afresh); `None` when it would hold the stream from its start. Offsets count from 0.
    fn window_base(&self, head: u64) -> Option<u64> {
        (head + 1).saturating_sub(self.window_batches as u64).checked_sub(1)
    }

    /// A read that finds no entry of `incarnation`: the stream is folded (a store page at a
    /// time, taking room for the fold as it grows) into a new entry when the read falls within
    /// what the entry's window will hold. `None` when it does not, or when the window kept less
    /// than the read asks (its byte bound): the caller answers it otherwise.
    async fn fill(
        &self,
        store: &dyn Store,
        key: &InstanceKey,
        incarnation: &str,
        slot: &SlotState,
        after: Option<u64>,
    ) -> Result<Option<Lookup>, ReadFailure> {
        let Some(head) = store.last_offset(key).await? else {
            return Ok(Some(Lookup::Missing));
        };
        if after > Some(head) {
            return Ok(Some(Lookup::Gone(Some(head))));
        }
        let base = self.window_base(head);
        if after < base {
            return Ok(None);
        }
        // Chunks only from the read's offset on, so a first read costs what an uncached one
        // does; reads further back fold afresh.
        let base = base.max(after);
        let mut entry = Entry::new(key, incarnation);
        // Held until the entry is kept: then the cache's bytes bound it.
        let mut room = self.fold_room()?;
        if let Some(base) = base {
            let (_, fits) = entry
                .projection
                .fold_stream_within(store, key, base, |bytes| self.room.hold(&mut room, bytes))
                .await?;
            if !fits {
                return Err(ReadFailure::Busy);
            }
            self.count_folded(base + 1);
        }
        entry.offset = base;
        entry.base = base;
        loop {
            let page = store.read_page(key, entry.offset, READ_PAGE).await?;
            self.extend(&mut entry, page.iter());
            if !self.room.hold(&mut room, entry.weight()) {
                return Err(ReadFailure::Busy);
            }
            if page.len() < READ_PAGE {
                break;
            }
        }
        let page = entry.page(after);
        // The entry folded furthest stays, unless it is another incarnation's.
        self.keep(key, slot, entry).await;
        Ok(page.map(Lookup::Page))
    }

    /// A read that the cache does not serve: the stream folded through `after` (a store page
    /// at a time, taking room for the fold as it grows) and the batches after it projected
    /// until the page is full ([`page_is_full`]).
    async fn fresh(&self, store: &dyn Store, key: &InstanceKey, after: Option<u64>) -> Result<Lookup, ReadFailure> {
        let Some(head) = store.last_offset(key).await? else {
            return Ok(Lookup::Missing);
        };
        if after > Some(head) {
            return Ok(Lookup::Gone(Some(head)));
        }
        let mut projection = Projection::new(&key.stream_path());
        // Held until the page is answered.
        let mut room = self.fold_room()?;
        if let Some(after) = after {
            let (_, fits) = projection
                .fold_stream_within(store, key, after, |bytes| self.room.hold(&mut room, bytes))
                .await?;
            if !fits {
                return Err(ReadFailure::Busy);
            }
            self.count_folded(after + 1);
        }
        // A full page of the read (by count), and one batch more to tell whether the page
        // reaches the head; held in room with the fold until answered.
        let batches = store.read_page(key, after, BATCHES_PER_READ + 1).await?;
        let read = batches.iter().map(super::projection::batch_weight).sum::<usize>();
        if !self.room.hold(&mut room, projection.weight() + read) {
            return Err(ReadFailure::Busy);
        }
        let mut page = Page {
            chunks: Vec::new(),
            next: after,
            up_to_date: batches.len() <= BATCHES_PER_READ,
        };
        let (mut projected, mut bytes) = (0, 0);
        for batch in &batches {
            if page_is_full(projected, bytes) {
                page.up_to_date = false;
                break;
            }
            let mut chunks = Vec::new();
            projection.apply(batch, Some(&mut chunks));
            self.count_folded(1);
            let chunks = serialize(chunks);
            bytes += chunks.len();
            if !chunks.is_empty() {
                page.chunks.push(chunks);
            }
            page.next = Some(batch.offset);
            projected += 1;
        }
        if !self.room.hold(&mut room, projection.weight() + read + bytes) {
            return Err(ReadFailure::Busy);
        }
        Ok(Lookup::Page(page))
    }

    /// Room for a fold from the start of the stream, taken before any of it is read: a read
    /// refused for want of room (a client retrying its 503) reads nothing.
    fn fold_room(&self) -> Result<Option<OwnedSemaphorePermit>, ReadFailure> {
        let mut room = None;
        if self.room.hold(&mut room, 1) {
            Ok(room)
        } else {
            Err(ReadFailure::Busy)
        }
    }

    fn count_folded(&self, batches: u64) {
        self.folded.fetch_add(batches, Ordering::Relaxed);
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests assert by unwrapping
mod tests {
    use flue_core::message::DeliveredMessage;
    use serde_json::json;

    use super::*;
    use crate::provider::StopReason;
    use crate::record::test_records::record;
    use crate::record::{Outcome, Record, RecordBody};
    use crate::store::{Admission, MemoryStore, SubmissionKind, UidCondition};

    /// A cache whose reads' folds find room always.
    fn new_cache(capacity: usize, capacity_bytes: usize) -> UpdatesCache {
        UpdatesCache::new(capacity, capacity_bytes, FoldRoom::new(usize::MAX))
    }

    /// [`new_cache`] with entries that keep at most `batches` batches' and `bytes` bytes' chunks.
    fn windowed_cache(capacity: usize, capacity_bytes: usize, batches: usize, bytes: usize) -> UpdatesCache {
        UpdatesCache::with_window(capacity, capacity_bytes, FoldRoom::new(usize::MAX), batches, bytes)
    }

    /// Creates the instance `id` (its birth batch); its incarnation.
    async fn create(store: &MemoryStore, id: &str) -> (InstanceKey, String) {
        let key = InstanceKey::new("agent", id);
        let admitted = store
            .admit(Admission {
                key: key.clone(),
                submission_id: format!("sub_{id}"),
                keyed: false,
                kind: SubmissionKind::Direct,
                message: DeliveredMessage::user("hello"),
                initial_data: None,
                uid: UidCondition::Any,
                max_attempts: 10,
                timeout_ms: 3_600_000,
                claim: None,
                trace: None,
            })
            .await
            .unwrap();
        (key, admitted.uid)
    }

    /// The batches of exchange `n`: a user message, a step calling a tool, the tool's
    /// committed outcome, the answer, a batch that projects to nothing and the settlement;
    /// every third exchange also edits its message (a conversation reset).
    fn exchange(n: usize) -> Vec<Vec<Record>> {
        let submission = format!("sub_{n}");
        let step = format!("step_{n}");
        let call = format!("call_{n}");
        let at = |body| record(&submission, body);
        let mut batches = vec![
            vec![at(RecordBody::UserMessage {
                message_id: format!("user_{n}"),
                body: format!("question {n}"),
                attachments: Vec::new(),
            })],
            vec![
                at(RecordBody::AssistantMessageStarted {
                    message_id: step.clone(),
                    model: "test/model".into(),
                    turn_id: None,
                    response_metadata: None,
                }),
                at(RecordBody::AssistantToolCall {
                    message_id: step.clone(),
                    tool_call_id: call.clone(),
                    name: "echo".into(),
                    arguments: format!("{{\"n\":{n}}}"),
                }),
            ],
            vec![
                at(RecordBody::ToolOutcome {
                    output: None,
                    assistant_message_id: step.clone(),
                    tool_call_id: call,
                    tool_name: "echo".into(),
                    is_error: n % 2 == 1,
                    content: format!("echoed {n}"),
                    terminate: false,
                    duration_ms: 3,
                }),
                at(RecordBody::ToolResultsCommitted {
                    assistant_message_id: step.clone(),
                }),
            ],
            vec![at(RecordBody::AssistantMessageCompleted {
                message_id: step,
                text: format!("answer {n}"),
                reasoning: String::new(),
                stop_reason: StopReason::Stop,
                usage: Default::default(),
                reasoning_blocks: Vec::new(),
            })],
            vec![at(RecordBody::StateWrite {
                name: "count".into(),
                value: json!(n),
            })],
            vec![at(RecordBody::SubmissionSettled {
                outcome: Outcome::Completed,
                error: None,
            })],
        ];
        // Text the step streamed before it completed: the start of its text, or (every fourth
        // exchange) a retried call's, which the completion corrects (a reset).
        // Every fourth from the third, it reasoned too, which its completion does not repeat.
        let streamed = if n % 4 == 1 { "draft" } else { "ans" };
        let mut deltas = vec![at(RecordBody::AssistantTextDelta {
            message_id: format!("step_{n}"),
            delta: streamed.into(),
        })];
        if n % 4 == 3 {
            deltas.insert(
                0,
                at(RecordBody::AssistantReasoningDelta {
                    message_id: format!("step_{n}"),
                    delta: "thinking".into(),
                }),
            );
        }
        batches.insert(3, deltas);
        if n % 3 == 2 {
            let mut updates = serde_json::Map::new();
            updates.insert("content".into(), json!(format!("question {n}, edited")));
            batches.push(vec![at(RecordBody::MessageUpdated {
                message_id: format!("user_{n}"),
                updates,
            })]);
        }
        batches
    }

    async fn append(store: &MemoryStore, key: &InstanceKey, records: Vec<Record>) {
        store.append_unfenced(key, records.into()).unwrap();
    }

    /// The response body of a read after `after`, as a fold of the whole stream from the start
    /// answers it, without this module.
    async fn from_scratch(store: &MemoryStore, key: &InstanceKey, incarnation: &str, after: Option<u64>) -> Vec<u8> {
        from_scratch_through(store, key, incarnation, after, u64::MAX).await
    }

    /// [`from_scratch`] of the stream as it was when `through` was its head.
    async fn from_scratch_through(
        store: &MemoryStore,
        key: &InstanceKey,
        incarnation: &str,
        after: Option<u64>,
        through: u64,
    ) -> Vec<u8> {
        let mut projection = Projection::new(&key.stream_path());
        let mut body = vec![checkpoint(incarnation)];
        let (mut projected, mut bytes) = (0, 0);
        let batches = store.read(key, None).await.unwrap();
        for batch in batches.into_iter().filter(|batch| batch.offset <= through) {
            if after.is_some_and(|after| batch.offset <= after) {
                projection.apply(&batch, None);
            } else if !page_is_full(projected, bytes) {
                let mut chunks = Vec::new();
                projection.apply(&batch, Some(&mut chunks));
                bytes += serialize(chunks.clone()).len();
                body.extend(chunks);
                projected += 1;
            }
        }
        serde_json::to_vec(&body).unwrap()
    }

    async fn read(cache: &UpdatesCache, store: &MemoryStore, key: &InstanceKey, uid: &str, after: Option<u64>) -> Page {
        match cache.updates(store, key, Some(uid), after).await.unwrap() {
            Lookup::Page(page) => page,
            other => panic!("a read after {after:?} found {other:?}"),
        }
    }

    /// Creates the instance `id` with `exchanges` exchanges in its stream: its key,
    /// incarnation and head offset.
    async fn conversation(store: &MemoryStore, id: &str, exchanges: usize) -> (InstanceKey, String, u64) {
        let (key, uid) = create(store, id).await;
        for n in 0..exchanges {
            for batch in exchange(n) {
                append(store, &key, batch).await;
            }
        }
        let head = store.read(&key, None).await.unwrap().last().unwrap().offset;
        (key, uid, head)
    }

    /// Past the cache's bytes, the least recently read entries go, but never the one a read
    /// just folded, however heavy: a few long conversations cannot make it hold them all, and
    /// a reader of one is still served from its entry.
    #[tokio::test]
    async fn entries_past_the_caches_bytes_go_least_recently_read_first_but_the_one_just_folded_stays() {
        let store = MemoryStore::new();
        let (first, first_uid, first_head) = conversation(&store, "first", 3).await;
        let (second, second_uid, second_head) = conversation(&store, "second", 3).await;
        let (first_length, second_length) = (first_head + 1, second_head + 1);

        // Room for both: the first is still held after the second is read.
        let roomy = new_cache(8, usize::MAX);
        read(&roomy, &store, &first, &first_uid, None).await;
        read(&roomy, &store, &second, &second_uid, None).await;
        read(&roomy, &store, &first, &first_uid, Some(2)).await;
        assert_eq!(roomy.folded(), first_length + second_length);
        let weight = roomy.entries.lock().unwrap().weight;
        assert!(weight > 0, "folds are weighed");

        // Room for about one: reading the second lets the first go, which is folded again.
        let one = weight * 3 / 4;
        let tight = new_cache(8, one);
        read(&tight, &store, &first, &first_uid, None).await;
        read(&tight, &store, &second, &second_uid, None).await;
        assert_eq!(tight.entries.lock().unwrap().map.len(), 1);
        assert!(tight.entries.lock().unwrap().weight <= one);
        let page = read(&tight, &store, &first, &first_uid, Some(2)).await;
        assert_eq!(tight.folded(), 2 * first_length + second_length);
        assert_eq!(
            page.body(&first_uid),
            from_scratch(&store, &first, &first_uid, Some(2)).await
        );

        // Room for none: the entry just folded stays all the same, and serves the next read.
        let none = new_cache(8, 1);
        read(&none, &store, &first, &first_uid, None).await;
        let again = read(&none, &store, &first, &first_uid, Some(2)).await;
        assert_eq!(none.folded(), first_length, "served from the entry");
        assert_eq!(
            again.body(&first_uid),
            from_scratch(&store, &first, &first_uid, Some(2)).await
        );
        read(&none, &store, &second, &second_uid, None).await;
        let held: Vec<InstanceKey> = none.entries.lock().unwrap().map.keys().cloned().collect();
        assert_eq!(held, [second]);
    }

    #[tokio::test]
    async fn an_updates_read_projects_only_the_batches_after_its_offset() {
        let store = MemoryStore::new();
        let (key, uid, head) = conversation(&store, "counted", 3).await;
        let cache = new_cache(8, usize::MAX);
        let first = read(&cache, &store, &key, &uid, None).await;
        assert_eq!(first.next, Some(head));
        assert_eq!(cache.folded(), head + 1, "the first read folds the whole stream once");

        let again = read(&cache, &store, &key, &uid, Some(head)).await;
        assert_eq!((again.chunks.len(), again.next), (0, Some(head)));
        let earlier = read(&cache, &store, &key, &uid, Some(head - 4)).await;
        assert_eq!(earlier.next, Some(head));
        assert_eq!(
            cache.folded(),
            head + 1,
            "nothing new: nothing folded, an earlier offset included"
        );

        for batch in exchange(3).into_iter().take(1) {
            append(&store, &key, batch).await;
        }
        let polled = read(&cache, &store, &key, &uid, Some(head)).await;
        assert_eq!(cache.folded(), head + 2, "the poll folds the one new batch");
        assert_eq!(polled.next, Some(head + 1));
        assert_eq!(polled.body(&uid), from_scratch(&store, &key, &uid, Some(head)).await);
    }

    /// The history snapshot and offset of the stream as a fold from the start gives them.
    async fn history_from_scratch(store: &MemoryStore, key: &InstanceKey) -> (Value, String) {
        let mut projection = Projection::new(&key.stream_path());
        for batch in store.read(key, None).await.unwrap() {
            projection.apply(&batch, None);
        }
        (projection.snapshot(), projection.offset())
    }

    #[tokio::test]
    async fn a_history_read_folds_only_the_batches_appended_since_the_last_read() {
        let store = MemoryStore::new();
        let (key, uid, head) = conversation(&store, "history", 1).await;
        let cache = new_cache(8, usize::MAX);
        let first = cache.history(&store, &key, Some(&uid)).await.unwrap().unwrap();
        assert_eq!(first, history_from_scratch(&store, &key).await);
        assert_eq!(cache.folded(), head + 1, "the first read folds the whole stream once");
        let again = cache.history(&store, &key, Some(&uid)).await.unwrap().unwrap();
        assert_eq!(
            (again, cache.folded()),
            (first, head + 1),
            "nothing new: nothing folded"
        );

        let mut appended = 0;
        for n in 1..4 {
            for batch in exchange(n) {
                append(&store, &key, batch).await;
                appended += 1;
                let read = cache.history(&store, &key, Some(&uid)).await.unwrap().unwrap();
                assert_eq!(read, history_from_scratch(&store, &key).await);
                assert_eq!(cache.folded(), head + 1 + appended, "each read folds the one new batch");
            }
        }
        // An updates read at the head the history read reached is answered from the entry.
        let now = store.read(&key, None).await.unwrap().last().unwrap().offset;
        let polled = cache.cached(&store, &key, Some(&uid), Some(now)).await.unwrap();
        assert!(
            matches!(polled, Some(Lookup::Page(Page { ref chunks, next, up_to_date: true })) if chunks.is_empty() && next == Some(now))
        );
        assert_eq!(cache.folded(), head + 1 + appended);
        // Uncached (no incarnation, or a cache of nothing): a fresh fold, the same answer.
        assert_eq!(
            new_cache(0, usize::MAX)
                .history(&store, &key, Some(&uid))
                .await
                .unwrap(),
            Some(history_from_scratch(&store, &key).await)
        );
        assert_eq!(
            cache.history(&store, &key, None).await.unwrap(),
            Some(history_from_scratch(&store, &key).await)
        );
        let missing = InstanceKey::new("agent", "missing");
        assert_eq!(cache.history(&store, &missing, Some("uid")).await.unwrap(), None);
    }

    #[tokio::test]
    async fn a_cached_lookup_answers_only_from_a_held_window_and_never_folds_the_stream() {
        let store = MemoryStore::new();
        let (key, uid, head) = conversation(&store, "window", 3).await;
        let cache = windowed_cache(8, usize::MAX, 4, usize::MAX);
        // Nothing held: no answer, and nothing folded.
        assert!(
            cache
                .cached(&store, &key, Some(&uid), Some(head - 4))
                .await
                .unwrap()
                .is_none()
        );
        assert_eq!(cache.folded(), 0);
        // A read fills the entry; the window holds the four batches after its offset.
        read(&cache, &store, &key, &uid, Some(head - 4)).await;
        let folded = cache.folded();
        for after in head - 4..=head {
            let Some(Lookup::Page(page)) = cache.cached(&store, &key, Some(&uid), Some(after)).await.unwrap() else {
                panic!("offset {after} is in the window");
            };
            assert_eq!(page.body(&uid), from_scratch(&store, &key, &uid, Some(after)).await);
        }
        assert!(
            cache
                .cached(&store, &key, Some(&uid), Some(head - 5))
                .await
                .unwrap()
                .is_none(),
            "before the window"
        );
        assert!(matches!(
            cache.cached(&store, &key, Some(&uid), Some(head + 1)).await.unwrap(),
            Some(Lookup::Gone(Some(gone))) if gone == head
        ));
        assert!(
            cache
                .cached(&store, &key, Some("another"), Some(head))
                .await
                .unwrap()
                .is_none()
        );
        assert_eq!(cache.folded(), folded, "no lookup folded anything");
    }

    #[tokio::test]
    async fn a_lookup_of_an_instance_without_an_entry_takes_no_room_from_the_entries_held() {
        let store = MemoryStore::new();
        let (held, held_uid, held_head) = conversation(&store, "held", 2).await;
        let (other, other_uid, other_head) = conversation(&store, "other", 2).await;
        let cache = windowed_cache(1, usize::MAX, 4, usize::MAX);
        read(&cache, &store, &held, &held_uid, Some(held_head)).await;
        assert!(
            cache
                .cached(&store, &other, Some(&other_uid), Some(other_head))
                .await
                .unwrap()
                .is_none()
        );
        let folded = cache.folded();
        assert!(
            matches!(
                cache
                    .cached(&store, &held, Some(&held_uid), Some(held_head))
                    .await
                    .unwrap(),
                Some(Lookup::Page(_))
            ),
            "the one entry the cache holds is still there"
        );
        assert_eq!(cache.folded(), folded);
    }

    /// A filled lookup that will not fill an entry (a read before the window it would hold, or
    /// past the head) takes no place from the entries held either.
    #[tokio::test]
    async fn a_filled_lookup_that_fills_nothing_takes_no_room_from_the_entries_held() {
        let store = MemoryStore::new();
        let (held, held_uid, held_head) = conversation(&store, "held", 2).await;
        let (other, other_uid, other_head) = conversation(&store, "other", 3).await;
        let cache = windowed_cache(1, usize::MAX, 4, usize::MAX);
        read(&cache, &store, &held, &held_uid, Some(held_head)).await;
        let before = cache.filled(&store, &other, Some(&other_uid), Some(other_head - 5));
        assert!(before.await.unwrap().is_none());
        let past = cache.filled(&store, &other, Some(&other_uid), Some(other_head + 1));
        assert!(matches!(past.await.unwrap(), Some(Lookup::Gone(Some(head))) if head == other_head));
        let folded = cache.folded();
        let again = cache.cached(&store, &held, Some(&held_uid), Some(held_head));
        assert!(
            matches!(again.await.unwrap(), Some(Lookup::Page(_))),
            "the one entry the cache holds is still there"
        );
        assert_eq!(cache.folded(), folded);
    }

    #[tokio::test]
    async fn a_filled_lookup_fills_the_entry_its_window_would_answer_and_leaves_older_reads_alone() {
        let store = MemoryStore::new();
        let (key, uid, head) = conversation(&store, "filled", 3).await;
        let cache = windowed_cache(8, usize::MAX, 4, usize::MAX);
        // Before the window the entry would hold: not answered, nothing folded.
        assert!(
            cache
                .filled(&store, &key, Some(&uid), Some(head - 5))
                .await
                .unwrap()
                .is_none()
        );
        assert_eq!(cache.folded(), 0);
        // Within it: filled and answered, as a fold from scratch answers.
        let Some(Lookup::Page(page)) = cache.filled(&store, &key, Some(&uid), Some(head - 2)).await.unwrap() else {
            panic!("offset {} is in the window", head - 2);
        };
        assert_eq!(page.body(&uid), from_scratch(&store, &key, &uid, Some(head - 2)).await);
        let folded = cache.folded();
        assert!(folded > 0);
        // The next readers read the window (from the offset it was filled at): nothing folded
        // again.
        for after in [head - 2, head - 1, head] {
            let Some(Lookup::Page(page)) = cache.cached(&store, &key, Some(&uid), Some(after)).await.unwrap() else {
                panic!("offset {after} is in the window");
            };
            assert_eq!(page.body(&uid), from_scratch(&store, &key, &uid, Some(after)).await);
        }
        assert!(matches!(
            cache.filled(&store, &key, Some(&uid), Some(head + 1)).await.unwrap(),
            Some(Lookup::Gone(Some(gone))) if gone == head
        ));
        assert_eq!(cache.folded(), folded);
    }

    #[tokio::test]
    async fn updates_reads_from_the_cache_equal_a_fresh_fold_at_every_offset() {
        let store = MemoryStore::new();
        let (key, uid) = create(&store, "checked").await;
        // Whole windows, one batch short of a response's size, and windows bound in bytes
        // (which a reset's snapshot chunk alone can overflow).
        let caches = [
            new_cache(8, usize::MAX),
            windowed_cache(8, usize::MAX, 7, usize::MAX),
            windowed_cache(8, usize::MAX, WINDOW_BATCHES, 1500),
        ];
        let mut head = 0;
        // 20 exchanges pass one response's 100 batches.
        for n in 0..20 {
            for batch in exchange(n) {
                append(&store, &key, batch).await;
                head += 1;
            }
            // Every offset now and then, in an order that moves the caches back and forth;
            // in between, a poll at the head and one a few batches back.
            let mut offsets: Vec<Option<u64>> = if n % 3 == 0 || n == 19 {
                (0..=head).map(Some).chain([None]).collect()
            } else {
                vec![Some(head), Some(head.saturating_sub(5))]
            };
            if n % 2 == 1 {
                offsets.reverse();
            }
            for after in offsets {
                let expected = from_scratch(&store, &key, &uid, after).await;
                for (index, cache) in caches.iter().enumerate() {
                    let page = read(cache, &store, &key, &uid, after).await;
                    assert_eq!(
                        String::from_utf8(page.body(&uid)).unwrap(),
                        String::from_utf8(expected.clone()).unwrap(),
                        "cache {index}, exchange {n}, after {after:?}"
                    );
                    let first = after.map_or(0, |after| after + 1);
                    let remaining = head + 1 - first;
                    let limit = BATCHES_PER_READ as u64;
                    assert_eq!(page.up_to_date, remaining <= limit, "after {after:?}");
                    let next = (remaining > 0).then(|| first + remaining.min(limit) - 1);
                    assert_eq!(page.next, next.or(after), "after {after:?}");
                }
            }
        }
        for cache in &caches {
            assert_eq!(
                cache.updates(&store, &key, Some(&uid), Some(head + 1)).await.unwrap(),
                Lookup::Gone(Some(head))
            );
        }
    }

    #[tokio::test]
    async fn an_updates_page_takes_no_further_batch_once_its_chunks_pass_the_page_bytes() {
        let store = MemoryStore::new();
        let (key, uid) = create(&store, "edited").await;
        let at = |body| record("sub_0", body);
        let big = "x".repeat(PAGE_BYTES / 4);
        append(
            &store,
            &key,
            vec![at(RecordBody::UserMessage {
                message_id: "user_0".into(),
                body: big.clone(),
                attachments: Vec::new(),
            })],
        )
        .await;
        // Each edit resets the conversation: its chunk carries the whole (big) snapshot.
        for edit in 0..12 {
            let mut updates = serde_json::Map::new();
            updates.insert("content".into(), json!(format!("{big}{edit}")));
            append(
                &store,
                &key,
                vec![at(RecordBody::MessageUpdated {
                    message_id: "user_0".into(),
                    updates,
                })],
            )
            .await;
        }
        let head = store.read(&key, None).await.unwrap().last().unwrap().offset;
        // Served from a window, and folded afresh (no caching).
        for cache in [new_cache(8, usize::MAX), new_cache(0, usize::MAX)] {
            let (mut after, mut pages) = (None, 0);
            loop {
                let page = read(&cache, &store, &key, &uid, after).await;
                assert_eq!(
                    page.body(&uid),
                    from_scratch(&store, &key, &uid, after).await,
                    "after {after:?}"
                );
                let bytes: usize = page.chunks.iter().map(Bytes::len).sum();
                let last = page.chunks.last().map_or(0, Bytes::len);
                assert!(
                    bytes - last < PAGE_BYTES,
                    "a page takes no batch after its chunks reach {PAGE_BYTES} bytes: {bytes}"
                );
                pages += 1;
                if page.up_to_date {
                    assert_eq!(page.next, Some(head));
                    break;
                }
                assert!(page.next > after, "every page moves on");
                after = page.next;
            }
            assert!(
                pages >= 3,
                "13 batches of a MiB or more take several pages, not {pages}"
            );
        }
    }

    /// A batch larger than the window's bytes (an edit's reset of a long conversation) stays
    /// in the window as its newest: a reader at the previous head reads it from there, without
    /// folding the stream from the start. One past [`NEWEST_KEPT`] times the window is not
    /// kept (the window's memory stays bounded).
    #[tokio::test]
    async fn a_batch_larger_than_the_window_is_kept_as_its_newest_within_a_bound() {
        let store = MemoryStore::new();
        let (key, uid, mut head) = conversation(&store, "large", 3).await;
        let cache = windowed_cache(8, usize::MAX, 8, 4096);
        read(&cache, &store, &key, &uid, None).await;
        // The second large batch comes while the first is still in the window: the newest
        // batch's own size counts, not the window's.
        for (size, kept) in [(12 * 1024, true), (12 * 1024, true), (64 * 1024, false)] {
            read(&cache, &store, &key, &uid, Some(head)).await;
            let folded = cache.folded();
            let mut updates = serde_json::Map::new();
            updates.insert("content".into(), json!("x".repeat(size)));
            append(
                &store,
                &key,
                vec![record(
                    "sub_0",
                    RecordBody::MessageUpdated {
                        message_id: "user_0".into(),
                        updates,
                    },
                )],
            )
            .await;
            let page = read(&cache, &store, &key, &uid, Some(head)).await;
            assert_eq!(page.body(&uid), from_scratch(&store, &key, &uid, Some(head)).await);
            let refolded = cache.folded() - folded;
            if kept {
                assert_eq!(refolded, 1, "only the new batch was folded");
            } else {
                assert!(refolded > 1, "a batch past the bound left the window: {refolded}");
            }
            head = page.next.unwrap();
        }
    }

    #[tokio::test]
    async fn an_evicted_or_reincarnated_instance_is_folded_afresh_and_answers_the_same() {
        let store = MemoryStore::new();
        let (first, first_uid) = create(&store, "first").await;
        let (second, second_uid) = create(&store, "second").await;
        for batch in exchange(0) {
            append(&store, &first, batch.clone()).await;
        }
        for batch in exchange(1) {
            append(&store, &second, batch).await;
        }
        let length = |key| {
            let store = &store;
            async move { store.read(key, None).await.unwrap().len() as u64 }
        };
        let (first_length, second_length) = (length(&first).await, length(&second).await);
        let cache = new_cache(1, usize::MAX);
        read(&cache, &store, &first, &first_uid, None).await;
        read(&cache, &store, &second, &second_uid, None).await;
        assert_eq!(cache.folded(), first_length + second_length);
        // One instance fits: the second evicted the first, which is folded again.
        let page = read(&cache, &store, &first, &first_uid, Some(2)).await;
        assert_eq!(cache.folded(), 2 * first_length + second_length);
        assert_eq!(
            page.body(&first_uid),
            from_scratch(&store, &first, &first_uid, Some(2)).await
        );

        // The instance deleted and created again (here: the same key in another store), with
        // a shorter stream: the entry of the old incarnation answers nothing.
        let recreated = MemoryStore::new();
        let (key, uid) = create(&recreated, "first").await;
        assert_eq!(key, first);
        assert_ne!(uid, first_uid);
        append(&recreated, &key, exchange(5).remove(0)).await;
        let folded = cache.folded();
        let page = read(&cache, &recreated, &key, &uid, None).await;
        assert_eq!(cache.folded(), folded + 2, "the new incarnation's two batches");
        assert_eq!(page.body(&uid), from_scratch(&recreated, &key, &uid, None).await);
        assert_eq!(
            cache.updates(&recreated, &key, Some(&uid), Some(3)).await.unwrap(),
            Lookup::Gone(Some(1)),
            "the old incarnation's head is gone with it"
        );

        // A cache of no instance folds every read from the start.
        let uncached = new_cache(0, usize::MAX);
        read(&uncached, &store, &second, &second_uid, Some(1)).await;
        read(&uncached, &store, &second, &second_uid, Some(1)).await;
        assert_eq!(uncached.folded(), 2 * second_length);
        assert_eq!(
            uncached
                .updates(&store, &InstanceKey::new("agent", "none"), None, None)
                .await
                .unwrap(),
            Lookup::Missing
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_reads_while_batches_are_appended_answer_what_a_fold_through_their_next_offset_answers() {
        let store = MemoryStore::new();
        let (key, uid) = create(&store, "busy").await;
        let cache = Arc::new(windowed_cache(4, usize::MAX, 16, usize::MAX));
        // The offsets the readers start after exist before they read (a read past the head
        // is answered `Gone`, which is not what this test is about).
        for batch in exchange(0) {
            append(&store, &key, batch).await;
        }
        let head = store.read(&key, None).await.unwrap().last().unwrap().offset;
        assert!(head >= 3, "{head}");
        let writer = {
            let (store, key) = (store.clone(), key.clone());
            tokio::spawn(async move {
                for n in 1..12 {
                    for batch in exchange(n) {
                        append(&store, &key, batch).await;
                        tokio::task::yield_now().await;
                    }
                }
            })
        };
        let readers: Vec<_> = (0..4u64)
            .map(|reader| {
                let (store, key, uid, cache) = (store.clone(), key.clone(), uid.clone(), Arc::clone(&cache));
                tokio::spawn(async move {
                    // Each reader follows the stream from its own start, now and then rereading
                    // an offset further back.
                    let mut answers = Vec::new();
                    let mut after = reader.checked_sub(1);
                    for round in 0..200u64 {
                        let asked = if round % 7 == 0 {
                            after.map(|after| after / 2)
                        } else {
                            after
                        };
                        let page = read(&cache, &store, &key, &uid, asked).await;
                        answers.push((asked, page.next, page.body(&uid)));
                        if asked == after {
                            after = page.next;
                        }
                        tokio::task::yield_now().await;
                    }
                    answers
                })
            })
            .collect();
        writer.await.unwrap();
        let mut checked = 0;
        for reader in readers {
            for (after, next, body) in reader.await.unwrap() {
                let through = next.or(after).unwrap_or(0);
                let expected = from_scratch_through(&store, &key, &uid, after, through).await;
                assert_eq!(body, expected, "after {after:?}, next {next:?}");
                checked += 1;
            }
        }
        assert_eq!(checked, 4 * 200);
    }

    /// A read that folds the stream takes room for its fold from the router's room for
    /// readers' folds: with none left it fails `Busy` before it reads a batch (filling an
    /// entry, folding afresh before the window, or folding to the head for a history), and it
    /// is served once the room is let go. A read the entry's window answers takes none, and
    /// what a read held is let go once it is answered.
    #[tokio::test]
    async fn reads_that_fold_the_stream_take_room_for_it_and_without_room_fold_nothing() {
        let store = MemoryStore::new();
        let (key, uid, head) = conversation(&store, "roomy", 4).await;
        let room = FoldRoom::new(1024 * 1024);
        let cache = UpdatesCache::with_window(8, usize::MAX, room.clone(), 4, usize::MAX);
        let uncached = UpdatesCache::new(0, usize::MAX, room.clone());
        // Another reader holds all of it.
        let mut other = None;
        assert!(room.hold(&mut other, usize::MAX));
        fn busy<T: std::fmt::Debug>(result: Result<T, ReadFailure>, what: &str) {
            assert!(matches!(result, Err(ReadFailure::Busy)), "{what}: {result:?}");
        }
        busy(
            cache.updates(&store, &key, Some(&uid), Some(head - 1)).await,
            "filling the entry",
        );
        busy(cache.history(&store, &key, Some(&uid)).await, "a history");
        busy(
            uncached.updates(&store, &key, Some(&uid), Some(1)).await,
            "folding afresh",
        );
        busy(uncached.updates(&store, &key, Some(&uid), None).await, "from the start");
        assert_eq!((cache.folded(), uncached.folded()), (0, 0), "no batch folded");
        drop(other);
        let page = read(&cache, &store, &key, &uid, Some(head - 1)).await;
        assert_eq!(page.body(&uid), from_scratch(&store, &key, &uid, Some(head - 1)).await);
        assert_eq!(
            read(&uncached, &store, &key, &uid, Some(1)).await.body(&uid),
            from_scratch(&store, &key, &uid, Some(1)).await
        );
        // Nothing is held once the reads are answered: all of the room is there again.
        let mut all = None;
        assert!(room.hold(&mut all, usize::MAX), "the reads let their room go");
        // The entry's window answers without room; a read before it folds, and finds none.
        let folded = cache.folded();
        let again = read(&cache, &store, &key, &uid, Some(head - 1)).await;
        assert_eq!(again, page);
        assert_eq!(cache.folded(), folded);
        // (The entry's window starts at the offset of the read that filled it.)
        busy(
            cache.updates(&store, &key, Some(&uid), Some(head - 2)).await,
            "before the window",
        );
        assert_eq!(cache.folded(), folded);
    }
}
