//! NBD wire format: constants and (de)serialisation of every message of
//! `doc/proto.md` of the NetworkBlockDevice/nbd project (fixed newstyle
//! handshake, the INFO extension, structured replies, metadata contexts),
//! for both ends: the NBD server (`blkstack-nbd`, which re-exports this
//! module as `blkstack_nbd::proto`) and the `nbd` client leaf driver of
//! this crate. It lives in the drivers layer because layers import only
//! downward and the client leaf is a driver.
//!
//! The protocol is written here by hand because no maintained Rust crate
//! implements it for both sides. Everything is big-endian ("network byte
//! order"). Parsing functions take untrusted bytes and return a
//! [`WireError`] naming what was wrong instead of panicking; encoding
//! functions append to a caller-owned `Vec<u8>` or return fixed arrays so
//! the hot paths of both ends reuse their buffers and never allocate per
//! request or reply.
//!
//! The client-side decoders ([`OptionReply::parse`], [`SimpleReply::parse`],
//! [`ChunkHeader::parse`]) serve the client leaf and the server's raw-socket
//! tests; keeping both directions in one file is what lets the unit tests
//! do round trips.

use blkstack_core::Status;

// ---- magics -------------------------------------------------------------

/// `NBDMAGIC`, first 8 bytes the server sends.
pub const NBDMAGIC: u64 = 0x4e42_444d_4147_4943;
/// `IHAVEOPT`: newstyle magic, and the prefix of every client option.
pub const IHAVEOPT: u64 = 0x4948_4156_454f_5054;
/// Prefix of every option reply.
pub const OPT_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
pub const REQUEST_MAGIC: u32 = 0x2560_9513;
pub const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
pub const STRUCTURED_REPLY_MAGIC: u32 = 0x668e_33ef;

// ---- handshake flags ----------------------------------------------------

pub const FLAG_FIXED_NEWSTYLE: u16 = 1 << 0;
pub const FLAG_NO_ZEROES: u16 = 1 << 1;
pub const FLAG_C_FIXED_NEWSTYLE: u32 = 1 << 0;
pub const FLAG_C_NO_ZEROES: u32 = 1 << 1;

// ---- options ------------------------------------------------------------

pub const OPT_EXPORT_NAME: u32 = 1;
pub const OPT_ABORT: u32 = 2;
pub const OPT_LIST: u32 = 3;
pub const OPT_STARTTLS: u32 = 5;
pub const OPT_INFO: u32 = 6;
pub const OPT_GO: u32 = 7;
pub const OPT_STRUCTURED_REPLY: u32 = 8;
pub const OPT_LIST_META_CONTEXT: u32 = 9;
pub const OPT_SET_META_CONTEXT: u32 = 10;

// ---- option reply types ---------------------------------------------------

pub const REP_ACK: u32 = 1;
pub const REP_SERVER: u32 = 2;
pub const REP_INFO: u32 = 3;
pub const REP_META_CONTEXT: u32 = 4;
const REP_ERR: u32 = 1 << 31;
pub const REP_ERR_UNSUP: u32 = REP_ERR | 1;
pub const REP_ERR_POLICY: u32 = REP_ERR | 2;
pub const REP_ERR_INVALID: u32 = REP_ERR | 3;
pub const REP_ERR_PLATFORM: u32 = REP_ERR | 4;
pub const REP_ERR_TLS_REQD: u32 = REP_ERR | 5;
pub const REP_ERR_UNKNOWN: u32 = REP_ERR | 6;
pub const REP_ERR_SHUTDOWN: u32 = REP_ERR | 7;
pub const REP_ERR_BLOCK_SIZE_REQD: u32 = REP_ERR | 8;
pub const REP_ERR_TOO_BIG: u32 = REP_ERR | 9;

/// Is this option reply type an error?
pub fn is_rep_err(rep: u32) -> bool {
    rep & REP_ERR != 0
}

// ---- info types (NBD_OPT_INFO / NBD_OPT_GO) -------------------------------

