//! A scripted NBD server that negotiates correctly on every connection
//! and then misbehaves in transmission, for the hostile-peer tests of the
//! `nbd` leaf and of multipath over it (`drivers/tests/nbd_misbehaving.rs`,
//! `frontends/cli/tests/nbd_failover.rs`). Real servers cannot be made to
//! misbehave on cue; this one follows the protocol up to the first reply
//! and then breaks it the way a buggy or hostile server would, so that
//! each reconnect succeeds and only the leaf's failure model (kernel nbd:
//! `nbd_handle_reply` errors, `nbd_xmit_timeout`, `dead_conn_timeout`)
//! can end the request.

use super::proto::*;
use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

#[derive(Clone, Copy, Debug)]
pub enum Misbehaviour {
    /// Replies with cookies it was never sent.
    UnknownCookie,
    /// READ data for an offset outside the request.
    OutsideRequest,
    /// A data chunk header and part of its data, then silence.
    HangMidReply,
    /// Reads every request, answers none.
    NeverReply,
}

fn handshake(s: &mut UnixStream, size: u64) -> std::io::Result<()> {
    let mut v = Vec::new();
    encode_greeting(&mut v, FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES);
    s.write_all(&v)?;
    let mut f = [0u8; 4];
    s.read_exact(&mut f)?;
    loop {
        let mut h = [0u8; OptionHeader::SIZE];
        s.read_exact(&mut h)?;
        let h = OptionHeader::parse(&h).map_err(std::io::Error::other)?;
        if h.len > 64 * 1024 {
            return Err(std::io::Error::other("option too long"));
        }
        let mut data = vec![0u8; h.len as usize];
        s.read_exact(&mut data)?;
        let mut v = Vec::new();
        match h.option {
            OPT_STRUCTURED_REPLY => encode_option_reply(&mut v, h.option, REP_ACK, &[]),
            OPT_GO => {
                let mut p = Vec::new();
                encode_info_export(&mut p, size, TFLAG_HAS_FLAGS);
                encode_option_reply(&mut v, h.option, REP_INFO, &p);
                encode_option_reply(&mut v, h.option, REP_ACK, &[]);
                s.write_all(&v)?;
                return Ok(());
            }
            o => encode_option_reply(&mut v, o, REP_ERR_UNSUP, &[]),
        }
        s.write_all(&v)?;
    }
}

fn serve(mut s: UnixStream, size: u64, how: Misbehaviour) -> std::io::Result<()> {
    handshake(&mut s, size)?;
    loop {
        let mut h = [0u8; Request::SIZE];
        s.read_exact(&mut h)?;
        let r = Request::parse(&h).map_err(std::io::Error::other)?;
        if r.cmd == CMD_WRITE {
            // Taken and dropped: the stream stays in step.
            std::io::copy(&mut (&mut s).take(r.len as u64), &mut std::io::sink())?;
        }
        let mut out = Vec::new();
        match how {
            Misbehaviour::UnknownCookie => encode_none_chunk(&mut out, r.handle ^ 0x5a5a_0000),
            Misbehaviour::OutsideRequest => {
                encode_data_chunk_header(&mut out, REPLY_FLAG_DONE, r.handle, r.offset + size, 16);
                out.extend_from_slice(&[7u8; 16]);
            }
            Misbehaviour::HangMidReply => {
                encode_data_chunk_header(&mut out, REPLY_FLAG_DONE, r.handle, r.offset, r.len);
                out.extend_from_slice(&[1u8; 100]);
            }
            Misbehaviour::NeverReply => {}
        }
        s.write_all(&out)?;
    }
}

/// Listen on `path` and serve an export of `size` bytes misbehaving
/// `how` on every connection, from background threads for the rest of
/// the process. Returns the count of connections accepted.
pub fn spawn(path: &Path, size: u64, how: Misbehaviour) -> std::io::Result<Arc<AtomicU32>> {
    let listener = UnixListener::bind(path)?;
    let conns = Arc::new(AtomicU32::new(0));
    let c = conns.clone();
    std::thread::spawn(move || {
        for s in listener.incoming() {
            let Ok(s) = s else { break };
            c.fetch_add(1, Ordering::SeqCst);
            std::thread::spawn(move || serve(s, size, how));
        }
    });
    Ok(conns)
}
