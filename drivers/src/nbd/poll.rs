//! Poll queues (`poll_queues=N`): connections whose replies are read by
//! the submitters that wait for them, with no reader thread, as the
//! kernel's nvme-tcp reaps its poll queues in `nvme_tcp_poll` from the
//! submitter's context (blk-mq `HCTX_TYPE_POLL`). A submitter at depth 1
//! then sleeps in the socket read itself and is woken once, by the reply,
//! instead of by a reader thread that was woken by the reply (libnbd's
//! model: a program reads its replies on the thread that sent them).
//!
//! The connection's read side sits in its reader lock. Whoever holds the
//! lock reads replies for every request on the connection and ends them,
//! whoever submitted them; before letting go it reads every reply whose
//! bytes it has already taken from the socket, so a poller that finds the
//! socket quiet knows nothing is waiting in someone's buffer. A poller
//! that finds the connection dead takes the read side away, marks the
//! connection down and wakes its thread, which reconnects and resends
//! (`reconnect.rs`); pollers then find no read side and wait for an
//! ordinary completion (the resent request's, or the dead timeout's EIO).

use super::connection::Connection;
use super::extents::ExtentQuery;
use super::options::MAX_CONNECTIONS;
use super::reply::{ReaderExit, ReplyReader};
use blkstack_mq::CompleterRef;
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// Where pollers of one device find their connections.
pub struct Pollers<'a> {
    pub conns: &'a [Arc<Connection>],
    pub extents: &'a ExtentQuery,
    pub timeout_ns: u64,
}

impl Pollers<'_> {
    /// End what the poll queues have ready, without sleeping.
    pub fn poll(&self, done: &CompleterRef<'_>) -> usize {
        self.conns
            .iter()
            .map(|c| self.reap(c, done, &|| true, false))
            .sum()
    }

    /// End at least one polled request, sleeping in a socket read if
    /// none is ready, unless `ready()` or nothing polled is in flight.
    pub fn poll_wait(&self, done: &CompleterRef<'_>, ready: &dyn Fn() -> bool) -> usize {
        loop {
            let mut busy = self
                .conns
                .iter()
                .filter(|c| c.stats.in_flight.load(Ordering::Acquire) > 0);
            let (Some(first), second) = (busy.next(), busy.next()) else {
                return 0;
            };
            if second.is_none() {
                // The common case (one poll queue, or one in use): sleep
                // in its read straight away.
                return self.reap(first, done, ready, true);
            }
            let n = self.poll(done);
            if n > 0 || ready() {
                return n;
            }
            match wait_readable(self.conns) {
                Wait::Woken => {}
                Wait::AllDown => return 0,
                // Other pollers read them all: wait for the first's lock
                // (its holder lets go once its buffers are read).
                Wait::AllTaken => return self.reap(first, done, ready, true),
            }
        }
    }

    /// Read `conn`'s replies while it has them ready (or, with `sleep`,
    /// until one of them ends a request or `ready()`). Returns how many
    /// requests ended; 0 also when another poller holds the connection
    /// (without `sleep`) or it is down.
    pub fn reap(
        &self,
        conn: &Connection,
        done: &CompleterRef<'_>,
        ready: &dyn Fn() -> bool,
        sleep: bool,
    ) -> usize {
        let guard = if sleep {
            Some(conn.reader_lock.lock())
        } else {
            conn.reader_lock.try_lock()
        };
        let Some(mut guard) = guard else { return 0 };
        let Some(side) = guard.as_mut() else { return 0 };
        if !sleep && !side.readable_now() {
            return 0;
        }
        let mut r = ReplyReader::new(conn, side, *done, self.extents, self.timeout_ns);
        let exit = loop {
            if sleep && r.ended == 0 {
                // Another poller may have ended ours while we waited for
                // the lock; with nothing in flight a read would never end.
                if ready() || conn.stats.in_flight.load(Ordering::Acquire) == 0 {
                    break None;
                }
            } else if !r.side.has_buffered() && (sleep || !r.side.readable_now()) {
                break None;
            }
            if let Err(e) = r.one_reply() {
                break Some(e);
            }
        };
        let ended = r.ended;
        match exit {
            None | Some(ReaderExit::Stop) => {}
            Some(ReaderExit::Dead(why)) => {
                if let Some(s) = guard.take() {
                    s.shutdown();
                }
                drop(guard);
                conn.mark_down(&why);
                conn.wake.wake();
            }
        }
        ended
    }
}

enum Wait {
    Woken,
    AllDown,
    AllTaken,
}

/// Sleep until one of the busy `conns`' sockets has something to read
/// (or a bound passes, so a connection that went down meanwhile is
/// noticed).
fn wait_readable(conns: &[Arc<Connection>]) -> Wait {
    let idle = libc::pollfd {
        fd: -1,
        events: 0,
        revents: 0,
    };
    let mut fds = [idle; MAX_CONNECTIONS as usize];
    let (mut n, mut taken) = (0, false);
    for c in conns {
        if c.stats.in_flight.load(Ordering::Acquire) == 0 || n == fds.len() {
            continue;
        }
        // Held by another poller: it reads until its buffers are empty.
        let Some(side) = c.reader_lock.try_lock() else {
            taken = true;
            continue;
        };
        if let Some(s) = side.as_ref() {
            fds[n].fd = s.rx.get_ref().socket().raw_fd();
            fds[n].events = libc::POLLIN;
            n += 1;
        }
    }
    if n == 0 {
        return if taken { Wait::AllTaken } else { Wait::AllDown };
    }
    // SAFETY: the first `n` entries of `fds` are valid pollfds.
    unsafe { libc::poll(fds.as_mut_ptr(), n as libc::nfds_t, WAIT_BOUND_MS) };
    Wait::Woken
}

/// Longest sleep over several poll queues before looking again: a reply
/// another poller reads for us meanwhile does not wake this sleep.
const WAIT_BOUND_MS: libc::c_int = 2;
