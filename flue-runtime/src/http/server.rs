//! Serving a router's connections ([`serve`]) with what a public server needs beyond the
//! router: a deadline on each request head, a deadline on each stalled write of a response,
//! and a cap on open connections.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::{Semaphore, watch};

use super::HttpOptions;

/// Serves `router` on `listener` until `shutdown` completes, then lets the open connections
/// finish their responses (each is told to close after the one in flight) and returns once
/// they have. HTTP/1.1.
///
/// A connection must send each request's head within
/// [`request_head_timeout`](HttpOptions::request_head_timeout) (also the longest it may stay
/// idle between requests), and at most [`max_connections`](HttpOptions::max_connections) are
/// served at once; past that the listener is not read until one closes, so further clients
/// wait in its backlog. A connection whose client takes none of a response's bytes for
/// [`response_write_timeout`](HttpOptions::response_write_timeout) (a reader that stopped
/// reading a live stream) is closed, and what its response held is freed. Errors accepting a connection are logged and retried (a process out
/// of file descriptors pauses a little first): they never end the server.
///
/// Live reads never end on their own: call [`Runtime::shutdown`](crate::Runtime::shutdown)
/// in `shutdown` (as [`crate::cli::serve`] does), or this waits for them.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    options: &HttpOptions,
    shutdown: impl Future<Output = ()> + Send,
) -> std::io::Result<()> {
    // Bounded: hyper adds it to the current instant, which a duration near `Duration::MAX`
    // overflows (a panic at every request's head).
    let head_timeout = options.request_head_timeout.min(HttpOptions::LONGEST_WAIT);
    let write_timeout = options.response_write_timeout;
    // At least one; `usize::MAX` (more than a semaphore counts) caps nothing.
    let permits = Arc::new(Semaphore::new(options.max_connections.clamp(1, Semaphore::MAX_PERMITS)));
    // Dropped to tell every connection to close after its response; each holds a receiver of
    // `closed`, whose sender learns when the last is gone.
    let (closing, closing_seen) = watch::channel(());
    let (closed, connections) = watch::channel(());
    tokio::pin!(shutdown);
    loop {
        let permit = tokio::select! {
            permit = Arc::clone(&permits).acquire_owned() => match permit {
                Ok(permit) => permit,
                Err(_) => break,
            },
            () = &mut shutdown => break,
        };
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(error) => {
                    if !is_connection_error(&error) {
                        tracing::warn!(%error, "accepting a connection failed");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        // Frames of a live read go out as written.
        let _ = stream.set_nodelay(true);
        let service = TowerToHyperService::new(router.clone());
        let mut closing = closing_seen.clone();
        let connections = connections.clone();
        tokio::spawn(async move {
            let mut builder = hyper::server::conn::http1::Builder::new();
            builder.timer(TokioTimer::new()).header_read_timeout(head_timeout);
            let connection = builder.serve_connection(TokioIo::new(StallLimit::new(stream, write_timeout)), service);
            tokio::pin!(connection);
            let served = tokio::select! {
                served = connection.as_mut() => served,
                _ = closing.changed() => {
                    connection.as_mut().graceful_shutdown();
                    connection.await
                }
            };
            if let Err(error) = served {
                tracing::debug!(%peer, %error, "a connection ended with an error");
            }
            drop(connections);
            drop(permit);
        });
    }
    drop(listener);
    drop(closing);
    drop(connections);
    closed.closed().await;
    Ok(())
}

/// Errors of one connection (it went away before it was accepted), after which accepting
/// the next goes on at once.
fn is_connection_error(error: &std::io::Error) -> bool {
    matches!(
        error.kind(),
        std::io::ErrorKind::ConnectionRefused
            | std::io::ErrorKind::ConnectionAborted
            | std::io::ErrorKind::ConnectionReset
    )
}

/// A connection's stream whose writes fail ([`std::io::ErrorKind::TimedOut`]) once one has
/// waited `limit` without the peer taking any byte: a client that stops reading (its receive
/// window closed) would otherwise hold its response, a live stream's buffers included, for as
/// long as it keeps the connection open, and a graceful shutdown would wait for it for ever.
/// Any progress starts the wait over, so a slow reader is served in its own time.
struct StallLimit<S> {
    stream: S,
    limit: Duration,
    /// Since when a write has waited, when one is waiting.
    stalled: Option<std::pin::Pin<Box<tokio::time::Sleep>>>,
}

impl<S> StallLimit<S> {
    fn new(stream: S, limit: Duration) -> Self {
        Self {
            stream,
            limit,
            stalled: None,
        }
    }

    /// What a write (or flush) that returned `poll` means: progress forgets the wait; a wait
    /// is timed from its first `Pending`, and fails once it lasted `limit`.
    fn timed<T>(
        &mut self,
        cx: &mut std::task::Context<'_>,
        poll: std::task::Poll<std::io::Result<T>>,
    ) -> std::task::Poll<std::io::Result<T>> {
        use std::task::Poll;
        if poll.is_ready() {
            self.stalled = None;
            return poll;
        }
        let limit = self.limit;
        let stalled = self.stalled.get_or_insert_with(|| Box::pin(tokio::time::sleep(limit)));
        match stalled.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "the client took none of the response for too long",
            ))),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl<S: tokio::io::AsyncRead + Unpin> tokio::io::AsyncRead for StallLimit<S> {
    fn poll_read(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.get_mut().stream).poll_read(cx, buf)
    }
}