pub const INFO_EXPORT: u16 = 0;
pub const INFO_NAME: u16 = 1;
pub const INFO_DESCRIPTION: u16 = 2;
pub const INFO_BLOCK_SIZE: u16 = 3;

// ---- transmission flags ---------------------------------------------------

pub const TFLAG_HAS_FLAGS: u16 = 1 << 0;
pub const TFLAG_READ_ONLY: u16 = 1 << 1;
pub const TFLAG_SEND_FLUSH: u16 = 1 << 2;
pub const TFLAG_SEND_FUA: u16 = 1 << 3;
pub const TFLAG_ROTATIONAL: u16 = 1 << 4;
pub const TFLAG_SEND_TRIM: u16 = 1 << 5;
pub const TFLAG_SEND_WRITE_ZEROES: u16 = 1 << 6;
pub const TFLAG_SEND_DF: u16 = 1 << 7;
pub const TFLAG_CAN_MULTI_CONN: u16 = 1 << 8;
pub const TFLAG_SEND_CACHE: u16 = 1 << 10;
pub const TFLAG_SEND_FAST_ZERO: u16 = 1 << 11;

// ---- commands and command flags -------------------------------------------

pub const CMD_READ: u16 = 0;
pub const CMD_WRITE: u16 = 1;
pub const CMD_DISC: u16 = 2;
pub const CMD_FLUSH: u16 = 3;
pub const CMD_TRIM: u16 = 4;
pub const CMD_CACHE: u16 = 5;
pub const CMD_WRITE_ZEROES: u16 = 6;
pub const CMD_BLOCK_STATUS: u16 = 7;

pub const CMD_FLAG_FUA: u16 = 1 << 0;
pub const CMD_FLAG_NO_HOLE: u16 = 1 << 1;
pub const CMD_FLAG_DF: u16 = 1 << 2;
pub const CMD_FLAG_REQ_ONE: u16 = 1 << 3;
pub const CMD_FLAG_FAST_ZERO: u16 = 1 << 4;

// ---- structured replies ---------------------------------------------------

pub const REPLY_FLAG_DONE: u16 = 1 << 0;
pub const REPLY_TYPE_NONE: u16 = 0;
pub const REPLY_TYPE_OFFSET_DATA: u16 = 1;
pub const REPLY_TYPE_OFFSET_HOLE: u16 = 2;
pub const REPLY_TYPE_BLOCK_STATUS: u16 = 5;
pub const REPLY_TYPE_ERROR: u16 = (1 << 15) + 1;
pub const REPLY_TYPE_ERROR_OFFSET: u16 = (1 << 15) + 2;

/// `base:allocation` status bits.
pub const STATE_HOLE: u32 = 1 << 0;
pub const STATE_ZERO: u32 = 1 << 1;
pub const BASE_ALLOCATION: &str = "base:allocation";

// ---- error values (the protocol's own numbering, not the host's errno) ----

pub const EPERM: u32 = 1;
pub const EIO: u32 = 5;
pub const ENOMEM: u32 = 12;
pub const EINVAL: u32 = 22;
pub const ENOSPC: u32 = 28;
pub const EOVERFLOW: u32 = 75;
pub const ENOTSUP: u32 = 95;
pub const ESHUTDOWN: u32 = 108;

/// The NBD error value for a bio status. The protocol only allows a few
/// values, so everything without a counterpart becomes `EIO`.
pub fn nbd_error(status: Status) -> u32 {
    match status {
        Status::Ok => 0,
        Status::Permission => EPERM,
        Status::Invalid => EINVAL,
        Status::NoSpace => ENOSPC,
        Status::Overflow => EOVERFLOW,
        Status::NotSupported | Status::Again => ENOTSUP,
        Status::Resource => ENOMEM,
        _ => EIO,
    }
}

/// Longest string (export name, query, message) the spec allows.
pub const MAX_STRING: usize = 4096;

// ---- errors -------------------------------------------------------------

