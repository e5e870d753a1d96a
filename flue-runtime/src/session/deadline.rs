//! The live deadline of an attempt, without a task of its own.
//!
//! [`Deadline`] wraps the attempt's response future together with a timer. When the timer
//! fires it aborts the attempt's signal with the timeout's reason and keeps polling the
//! response, which then unwinds through its own abort path (cancelling the model stream,
//! running tools, a retry delay) and settles. Sharing the response's task saves a spawn, a
//! cross-thread wake-up and a cancellation per attempt over a watchdog task.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use flue_core::abort::AbortSignal;
use tokio::time::{Instant, Sleep};

pin_project_lite::pin_project! {
    /// `inner`, with `signal` aborted for `reason` once `at` passes.
    pub(crate) struct Deadline<F> {
        #[pin]
        inner: F,
        #[pin]
        timer: Sleep,
        fired: bool,
        signal: AbortSignal,
        reason: &'static str,
    }
}

impl<F: Future> Deadline<F> {
    pub(crate) fn new(inner: F, at: std::time::Instant, signal: AbortSignal, reason: &'static str) -> Self {
        Self {
            inner,
            timer: tokio::time::sleep_until(Instant::from_std(at)),
            fired: false,
            signal,
            reason,
        }
    }
}

impl<F: Future> Future for Deadline<F> {
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let this = self.project();
        if !*this.fired && this.timer.poll(cx).is_ready() {
            *this.fired = true;
            // The first reason wins: an abort requested earlier stays the reason.
            this.signal.abort(*this.reason);
        }
        this.inner.poll(cx)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[tokio::test(start_paused = true)]
    async fn the_deadline_aborts_the_signal_and_the_inner_future_sees_it() {
        let signal = AbortSignal::new();
        let watched = signal.clone();
        let at = std::time::Instant::now() + Duration::from_secs(5);
        let outcome = Deadline::new(
            async move {
                watched.aborted().await;
                watched.reason().map(str::to_owned)
            },
            at,
            signal.clone(),
            "too late",
        )
        .await;
        assert_eq!(outcome.as_deref(), Some("too late"));
    }

    #[tokio::test(start_paused = true)]
    async fn a_future_that_finishes_first_leaves_the_signal_alone() {
        let signal = AbortSignal::new();
        let at = std::time::Instant::now() + Duration::from_secs(5);
        let value = Deadline::new(async { 7 }, at, signal.clone(), "too late").await;
        assert_eq!(value, 7);
        assert!(!signal.is_aborted());
    }

    #[tokio::test(start_paused = true)]
    async fn an_earlier_abort_keeps_its_reason() {
        let signal = AbortSignal::new();
        signal.abort("user");
        let watched = signal.clone();
        let at = std::time::Instant::now();
        let reason = Deadline::new(
            async move {
                tokio::time::sleep(Duration::from_secs(1)).await;
                watched.reason().map(str::to_owned)
            },
            at,
            signal,
            "too late",
        )
        .await;
        assert_eq!(reason.as_deref(), Some("user"));
    }
}
