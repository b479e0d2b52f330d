//! The job loop's polled wait (`wait=poll|hybrid`, `--hipri`): spin on
//! the completion queue, polling the device (io_uring IOPOLL's reaping on
//! the submitter), and yield the CPU after a bounded number of spins. It
//! never sleeps: `wait=poll` is the classic busy polling that the
//! hybrid-poll experiment compares hybrid polling with. (A poller that
//! napped once a yield showed its CPU shared kept 4 jobs' IOPS, but cost
//! classic polling its throughput on the lab's rows; what made 4 pollers
//! collapse was the tag wait, which mq's `polled_tag` fixed.)

use crate::engine::{Engine, POLL_SPINS};

impl Engine {
    /// Spin on the queue, yielding the CPU after a bounded number of spins
    /// (on a small machine the completing thread may need this CPU). On a
    /// polling device each round first polls it.
    pub(crate) fn poll_take(&mut self) -> usize {
        let mut spins = 0u32;
        loop {
            // What the poll completes for this job lands on this thread's
            // local list, which `has_ready` (other threads' list) does not
            // show.
            if self.dev_polls && self.dev.poll() > 0 {
                let n = self.cq.try_take(&mut self.drained);
                if n > 0 {
                    return n;
                }
            }
            if self.cq.has_ready() {
                let n = self.cq.try_take(&mut self.drained);
                if n > 0 {
                    return n;
                }
            }
            if spins < POLL_SPINS {
                spins += 1;
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
    }
}
