//! Notices between the nodes sharing one Postgres store ([`Store::notices`]): a node announces
//! the settlements, abort requests and submissions given back to the queue it commits, and
//! hears the other nodes' announcements,
//! over Postgres's `LISTEN`/`NOTIFY` on one dedicated connection per store.
//!
//! Announcements are hints, sent after the change they announce committed: a node that misses
//! one (its connection was down, its receiver fell behind) still finds the change at its next
//! look (a waiting send's poll, the heartbeat's look for abort requests), and after a
//! reconnection it is told to look at everything again ([`StoreNotice::Resync`]).
//!
//! They go out on the listening connection, not in the transaction that made the change:
//! Postgres serializes the commits of every transaction that notifies (on one lock, held until
//! the commit is flushed), which would put every settlement of every node in one line. The
//! listening connection notifies in transactions of their own with `synchronous_commit` off, so
//! the lock is held only for as long as the queue append takes, and a slow announcement never
//! holds up a settlement. A node's queue of announcements is bounded: past it, announcements are
//! dropped. An announcement dropped (the queue full, the server refusing it, the connection lost
//! while it was sent) is made up for by a [`StoreNotice::Resync`] with the next ones that go
//! out (at once after a reconnection): the others look at everything again, rather than wait
//! for their own looks to find the changes.
//!
//! Each payload names the schema of the store that sent it (several stores may share one
//! database in schemas of their own); a node keeps only its own schema's notices, and not its
//! own announcements (two runtimes of one process that share one store value hear each other
//! only through their looks).
//!
//! A connection that went silent without closing (a failover without a reset, a NAT that
//! forgot it) is found by TCP keepalives and a ping every [`PING_EVERY`], and made again.
//!
//! The listening connection is a session of its own: behind a pooler in transaction mode
//! (PgBouncer's `pool_mode = transaction`) `LISTEN` does not hold, and the nodes then learn of
//! each other's changes only through their looks.
//!
//! [`Store::notices`]: crate::store::Store::notices

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::sync::{broadcast, mpsc};
use tokio_postgres::{AsyncMessage, NoTls};

use super::super::{InstanceKey, StoreNotice};

/// The channel every store's notices travel on (payloads name their schema).
const CHANNEL: &str = "flue_notices";

/// How many announcements may wait for the listening connection; past it they are dropped.
const OUTBOX: usize = 1024;

/// How long a flush of the announcements (a node about to exit) waits at most.
pub(super) const FLUSH_WITHIN: Duration = Duration::from_secs(2);

/// How many waiting announcements go out in one transaction at most.
const BATCH: usize = 64;

/// How many notices a slow receiver may fall behind by before it is told to resync.
const RECEIVED: usize = 1024;

/// Postgres refuses a payload of 8,000 bytes or more; a notice too long to send whole (an
/// instance id that long) is sent as a [`StoreNotice::Resync`].
const MAX_PAYLOAD: usize = 7_900;

/// The first wait before connecting again after the listening connection failed (doubling up
/// to [`RECONNECT_MAX`]).
const RECONNECT_MIN: Duration = Duration::from_millis(100);
const RECONNECT_MAX: Duration = Duration::from_secs(10);

/// How often the listening connection is asked whether it is still there, and how long any
/// statement on it may take before it is taken for lost.
const PING_EVERY: Duration = Duration::from_secs(30);
const STATEMENT_TIMEOUT: Duration = Duration::from_secs(10);

/// A notice as it travels.
#[derive(Debug, Serialize, Deserialize, PartialEq)]
struct Payload {
    schema: String,
    notice: Kind,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    agent: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    id: Option<String>,
}

#[derive(Debug, Serialize, Deserialize, PartialEq, Clone, Copy)]
#[serde(rename_all = "snake_case")]
enum Kind {
    Settled,
    Abort,
    Queued,
    Resync,
}

impl Payload {
    fn of(schema: &str, notice: &StoreNotice) -> String {
        let (kind, key) = match notice {
            StoreNotice::Settled(key) => (Kind::Settled, Some(key)),
            StoreNotice::AbortRequested(key) => (Kind::Abort, Some(key)),
            StoreNotice::Queued(key) => (Kind::Queued, Some(key)),
            StoreNotice::Resync => (Kind::Resync, None),
        };
        let payload = |kind, key: Option<&InstanceKey>| {
            serde_json::to_string(&Payload {
                schema: schema.to_owned(),
                notice: kind,
                agent: key.map(|key| key.agent.to_string()),
                id: key.map(|key| key.id.to_string()),
            })
            .unwrap_or_default()
        };
        let whole = payload(kind, key);
        if whole.len() <= MAX_PAYLOAD {
            whole
        } else {
            payload(Kind::Resync, None)
        }
    }

