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
    wakers: Mutex<Vec<Waker>>,
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
        let wakers = std::mem::take(&mut *self.inner.wakers.lock().unwrap_or_else(|e| e.into_inner()));
        for waker in wakers {
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
        Aborted { signal: self.clone() }
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
}

impl Future for Aborted {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        if self.signal.is_aborted() {
            return Poll::Ready(());
        }
        let mut wakers = self.signal.inner.wakers.lock().unwrap_or_else(|e| e.into_inner());
        // Re-check under the lock: `abort` takes the wakers under the same lock.
        if self.signal.is_aborted() {
            return Poll::Ready(());
        }
        if !wakers.iter().any(|waker| waker.will_wake(cx.waker())) {
            wakers.push(cx.waker().clone());
        }
        Poll::Pending
    }
}
