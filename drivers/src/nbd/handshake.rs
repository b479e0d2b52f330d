//! Client negotiation (`doc/proto.md`, "Fixed newstyle negotiation"):
//! greeting, client flags, STARTTLS when the URI asks for TLS, then
//! NBD_OPT_STRUCTURED_REPLY, NBD_OPT_SET_META_CONTEXT `base:allocation`
//! and NBD_OPT_GO asking for NBD_INFO_BLOCK_SIZE, the order libnbd uses.
//! A server that does not know OPT_GO (an old nbd-server) gets
//! NBD_OPT_EXPORT_NAME instead, as the kernel's `nbd-client` does; one
//! that refuses structured replies is spoken to with simple replies.
//!
//! The whole negotiation runs under one absolute deadline (each read and
//! write waits at most what is left of it), so a server that accepts but
//! never answers, or trickles its replies a byte at a time, fails the
//! table load within its bound.

use super::proto::*;
use super::uri::{Endpoint, NbdUri};
use super::wire::{self, Receiver, Sender, Socket};
use rustls::{ClientConfig, ClientConnection, StreamOwned};
use std::io::{self, Read, Write};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Longest option reply payload the client accepts (a description or
/// an error message; the spec bounds strings at 4 KiB).
const MAX_OPTION_REPLY: u32 = 64 * 1024;
/// The largest request the protocol lets a client assume without
/// NBD_INFO_BLOCK_SIZE.
pub const DEFAULT_MAX_BLOCK: u32 = 32 << 20;

/// Why negotiation failed.
#[derive(Debug, thiserror::Error)]
pub enum HandshakeError {
    #[error("{step}")]
    Io {
        step: &'static str,
        #[source]
        source: io::Error,
    },
    #[error("protocol error: {0}")]
    Protocol(String),
    #[error("server refused {option}: {reason}{}", if message.is_empty() { String::new() } else { format!(" ({message})") })]
    Refused {
        option: &'static str,
        reason: &'static str,
        message: String,
    },
    #[error("TLS: {0}")]
    Tls(String),
}

impl HandshakeError {
    /// The error with its cause on one line (for `status`'s last_error).
    pub fn describe(&self) -> String {
        match self {
            HandshakeError::Io { step, source } => format!("{step}: {source}"),
            e => e.to_string(),
        }
    }
}

fn io_step(step: &'static str) -> impl FnOnce(io::Error) -> HandshakeError {
    move |source| {
        let source = if matches!(
            source.kind(),
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
        ) {
            io::Error::new(io::ErrorKind::TimedOut, "the server did not answer in time")
        } else {
            source
        };
        HandshakeError::Io { step, source }
    }
}

/// What the server told us about the export.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExportInfo {
    pub size: u64,
    pub tflags: u16,
    pub min_block: u32,
    pub preferred_block: u32,
    pub max_block: u32,
    pub structured: bool,
    /// The `base:allocation` context id, when the server agreed to it.
    pub allocation_context: Option<u32>,
}

impl ExportInfo {
    /// What a client may assume before the server says otherwise.
    pub fn protocol_defaults() -> ExportInfo {
        ExportInfo {
            size: 0,
            tflags: 0,
            min_block: 1,
            preferred_block: 4096,
            max_block: DEFAULT_MAX_BLOCK,
            structured: false,
            allocation_context: None,
        }
    }

    pub fn has(&self, flag: u16) -> bool {
        self.tflags & flag != 0
    }
}

fn reason(rep: u32) -> &'static str {
    match rep {
        REP_ERR_UNSUP => "unsupported",
        REP_ERR_POLICY => "forbidden by policy",
        REP_ERR_INVALID => "invalid",
        REP_ERR_PLATFORM => "not available on this platform",
        REP_ERR_TLS_REQD => "TLS required (use nbds:// or nbds+unix://)",
        REP_ERR_UNKNOWN => "no such export",
        REP_ERR_SHUTDOWN => "server shutting down",
        REP_ERR_BLOCK_SIZE_REQD => "block size constraints required",
        REP_ERR_TOO_BIG => "too big",
        _ => "error",
    }
}

fn send_option<S: Write>(s: &mut S, option: u32, data: &[u8]) -> Result<(), HandshakeError> {
    let mut v = Vec::with_capacity(16 + data.len());
    OptionHeader {
        option,
        len: data.len() as u32,
    }
    .encode(&mut v);
    v.extend_from_slice(data);
    s.write_all(&v).map_err(io_step("sending an option"))?;
    s.flush().map_err(io_step("sending an option"))
}