    /// The notice `text` carries for a store in `schema`: `None` for another schema's, or for
    /// text that is not a notice.
    fn read(text: &str, schema: &str) -> Option<StoreNotice> {
        let payload: Payload = serde_json::from_str(text).ok()?;
        if payload.schema != schema {
            return None;
        }
        let key = || Some(InstanceKey::new(payload.agent.clone()?, payload.id.clone()?));
        match payload.notice {
            Kind::Settled => key().map(StoreNotice::Settled),
            Kind::Abort => key().map(StoreNotice::AbortRequested),
            Kind::Queued => key().map(StoreNotice::Queued),
            Kind::Resync => Some(StoreNotice::Resync),
        }
    }
}

/// A store's end of the notices (its clones share it): started by its first use, stopped when
/// the last clone of the store goes.
pub(super) struct Notices {
    config: tokio_postgres::Config,
    received: broadcast::Sender<StoreNotice>,
    listening: Mutex<Option<Listening>>,
    /// An announcement was dropped since the last that went out: a resync is owed.
    dropped: Arc<AtomicBool>,
}

/// What the listening task is asked to send.
enum Outgoing {
    Notice(StoreNotice),
    /// Answered once everything queued before it was sent (`true`) or could not be (`false`;
    /// not answered at all when the connection was lost meanwhile).
    Flush(tokio::sync::oneshot::Sender<bool>),
}

/// The listening task and the queue of announcements it sends.
struct Listening {
    outbox: mpsc::Sender<Outgoing>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Notices {
    fn drop(&mut self) {
        if let Some(listening) = self.listening.get_mut().unwrap_or_else(|e| e.into_inner()).take() {
            listening.task.abort();
        }
    }
}

impl Notices {
    pub(super) fn new(mut config: tokio_postgres::Config) -> Arc<Self> {
        config
            .keepalives(true)
            .keepalives_idle(PING_EVERY)
            .keepalives_interval(STATEMENT_TIMEOUT)
            .keepalives_retries(3);
        Arc::new(Self {
            config,
            received: broadcast::channel(RECEIVED).0,
            listening: Mutex::new(None),
            dropped: Arc::default(),
        })
    }

    /// The other nodes' notices from now on (see [`crate::store::Store::notices`]); `None`
    /// outside a tokio runtime.
    pub(super) fn subscribe(&self) -> Option<broadcast::Receiver<StoreNotice>> {
        let receiver = self.received.subscribe();
        self.with_listening(|_| ()).map(|()| receiver)
    }

    /// Announces `notice` to the other nodes, once what it announces committed. Never waits:
    /// when the queue is full (the listening connection is down), it is dropped.
    pub(super) fn announce(&self, notice: StoreNotice) {
        let sent = self.with_listening(|listening| listening.outbox.try_send(Outgoing::Notice(notice)).is_ok());
        if sent == Some(false) && !self.dropped.swap(true, Ordering::AcqRel) {
            tracing::warn!(
                "postgres notices: the queue of announcements is full; dropping them until it drains (the other nodes are then told to look at everything again)"
            );
        }
    }

    /// Waits (at most `within`) until the announcements queued so far went out: what a
    /// process about to exit does last.
    pub(super) async fn flush(&self, within: Duration) {
        let (done, sent) = tokio::sync::oneshot::channel();
        let queued = self
            .listening
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .filter(|listening| !listening.task.is_finished())
            .map(|listening| listening.outbox.clone());
        let Some(outbox) = queued else { return };
        let flushed = async { outbox.send(Outgoing::Flush(done)).await.is_ok() && sent.await == Ok(true) };
        match tokio::time::timeout(within, flushed).await {
            Ok(true) => {}
            Ok(false) => tracing::warn!(
                "postgres notices: the last announcements could not be sent; the other nodes' looks find those changes"
            ),
            Err(_) => tracing::warn!(
                "postgres notices: announcements still queued after {within:?}; the other nodes' looks find those changes"
            ),
        }
    }

