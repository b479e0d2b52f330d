//! A minimal blocking NBD client speaking raw protocol messages.
//!
//! It exists for tests: the real clients (libnbd, qemu) never send the
//! malformed or out-of-contract messages a server must survive, so the
//! unit tests and the raw-socket interop tests drive the server with this
//! instead. It is deliberately thin — each method is one protocol message —
//! so a test can break the protocol at any step.

use crate::proto::*;
use std::io::{self, Read, Write};

pub struct RawClient<S: Read + Write> {
    pub s: S,
}

fn bad(msg: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg)
}

impl<S: Read + Write> RawClient<S> {
    pub fn new(s: S) -> Self {
        RawClient { s }
    }

    /// Read the server's greeting; returns its handshake flags.
    pub fn greeting(&mut self) -> io::Result<u16> {
        let mut b = [0u8; 18];
        self.s.read_exact(&mut b)?;
        let m1 = u64::from_be_bytes(b[0..8].try_into().expect("8 bytes"));
        let m2 = u64::from_be_bytes(b[8..16].try_into().expect("8 bytes"));
        if m1 != NBDMAGIC || m2 != IHAVEOPT {
            return Err(bad(format!("bad greeting magics {m1:#x} {m2:#x}")));
        }
        Ok(u16::from_be_bytes([b[16], b[17]]))
    }

    pub fn client_flags(&mut self, f: u32) -> io::Result<()> {
        self.s.write_all(&f.to_be_bytes())
    }

    /// Greeting plus client flags FIXED_NEWSTYLE|NO_ZEROES.
    pub fn start(&mut self) -> io::Result<()> {
        self.greeting()?;
        self.client_flags(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES)
    }

    pub fn option(&mut self, option: u32, data: &[u8]) -> io::Result<()> {
        let mut v = Vec::new();
        OptionHeader {
            option,
            len: data.len() as u32,
        }
        .encode(&mut v);
        v.extend_from_slice(data);
        self.s.write_all(&v)
    }

    pub fn option_reply(&mut self) -> io::Result<(OptionReply, Vec<u8>)> {
        let mut h = [0u8; OptionReply::SIZE];
        self.s.read_exact(&mut h)?;
        let r = OptionReply::parse(&h).map_err(|e| bad(e.to_string()))?;
        let mut p = vec![0u8; r.len as usize];
        self.s.read_exact(&mut p)?;
        Ok((r, p))
    }

    /// Option replies up to and including the final one (ACK or error).
    pub fn option_replies(&mut self) -> io::Result<Vec<(OptionReply, Vec<u8>)>> {
        let mut all = Vec::new();
        loop {
            let r = self.option_reply()?;
            let fin = r.0.rep == REP_ACK || is_rep_err(r.0.rep);
            all.push(r);
            if fin {
                return Ok(all);
            }
        }
    }

    pub fn structured(&mut self) -> io::Result<()> {
        self.option(OPT_STRUCTURED_REPLY, &[])?;
        let (r, _) = self.option_reply()?;
        if r.rep != REP_ACK {
            return Err(bad(format!("structured reply refused: {:#x}", r.rep)));
        }
        Ok(())
    }

    /// NBD_OPT_GO on `name`; returns (size, transmission flags).
    pub fn go(&mut self, name: &str) -> io::Result<(u64, u16)> {
        let mut d = Vec::new();
        GoRequest {
            name: name.into(),
            infos: vec![INFO_BLOCK_SIZE],
        }
        .encode(&mut d);
        self.option(OPT_GO, &d)?;
        let mut export = None;
        for (r, p) in self.option_replies()? {
            if is_rep_err(r.rep) {
                return Err(bad(format!(
                    "NBD_OPT_GO refused ({:#x}): {}",
                    r.rep,
                    String::from_utf8_lossy(&p)
                )));
            }
            if r.rep == REP_INFO && p.len() == 12 && u16::from_be_bytes([p[0], p[1]]) == INFO_EXPORT
            {
                let size = u64::from_be_bytes(p[2..10].try_into().expect("8 bytes"));
                export = Some((size, u16::from_be_bytes([p[10], p[11]])));
            }
        }
        export.ok_or_else(|| bad("no NBD_INFO_EXPORT in the reply to NBD_OPT_GO".into()))
    }

    pub fn request(&mut self, r: &Request, payload: &[u8]) -> io::Result<()> {
        let mut v = Vec::with_capacity(Request::SIZE + payload.len());
        v.extend_from_slice(&r.encode());
        v.extend_from_slice(payload);
        self.s.write_all(&v)
    }

    pub fn simple_reply(&mut self) -> io::Result<SimpleReply> {
        let mut h = [0u8; SimpleReply::SIZE];
        self.s.read_exact(&mut h)?;
        SimpleReply::parse(&h).map_err(|e| bad(e.to_string()))
    }

    /// Either kind of reply header: a simple reply, or a structured chunk
    /// with its payload.
    pub fn any_reply(&mut self) -> io::Result<Reply> {
        let mut m = [0u8; 4];
        self.s.read_exact(&mut m)?;
        match u32::from_be_bytes(m) {
            SIMPLE_REPLY_MAGIC => {
                let mut h = [0u8; SimpleReply::SIZE];
                h[..4].copy_from_slice(&m);
                self.s.read_exact(&mut h[4..])?;
                Ok(Reply::Simple(
                    SimpleReply::parse(&h).map_err(|e| bad(e.to_string()))?,
                ))
            }
            STRUCTURED_REPLY_MAGIC => {
                let mut h = [0u8; ChunkHeader::SIZE];
                h[..4].copy_from_slice(&m);
                self.s.read_exact(&mut h[4..])?;
                let c = ChunkHeader::parse(&h).map_err(|e| bad(e.to_string()))?;
                let mut p = vec![0u8; c.len as usize];
                self.s.read_exact(&mut p)?;
                Ok(Reply::Chunk(c, p))
            }
            other => Err(bad(format!("bad reply magic {other:#x}"))),
        }
    }

    /// The error value of a reply that carries no data (simple, or a final
    /// structured chunk).
    pub fn status_reply(&mut self) -> io::Result<(u64, u32)> {
        match self.any_reply()? {
            Reply::Simple(r) => Ok((r.handle, r.error)),
            Reply::Chunk(c, p) if c.typ == REPLY_TYPE_ERROR && p.len() >= 6 => Ok((
                c.handle,
                u32::from_be_bytes(p[0..4].try_into().expect("4 bytes")),
            )),
            Reply::Chunk(c, _) if c.typ == REPLY_TYPE_NONE => Ok((c.handle, 0)),
            Reply::Chunk(c, _) => Err(bad(format!("unexpected chunk type {}", c.typ))),
        }
    }
}

#[derive(Debug)]
pub enum Reply {
    Simple(SimpleReply),
    Chunk(ChunkHeader, Vec<u8>),
}
