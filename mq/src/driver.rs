//! What a leaf driver implements and how it hands requests back (kernel
//! `struct blk_mq_ops`: `queue_rq`, `complete`, `poll`; and
//! `blk_mq_end_request`). The engine knows nothing of how a driver
//! completes: at once from `queue_rq` ([`QueueRq::Done`]), later from its
//! own context through a [`RequestCompleter`] (an interrupt handler, a
//! timer, an io_uring reaper), or from the submitter's poll through the
//! [`CompleterRef`] the engine passes to [`Driver::poll`] (kernel
//! `blk_mq_poll` calling `mq_ops->poll`).

use blkstack_core::device::Extent;
use blkstack_core::{Bio, Status};
use std::sync::{Arc, Weak};

/// What the driver did with a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QueueRq {
    /// Finished with this status; the engine ends it now, on this thread.
    Done(Status),
    /// Accepted; the driver will end it through its [`RequestCompleter`]
    /// (or, polled, from [`Driver::poll`]). After returning this the driver
    /// must not look at the request's bio again.
    Issued,
    /// Cannot take it now (kernel `BLK_STS_RESOURCE`): requeue.
    Busy,
}

/// A request as the driver sees it.
#[derive(Clone, Copy)]
pub struct Rq<'a> {
    /// The request's tag: its slot in the hardware queue's tag set, unique
    /// among the requests in flight there (kernel `rq->tag`).
    pub tag: u32,
    /// Index of the hardware queue that dispatched it (kernel `hctx->queue_num`).
    pub hctx: u32,
    /// The bio the request carries; the driver reads its op, range and buffer.
    pub bio: &'a Bio,
}

/// A leaf driver under the engine (kernel `struct blk_mq_ops`).
pub trait Driver: Send + Sync + 'static {
    /// Start a request (kernel `queue_rq`).
    fn queue_rq(&self, rq: Rq<'_>) -> QueueRq;

    /// Finish a request in completion context (kernel `complete`); may
    /// change the status.
    fn complete(&self, _rq: Rq<'_>, status: Status) -> Status {
        status
    }

    /// Called once with a handle for ending [`QueueRq::Issued`] requests
    /// later.
    fn attach(&self, _completer: RequestCompleter) {}

    /// Whether submitters may poll this driver for completions (kernel
    /// `BLK_FEAT_POLL`).
    fn polls(&self) -> bool {
        false
    }

    /// End, through `completer`, the polled requests that are ready
    /// (kernel `mq_ops->poll`); returns how many.
    fn poll(&self, _completer: &CompleterRef<'_>) -> usize {
        0
    }

    /// Whether [`Driver::poll_wait`] sleeps in the driver's own wait (see
    /// `blkstack_core::Device::poll_sleeps`).
    fn poll_sleeps(&self) -> bool {
        false
    }

    /// [`Driver::poll`] that, with nothing ready, sleeps until it ends at
    /// least one polled request or `ready()` holds (see
    /// `blkstack_core::Device::poll_wait`).
    fn poll_wait(&self, completer: &CompleterRef<'_>, _ready: &dyn Fn() -> bool) -> usize {
        self.poll(completer)
    }

    /// The data/hole map of `offset..end` (`end` already within the
    /// disk), if the driver knows one (see
    /// `blkstack_core::Device::extents`, which the driver's
    /// [`crate::Disk`] answers with this).
    fn extents(&self, _offset: u64, _end: u64) -> Option<Vec<Extent>> {
        None
    }
}

/// The engine side of ending a request.
pub(crate) trait EndRequest: Send + Sync {
    fn end(&self, hctx: u32, tag: u32, status: Status);
}

/// Ends requests a driver accepted with [`QueueRq::Issued`], from any
/// thread. It does not keep the queue alive: once the queue is gone,
/// ending does nothing.
#[derive(Clone)]
pub struct RequestCompleter {
    pub(crate) inner: Weak<dyn EndRequest>,
}

impl RequestCompleter {
    /// End the request `tag` of hardware queue `hctx` (kernel
    /// `blk_mq_end_request`): free its tag and complete its bio.
    pub fn end_request(&self, hctx: u32, tag: u32, status: Status) {
        if let Some(q) = self.inner.upgrade() {
            q.end(hctx, tag, status);
        }
    }

    /// A handle that keeps the queue's request state alive while held,
    /// for a driver thread that ends many requests (no reference count
    /// touched per request). `None` once the queue is gone. The driver
    /// must let go of it when its device is torn down.
    pub fn hold(&self) -> Option<HeldCompleter> {
        self.inner.upgrade().map(|inner| HeldCompleter { inner })
    }
}

/// See [`RequestCompleter::hold`].
pub struct HeldCompleter {
    inner: Arc<dyn EndRequest>,
}

impl HeldCompleter {
    /// [`RequestCompleter::end_request`].
    #[inline]
    pub fn end_request(&self, hctx: u32, tag: u32, status: Status) {
        self.inner.end(hctx, tag, status);
    }

    /// The same handle, borrowed.
    pub fn completer_ref(&self) -> CompleterRef<'_> {
        CompleterRef {
            inner: &*self.inner,
        }
    }
}

/// A borrowed completer: what [`Driver::poll`] ends its requests with.
#[derive(Clone, Copy)]
pub struct CompleterRef<'a> {
    pub(crate) inner: &'a dyn EndRequest,
}

impl CompleterRef<'_> {
    /// [`RequestCompleter::end_request`].
    #[inline]
    pub fn end_request(&self, hctx: u32, tag: u32, status: Status) {
        self.inner.end(hctx, tag, status);
    }
}
