//! A runtime-agnostic abort signal.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::task::{Context, Poll, Waker};

/// The submission's abort signal, as handed to tools and event-hook callbacks.
///
/// Cheap to clone; every clone observes the same abort. `aborted().await` resolves when the
/// signal fires (usable from any executor: it needs no runtime of its own).
#[derive(Clone, Default)]
pub struct AbortSignal {
    inner: Arc<Inner>,
}

#[derive(Default)]
struct Inner {
    aborted: AtomicBool,
    reason: OnceLock<String>,
    waiting: Mutex<Waiting>,
}

/// The wakers of the [`Aborted`] futures waiting on the signal, each under its future's slot
/// (removed when the future is dropped: a signal that lives as long as an attempt, awaited by
/// thousands of tool calls, holds only the wakers of the futures still waiting).
#[derive(Default)]
struct Waiting {
    next: u64,
    wakers: Vec<(u64, Waker)>,
}

impl AbortSignal {
    /// A signal that has not fired.
    pub fn new() -> Self {
        Self::default()
    }

    /// Fires the signal with `reason`. Only the first call has an effect.
    pub fn abort(&self, reason: impl Into<String>) {
        if self.inner.reason.set(reason.into()).is_err() {
            return;
        }
        self.inner.aborted.store(true, Ordering::Release);
        let wakers = std::mem::take(&mut self.inner.waiting().wakers);
        for (_, waker) in wakers {
            waker.wake();
        }
    }

    /// Whether the signal fired.
    pub fn is_aborted(&self) -> bool {
        self.inner.aborted.load(Ordering::Acquire)
    }

    /// Why the signal fired, once it has.
    pub fn reason(&self) -> Option<&str> {
        if self.is_aborted() {
            self.inner.reason.get().map(String::as_str)
        } else {
            None
        }
    }

    /// A future that resolves when the signal fires.
    pub fn aborted(&self) -> Aborted {
        Aborted {
            signal: self.clone(),
            slot: None,
        }
    }
}

impl Inner {
    fn waiting(&self) -> std::sync::MutexGuard<'_, Waiting> {
        self.waiting.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl std::fmt::Debug for AbortSignal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AbortSignal").field("reason", &self.reason()).finish()
    }
}

/// Future returned by [`AbortSignal::aborted`].
#[derive(Debug)]
pub struct Aborted {
    signal: AbortSignal,
    /// Where its waker waits in the signal, once it has been polled.
    slot: Option<u64>,
}

impl Future for Aborted {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let this = self.get_mut();
        if this.signal.is_aborted() {
            return Poll::Ready(());
        }
        let mut waiting = this.signal.inner.waiting();
        // Re-check under the lock: `abort` takes the wakers under the same lock.
        if this.signal.is_aborted() {
            return Poll::Ready(());
        }
        let waker = cx.waker();
        let kept = this
            .slot
            .and_then(|slot| waiting.wakers.iter_mut().find(|(at, _)| *at == slot));
        match kept {
            Some((_, kept)) => {
                if !kept.will_wake(waker) {
                    kept.clone_from(waker);
                }
            }
            None => {
                let slot = waiting.next;
                waiting.next += 1;
                waiting.wakers.push((slot, waker.clone()));
                this.slot = Some(slot);
            }
        }
        Poll::Pending
    }
}

impl Drop for Aborted {
    fn drop(&mut self) {
        let Some(slot) = self.slot else { return };
        let mut waiting = self.signal.inner.waiting();
        if let Some(at) = waiting.wakers.iter().position(|(at, _)| *at == slot) {
            waiting.wakers.swap_remove(at);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;
    use std::task::Wake;

    /// A waker counting its wakes.
    struct Counting(AtomicUsize);

    impl Wake for Counting {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    fn counting() -> (Arc<Counting>, Waker) {
        let counter = Arc::new(Counting(AtomicUsize::new(0)));
        (counter.clone(), Waker::from(counter))
    }

    fn poll(future: &mut Aborted, waker: &Waker) -> Poll<()> {
        Pin::new(future).poll(&mut Context::from_waker(waker))
    }

    fn waiting(signal: &AbortSignal) -> usize {
        signal.inner.waiting().wakers.len()
    }

    #[test]
    fn a_waiting_future_dropped_leaves_no_waker_behind() {
        let signal = AbortSignal::new();
        for _ in 0..1_000 {
            let (_, waker) = counting();
            let mut future = signal.aborted();
            assert_eq!(poll(&mut future, &waker), Poll::Pending);
        }
        assert_eq!(waiting(&signal), 0, "each dropped future took its waker away");
    }

    #[test]
    fn a_future_polled_again_by_another_task_keeps_one_slot_and_wakes_the_latest() {
        let signal = AbortSignal::new();
        let (first, first_waker) = counting();
        let (second, second_waker) = counting();
        let mut future = signal.aborted();
        assert_eq!(poll(&mut future, &first_waker), Poll::Pending);
        assert_eq!(poll(&mut future, &first_waker), Poll::Pending);
        assert_eq!(poll(&mut future, &second_waker), Poll::Pending);
        assert_eq!(waiting(&signal), 1);
        // Another future waiting beside it, dropped before the abort: not woken.
        let (dropped, dropped_waker) = counting();
        let mut other = signal.aborted();
        assert_eq!(poll(&mut other, &dropped_waker), Poll::Pending);
        drop(other);
        signal.abort("stop");
        assert_eq!(first.0.load(Ordering::SeqCst), 0);
        assert_eq!(second.0.load(Ordering::SeqCst), 1);
        assert_eq!(dropped.0.load(Ordering::SeqCst), 0);
        assert_eq!(poll(&mut future, &second_waker), Poll::Ready(()));
        assert_eq!(signal.reason(), Some("stop"));
        // A future made after the abort is ready at once, and holds nothing.
        let mut late = signal.aborted();
        assert_eq!(poll(&mut late, &first_waker), Poll::Ready(()));
        assert_eq!(waiting(&signal), 0);
    }
}