/// Something a peer sent that does not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    #[error("{what}: bad magic {got:#x}")]
    BadMagic { what: &'static str, got: u64 },
    #[error("{what}: needs {need} bytes, got {have}")]
    Truncated {
        what: &'static str,
        need: usize,
        have: usize,
    },
    #[error("{what}: {extra} unexpected trailing bytes")]
    TrailingBytes { what: &'static str, extra: usize },
    #[error("{what}: string of {len} bytes exceeds {MAX_STRING}")]
    StringTooLong { what: &'static str, len: usize },
    #[error("{what}: string is not UTF-8")]
    NotUtf8 { what: &'static str },
    #[error("{what}: string contains NUL")]
    ContainsNul { what: &'static str },
}

/// A bounds-checked big-endian cursor over untrusted bytes.
struct Cursor<'a> {
    what: &'static str,
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn new(what: &'static str, buf: &'a [u8]) -> Self {
        Cursor { what, buf, pos: 0 }
    }
    fn take(&mut self, n: usize) -> Result<&'a [u8], WireError> {
        let have = self.buf.len() - self.pos;
        if n > have {
            return Err(WireError::Truncated {
                what: self.what,
                need: self.pos + n,
                have: self.buf.len(),
            });
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }
    fn u16(&mut self) -> Result<u16, WireError> {
        let b = self.take(2)?;
        Ok(u16::from_be_bytes([b[0], b[1]]))
    }
    fn u32(&mut self) -> Result<u32, WireError> {
        let b = self.take(4)?;
        Ok(u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    }
    fn u64(&mut self) -> Result<u64, WireError> {
        let b = self.take(8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_be_bytes(a))
    }
    fn string(&mut self, len: usize) -> Result<String, WireError> {
        if len > MAX_STRING {
            return Err(WireError::StringTooLong {
                what: self.what,
                len,
            });
        }
        let b = self.take(len)?;
        check_string(self.what, b)
    }
    fn finish(&self) -> Result<(), WireError> {
        let extra = self.buf.len() - self.pos;
        if extra != 0 {
            return Err(WireError::TrailingBytes {
                what: self.what,
                extra,
            });
        }
        Ok(())
    }
}

fn check_string(what: &'static str, b: &[u8]) -> Result<String, WireError> {
    if b.contains(&0) {
        return Err(WireError::ContainsNul { what });
    }
    String::from_utf8(b.to_vec()).map_err(|_| WireError::NotUtf8 { what })
}

// ---- handshake ------------------------------------------------------------

/// The server's greeting: NBDMAGIC, IHAVEOPT, handshake flags (18 bytes).
pub fn encode_greeting(out: &mut Vec<u8>, flags: u16) {
    out.extend_from_slice(&NBDMAGIC.to_be_bytes());
    out.extend_from_slice(&IHAVEOPT.to_be_bytes());
    out.extend_from_slice(&flags.to_be_bytes());
}

/// One option header from the client: IHAVEOPT, option, data length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OptionHeader {
    pub option: u32,
    pub len: u32,
}

impl OptionHeader {
    pub const SIZE: usize = 16;

    pub fn parse(b: &[u8; Self::SIZE]) -> Result<OptionHeader, WireError> {
        let mut c = Cursor::new("option header", b);
        let magic = c.u64()?;
        if magic != IHAVEOPT {
            return Err(WireError::BadMagic {
                what: "option header",
                got: magic,
            });
        }
        Ok(OptionHeader {
            option: c.u32()?,
            len: c.u32()?,
        })
    }

    pub fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&IHAVEOPT.to_be_bytes());
        out.extend_from_slice(&self.option.to_be_bytes());
        out.extend_from_slice(&self.len.to_be_bytes());
    }
}

/// One option reply: magic, option, reply type, length, payload.
pub fn encode_option_reply(out: &mut Vec<u8>, option: u32, rep: u32, payload: &[u8]) {
    out.extend_from_slice(&OPT_REPLY_MAGIC.to_be_bytes());
    out.extend_from_slice(&option.to_be_bytes());
    out.extend_from_slice(&rep.to_be_bytes());
    out.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    out.extend_from_slice(payload);
}

/// A decoded option reply (client side; used by tests).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OptionReply {
    pub option: u32,
    pub rep: u32,
    pub len: u32,
}