fn read_reply<S: Read>(s: &mut S, option: u32) -> Result<(u32, Vec<u8>), HandshakeError> {
    let mut h = [0u8; OptionReply::SIZE];
    s.read_exact(&mut h)
        .map_err(io_step("reading an option reply"))?;
    let r = OptionReply::parse(&h).map_err(|e| HandshakeError::Protocol(e.to_string()))?;
    if r.option != option {
        return Err(HandshakeError::Protocol(format!(
            "reply to option {} while waiting for option {option}",
            r.option
        )));
    }
    if r.len > MAX_OPTION_REPLY {
        return Err(HandshakeError::Protocol(format!(
            "option reply of {} bytes",
            r.len
        )));
    }
    let mut payload = vec![0u8; r.len as usize];
    s.read_exact(&mut payload)
        .map_err(io_step("reading an option reply"))?;
    Ok((r.rep, payload))
}

fn refused(option: &'static str, rep: u32, payload: &[u8]) -> HandshakeError {
    HandshakeError::Refused {
        option,
        reason: reason(rep),
        message: String::from_utf8_lossy(payload).into_owned(),
    }
}

/// A reply that must be a plain ACK (STARTTLS, STRUCTURED_REPLY); Ok(false)
/// when the server says it does not support the option.
fn expect_ack<S: Read>(s: &mut S, option: u32, name: &'static str) -> Result<bool, HandshakeError> {
    let (rep, payload) = read_reply(s, option)?;
    match rep {
        REP_ACK => Ok(true),
        // Anything but "TLS first" or "going away" just means "not
        // offered" to an optional extension.
        r if is_rep_err(r)
            && option != OPT_STARTTLS
            && r != REP_ERR_TLS_REQD
            && r != REP_ERR_SHUTDOWN =>
        {
            Ok(false)
        }
        r if is_rep_err(r) => Err(refused(name, r, &payload)),
        r => Err(HandshakeError::Protocol(format!(
            "unexpected reply {r} to {name}"
        ))),
    }
}

/// NBD_OPT_SET_META_CONTEXT `base:allocation`; the context id if granted.
fn set_meta_context<S: Read + Write>(
    s: &mut S,
    export: &str,
) -> Result<Option<u32>, HandshakeError> {
    let mut data = Vec::new();
    MetaRequest {
        export: export.to_string(),
        queries: vec![BASE_ALLOCATION.to_string()],
    }
    .encode(&mut data);
    send_option(s, OPT_SET_META_CONTEXT, &data)?;
    let mut id = None;
    loop {
        let (rep, payload) = read_reply(s, OPT_SET_META_CONTEXT)?;
        match rep {
            REP_META_CONTEXT if payload.len() >= 4 => {
                if &payload[4..] == BASE_ALLOCATION.as_bytes() {
                    id = Some(u32::from_be_bytes([
                        payload[0], payload[1], payload[2], payload[3],
                    ]));
                }
            }
            REP_ACK => return Ok(id),
            // A server without metadata contexts: no extent map.
            r if is_rep_err(r) => return Ok(None),
            r => {
                return Err(HandshakeError::Protocol(format!(
                    "unexpected reply {r} to NBD_OPT_SET_META_CONTEXT"
                )))
            }
        }
    }
}

/// Apply one NBD_REP_INFO payload; true if it was NBD_INFO_EXPORT.
fn apply_info(info: &mut ExportInfo, p: &[u8]) -> Result<bool, HandshakeError> {
    let be32 = |b: &[u8]| u32::from_be_bytes([b[0], b[1], b[2], b[3]]);
    if p.len() < 2 {
        return Err(HandshakeError::Protocol("empty NBD_REP_INFO".into()));
    }
    match u16::from_be_bytes([p[0], p[1]]) {
        INFO_EXPORT if p.len() == 12 => {
            let mut b = [0u8; 8];
            b.copy_from_slice(&p[2..10]);
            info.size = u64::from_be_bytes(b);
            info.tflags = u16::from_be_bytes([p[10], p[11]]);
            return Ok(true);
        }
        INFO_BLOCK_SIZE if p.len() == 14 => {
            info.min_block = be32(&p[2..6]);
            info.preferred_block = be32(&p[6..10]);
            info.max_block = be32(&p[10..14]);
        }
        INFO_EXPORT | INFO_BLOCK_SIZE => {
            return Err(HandshakeError::Protocol(format!(
                "NBD_REP_INFO of {} bytes",
                p.len()
            )))
        }
        _ => {}
    }
    Ok(false)
}

