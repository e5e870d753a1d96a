//! The read side of the protocol: the history snapshot, updates as JSON, long-poll and SSE,
//! `HEAD`, and attachments.

use std::convert::Infallible;
use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::rejection::PathRejection;
use axum::extract::{Path, RawQuery, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use futures_util::StreamExt;
use serde_json::json;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

use super::error::ApiError;
use super::feed::{Delivery, Feed};
use super::projection::{Projection, READ_PAGE, batch_weight, checkpoint};
use super::updates_cache::{Lookup, Page, ReadFailure, UpdatesCache, page_is_full};
use super::{HttpOptions, Routes};
use crate::record::{Batch, format_offset};
use crate::runtime::RuntimeInner;
use crate::session::InstanceSlot;
use crate::store::{InstanceKey, Store, StoreError};

/// The size past which an SSE reader gets its chunks in more than one data frame (one chunk is
/// never split: a message at the request body limit is one frame that large, which a client
/// of this crate reads by default).
const FRAME_BYTES: usize = 1024 * 1024;

/// SSE data frames of serialized chunks, in order: a frame is closed before it would pass
/// [`FRAME_BYTES`] (a frame of many big chunks would pass what a client may buffer for one
/// event, and it could never get past it), one chunk alone being as large as it is.
#[derive(Default)]
pub(super) struct DataFrames {
    frames: String,
    frame: String,
}

impl DataFrames {
    /// Adds one serialized chunk (or several, already joined with commas).
    pub(super) fn push(&mut self, chunk: &str) {
        if !self.frame.is_empty() && self.frame.len() + chunk.len() > FRAME_BYTES {
            self.close();
        }
        if !self.frame.is_empty() {
            self.frame.push(',');
        }
        self.frame.push_str(chunk);
    }

    fn close(&mut self) {
        self.frames.push_str("event: data\ndata:[");
        self.frames.push_str(&self.frame);
        self.frames.push_str("]\n\n");
        self.frame.clear();
    }

    /// The frames (empty when no chunk was pushed).
    pub(super) fn finish(mut self) -> String {
        if !self.frame.is_empty() {
            self.close();
        }
        self.frames
    }
}

/// The query's pairs, decoded, in order.
pub(super) fn pairs(query: Option<&str>) -> impl Iterator<Item = (String, String)> + '_ {
    form_urlencoded::parse(query.unwrap_or_default().as_bytes())
        .map(|(name, value)| (name.into_owned(), value.into_owned()))
}

/// A well-formed `offset` parameter.
#[derive(Debug, PartialEq, Eq)]
enum Offset {
    /// After this batch (`None`: before the first).
    After(Option<u64>),
    /// Numerically beyond any batch a stream can have (too large for a `u64`).
    Beyond,
}

/// `-1` (before the first batch) or `<digits>_<digits>` (compared by its second part).
fn parse_offset(text: &str) -> Option<Offset> {
    if text == "-1" {
        return Some(Offset::After(None));
    }
    let (epoch, sequence) = text.split_once('_')?;
    let digits = |part: &str| !part.is_empty() && part.bytes().all(|byte| byte.is_ascii_digit());
    if !digits(epoch) || !digits(sequence) {
        return None;
    }
    // Only digits: the one way to fail is to overflow, which is past every head.
    Some(match sequence.parse() {
        Ok(sequence) => Offset::After(Some(sequence)),
        Err(_) => Offset::Beyond,
    })
}

