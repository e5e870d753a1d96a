//! Serving a router's connections ([`serve`]) with what a public server needs beyond the
//! router: a deadline on each request head and a cap on open connections.

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
/// wait in its backlog. Errors accepting a connection are logged and retried (a process out
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
    let head_timeout = options.request_head_timeout;
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
            let connection = builder.serve_connection(TokioIo::new(stream), service);
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