/// NBD_OPT_GO; false when the server does not know it.
fn go<S: Read + Write>(
    s: &mut S,
    export: &str,
    info: &mut ExportInfo,
) -> Result<bool, HandshakeError> {
    let mut data = Vec::new();
    GoRequest {
        name: export.to_string(),
        infos: vec![INFO_BLOCK_SIZE],
    }
    .encode(&mut data);
    send_option(s, OPT_GO, &data)?;
    let mut got_export = false;
    loop {
        let (rep, payload) = read_reply(s, OPT_GO)?;
        match rep {
            REP_INFO => got_export |= apply_info(info, &payload)?,
            REP_ACK if got_export => return Ok(true),
            REP_ACK => {
                return Err(HandshakeError::Protocol(
                    "NBD_OPT_GO acknowledged without NBD_INFO_EXPORT".into(),
                ))
            }
            REP_ERR_UNSUP => return Ok(false),
            r if is_rep_err(r) => return Err(refused("NBD_OPT_GO", r, &payload)),
            _ => {} // replies a client must ignore
        }
    }
}

/// NBD_OPT_EXPORT_NAME (servers without OPT_GO): size and flags follow
/// with no reply header; the server closes on an unknown name.
fn export_name<S: Read + Write>(
    s: &mut S,
    export: &str,
    no_zeroes: bool,
    info: &mut ExportInfo,
) -> Result<(), HandshakeError> {
    send_option(s, OPT_EXPORT_NAME, export.as_bytes())?;
    let mut b = [0u8; 10];
    s.read_exact(&mut b)
        .map_err(io_step("NBD_OPT_EXPORT_NAME (unknown export?)"))?;
    info.size = u64::from_be_bytes(b[..8].try_into().unwrap_or([0; 8]));
    info.tflags = u16::from_be_bytes([b[8], b[9]]);
    if !no_zeroes {
        let mut z = [0u8; 124];
        s.read_exact(&mut z)
            .map_err(io_step("NBD_OPT_EXPORT_NAME padding"))?;
    }
    Ok(())
}

/// Everything after the greeting (and STARTTLS): options until the export
/// is chosen.
fn negotiate<S: Read + Write>(
    s: &mut S,
    export: &str,
    no_zeroes: bool,
) -> Result<ExportInfo, HandshakeError> {
    let mut info = ExportInfo::protocol_defaults();
    send_option(s, OPT_STRUCTURED_REPLY, &[])?;
    info.structured = expect_ack(s, OPT_STRUCTURED_REPLY, "NBD_OPT_STRUCTURED_REPLY")?;
    if info.structured {
        info.allocation_context = set_meta_context(s, export)?;
    }
    if !go(s, export, &mut info)? {
        info.allocation_context = None;
        export_name(s, export, no_zeroes, &mut info)?;
    }
    check_block_sizes(&mut info)?;
    Ok(info)
}

/// Block-size constraints as the spec bounds them; absent ones take the
/// protocol defaults.
fn check_block_sizes(info: &mut ExportInfo) -> Result<(), HandshakeError> {
    let (min, pref, max) = (info.min_block, info.preferred_block, info.max_block);
    if !min.is_power_of_two() || min > 64 * 1024 {
        return Err(HandshakeError::Protocol(format!(
            "minimum block size {min} is not a power of two up to 64 KiB"
        )));
    }
    if !pref.is_power_of_two() || pref < min {
        info.preferred_block = min.max(4096);
    }
    if max < min {
        return Err(HandshakeError::Protocol(format!(
            "maximum block size {max} is below the minimum {min}"
        )));
    }
    Ok(())
}

/// A negotiated connection ready for transmission.
pub struct Connected {
    pub sender: Sender,
    pub receiver: Receiver,
    pub info: ExportInfo,
}

/// The socket during negotiation: every read and write bounded by what
/// is left of one deadline, however the server paces its bytes.
struct Timed {
    sock: Socket,
    deadline: Instant,
}

impl Timed {
    fn left(&self) -> io::Result<Duration> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "the server did not finish the handshake in time",
            ));
        }
        Ok(left)
    }
}

impl Read for Timed {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let left = self.left()?;
        self.sock.set_read_timeout(Some(left))?;
        self.sock.read(buf)
    }
}