/// How a `GET /:id` reads.
enum Read {
    History,
    Updates {
        offset: Offset,
        /// The `offset` parameter as given, which a 416 quotes back.
        requested: String,
        live: Live,
    },
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Live {
    No,
    LongPoll,
    Sse,
}

/// The query rules of `GET /:id`, in the protocol's order.
fn read_of(query: Option<&str>) -> Result<Read, ApiError> {
    let (mut view, mut offsets, mut live, mut tail) = (None, Vec::new(), None, false);
    for (name, value) in pairs(query) {
        // Given twice, a parameter has no one meaning (the first? the last?): refused, as
        // two offsets are. Stricter than the reference, which requires `offset` once and
        // reads the first of the others.
        let once = |slot: &mut Option<String>, value: String| match slot.replace(value) {
            None => Ok(()),
            Some(_) => Err(ApiError::invalid_request(format!(
                "The `{name}` parameter is given more than once."
            ))),
        };
        match name.as_str() {
            "view" => once(&mut view, value)?,
            "offset" => offsets.push(value),
            "live" => once(&mut live, value)?,
            "tail" => tail = true,
            _ => {}
        }
    }
    match view.as_deref().unwrap_or("history") {
        "history" => {
            if !offsets.is_empty() || live.is_some() || tail {
                return Err(ApiError::invalid_request(
                    "view=history takes no offset, tail or live parameter; read updates with view=updates.",
                ));
            }
            Ok(Read::History)
        }
        "updates" => {
            if tail {
                return Err(ApiError::invalid_request("The `tail` parameter is not supported."));
            }
            let [offset_text] = offsets.as_slice() else {
                return Err(ApiError::invalid_request(
                    "view=updates needs exactly one `offset` parameter (-1 to read from the start).",
                ));
            };
            let offset = parse_offset(offset_text).ok_or_else(|| {
                ApiError::invalid_request(format!(
                    "Offset \"{offset_text}\" is malformed: use -1 or an offset the stream returned."
                ))
            })?;
            let live = match live.as_deref() {
                None => Live::No,
                Some("long-poll") => Live::LongPoll,
                Some("sse") => Live::Sse,
                Some(other) => {
                    return Err(ApiError::invalid_request(format!(
                        "live=\"{other}\" is not supported: use long-poll or sse."
                    )));
                }
            };
            Ok(Read::Updates {
                offset,
                requested: offset_text.clone(),
                live,
            })
        }
        other => Err(ApiError::invalid_request(format!(
            "view=\"{other}\" is not supported: use history or updates."
        ))),
    }
}

/// Room for the folds and pages reads make themselves (SSE readers catching up on their own,
/// reads the updates cache does not serve, the read filling an entry), in bytes
/// ([`HttpOptions::max_reader_fold_bytes`]).
#[derive(Clone)]
pub(super) struct FoldRoom {
    room: Arc<Semaphore>,
    whole: u32,
}

impl FoldRoom {
    pub(super) fn new(bytes: usize) -> Self {
        // At most what a semaphore holds (less than 512 MiB on a 32-bit target).
        let whole = u32::try_from(bytes.min(Semaphore::MAX_PERMITS))
            .unwrap_or(u32::MAX)
            .max(1);
        Self {
            room: Arc::new(Semaphore::new(whole as usize)),
            whole,
        }
    }

