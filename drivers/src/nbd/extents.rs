//! `Device::extents` over NBD_CMD_BLOCK_STATUS with the `base:allocation`
//! context: the server's data/hole map, so a stack (or the NBD server
//! re-exporting this device) can skip holes as `qemu-img map` and
//! `nbdcopy` do. A query is rare and synchronous, so it does not take an
//! engine tag: it uses one extra slot of connection 0 (the tag after the
//! engine's last) and waits for the reply on a condition variable.

use super::connection::{Connection, SlotData};
use super::proto::{CMD_BLOCK_STATUS, STATE_HOLE};
use blkstack_core::bio::IoBuf;
use blkstack_core::clock::now_ns;
use blkstack_core::device::Extent;
use blkstack_core::Status;
use parking_lot::{Condvar, Mutex};
use std::time::{Duration, Instant};

#[derive(Default)]
struct QueryState {
    /// Where the next descriptor starts.
    next: u64,
    end: u64,
    context: u32,
    out: Vec<Extent>,
    done: Option<Status>,
}

#[derive(Default)]
pub struct ExtentQuery {
    /// One query at a time.
    serial: Mutex<()>,
    state: Mutex<QueryState>,
    cv: Condvar,
}

impl ExtentQuery {
    /// A BLOCK_STATUS chunk's payload: context id, then (length, flags)
    /// descriptors from the query's offset on.
    pub fn add_chunk(&self, payload: &[u8]) {
        let mut st = self.state.lock();
        if payload.len() < 4
            || u32::from_be_bytes([payload[0], payload[1], payload[2], payload[3]]) != st.context
        {
            return;
        }
        for d in payload[4..].chunks_exact(8) {
            let len = u32::from_be_bytes([d[0], d[1], d[2], d[3]]) as u64;
            let flags = u32::from_be_bytes([d[4], d[5], d[6], d[7]]);
            let len = len.min(st.end.saturating_sub(st.next));
            if len == 0 {
                break;
            }
            let hole = flags & STATE_HOLE != 0;
            let at = st.next;
            match st.out.last_mut() {
                Some(l) if l.hole == hole && l.offset + l.len == at => l.len += len,
                _ => st.out.push(Extent {
                    offset: at,
                    len,
                    hole,
                }),
            }
            st.next += len;
        }
    }

    pub fn finish(&self, status: Status) {
        self.state.lock().done = Some(status);
        self.cv.notify_all();
    }

    /// Ask connection `conn` for the map of `offset..offset+len` (clipped
    /// to what one request may cover); None when the server could not
    /// answer within `wait`.
    pub fn query(
        &self,
        conn: &Connection,
        context: u32,
        offset: u64,
        len: u64,
        wait: Duration,
    ) -> Option<Vec<Extent>> {
        let _one = self.serial.lock();
        let len = len.min(conn.geo.max_part).min(u32::MAX as u64);
        if len == 0 {
            return Some(Vec::new());
        }
        *self.state.lock() = QueryState {
            next: offset,
            end: offset + len,
            context,
            out: Vec::new(),
            done: None,
        };
        let tag = (conn.slots.len() - 1) as u32;
        {
            let mut tx = conn.tx.lock();
            *conn.slots[tag as usize].0.lock() = SlotData {
                active: true,
                cmd: CMD_BLOCK_STATUS,
                flags: 0,
                offset,
                len,
                buf: IoBuf::empty(),
                parts: 1,
                data_parts: 1,
                remaining: 1,
                status: Status::Ok,
                sent_gen: 0,
                queued_ns: now_ns(),
                sent_ns: 0,
                zero_fill: false,
                covered: 0,
                failed_sends: 0,
            };
            if let Err(e) = conn.send_slot(&mut tx, tag) {
                conn.note_send_error(&mut tx, e);
            }
        }
        let deadline = Instant::now() + wait;
        let mut st = self.state.lock();
        while st.done.is_none() {
            if self.cv.wait_until(&mut st, deadline).timed_out() {
                break;
            }
        }
        let ok = st.done == Some(Status::Ok) && st.next > offset;
        let out = std::mem::take(&mut st.out);
        drop(st);
        if !ok {
            // Unanswered: forget it (a late reply then kills the
            // connection, which reconnects).
            let mut d = conn.slots[tag as usize].0.lock();
            d.active = false;
            return None;
        }
        Some(out)
    }
}