impl Write for Timed {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let left = self.left()?;
        self.sock.set_write_timeout(Some(left))?;
        self.sock.write(buf)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

fn greeting<S: Read + Write>(sock: &mut S) -> Result<bool, HandshakeError> {
    let mut g = [0u8; 18];
    sock.read_exact(&mut g)
        .map_err(io_step("reading the greeting"))?;
    let m1 = u64::from_be_bytes(g[0..8].try_into().unwrap_or([0; 8]));
    let m2 = u64::from_be_bytes(g[8..16].try_into().unwrap_or([0; 8]));
    if m1 != NBDMAGIC || m2 != IHAVEOPT {
        return Err(HandshakeError::Protocol(
            "not a newstyle NBD server (bad greeting magic)".into(),
        ));
    }
    let flags = u16::from_be_bytes([g[16], g[17]]);
    if flags & FLAG_FIXED_NEWSTYLE == 0 {
        return Err(HandshakeError::Protocol(
            "server does not speak fixed newstyle".into(),
        ));
    }
    let no_zeroes = flags & FLAG_NO_ZEROES != 0;
    let cflags = FLAG_C_FIXED_NEWSTYLE | if no_zeroes { FLAG_C_NO_ZEROES } else { 0 };
    sock.write_all(&cflags.to_be_bytes())
        .map_err(io_step("sending client flags"))?;
    Ok(no_zeroes)
}

/// Connect to `uri` and negotiate, every step bounded by `timeout`.
pub fn connect(
    uri: &NbdUri,
    tls: Option<&Arc<ClientConfig>>,
    timeout: Duration,
) -> Result<Connected, HandshakeError> {
    let sock = match &uri.endpoint {
        Endpoint::Tcp { host, port } => Socket::connect_tcp(host, *port, timeout),
        Endpoint::Unix(p) => Socket::connect_unix(p),
    }
    .map_err(io_step("connecting"))?;
    sock.set_user_timeout(timeout)
        .map_err(io_step("setting socket timeouts"))?;
    let mut sock = Timed {
        sock,
        deadline: Instant::now() + timeout,
    };
    let no_zeroes = greeting(&mut sock)?;
    let (info, sock, conn) = match tls {
        None => (negotiate(&mut sock, &uri.export, no_zeroes)?, sock, None),
        Some(cfg) => {
            send_option(&mut sock, OPT_STARTTLS, &[])?;
            expect_ack(&mut sock, OPT_STARTTLS, "NBD_OPT_STARTTLS")?;
            let name = rustls::pki_types::ServerName::try_from(uri.tls_server_name().to_string())
                .map_err(|e| HandshakeError::Tls(e.to_string()))?;
            let conn = ClientConnection::new(cfg.clone(), name)
                .map_err(|e| HandshakeError::Tls(e.to_string()))?;
            let mut stream = StreamOwned::new(conn, sock);
            let info = negotiate(&mut stream, &uri.export, no_zeroes)?;
            let (conn, sock) = stream.into_parts();
            (info, sock, Some(conn))
        }
    };
    let sock = sock.sock;
    sock.set_read_timeout(None)
        .and_then(|_| sock.set_write_timeout(None))
        .map_err(io_step("setting socket timeouts"))?;
    let (sender, receiver) = wire::split(sock, conn).map_err(io_step("splitting the socket"))?;
    Ok(Connected {
        sender,
        receiver,
        info,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn info_replies_fill_the_export() {
        let mut i = ExportInfo::protocol_defaults();
        let mut p = Vec::new();
        encode_info_export(&mut p, 1 << 30, TFLAG_HAS_FLAGS | TFLAG_SEND_FLUSH);
        assert!(apply_info(&mut i, &p).unwrap());
        assert_eq!(
            (i.size, i.tflags),
            (1 << 30, TFLAG_HAS_FLAGS | TFLAG_SEND_FLUSH)
        );
        let mut p = Vec::new();
        encode_info_block_size(&mut p, 512, 65536, 1 << 20);
        assert!(!apply_info(&mut i, &p).unwrap());
        assert_eq!(
            (i.min_block, i.preferred_block, i.max_block),
            (512, 65536, 1 << 20)
        );
        // A 12-byte NBD_INFO_NAME is not the export info.
        let mut p = Vec::new();
        encode_info_string(&mut p, INFO_NAME, "ten bytes!");
        assert_eq!(p.len(), 12);
        assert!(!apply_info(&mut i, &p).unwrap());
        assert!(apply_info(&mut i, &p[..11]).is_ok());
        assert!(apply_info(&mut i, &[0, 0, 1]).is_err());
    }

    #[test]
    fn block_size_constraints_are_checked() {
        let mut i = ExportInfo::protocol_defaults();
        i.min_block = 3;
        assert!(check_block_sizes(&mut i).is_err());
        let mut i = ExportInfo::protocol_defaults();
        i.min_block = 4096;
        i.max_block = 512;
        assert!(check_block_sizes(&mut i).is_err());
        let mut i = ExportInfo::protocol_defaults();
        i.preferred_block = 1000;
        check_block_sizes(&mut i).unwrap();
        assert_eq!(i.preferred_block, 4096);
    }
}