    /// Makes `held` hold room for `bytes` (never more than the whole room, so a reader that
    /// fits alone is served once the others are done): false when there is not that much left.
    pub(super) fn hold(&self, held: &mut Option<OwnedSemaphorePermit>, bytes: usize) -> bool {
        let wanted = u32::try_from(bytes).unwrap_or(u32::MAX).min(self.whole);
        let have = held
            .as_ref()
            .map_or(0, |held| u32::try_from(held.num_permits()).unwrap_or(u32::MAX));
        if wanted <= have {
            return true;
        }
        match self.room.clone().try_acquire_many_owned(wanted - have) {
            Ok(more) => {
                match held {
                    Some(held) => held.merge(more),
                    None => *held = Some(more),
                }
                true
            }
            Err(_) => false,
        }
    }
}

impl FoldRoom {
    /// Makes `held` hold room for `bytes` as [`Self::hold`] does, and gives back what it held
    /// beyond that (a live feed that took over a reader's room, which counted the page it had
    /// just sent too; a fold a reset made smaller): false when there is not that much left.
    pub(super) fn fit(&self, held: &mut Option<OwnedSemaphorePermit>, bytes: usize) -> bool {
        if !self.hold(held, bytes) {
            return false;
        }
        let wanted = usize::try_from(u32::try_from(bytes).unwrap_or(u32::MAX).min(self.whole)).unwrap_or(usize::MAX);
        if let Some(permit) = held
            && permit.num_permits() > wanted
        {
            drop(permit.split(permit.num_permits() - wanted));
        }
        true
    }
}

/// The bytes a reader holding `own` and `pending` is counted for.
fn reader_bytes(own: Option<&Projection>, pending: &[Batch]) -> usize {
    own.map_or(0, Projection::weight) + pending.iter().map(batch_weight).sum::<usize>()
}

/// A catching-up reader's next page after `after`, and whether the stream holds more (one
/// batch more is read to tell: a reader whose last page ends at the head learns it is up to
/// date with that page, not after a read that finds nothing).
async fn next_page(store: &dyn Store, key: &InstanceKey, after: Option<u64>) -> Result<(Vec<Batch>, bool), StoreError> {
    let mut page = store.read_page(key, after, READ_PAGE + 1).await?;
    let more = page.len() > READ_PAGE;
    page.truncate(READ_PAGE);
    Ok((page, more))
}

fn no_store(mut response: Response, next_offset: &str, up_to_date: bool) -> Response {
    let headers = response.headers_mut();
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    if let Ok(offset) = HeaderValue::from_str(next_offset) {
        headers.insert("stream-next-offset", offset);
    }
    if up_to_date {
        headers.insert("stream-up-to-date", HeaderValue::from_static("true"));
    }
    response
}

/// The incarnation (`uid`) of the instance `key`, if it exists. An instance is created with
/// its stream, so a stream found after the instance was not is one created meanwhile: its
/// instance is read again, and a read never goes on with a stream but no incarnation (an
/// empty one in its checkpoint, kept by a live reader for the life of its stream).
async fn incarnation_of(routes: &Routes, key: &InstanceKey) -> Result<Option<String>, ApiError> {
    let store = routes.runtime.store.as_ref();
    let uid = |instance: Option<crate::store::InstanceInfo>| instance.map(|instance| instance.uid);
    let incarnation = uid(store.instance(key).await.map_err(|error| ApiError::internal(&error))?);
    if incarnation.is_some()
        || store
            .last_offset(key)
            .await
            .map_err(|error| ApiError::internal(&error))?
            .is_none()
    {
        return Ok(incarnation);
    }
    Ok(uid(store
        .instance(key)
        .await
        .map_err(|error| ApiError::internal(&error))?))
}

/// `GET /:id`.
pub(super) async fn get_stream(
    State(routes): State<Routes>,
    id: super::InstanceId,
    RawQuery(query): RawQuery,
) -> Result<Response, ApiError> {
    let key = routes.read_key(id)?;
    let read = read_of(query.as_deref())?;
    let incarnation = incarnation_of(&routes, &key).await?;
    // No instance when the read starts: no stream to read. (One an admission creates
    // meanwhile is the next read's: going on, this one could serve its stream with no
    // incarnation, which a live reader would keep for the life of its stream.)
    if incarnation.is_none() {
        return Err(ApiError::stream_not_found(&key.stream_path()));
    }
    match read {
        Read::History => {
            let (snapshot, offset) = routes
                .updates
                .history(routes.runtime.store.as_ref(), &key, incarnation.as_deref())
                .await?
                .ok_or_else(|| ApiError::stream_not_found(&key.stream_path()))?;
            Ok(no_store(axum::Json(snapshot).into_response(), &offset, true))
        }
        Read::Updates {
            offset,
            requested,
            live,
        } => {
            let after = match offset {
                Offset::After(after) => after,
                // Past any head: the lookup answers 416 with the head.
                Offset::Beyond => Some(u64::MAX),
            };
            if live == Live::Sse {
                // Near the head, the cached window answers the catch-up (filled now when no
                // entry is held); further back the reader folds the stream itself.
                let cached = routes
                    .updates
                    .filled(routes.runtime.store.as_ref(), &key, incarnation.as_deref(), after)
                    .await?;
                match cached {
                    Some(Lookup::Page(page)) => {
                        return Ok(sse(
                            routes,
                            key,
                            incarnation.unwrap_or_default(),
                            Catch::Page(page),
                            after,
                        ));
                    }
                    Some(Lookup::Gone(head)) => {
                        return Err(ApiError::stream_offset_gone(
                            &requested,
                            &wire_offset(head),
                            incarnation.as_deref(),
                        ));
                    }
                    Some(Lookup::Missing) | None => {}
                }
                let store = routes.runtime.store.as_ref();
                let internal = |error: StoreError| ApiError::internal(&error);
                let Some(head) = store.last_offset(&key).await.map_err(internal)? else {
                    return Err(ApiError::stream_not_found(&key.stream_path()));
                };
                if after > Some(head) {
                    // The offset as the client wrote it (`5_9` stays `5_9`).
                    return Err(ApiError::stream_offset_gone(
                        &requested,
                        &wire_offset(Some(head)),
                        incarnation.as_deref(),
                    ));
                }
                // Room first, as the fold grows: a reader refused for want of it (retrying
                // while the room is full) costs no fold of the stream, nor memory beyond it.
                let mut room = None;
                if !routes.folds.hold(&mut room, 1) {
                    return Err(ApiError::readers_busy());
                }
                let mut projection = Projection::new(&key.stream_path());
                if let Some(after) = after {
                    let folds = &routes.folds;
                    let (_, fits) = projection
                        .fold_stream_within(store, &key, after, |bytes| folds.hold(&mut room, bytes))
                        .await
                        .map_err(internal)?;
                    if !fits {
                        return Err(ApiError::readers_busy());
                    }
                }
                let (pending, more) = next_page(store, &key, after).await.map_err(internal)?;
                if !routes.folds.hold(&mut room, reader_bytes(Some(&projection), &pending)) {
                    return Err(ApiError::readers_busy());
                }
                return Ok(sse(
                    routes,
                    key,
                    incarnation.unwrap_or_default(),
                    Catch::Fold {
                        projection: Box::new(projection),
                        pending,
                        more,
                        room,
                    },
                    after,
                ));
            }
            updates(
                &routes,
                &key,
                incarnation.as_deref(),
                after,
                &requested,
                live == Live::LongPoll,
            )
            .await
        }
    }
}

fn wire_offset(offset: Option<u64>) -> String {
    offset.map_or_else(|| "-1".to_owned(), format_offset)
}

/// Updates as a JSON array (checkpoint first); with `long_poll`, a read that finds no batch
/// waits for new batches first. Batches that project to no chunk still answer at once (just
/// the checkpoint, with the moved `Stream-Next-Offset`): waiting on would find them again and
/// again until the deadline.
async fn updates(
    routes: &Routes,
    key: &InstanceKey,
    incarnation: Option<&str>,
    after: Option<u64>,
    requested: &str,
    long_poll: bool,
) -> Result<Response, ApiError> {
    let (runtime, options) = (&routes.runtime, &routes.options);
    let deadline = Instant::now() + options.long_poll_timeout;
    // Taken once the instance is known to exist (a read of a missing one takes none).
    let mut slot = None;
    loop {
        let lookup = routes
            .updates
            .updates(runtime.store.as_ref(), key, incarnation, after)
            .await?;
        let page = match lookup {
            Lookup::Page(page) => page,
            Lookup::Missing => return Err(ApiError::stream_not_found(&key.stream_path())),
            // The offset as the client wrote it (`5_9` stays `5_9`).
            Lookup::Gone(head) => {
                return Err(ApiError::stream_offset_gone(requested, &wire_offset(head), incarnation));
            }
        };
        if page.next != after || !long_poll || Instant::now() >= deadline || runtime.is_closed() {
            let mut response = page.body(incarnation.unwrap_or_default()).into_response();
            response
                .headers_mut()
                .insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
            return Ok(no_store(response, &wire_offset(page.next), page.up_to_date));
        }
        let slot = slot.get_or_insert_with(|| runtime.slot(key));
        wait_for_batches(runtime, slot, key, after, deadline, options).await?;
    }
}

/// Waits until the stream has batches after `after` (or `deadline`).
async fn wait_for_batches(
    runtime: &RuntimeInner,
    slot: &InstanceSlot,
    key: &InstanceKey,
    after: Option<u64>,
    deadline: Instant,
    options: &HttpOptions,
) -> Result<(), ApiError> {
    loop {
        // Registered before reading, so an append between the read and the wait wakes it.
        let appended = slot.appended().notified();
        tokio::pin!(appended);
        appended.as_mut().enable();
        // One batch tells whether there is anything new.
        let newer = runtime
            .store
            .read_page(key, after, 1)
            .await
            .map_err(|error| ApiError::internal(&error))?;
        if !newer.is_empty() || Instant::now() >= deadline || runtime.is_closed() {
            return Ok(());
        }
        let wait = if runtime.store.shared() {
            options.shared_store_poll.min(deadline - Instant::now())
        } else {
            deadline - Instant::now()
        };
        // A runtime shutting down answers the poll now (the caller sees it closed).
        tokio::select! {
            _ = tokio::time::timeout(wait, appended) => {}
            () = runtime.closed() => {}
        }
    }
}

/// One SSE frame.
fn frame(event: &str, data: &str) -> String {
    format!("event: {event}\ndata:{data}\n\n")
}

/// The state of one SSE response.
struct SseStream {
    runtime: Arc<RuntimeInner>,
    options: Arc<HttpOptions>,
    key: InstanceKey,
    slot: Arc<InstanceSlot>,
    /// The instance's shared feed, which serves this reader once it has caught up.
    feed: Arc<Feed>,
    /// The router's updates cache, whose window serves a reader near the head.
    updates: Arc<UpdatesCache>,
    /// This reader's own fold, while it catches up (dropped once the feed serves it).
    own: Option<Projection>,
    /// The router's room for readers' own folds, and what this reader holds of it (for its
    /// fold and its pending page).
    folds: FoldRoom,
    room: Option<OwnedSemaphorePermit>,
    incarnation: String,
    /// Batches read but not yet sent (catching up with its own fold): one page of the store.
    pending: Vec<Batch>,
    /// Whether the store may hold batches after `pending` (its page was full): the next page
    /// is read once `pending` is sent.
    more: bool,
    /// A page of the updates cache's window not yet sent (catching up from the cache).
    page: Option<Page>,
    offset: Option<u64>,
    started: bool,
    /// When the last frames were sent (heartbeats count from it).
    last_sent: Instant,
    /// When the last control frame was sent (keep-alive controls count from it; heartbeats do
    /// not move it); `None` before the first.
    last_control: Option<Instant>,
}

impl SseStream {
    /// `result`'s value, or `None` (which ends the response) with its error logged: the
    /// client reconnects from its last offset, and the server's log says why it had to.
    fn logged<T, E: Into<ReadFailure>>(&self, result: Result<T, E>) -> Option<T> {
        result
            .map_err(|error| match error.into() {
                ReadFailure::Store(error) => {
                    tracing::warn!(instance = %self.key, %error, "an SSE stream ended: reading the store failed");
                }
                ReadFailure::Busy => self.warn_busy(),
            })
            .ok()
    }