impl OptionReply {
    pub const SIZE: usize = 20;
    pub fn parse(b: &[u8; Self::SIZE]) -> Result<OptionReply, WireError> {
        let mut c = Cursor::new("option reply", b);
        let magic = c.u64()?;
        if magic != OPT_REPLY_MAGIC {
            return Err(WireError::BadMagic {
                what: "option reply",
                got: magic,
            });
        }
        Ok(OptionReply {
            option: c.u32()?,
            rep: c.u32()?,
            len: c.u32()?,
        })
    }
}

/// `NBD_REP_SERVER` payload: name length, name, then a human description.
pub fn encode_rep_server(out: &mut Vec<u8>, name: &str, description: &str) {
    out.extend_from_slice(&(name.len() as u32).to_be_bytes());
    out.extend_from_slice(name.as_bytes());
    out.extend_from_slice(description.as_bytes());
}

/// `NBD_INFO_EXPORT` payload: type, size, transmission flags.
pub fn encode_info_export(out: &mut Vec<u8>, size: u64, tflags: u16) {
    out.extend_from_slice(&INFO_EXPORT.to_be_bytes());
    out.extend_from_slice(&size.to_be_bytes());
    out.extend_from_slice(&tflags.to_be_bytes());
}

/// `NBD_INFO_NAME` / `NBD_INFO_DESCRIPTION` payload.
pub fn encode_info_string(out: &mut Vec<u8>, info: u16, s: &str) {
    out.extend_from_slice(&info.to_be_bytes());
    out.extend_from_slice(s.as_bytes());
}

/// `NBD_INFO_BLOCK_SIZE` payload: minimum, preferred, maximum.
pub fn encode_info_block_size(out: &mut Vec<u8>, min: u32, preferred: u32, max: u32) {
    out.extend_from_slice(&INFO_BLOCK_SIZE.to_be_bytes());
    out.extend_from_slice(&min.to_be_bytes());
    out.extend_from_slice(&preferred.to_be_bytes());
    out.extend_from_slice(&max.to_be_bytes());
}

/// Reply to `NBD_OPT_EXPORT_NAME`: size, flags, and 124 zero bytes unless
/// the client negotiated NO_ZEROES.
pub fn encode_export_name_reply(out: &mut Vec<u8>, size: u64, tflags: u16, no_zeroes: bool) {
    out.extend_from_slice(&size.to_be_bytes());
    out.extend_from_slice(&tflags.to_be_bytes());
    if !no_zeroes {
        out.extend_from_slice(&[0u8; 124]);
    }
}

/// Data of `NBD_OPT_GO` / `NBD_OPT_INFO`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GoRequest {
    pub name: String,
    pub infos: Vec<u16>,
}

impl GoRequest {
    pub fn parse(b: &[u8]) -> Result<GoRequest, WireError> {
        let mut c = Cursor::new("NBD_OPT_GO/INFO data", b);
        let name_len = c.u32()? as usize;
        let name = c.string(name_len)?;
        let n = c.u16()? as usize;
        let mut infos = Vec::with_capacity(n.min(16));
        for _ in 0..n {
            infos.push(c.u16()?);
        }
        c.finish()?;
        Ok(GoRequest { name, infos })
    }

    pub fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&(self.name.len() as u32).to_be_bytes());
        out.extend_from_slice(self.name.as_bytes());
        out.extend_from_slice(&(self.infos.len() as u16).to_be_bytes());
        for i in &self.infos {
            out.extend_from_slice(&i.to_be_bytes());
        }
    }
}

/// Data of `NBD_OPT_LIST_META_CONTEXT` / `NBD_OPT_SET_META_CONTEXT`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MetaRequest {
    pub export: String,
    pub queries: Vec<String>,
}

impl MetaRequest {
    pub fn parse(b: &[u8]) -> Result<MetaRequest, WireError> {
        let mut c = Cursor::new("meta context data", b);
        let name_len = c.u32()? as usize;
        let export = c.string(name_len)?;
        let n = c.u32()? as usize;
        let mut queries = Vec::with_capacity(n.min(16));
        for _ in 0..n {
            let l = c.u32()? as usize;
            queries.push(c.string(l)?);
        }
        c.finish()?;
        Ok(MetaRequest { export, queries })
    }

