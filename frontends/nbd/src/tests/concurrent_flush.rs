//! Replies sent outside the writer lock (`Shared::flush`): completers on
//! several threads at once, with more reply bytes than the socket holds,
//! so flushes overlap, meet partial sends and hand over to the writer
//! thread; every reply must arrive once, whole and with its own data, with
//! the reader's poll off (the default), fixed and adaptive.

use super::{req, serve_with_poll};
use crate::proto::*;
use crate::Export;
use blkstack_core::timing::spin::PollSetting;
use blkstack_core::{Bio, Device, Op, Status};
use parking_lot::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{channel, Sender};
use std::sync::Arc;

/// Completes every read on one of `THREADS` threads in turn, its data the
/// low byte of its offset's block number.
struct ThreadedDev {
    workers: Mutex<Vec<Sender<Bio>>>,
    next: AtomicUsize,
}

const THREADS: usize = 4;
const LEN: u32 = 8192;
const REQS: u64 = 240;

impl ThreadedDev {
    fn new() -> Arc<ThreadedDev> {
        let workers = (0..THREADS)
            .map(|_| {
                let (tx, rx) = channel::<Bio>();
                std::thread::spawn(move || {
                    for bio in rx {
                        let v = (bio.offset / LEN as u64) as u8;
                        bio.data_mut().fill(v);
                        bio.complete(Status::Ok);
                    }
                });
                tx
            })
            .collect();
        Arc::new(ThreadedDev {
            workers: Mutex::new(workers),
            next: AtomicUsize::new(0),
        })
    }
}

impl Device for ThreadedDev {
    fn submit(&self, bio: Bio) {
        if bio.op != Op::Read {
            bio.complete(Status::Ok);
            return;
        }
        let i = self.next.fetch_add(1, Ordering::Relaxed) % THREADS;
        let tx = self.workers.lock()[i].clone();
        if let Err(e) = tx.send(bio) {
            e.0.complete(Status::IoError);
        }
    }
    fn size(&self) -> u64 {
        REQS * LEN as u64
    }
}

fn all_replies_arrive(poll: PollSetting) {
    let run = serve_with_poll(vec![Export::new("a", ThreadedDev::new(), false)], poll);
    let (mut c, _, _) = run.client("a", false);
    // Requests first, replies after: the replies outgrow the socket buffer
    // while nobody reads them.
    for h in 0..REQS {
        c.request(&req(CMD_READ, 0, h, h * LEN as u64, LEN), &[])
            .unwrap();
    }
    let mut seen = vec![false; REQS as usize];
    let mut data = vec![0u8; LEN as usize];
    for _ in 0..REQS {
        let r = c.simple_reply().expect("every reply arrives");
        assert_eq!(r.error, 0, "handle {}", r.handle);
        std::io::Read::read_exact(&mut c.s, &mut data).unwrap();
        let h = r.handle as usize;
        assert!(h < seen.len() && !seen[h], "handle {h} unknown or twice");
        seen[h] = true;
        assert!(data.iter().all(|&b| b == h as u8), "data of handle {h}");
    }
    run.stop();
}

/// Requests keep coming from another thread while replies are read
/// with pauses: the socket fills and drains over and over, so flushes
/// meet partial sends while other completers append behind them.
fn a_stream_of_replies_arrives(poll: PollSetting) {
    const STREAM: u64 = 3000;
    let run = serve_with_poll(vec![Export::new("a", ThreadedDev::new(), false)], poll);
    let (mut c, _, _) = run.client("a", false);
    let mut tx = crate::client::RawClient::new(c.s.try_clone().expect("clone the socket"));
    let sender = std::thread::spawn(move || {
        for h in 0..STREAM {
            let off = (h % REQS) * LEN as u64;
            tx.request(&req(CMD_READ, 0, h, off, LEN), &[]).unwrap();
        }
    });
    let mut seen = vec![false; STREAM as usize];
    let mut data = vec![0u8; LEN as usize];
    for i in 0..STREAM {
        if i % 8 == 0 {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        let r = c.simple_reply().expect("every reply arrives");
        assert_eq!(r.error, 0, "handle {}", r.handle);
        std::io::Read::read_exact(&mut c.s, &mut data).unwrap();
        let h = r.handle as usize;
        assert!(h < seen.len() && !seen[h], "handle {h} unknown or twice");
        seen[h] = true;
        let want = (r.handle % REQS) as u8;
        assert!(data.iter().all(|&b| b == want), "data of handle {h}");
    }
    sender.join().expect("sender");
    run.stop();
}

#[test]
fn a_stream_of_replies_from_concurrent_completers_arrives() {
    a_stream_of_replies_arrives(PollSetting::Off);
    a_stream_of_replies_arrives(PollSetting::Fixed(50_000));
    a_stream_of_replies_arrives(PollSetting::Adaptive(50_000));
}

#[test]
fn replies_from_concurrent_completers_all_arrive() {
    all_replies_arrive(PollSetting::Off);
}

#[test]
fn replies_from_concurrent_completers_all_arrive_with_polling() {
    all_replies_arrive(PollSetting::Fixed(50_000));
    all_replies_arrive(PollSetting::Adaptive(50_000));
}