    fn warn_busy(&self) {
        tracing::warn!(instance = %self.key, "an SSE stream ended: readers' folds and live feeds hold all the room max_reader_fold_bytes gives");
    }

    /// Holds room for this reader's own fold and pending page, or lets it go once it has
    /// neither; false (its response ends: the client reconnects from its last offset) when the
    /// router has not that much left.
    fn hold_room(&mut self) -> bool {
        if self.own.is_none() && self.pending.is_empty() {
            self.room = None;
            return true;
        }
        let bytes = reader_bytes(self.own.as_ref(), &self.pending);
        if self.folds.hold(&mut self.room, bytes) {
            return true;
        }
        self.warn_busy();
        false
    }

    /// The next frames to send; `None` ends the response (the store failed: the client
    /// reconnects from its last offset). The feed's frames are its own shared bytes: a
    /// thousand readers woken by one append send one copy of its frames, not a thousand.
    async fn next(&mut self) -> Option<Vec<Bytes>> {
        if !self.started {
            self.started = true;
            self.last_sent = Instant::now();
            return Some(vec![
                frame("data", &json!([checkpoint(&self.incarnation)]).to_string()).into(),
            ]);
        }
        loop {
            if let Some(page) = self.page.take() {
                return Some(vec![self.send_page(page).into()]);
            }
            if self.pending.is_empty() && self.more {
                let page = next_page(self.runtime.store.as_ref(), &self.key, self.offset).await;
                (self.pending, self.more) = self.logged(page)?;
                if !self.hold_room() {
                    return None;
                }
            }
            if !self.pending.is_empty() {
                return Some(vec![self.catch_up().into()]);
            }
            // Registered before looking, so an append after the look wakes the wait (on a
            // handle of its own: the frames sent below update this reader's state).
            let slot = Arc::clone(&self.slot);
            let appended = slot.appended().notified();
            tokio::pin!(appended);
            appended.as_mut().enable();
            let appends = self.slot.appends();
            let poll = self.options.shared_store_poll;
            let cache = (&*self.updates, self.incarnation.as_str());
            let room = (&self.folds, &mut self.room);
            let delivery = self
                .feed
                .after(&self.runtime, self.offset, appends, poll, cache, room)
                .await;
            match self.logged(delivery)? {
                Delivery::Frames(frames, offset) if !frames.is_empty() || offset != self.offset => {
                    self.own = None;
                    self.room = None;
                    self.offset = offset;
                    let mut out = frames;
                    out.push(self.control(true).into());
                    return Some(out);
                }
                Delivery::Frames(..) => {
                    // Served by the feed from here on.
                    self.own = None;
                    self.room = None;
                    // Every read cycle ends with a control frame: a reader that connects at the
                    // head learns at once that it is up to date.
                    let Some(last_control) = self.last_control else {
                        return Some(vec![self.control(true).into()]);
                    };
                    let heartbeat = self.last_sent + self.options.heartbeat;
                    let keep_alive = last_control + self.options.sse_wait;
                    let mut wake = heartbeat.min(keep_alive);
                    if self.runtime.store.shared() {
                        wake = wake.min(Instant::now() + self.options.shared_store_poll);
                    }
                    if tokio::time::timeout_at(wake, appended).await.is_err() {
                        let now = Instant::now();
                        if now >= keep_alive {
                            return Some(vec![self.control(true).into()]);
                        }
                        if now >= heartbeat {
                            self.last_sent = now;
                            return Some(vec![Bytes::from_static(b": heartbeat\n\n")]);
                        }
                    }
                }
                Delivery::Behind => {
                    // The cache's window first: a reader a few batches behind reads them
                    // without folding the stream.
                    if self.own.is_none()
                        && let Some(Lookup::Page(page)) = self.logged(
                            self.updates
                                .cached(
                                    self.runtime.store.as_ref(),
                                    &self.key,
                                    Some(&self.incarnation),
                                    self.offset,
                                )
                                .await,
                        )?
                    {
                        self.page = Some(page);
                        continue;
                    }
                    let store = self.runtime.store.as_ref();
                    if self.own.is_none() {
                        // Far behind the feed: fold the stream up to this reader's offset again,
                        // within the room.
                        let mut own = Projection::new(&self.key.stream_path());
                        if let Some(offset) = self.offset {
                            let (folds, room) = (&self.folds, &mut self.room);
                            let folded = own
                                .fold_stream_within(store, &self.key, offset, |bytes| folds.hold(room, bytes))
                                .await;
                            if !self.logged(folded)?.1 {
                                self.warn_busy();
                                return None;
                            }
                        }
                        self.own = Some(own);
                    }
                    (self.pending, self.more) = self.logged(next_page(store, &self.key, self.offset).await)?;
                    if !self.hold_room() {
                        return None;
                    }
                }
            }
        }
    }

