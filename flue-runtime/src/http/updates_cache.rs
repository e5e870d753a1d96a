//! What `view=updates` reads (JSON and long-poll) answer, kept per instance so a read costs
//! what is new after the last one, not a fold of the whole stream.
//!
//! Batches are append-only and a batch projects against the fold of the batches before it,
//! so once projected its chunks never change. An instance's entry keeps the fold through the
//! newest batch any read saw and the serialized chunks of the newest batches (a window bounded
//! in batches and bytes). A read after an offset inside the window reads from the store only
//! the batches after the entry's fold, folds them in and answers with the window's chunks; a
//! read before the window (or of an instance the cache does not hold) folds the whole stream,
//! as without the cache.
//!
//! The entries are few (least recently read evicted first) and tied to the incarnation they
//! folded: a read that finds another incarnation folds from the start again. No lock is held
//! while the store is read, so readers of one instance do not wait for each other's reads,
//! and a long-poll read waits for new batches outside the cache.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use axum::body::Bytes;
use serde_json::Value;

use super::projection::{Projection, checkpoint};
use crate::record::Batch;
use crate::store::{InstanceKey, Store, StoreError};

/// The most batches one updates response covers.
pub(super) const BATCHES_PER_READ: usize = 100;

/// How many of the newest batches' chunks an entry keeps.
const WINDOW_BATCHES: usize = 1024;

/// The most serialized chunk bytes an entry keeps (the newest batches' first).
const WINDOW_BYTES: usize = 2 * 1024 * 1024;

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
        for (projected, (offset, chunks)) in self.window.range(start..).enumerate() {
            if projected == BATCHES_PER_READ {
                page.up_to_date = false;
                break;
            }
            if !chunks.is_empty() {
                page.chunks.push(chunks.clone());
            }
            page.next = Some(*offset);
        }
        Some(page)
    }
}

/// The least recently read entries, by instance.
#[derive(Default)]
struct Entries {
    /// Instance → (when last read, its entry). An entry is `None` until a read fills it.
    map: HashMap<InstanceKey, (u64, Arc<tokio::sync::Mutex<Option<Entry>>>)>,
    /// The read count, which orders the entries.
    clock: u64,
}

/// The per-instance cache of updates reads of one router.
pub(super) struct UpdatesCache {
    /// The most instances held (0: no caching).
    capacity: usize,
    window_batches: usize,
    window_bytes: usize,
    entries: Mutex<Entries>,
    /// How many batches reads folded, cached or not (what the tests count).
    folded: AtomicU64,
}

impl UpdatesCache {
    /// A cache of at most `capacity` instances (0 caches nothing).
    pub(super) fn new(capacity: usize) -> Self {
        Self::with_window(capacity, WINDOW_BATCHES, WINDOW_BYTES)
    }