    /// Runs `f` on the listening task, started first unless it runs (again, when the tokio
    /// runtime that ran it shut down); `None` outside a tokio runtime.
    fn with_listening<T>(&self, f: impl FnOnce(&Listening) -> T) -> Option<T> {
        let mut listening = self.listening.lock().unwrap_or_else(|e| e.into_inner());
        if listening.as_ref().is_none_or(|listening| listening.task.is_finished()) {
            let runtime = tokio::runtime::Handle::try_current().ok()?;
            let (outbox, announcements) = mpsc::channel(OUTBOX);
            let task = runtime.spawn(listen(
                self.config.clone(),
                self.received.clone(),
                announcements,
                self.dropped.clone(),
            ));
            *listening = Some(Listening { outbox, task });
        }
        listening.as_ref().map(f)
    }
}

/// The listening task: connects, listens, forwards notices and sends announcements; connects
/// again (after a growing pause) when the connection fails.
async fn listen(
    config: tokio_postgres::Config,
    received: broadcast::Sender<StoreNotice>,
    mut announcements: mpsc::Receiver<Outgoing>,
    dropped: Arc<AtomicBool>,
) {
    let mut pause = RECONNECT_MIN;
    loop {
        let mut listened = None;
        match listen_once(&config, &received, &mut announcements, &dropped, &mut listened).await {
            Ok(Ended::Stopped) => return,
            Ok(Ended::Lost) => {
                tracing::warn!("postgres notices: the listening connection closed; connecting again");
            }
            Err(error) => {
                tracing::warn!(%error, "postgres notices: the listening connection failed; connecting again");
            }
        }
        // A connection that stayed up a while starts the pauses over; one lost soon after it
        // listened (a server that ends idle sessions, say) makes them grow.
        if listened.is_some_and(|at: tokio::time::Instant| at.elapsed() >= PING_EVERY) {
            pause = RECONNECT_MIN;
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(RECONNECT_MAX);
    }
}

enum Ended {
    /// The store is gone (no more announcements can come).
    Stopped,
    /// The connection closed.
    Lost,
}

/// Why the listening connection is taken for lost.
#[derive(Debug, thiserror::Error)]
enum Lost {
    #[error(transparent)]
    Db(#[from] tokio_postgres::Error),
    #[error("a statement took more than {STATEMENT_TIMEOUT:?}")]
    Silent,
}

/// Runs `statement` on the listening connection, given up after [`STATEMENT_TIMEOUT`].
async fn timed<T>(statement: impl Future<Output = Result<T, tokio_postgres::Error>>) -> Result<T, Lost> {
    Ok(tokio::time::timeout(STATEMENT_TIMEOUT, statement)
        .await
        .map_err(|_| Lost::Silent)??)
}

async fn listen_once(
    config: &tokio_postgres::Config,
    received: &broadcast::Sender<StoreNotice>,
    announcements: &mut mpsc::Receiver<Outgoing>,
    dropped: &AtomicBool,
    listened: &mut Option<tokio::time::Instant>,
) -> Result<Ended, Lost> {
    let (client, mut connection) = timed(config.connect(NoTls)).await?;
    // The connection's driver, forwarding what the server sends on its own (with the sending
    // session's process id); it ends with the connection (when `client` is dropped, or the
    // server goes).
    let (forward, mut notifications) = mpsc::unbounded_channel::<(i32, String)>();
    let mut driver = tokio::spawn(async move {
        loop {
            match std::future::poll_fn(|cx| connection.poll_message(cx)).await {
                Some(Ok(AsyncMessage::Notification(notification))) => {
                    let sent = (notification.process_id(), notification.payload().to_owned());
                    if forward.send(sent).is_err() {
                        return Ok(());
                    }
                }
                Some(Ok(_)) => {}
                Some(Err(error)) => return Err(error),
                None => return Ok(()),
            }
        }
    });
    let _driver = AbortOnDrop(driver.abort_handle());
    let identity = timed(client.query_one(
        "SELECT current_schema()::TEXT, pg_backend_pid(), current_setting('server_version_num')::INT",
        &[],
    ))
    .await?;
    let schema: String = identity.try_get::<_, Option<String>>(0)?.unwrap_or_default();
    let own: i32 = identity.try_get(1)?;
    // A server that ends idle sessions (`idle_session_timeout`, from Postgres 14) would end
    // this one between notices, and every node would resync each time.
    let keep = if identity.try_get::<_, i32>(2)? >= 140_000 {
        "SET idle_session_timeout = 0;"
    } else {
        ""
    };
    // Once it listens, the session is named after its schema among the database's sessions
    // (`pg_stat_activity`), as `flue notices <schema>` (cut to Postgres's 63 bytes).
    timed(client.batch_execute(&format!(
        "SET synchronous_commit = off; {keep} LISTEN {CHANNEL}; \
         SELECT set_config('application_name', 'flue notices ' || COALESCE(current_schema(), ''), false)"
    )))
    .await?;
    // The announcements waiting go out in one transaction (one statement): under load, one
    // transaction id for many.
    let notify = timed(client.prepare(&format!(
        "SELECT pg_notify('{CHANNEL}', payload) FROM unnest($1::TEXT[]) AS payload"
    )))
    .await?;
    *listened = Some(tokio::time::Instant::now());
    // Whatever was announced while no connection listened is looked at again.
    let _ = received.send(StoreNotice::Resync);
    // And what this node could not announce meanwhile, by the others.
    let resync = Payload::of(&schema, &StoreNotice::Resync);
    if dropped.swap(false, Ordering::AcqRel) {
        send_or_owe(&client, &notify, std::slice::from_ref(&resync), dropped).await?;
    }
    let mut ping = tokio::time::interval_at(tokio::time::Instant::now() + PING_EVERY, PING_EVERY);
    loop {
        tokio::select! {
            sent = notifications.recv() => match sent {
                Some((from, payload)) => {
                    if from != own
                        && let Some(notice) = Payload::read(&payload, &schema)
                    {
                        let _ = received.send(notice);
                    }
                }
                None => return Ok(Ended::Lost),
            },
            announcement = announcements.recv() => {
                let (mut payloads, mut flushes) = (Vec::new(), Vec::new());
                let mut next = announcement;
                loop {
                    match next {
                        Some(Outgoing::Notice(notice)) => {
                            let payload = Payload::of(&schema, &notice);
                            // Postgres sends one of identical notices of a transaction anyway.
                            if !payloads.contains(&payload) {
                                payloads.push(payload);
                            }
                        }
                        Some(Outgoing::Flush(done)) => flushes.push(done),
                        None if payloads.is_empty() && flushes.is_empty() => return Ok(Ended::Stopped),
                        None => break,
                    }
                    if payloads.len() >= BATCH {
                        break;
                    }
                    next = match announcements.try_recv() {
                        Ok(outgoing) => Some(outgoing),
                        Err(_) => break,
                    };
                }
                // A resync owed for announcements dropped before these goes out with them.
                if dropped.swap(false, Ordering::AcqRel) && !payloads.contains(&resync) {
                    payloads.push(resync.clone());
                }
                let sent = payloads.is_empty() || send_or_owe(&client, &notify, &payloads, dropped).await?;
                for done in flushes {
                    let _ = done.send(sent);
                }
            }
            _ = ping.tick() => {
                timed(client.batch_execute("SELECT 1")).await?;
            }
            ended = &mut driver => {
                return match ended {
                    Ok(Err(error)) => Err(error.into()),
                    _ => Ok(Ended::Lost),
                };
            }
        }
    }
}

/// Sends `payloads`: `false` when the server refused them (its notify queue full, say) and the
/// connection is sound; they are dropped, and a resync is owed. A connection lost meanwhile
/// owes one too, sent once connected again.
async fn send_or_owe(
    client: &tokio_postgres::Client,
    notify: &tokio_postgres::Statement,
    payloads: &[String],
    dropped: &AtomicBool,
) -> Result<bool, Lost> {
    match timed(client.execute(notify, &[&payloads])).await {
        Ok(_) => Ok(true),
        Err(Lost::Db(error)) if error.as_db_error().is_some() => {
            tracing::warn!(%error, "postgres notices: announcements refused; dropped (a resync is owed)");
            dropped.store(true, Ordering::Release);
            Ok(false)
        }
        Err(lost) => {
            dropped.store(true, Ordering::Release);
            Err(lost)
        }
    }
}

struct AbortOnDrop(tokio::task::AbortHandle);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_notice_travels_as_its_schema_and_key_and_is_kept_only_by_its_own_schema() {
        let key = InstanceKey::new("assistant", "a-1");
        for notice in [
            StoreNotice::Settled(key.clone()),
            StoreNotice::AbortRequested(key.clone()),
            StoreNotice::Queued(key.clone()),
            StoreNotice::Resync,
        ] {
            let text = Payload::of("tenant_a", &notice);
            assert_eq!(Payload::read(&text, "tenant_a"), Some(notice.clone()), "{text}");
            assert_eq!(Payload::read(&text, "tenant_b"), None, "{text}");
        }
    }

    #[test]
    fn a_notice_too_long_for_postgres_travels_as_a_resync() {
        let key = InstanceKey::new("assistant", "x".repeat(MAX_PAYLOAD));
        let text = Payload::of("public", &StoreNotice::Settled(key));
        assert!(text.len() < 8_000);
        assert_eq!(Payload::read(&text, "public"), Some(StoreNotice::Resync));
    }

    #[test]
    fn text_that_is_not_a_whole_notice_is_ignored() {
        for text in [
            "",
            "not json",
            r#"{"schema":"public","notice":"settled"}"#,
            r#"{"schema":"public","notice":"settled","agent":"a"}"#,
            r#"{"schema":"public","notice":"explode","agent":"a","id":"b"}"#,
            r#"{"notice":"resync"}"#,
        ] {
            assert_eq!(Payload::read(text, "public"), None, "{text}");
        }
    }
}