    /// Sends the next batches this reader reads itself, with its own fold: their chunks in
    /// one data frame, split before a frame passes [`FRAME_BYTES`] (a frame of many big
    /// batches would pass what a client may buffer for one event, and it could never get past
    /// it).
    fn catch_up(&mut self) -> String {
        let own = self.own.get_or_insert_with(|| Projection::new(&self.key.stream_path()));
        // As many batches as an updates page takes (by count and by bytes: a reset carries
        // the whole snapshot); the rest wait for the next round.
        let (mut taken, mut bytes) = (0, 0);
        let mut serialized = Vec::new();
        while taken < self.pending.len() && !page_is_full(taken, bytes) {
            let batch = &self.pending[taken];
            let mut chunks = Vec::new();
            own.apply(batch, Some(&mut chunks));
            for chunk in chunks {
                let chunk = chunk.to_string();
                bytes += chunk.len();
                serialized.push(chunk);
            }
            self.offset = Some(batch.offset);
            taken += 1;
        }
        self.pending.drain(..taken);
        let mut frames = DataFrames::default();
        for chunk in &serialized {
            frames.push(chunk);
        }
        let mut frames = frames.finish();
        let up_to_date = self.pending.is_empty() && !self.more;
        frames.push_str(&self.control(up_to_date));
        frames
    }