    pub fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&(self.export.len() as u32).to_be_bytes());
        out.extend_from_slice(self.export.as_bytes());
        out.extend_from_slice(&(self.queries.len() as u32).to_be_bytes());
        for q in &self.queries {
            out.extend_from_slice(&(q.len() as u32).to_be_bytes());
            out.extend_from_slice(q.as_bytes());
        }
    }
}

/// `NBD_REP_META_CONTEXT` payload: context id, name.
pub fn encode_meta_context(out: &mut Vec<u8>, id: u32, name: &str) {
    out.extend_from_slice(&id.to_be_bytes());
    out.extend_from_slice(name.as_bytes());
}

/// Decode an option's payload that is just a string (OPT_EXPORT_NAME).
pub fn parse_name(what: &'static str, b: &[u8]) -> Result<String, WireError> {
    if b.len() > MAX_STRING {
        return Err(WireError::StringTooLong { what, len: b.len() });
    }
    check_string(what, b)
}

// ---- transmission -------------------------------------------------------

/// A request header (28 bytes; a WRITE's payload follows it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request {
    pub flags: u16,
    pub cmd: u16,
    pub handle: u64,
    pub offset: u64,
    pub len: u32,
}

impl Request {
    pub const SIZE: usize = 28;

    pub fn parse(b: &[u8; Self::SIZE]) -> Result<Request, WireError> {
        let magic = u32::from_be_bytes([b[0], b[1], b[2], b[3]]);
        if magic != REQUEST_MAGIC {
            return Err(WireError::BadMagic {
                what: "request",
                got: magic as u64,
            });
        }
        let mut h = [0u8; 8];
        h.copy_from_slice(&b[8..16]);
        let mut o = [0u8; 8];
        o.copy_from_slice(&b[16..24]);
        Ok(Request {
            flags: u16::from_be_bytes([b[4], b[5]]),
            cmd: u16::from_be_bytes([b[6], b[7]]),
            handle: u64::from_be_bytes(h),
            offset: u64::from_be_bytes(o),
            len: u32::from_be_bytes([b[24], b[25], b[26], b[27]]),
        })
    }

    pub fn encode(&self) -> [u8; Self::SIZE] {
        let mut b = [0u8; Self::SIZE];
        b[0..4].copy_from_slice(&REQUEST_MAGIC.to_be_bytes());
        b[4..6].copy_from_slice(&self.flags.to_be_bytes());
        b[6..8].copy_from_slice(&self.cmd.to_be_bytes());
        b[8..16].copy_from_slice(&self.handle.to_be_bytes());
        b[16..24].copy_from_slice(&self.offset.to_be_bytes());
        b[24..28].copy_from_slice(&self.len.to_be_bytes());
        b
    }
}

/// Simple reply header (16 bytes); a successful READ's data follows.
pub fn encode_simple_reply(out: &mut Vec<u8>, error: u32, handle: u64) {
    out.extend_from_slice(&simple_reply(error, handle));
}

pub fn simple_reply(error: u32, handle: u64) -> [u8; 16] {
    let mut b = [0u8; 16];
    b[0..4].copy_from_slice(&SIMPLE_REPLY_MAGIC.to_be_bytes());
    b[4..8].copy_from_slice(&error.to_be_bytes());
    b[8..16].copy_from_slice(&handle.to_be_bytes());
    b
}

/// A decoded simple reply header (client side; used by tests).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SimpleReply {
    pub error: u32,
    pub handle: u64,
}

impl SimpleReply {
    pub const SIZE: usize = 16;
    pub fn parse(b: &[u8; Self::SIZE]) -> Result<SimpleReply, WireError> {
        let mut c = Cursor::new("simple reply", b);
        let magic = c.u32()?;
        if magic != SIMPLE_REPLY_MAGIC {
            return Err(WireError::BadMagic {
                what: "simple reply",
                got: magic as u64,
            });
        }
        Ok(SimpleReply {
            error: c.u32()?,
            handle: c.u64()?,
        })
    }
}