    /// A cache whose entries keep the chunks of at most `batches` batches and `bytes` bytes.
    fn with_window(capacity: usize, batches: usize, bytes: usize) -> Self {
        Self {
            capacity,
            window_batches: batches,
            window_bytes: bytes,
            entries: Mutex::default(),
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
    fn slot(&self, key: &InstanceKey) -> Arc<tokio::sync::Mutex<Option<Entry>>> {
        let mut entries = self.entries.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        entries.clock += 1;
        let now = entries.clock;
        if let Some((read, slot)) = entries.map.get_mut(key) {
            *read = now;
            return Arc::clone(slot);
        }
        if entries.map.len() >= self.capacity
            && let Some(oldest) = entries
                .map
                .iter()
                .min_by_key(|(_, (read, _))| *read)
                .map(|(key, _)| key.clone())
        {
            entries.map.remove(&oldest);
        }
        let slot = Arc::default();
        entries.map.insert(key.clone(), (now, Arc::clone(&slot)));
        slot
    }

    /// The updates of `key` after `after`. `incarnation` is the instance's, read before
    /// (`None` when the store has no such instance: nothing is cached then).
    pub(super) async fn updates(
        &self,
        store: &dyn Store,
        key: &InstanceKey,
        incarnation: Option<&str>,
        after: Option<u64>,
    ) -> Result<Lookup, StoreError> {
        let Some(incarnation) = incarnation.filter(|_| self.capacity > 0) else {
            return self.fresh(store, key, after).await;
        };
        let slot = self.slot(key);
        let folded = slot
            .lock()
            .await
            .as_ref()
            .filter(|entry| entry.incarnation == incarnation)
            .map(|entry| entry.offset);
        let Some(folded) = folded else {
            return self.fill(store, key, incarnation, &slot, after).await;
        };
        let batches = store.read(key, folded).await?;
        {
            let mut guard = slot.lock().await;
            // Another read may have filled it again meanwhile, with another incarnation.
            if let Some(entry) = guard.as_mut().filter(|entry| entry.incarnation == incarnation) {
                let folded = entry.offset;
                self.extend(entry, batches.iter().filter(|batch| Some(batch.offset) > folded));
                if after > entry.offset {
                    return Ok(Lookup::Gone(entry.offset));
                }
                if let Some(page) = entry.page(after) {
                    return Ok(Lookup::Page(page));
                }
            }
        }
        // Before the window.
        self.fresh(store, key, after).await
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
            while entry.window.len() > self.window_batches || entry.bytes > self.window_bytes {
                let Some((offset, chunks)) = entry.window.pop_front() else {
                    break;
                };
                entry.bytes -= chunks.len();
                entry.base = Some(offset);
            }
        }
    }

    /// A read that finds no entry of `incarnation`: the whole stream is read, and folded into
    /// a new entry when the read falls within what the entry's window will hold.
    async fn fill(
        &self,
        store: &dyn Store,
        key: &InstanceKey,
        incarnation: &str,
        slot: &tokio::sync::Mutex<Option<Entry>>,
        after: Option<u64>,
    ) -> Result<Lookup, StoreError> {
        let batches = store.read(key, None).await?;
        let Some(head) = batches.last().map(|batch| batch.offset) else {
            return Ok(Lookup::Missing);
        };
        if after > Some(head) {
            return Ok(Lookup::Gone(Some(head)));
        }
        // The first batch the window would hold (counting only the batch bound: the byte bound
        // may keep fewer, and then the read is answered afresh).
        let start = batches.len().saturating_sub(self.window_batches);
        let base = start.checked_sub(1).and_then(|last| batches.get(last)).map(|batch| batch.offset);
        if after < base {
            return Ok(Lookup::Page(self.project(key, &batches, after)));
        }
        let mut entry = Entry::new(key, incarnation);
        for batch in &batches[..start] {
            entry.projection.apply(batch, None);
            self.folded.fetch_add(1, Ordering::Relaxed);
        }
        entry.offset = base;
        entry.base = base;
        self.extend(&mut entry, batches[start..].iter());
        let page = entry.page(after);
        {
            let mut guard = slot.lock().await;
            // The entry folded furthest stays, unless it is another incarnation's.
            let keep = guard
                .as_ref()
                .is_some_and(|held| held.incarnation == incarnation && held.offset > entry.offset);
            if !keep {
                *guard = Some(entry);
            }
        }
        Ok(Lookup::Page(match page {
            Some(page) => page,
            None => self.project(key, &batches, after),
        }))
    }

    /// A read that the cache does not serve: the whole stream read and folded.
    async fn fresh(&self, store: &dyn Store, key: &InstanceKey, after: Option<u64>) -> Result<Lookup, StoreError> {
        let batches = store.read(key, None).await?;
        let Some(head) = batches.last().map(|batch| batch.offset) else {
            return Ok(Lookup::Missing);
        };
        if after > Some(head) {
            return Ok(Lookup::Gone(Some(head)));
        }
        Ok(Lookup::Page(self.project(key, &batches, after)))
    }

    /// Folds `batches` up to `after` from the start and projects up to [`BATCHES_PER_READ`]
    /// after it.
    fn project(&self, key: &InstanceKey, batches: &[Batch], after: Option<u64>) -> Page {
        let mut projection = Projection::new(&key.stream_path());
        let mut page = Page {
            chunks: Vec::new(),
            next: after,
            up_to_date: true,
        };
        let mut projected = 0;
        for batch in batches {
            if after.is_some_and(|after| batch.offset <= after) {
                projection.apply(batch, None);
                self.folded.fetch_add(1, Ordering::Relaxed);
                continue;
            }
            if projected == BATCHES_PER_READ {
                page.up_to_date = false;
                break;
            }
            let mut chunks = Vec::new();
            projection.apply(batch, Some(&mut chunks));
            self.folded.fetch_add(1, Ordering::Relaxed);
            let chunks = serialize(chunks);
            if !chunks.is_empty() {
                page.chunks.push(chunks);
            }
            page.next = Some(batch.offset);
            projected += 1;
        }
        page
    }
}