    /// Sends a page of the cache's window: its batches' chunks in data frames (split between
    /// batches before a frame passes [`FRAME_BYTES`]; the window keeps no batch of more than
    /// a fraction of one).
    fn send_page(&mut self, page: Page) -> String {
        let mut frames = DataFrames::default();
        for chunks in &page.chunks {
            frames.push(std::str::from_utf8(chunks).unwrap_or_default());
        }
        let mut frames = frames.finish();
        self.offset = page.next;
        frames.push_str(&self.control(page.up_to_date));
        frames
    }

    /// The control frame at this reader's offset; the frames it ends are sent now.
    fn control(&mut self, up_to_date: bool) -> String {
        let now = Instant::now();
        (self.last_sent, self.last_control) = (now, Some(now));
        let mut control = json!({"streamNextOffset": wire_offset(self.offset)});
        if up_to_date {
            control["upToDate"] = json!(true);
        }
        frame("control", &control.to_string())
    }
}

/// Where an SSE reader starts catching up from.
enum Catch {
    /// The updates cache's page after its offset.
    Page(Page),
    /// The reader's own fold through its offset, the first page after it, and whether the
    /// stream may hold more.
    Fold {
        projection: Box<Projection>,
        pending: Vec<Batch>,
        more: bool,
        /// The room they hold.
        room: Option<OwnedSemaphorePermit>,
    },
}

/// `live=sse`: checkpoint, then data and control frames for ever.
fn sse(routes: Routes, key: InstanceKey, incarnation: String, catch: Catch, after: Option<u64>) -> Response {
    let (own, pending, more, page, room) = match catch {
        Catch::Page(page) => (None, Vec::new(), false, Some(page), None),
        Catch::Fold {
            projection,
            pending,
            more,
            room,
        } => (Some(*projection), pending, more, None, room),
    };
    let state = SseStream {
        updates: routes.updates.clone(),
        page,
        slot: routes.runtime.slot(&key),
        feed: routes.feeds.of(&key),
        runtime: routes.runtime,
        options: routes.options,
        key,
        own,
        folds: routes.folds,
        room,
        incarnation,
        pending,
        more,
        offset: after,
        started: false,
        last_sent: Instant::now(),
        last_control: None,
    };
    let closed = state.runtime.closed();
    let body = futures_util::stream::unfold(state, |mut state| async move {
        let frames = state.next().await?;
        // (An empty chunk would say nothing; it is left out.)
        let frames = frames.into_iter().filter(|frame| !frame.is_empty());
        Some((futures_util::stream::iter(frames.map(Ok::<_, Infallible>)), state))
    })
    .flatten()
    // A runtime shutting down ends the stream (the client reconnects from its last offset).
    .take_until(closed);
    let mut response = Response::new(Body::from_stream(body));
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    response
}

/// `HEAD /:id`: the head offset; errors without a body.
pub(super) async fn head_stream(State(routes): State<Routes>, id: super::InstanceId) -> Response {
    let result = async {
        let key = routes.read_key(id)?;
        // The head alone: the stream is not read.
        match routes.runtime.store.last_offset(&key).await {
            Ok(Some(last)) => Ok(last),
            Ok(None) => Err(ApiError::stream_not_found(&key.stream_path())),
            Err(error) => Err(ApiError::internal(&error)),
        }
    }
    .await;
    match result {
        Ok(last) => {
            let head = wire_offset(Some(last));
            let mut response = StatusCode::OK.into_response();
            response
                .headers_mut()
                .insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
            no_store(response, &head, true)
        }
        Err(error) => error.without_body(),
    }
}

/// The attachment route's parameters, taken by name (see [`super::InstancePath`]).
#[derive(serde::Deserialize)]
pub(super) struct AttachmentPath {
    id: String,
    attachment_id: String,
}

/// `GET /:id/attachments/:attachmentId`.
pub(super) async fn get_attachment(
    State(routes): State<Routes>,
    path: Result<Path<AttachmentPath>, PathRejection>,
) -> Result<Response, ApiError> {
    let Path(AttachmentPath { id, attachment_id }) =
        path.map_err(|rejection| ApiError::invalid_request(rejection.body_text()))?;
    // As the reference, this route does not refuse a blank id; an id admission refuses has no
    // instance (and is not sent to the store, which may not take it), and an attachment id
    // breaking the same rule is none the store made.
    let valid_id = flue_core::message::is_blank(&id) || crate::runtime::check_instance_id(&id).is_ok();
    let key = InstanceKey::new(routes.agent.clone(), id);
    let store = &routes.runtime.store;
    if !valid_id
        || store
            .instance(&key)
            .await
            .map_err(|error| ApiError::internal(&error))?
            .is_none()
    {
        return Err(ApiError::stream_not_found(&key.stream_path()));
    }
    if crate::runtime::check_instance_id(&attachment_id).is_err() {
        return Err(ApiError::attachment_not_found(&attachment_id));
    }
    let attachment = store
        .attachment(&key, &attachment_id)
        .await
        .map_err(|error| match error {
            crate::store::StoreError::AttachmentIntegrity { id, reason, detail } => {
                tracing::error!(instance = %key, attachment = %id, %detail, "a stored attachment failed its integrity check");
                ApiError::attachment_integrity(&id, reason)
            }
            error => ApiError::internal(&error),
        })?
        .ok_or_else(|| ApiError::attachment_not_found(&attachment_id))?;
    // An image is served as itself, inline; anything else an older build admitted is served
    // as bytes to download, never as a document a browser would render.
    let image = flue_core::message::is_image_type(&attachment.media_type);
    let (media_type, disposition) = match HeaderValue::from_str(&attachment.media_type) {
        Ok(media_type) if image => (media_type, "inline"),
        _ => (HeaderValue::from_static("application/octet-stream"), "attachment"),
    };
    let mut headers = HeaderMap::new();
    headers.insert(header::CONTENT_TYPE, media_type);
    headers.insert(header::CONTENT_LENGTH, HeaderValue::from(attachment.bytes.len()));
    headers.insert(header::CONTENT_DISPOSITION, HeaderValue::from_static(disposition));
    headers.insert(
        header::CACHE_CONTROL,
        HeaderValue::from_static("private, max-age=31536000, immutable"),
    );
    headers.insert(header::CONTENT_SECURITY_POLICY, HeaderValue::from_static("sandbox"));
    Ok((StatusCode::OK, headers, attachment.bytes).into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `fit` holds exactly what is asked: more taken from the room, or what was held beyond it
    /// given back (a live feed keeps no room for the page its reader had just sent).
    #[test]
    fn a_fitted_hold_gives_back_what_it_held_beyond_what_is_asked() {
        let room = FoldRoom::new(100);
        let mut held = None;
        assert!(room.hold(&mut held, 80));
        assert!(room.fit(&mut held, 30));
        assert_eq!(held.as_ref().map(OwnedSemaphorePermit::num_permits), Some(30));
        assert_eq!(room.room.available_permits(), 70);
        assert!(room.fit(&mut held, 50));
        assert_eq!(room.room.available_permits(), 50);
        // More than the whole room: all of it, as `hold`.
        assert!(room.fit(&mut held, 151));
        assert_eq!(room.room.available_permits(), 0);
        drop(held);
        assert_eq!(room.room.available_permits(), 100);
    }

    #[test]
    fn offsets_parse_as_the_protocol_writes_them_and_nothing_else() {
        assert_eq!(parse_offset("-1"), Some(Offset::After(None)));
        assert_eq!(
            parse_offset("0000000000000000_0000000000000007"),
            Some(Offset::After(Some(7)))
        );
        assert_eq!(
            parse_offset("0_12"),
            Some(Offset::After(Some(12))),
            "no fixed width is required"
        );
        assert_eq!(
            parse_offset("0_99999999999999999999"),
            Some(Offset::Beyond),
            "well formed, past any head"
        );
        for malformed in ["", "7", "_7", "7_", "a_1", "1_b", "-2", "1_2_3", "now"] {
            assert_eq!(parse_offset(malformed), None, "{malformed:?}");
        }
    }
}