/// Structured reply chunk header (20 bytes); `len` payload bytes follow.
pub fn chunk_header(flags: u16, typ: u16, handle: u64, len: u32) -> [u8; 20] {
    let mut b = [0u8; 20];
    b[0..4].copy_from_slice(&STRUCTURED_REPLY_MAGIC.to_be_bytes());
    b[4..6].copy_from_slice(&flags.to_be_bytes());
    b[6..8].copy_from_slice(&typ.to_be_bytes());
    b[8..16].copy_from_slice(&handle.to_be_bytes());
    b[16..20].copy_from_slice(&len.to_be_bytes());
    b
}

/// A decoded chunk header (client side; used by tests).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkHeader {
    pub flags: u16,
    pub typ: u16,
    pub handle: u64,
    pub len: u32,
}

impl ChunkHeader {
    pub const SIZE: usize = 20;
    pub fn parse(b: &[u8; Self::SIZE]) -> Result<ChunkHeader, WireError> {
        let mut c = Cursor::new("structured reply chunk", b);
        let magic = c.u32()?;
        if magic != STRUCTURED_REPLY_MAGIC {
            return Err(WireError::BadMagic {
                what: "structured reply chunk",
                got: magic as u64,
            });
        }
        Ok(ChunkHeader {
            flags: c.u16()?,
            typ: c.u16()?,
            handle: c.u64()?,
            len: c.u32()?,
        })
    }
}

/// Header of an OFFSET_DATA chunk carrying `data_len` bytes at `offset`;
/// the data follows (28 bytes here).
pub fn encode_data_chunk_header(
    out: &mut Vec<u8>,
    flags: u16,
    handle: u64,
    offset: u64,
    data_len: u32,
) {
    out.extend_from_slice(&chunk_header(
        flags,
        REPLY_TYPE_OFFSET_DATA,
        handle,
        data_len + 8,
    ));
    out.extend_from_slice(&offset.to_be_bytes());
}

/// A complete OFFSET_HOLE chunk.
pub fn encode_hole_chunk(out: &mut Vec<u8>, flags: u16, handle: u64, offset: u64, len: u32) {
    out.extend_from_slice(&chunk_header(flags, REPLY_TYPE_OFFSET_HOLE, handle, 12));
    out.extend_from_slice(&offset.to_be_bytes());
    out.extend_from_slice(&len.to_be_bytes());
}

/// A complete ERROR chunk with a human-readable message (final).
pub fn encode_error_chunk(out: &mut Vec<u8>, handle: u64, error: u32, msg: &str) {
    let msg = &msg.as_bytes()[..msg.len().min(MAX_STRING)];
    out.extend_from_slice(&chunk_header(
        REPLY_FLAG_DONE,
        REPLY_TYPE_ERROR,
        handle,
        6 + msg.len() as u32,
    ));
    out.extend_from_slice(&error.to_be_bytes());
    out.extend_from_slice(&(msg.len() as u16).to_be_bytes());
    out.extend_from_slice(msg);
}

/// A complete NONE chunk: "done, no error".
pub fn encode_none_chunk(out: &mut Vec<u8>, handle: u64) {
    out.extend_from_slice(&chunk_header(REPLY_FLAG_DONE, REPLY_TYPE_NONE, handle, 0));
}

/// A complete BLOCK_STATUS chunk for one context: (length, flags) pairs.
pub fn encode_block_status_chunk(
    out: &mut Vec<u8>,
    flags: u16,
    handle: u64,
    context: u32,
    descriptors: &[(u32, u32)],
) {
    out.extend_from_slice(&chunk_header(
        flags,
        REPLY_TYPE_BLOCK_STATUS,
        handle,
        4 + 8 * descriptors.len() as u32,
    ));
    out.extend_from_slice(&context.to_be_bytes());
    for (len, st) in descriptors {
        out.extend_from_slice(&len.to_be_bytes());
        out.extend_from_slice(&st.to_be_bytes());
    }
}

#[cfg(test)]
mod tests;