impl<S: tokio::io::AsyncWrite + Unpin> tokio::io::AsyncWrite for StallLimit<S> {
    fn poll_write(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        let this = self.get_mut();
        let poll = std::pin::Pin::new(&mut this.stream).poll_write(cx, buf);
        this.timed(cx, poll)
    }

    fn poll_write_vectored(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> std::task::Poll<std::io::Result<usize>> {
        let this = self.get_mut();
        let poll = std::pin::Pin::new(&mut this.stream).poll_write_vectored(cx, bufs);
        this.timed(cx, poll)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let this = self.get_mut();
        let poll = std::pin::Pin::new(&mut this.stream).poll_flush(cx);
        this.timed(cx, poll)
    }

    fn poll_shutdown(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let this = self.get_mut();
        let poll = std::pin::Pin::new(&mut this.stream).poll_shutdown(cx);
        this.timed(cx, poll)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A peer that takes nothing: the write waiting on it fails once it waited the limit, not
    /// before; a peer that takes some bytes now and then is served however long it takes.
    #[tokio::test(start_paused = true)]
    async fn a_write_the_peer_takes_nothing_of_fails_after_the_limit_and_progress_restarts_it() {
        let (ours, mut theirs) = tokio::io::duplex(64);
        let mut limited = StallLimit::new(ours, Duration::from_secs(60));
        limited.write_all(&[0; 64]).await.expect("fits the buffer");
        let started = tokio::time::Instant::now();
        let mut taken = [0; 16];
        // A slow reader: 16 bytes every 50 s, for 200 s in all.
        let reader = tokio::spawn(async move {
            for _ in 0..4 {
                tokio::time::sleep(Duration::from_secs(50)).await;
                theirs.read_exact(&mut taken).await.expect("reads");
            }
            theirs
        });
        limited
            .write_all(&[1; 64])
            .await
            .expect("the slow reader keeps it going");
        assert!(started.elapsed() >= Duration::from_secs(200));
        let theirs = reader.await.expect("the reader");
        // Now nobody reads: the buffer is full, and the next write waits until the limit.
        let waiting = tokio::time::Instant::now();
        let error = limited.write_all(&[2; 64]).await.expect_err("timed out");
        assert_eq!(error.kind(), std::io::ErrorKind::TimedOut);
        assert_eq!(waiting.elapsed(), Duration::from_secs(60));
        drop(theirs);
    }
}
