//! The live deadline of an attempt, without a task of its own.
//!
//! [`Deadline`] wraps the attempt's response future together with a timer. When the timer
//! fires it aborts the attempt's signal with the timeout's reason and keeps polling the
//! response, which then unwinds through its own abort path (cancelling the model stream,
//! running tools, a retry delay) and settles. Sharing the response's task saves a spawn, a
//! cross-thread wake-up and a cancellation per attempt over a watchdog task.
//!
//! Code that ignores the signal (a callback awaiting something that never ends) must not hold
//! the instance forever: once the signal fired, for whatever reason, the response has a
//! grace to unwind, after which it is dropped where it waits and the attempt settles over it
//! (reference §3.9: "after a 60 s grace the row is force-settled over the hung task").

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use flue_core::abort::{AbortSignal, Aborted};
use tokio::time::{Instant, Sleep};

pin_project_lite::pin_project! {
    /// `inner`, with `signal` aborted for `reason` once `at` passes, and given up `grace`
    /// after the signal fired.
    pub(crate) struct Deadline<F> {
        #[pin]
        inner: F,
        // The deadline, then (once the signal fired) the end of the grace.
        #[pin]
        timer: Sleep,
        in_grace: bool,
        signal: AbortSignal,
        aborted: Aborted,
        reason: &'static str,
        grace: Duration,
    }
}

impl<F: Future> Deadline<F> {
    pub(crate) fn new(
        inner: F,
        at: std::time::Instant,
        signal: AbortSignal,
        reason: &'static str,
        grace: Duration,
    ) -> Self {
        Self {
            inner,
            timer: tokio::time::sleep_until(Instant::from_std(at)),
            in_grace: false,
            aborted: signal.aborted(),
            signal,
            reason,
            grace,
        }
    }
}

impl<F: Future> Future for Deadline<F> {
    /// `None` when `inner` was given up: its grace ended before it did.
    type Output = Option<F::Output>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        if !*this.in_grace && this.timer.as_mut().poll(cx).is_ready() {
            // The first reason wins: an abort requested earlier stays the reason.
            this.signal.abort(*this.reason);
        }
        if let Poll::Ready(output) = this.inner.poll(cx) {
            return Poll::Ready(Some(output));
        }
        if !*this.in_grace {
            // Woken when the signal fires, whoever fires it.
            if Pin::new(&mut *this.aborted).poll(cx).is_pending() {
                return Poll::Pending;
            }
            *this.in_grace = true;
            this.timer
                .as_mut()
                .reset(Instant::from_std(super::later_by(*this.grace)));
        }
        match this.timer.poll(cx) {
            Poll::Ready(()) => Poll::Ready(None),
            Poll::Pending => Poll::Pending,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    const GRACE: Duration = Duration::from_secs(60);

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
            GRACE,
        )
        .await;
        assert_eq!(outcome.flatten().as_deref(), Some("too late"));
    }

    #[tokio::test(start_paused = true)]
    async fn a_future_that_finishes_first_leaves_the_signal_alone() {
        let signal = AbortSignal::new();
        let at = std::time::Instant::now() + Duration::from_secs(5);
        let value = Deadline::new(async { 7 }, at, signal.clone(), "too late", GRACE).await;
        assert_eq!(value, Some(7));
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
            GRACE,
        )
        .await;
        assert_eq!(reason.flatten().as_deref(), Some("user"));
    }

    #[tokio::test(start_paused = true)]
    async fn a_future_ignoring_the_deadline_is_given_up_when_its_grace_ends() {
        let signal = AbortSignal::new();
        let at = std::time::Instant::now() + Duration::from_secs(5);
        let mut run = std::pin::pin!(Deadline::new(
            std::future::pending::<()>(),
            at,
            signal.clone(),
            "too late",
            GRACE
        ));
        let halfway = Duration::from_secs(5) + GRACE / 2;
        assert!(
            tokio::time::timeout(halfway, &mut run).await.is_err(),
            "waited on halfway through the grace"
        );
        assert_eq!(signal.reason(), Some("too late"));
        assert_eq!(run.await, None, "given up");
    }

    #[tokio::test(start_paused = true)]
    async fn a_future_ignoring_an_abort_fired_elsewhere_is_given_up_when_its_grace_ends() {
        let signal = AbortSignal::new();
        let at = std::time::Instant::now() + Duration::from_secs(3600);
        let mut run = std::pin::pin!(Deadline::new(
            std::future::pending::<()>(),
            at,
            signal.clone(),
            "too late",
            GRACE
        ));
        assert!(tokio::time::timeout(Duration::from_secs(2), &mut run).await.is_err());
        signal.abort("user");
        assert!(
            tokio::time::timeout(GRACE / 2, &mut run).await.is_err(),
            "waited on halfway through the grace"
        );
        let given_up = tokio::time::timeout(GRACE, &mut run).await;
        assert_eq!(
            given_up,
            Ok(None),
            "given up at the grace's end, long before the deadline"
        );
        assert_eq!(signal.reason(), Some("user"), "the abort's reason stays");
    }

    #[test]
    fn a_wait_no_clock_can_add_is_a_century_not_a_panic() {
        let far = super::super::later_by(Duration::MAX);
        assert!(far > std::time::Instant::now() + Duration::from_secs(50 * 365 * 24 * 3600));
        let near = super::super::later_by(Duration::from_secs(5));
        assert!(near <= std::time::Instant::now() + Duration::from_secs(5));
    }

    #[tokio::test(start_paused = true)]
    async fn a_future_that_unwinds_within_its_grace_keeps_its_output() {
        let signal = AbortSignal::new();
        let watched = signal.clone();
        let at = std::time::Instant::now();
        let output = Deadline::new(
            async move {
                watched.aborted().await;
                tokio::time::sleep(GRACE / 2).await;
                "unwound"
            },
            at,
            signal,
            "too late",
            GRACE,
        )
        .await;
        assert_eq!(output, Some("unwound"));
    }
}
