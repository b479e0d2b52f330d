//! Polling a virtqueue between kicks, bounded and adaptive: after a
//! round of requests a queue's thread may watch the avail ring a while
//! before it goes back to sleep in epoll, with the guest's notifications
//! still suppressed, so a guest that adds its next request soon neither
//! kicks (an eventfd write, a VM exit on KVM) nor wakes a sleeping thread
//! (an eventfd read, an epoll wait and a context switch on ours). This is
//! qemu's `poll-max-ns` (util/aio-posix.c, `adjust_polling_time`): the
//! window starts at 0, grows (from 4 µs, doubling) while the sleeps that
//! follow it are shorter than the limit, and drops to 0 when a sleep was
//! longer, so a guest that is idle or slow costs no polling.
//!
//! Off unless asked for (`serve --vhost-poll-us`): a spinning thread
//! takes a CPU another runnable thread (the guest's vCPU on a shared
//! host) may need, and each poll that finds nothing is pure cost. The
//! limit bounds every window; the thread always ends up back in epoll,
//! with notifications enabled and the ring checked once more.

use std::time::{Duration, Instant};

/// Where a growing window starts (qemu's 4 µs).
const START: Duration = Duration::from_micros(4);

/// Largest limit `serve` takes (a window is spent spinning).
pub const MAX_LIMIT: Duration = Duration::from_millis(1);

/// One queue's polling window and what it has learned.
#[derive(Debug)]
pub struct PollWindow {
    limit: Duration,
    window: Duration,
    /// When the queue's thread last went to sleep (None: not since the
    /// window was last adjusted).
    slept_at: Option<Instant>,
}

impl PollWindow {
    /// A window of at most `limit` (zero: never polls).
    pub fn new(limit: Duration) -> PollWindow {
        PollWindow {
            limit: limit.min(MAX_LIMIT),
            window: Duration::ZERO,
            slept_at: None,
        }
    }

    /// How long to poll now.
    pub fn window(&self) -> Duration {
        self.window
    }

    /// The thread goes to sleep (polling found nothing, or is off).
    pub fn sleeping(&mut self, now: Instant) {
        if !self.limit.is_zero() {
            self.slept_at = Some(now);
        }
    }

    /// The thread woke for a kick: learn from how long it slept.
    pub fn woke(&mut self, now: Instant) {
        if let Some(t) = self.slept_at.take() {
            self.adjust(now.saturating_duration_since(t));
        }
    }

    /// qemu's `adjust_polling_time` with its defaults (grow 2, shrink
    /// to 0): a sleep the window would have covered changes nothing, one
    /// longer than the limit closes the window, a shorter one grows it.
    pub fn adjust(&mut self, slept: Duration) {
        if slept <= self.window {
            return;
        }
        if slept > self.limit {
            self.window = Duration::ZERO;
        } else if self.window < self.limit {
            self.window = if self.window.is_zero() {
                START
            } else {
                self.window * 2
            }
            .min(self.limit);
        }
    }
}

/// Spin until `ready()` or `window` has passed; whether it became ready.
/// The clock is read every few checks only: `ready` is a load from guest
/// memory, far cheaper than reading the clock.
pub fn spin(window: Duration, mut ready: impl FnMut() -> bool) -> bool {
    if window.is_zero() {
        return false;
    }
    let end = Instant::now() + window;
    loop {
        for _ in 0..32 {
            if ready() {
                return true;
            }
            std::hint::spin_loop();
        }
        if Instant::now() >= end {
            return ready();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const US: Duration = Duration::from_micros(1);

    #[test]
    fn short_sleeps_grow_the_window_to_the_limit_and_a_long_one_closes_it() {
        let mut w = PollWindow::new(50 * US);
        assert_eq!(w.window(), Duration::ZERO);
        let mut seen = Vec::new();
        for _ in 0..6 {
            w.adjust(40 * US);
            seen.push(w.window().as_micros());
        }
        assert_eq!(seen, [4, 8, 16, 32, 50, 50]);
        // A sleep inside the window changes nothing.
        w.adjust(10 * US);
        assert_eq!(w.window(), 50 * US);
        // A sleep longer than the limit: polling would not have caught it.
        w.adjust(200 * US);
        assert_eq!(w.window(), Duration::ZERO);
    }

    #[test]
    fn a_zero_limit_never_polls() {
        let mut w = PollWindow::new(Duration::ZERO);
        for slept in [0, 1, 3, 100] {
            w.adjust(slept * US);
        }
        assert_eq!(w.window(), Duration::ZERO);
        let t = Instant::now();
        w.sleeping(t);
        w.woke(t + US);
        assert_eq!(w.window(), Duration::ZERO);
        assert!(!spin(w.window(), || panic!(
            "a closed window must not poll"
        )));
    }

    #[test]
    fn the_limit_is_bounded_and_spin_stops_when_ready() {
        let mut w = PollWindow::new(Duration::from_secs(5));
        for _ in 0..20 {
            w.adjust(MAX_LIMIT);
        }
        assert_eq!(w.window(), MAX_LIMIT);
        let mut n = 0;
        assert!(spin(Duration::from_secs(60), || {
            n += 1;
            n == 3
        }));
        assert_eq!(n, 3);
    }

    #[test]
    fn woke_learns_from_the_sleep_since_sleeping() {
        let mut w = PollWindow::new(50 * US);
        let t = Instant::now();
        // Woken without having slept since: nothing learned.
        w.woke(t);
        assert_eq!(w.window(), Duration::ZERO);
        w.sleeping(t);
        w.woke(t + 10 * US);
        assert_eq!(w.window(), 4 * US);
        w.sleeping(t);
        w.woke(t + Duration::from_millis(5));
        assert_eq!(w.window(), Duration::ZERO);
    }
}
