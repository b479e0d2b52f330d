//! The floor server's fixed-newstyle handshake (`doc/proto.md`, "Option
//! haggling"), blocking and bounded by a timeout: what fio's nbd engine
//! (libnbd), qemu-io and nbdinfo need to reach the transmission phase,
//! and nothing else. NBD_OPT_GO, NBD_OPT_INFO and NBD_OPT_EXPORT_NAME of
//! the one export, NBD_OPT_STARTTLS when certificates were given (then
//! required: every other option is refused with NBD_REP_ERR_TLS_REQD
//! until TLS is up), NBD_OPT_ABORT; every other option, structured
//! replies and meta contexts among them, gets NBD_REP_ERR_UNSUP, so
//! replies stay simple (the fewest bytes a reply can take).

use crate::{conn::MAX_LEN, Export, Kind};
use blkstack_nbd::proto::{self, GoRequest, OptionHeader};
use rustls::{ServerConfig, ServerConnection};
use std::io::{self, Read, Write};
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::time::Duration;

/// Options a client may send before it picks the export.
const MAX_OPTIONS: usize = 32;
/// The largest option payload read (names, info requests).
const MAX_OPTION_LEN: u32 = 4096;
/// How long a handshake may wait for the client (it blocks the server).
const TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Debug, thiserror::Error)]
pub enum HandshakeError {
    #[error("client flags {0:#x} include bits this server does not know")]
    ClientFlags(u32),
    #[error("malformed option: {0}")]
    Wire(#[from] proto::WireError),
    #[error("option {option} carries {len} bytes, more than the {MAX_OPTION_LEN} allowed")]
    OptionTooLong { option: u32, len: u32 },
    #[error("NBD_OPT_EXPORT_NAME asks for {0:?}, not the one export")]
    UnknownExport(String),
    #[error("NBD_OPT_EXPORT_NAME before STARTTLS, and TLS is required")]
    TlsRequired,
    #[error("more than {MAX_OPTIONS} options")]
    TooManyOptions,
    #[error("TLS: {0}")]
    Tls(#[from] rustls::Error),
    #[error(transparent)]
    Io(#[from] io::Error),
}

/// The socket, and the TLS session once the client started one.
struct Io {
    sock: UnixStream,
    tls: Option<ServerConnection>,
}

impl Io {
    fn read_exact(&mut self, b: &mut [u8]) -> io::Result<()> {
        match &mut self.tls {
            Some(t) => rustls::Stream::new(t, &mut self.sock).read_exact(b),
            None => self.sock.read_exact(b),
        }
    }

    fn send(&mut self, b: &[u8]) -> io::Result<()> {
        match &mut self.tls {
            Some(t) => {
                let mut s = rustls::Stream::new(t, &mut self.sock);
                s.write_all(b)?;
                s.flush()
            }
            None => self.sock.write_all(b),
        }
    }

    fn reply(&mut self, option: u32, rep: u32, payload: &[u8]) -> io::Result<()> {
        let mut v = Vec::with_capacity(20 + payload.len());
        proto::encode_option_reply(&mut v, option, rep, payload);
        self.send(&v)
    }
}

/// The transmission flags of the export.
fn tflags(export: &Export) -> u16 {
    let base = proto::TFLAG_HAS_FLAGS | proto::TFLAG_CAN_MULTI_CONN;
    match export.kind {
        Kind::Memory => base | proto::TFLAG_SEND_FLUSH,
        Kind::Null | Kind::Delay => base | proto::TFLAG_READ_ONLY,
    }
}

/// Run the handshake on a new connection: `Ok(None)` when the client
/// aborted, else the socket and its TLS session, ready to transmit.
pub fn handshake(
    sock: UnixStream,
    export: &Export,
    tls: Option<Arc<ServerConfig>>,
) -> Result<Option<(UnixStream, Option<ServerConnection>)>, HandshakeError> {
    sock.set_nonblocking(false)?;
    sock.set_read_timeout(Some(TIMEOUT))?;
    sock.set_write_timeout(Some(TIMEOUT))?;
    let mut io = Io { sock, tls: None };
    let mut v = Vec::new();
    proto::encode_greeting(&mut v, proto::FLAG_FIXED_NEWSTYLE | proto::FLAG_NO_ZEROES);
    io.send(&v)?;
    let mut cf = [0u8; 4];
    io.read_exact(&mut cf)?;
    let cflags = u32::from_be_bytes(cf);
    if cflags & !(proto::FLAG_C_FIXED_NEWSTYLE | proto::FLAG_C_NO_ZEROES) != 0 {
        return Err(HandshakeError::ClientFlags(cflags));
    }
    let no_zeroes = cflags & proto::FLAG_C_NO_ZEROES != 0;
    for _ in 0..MAX_OPTIONS {
        let mut h = [0u8; OptionHeader::SIZE];
        io.read_exact(&mut h)?;
        let hdr = OptionHeader::parse(&h)?;
        if hdr.len > MAX_OPTION_LEN {
            return Err(HandshakeError::OptionTooLong {
                option: hdr.option,
                len: hdr.len,
            });
        }
        let mut data = vec![0u8; hdr.len as usize];
        io.read_exact(&mut data)?;
        let tls_missing = tls.is_some() && io.tls.is_none();
        match hdr.option {
            proto::OPT_STARTTLS => match (&tls, io.tls.is_some()) {
                (None, _) => io.reply(hdr.option, proto::REP_ERR_POLICY, b"TLS is off")?,
                (Some(_), true) => io.reply(hdr.option, proto::REP_ERR_INVALID, b"TLS is on")?,
                (Some(cfg), false) => {
                    io.reply(hdr.option, proto::REP_ACK, &[])?;
                    let mut t = ServerConnection::new(cfg.clone())?;
                    while t.is_handshaking() {
                        t.complete_io(&mut io.sock)?;
                    }
                    io.tls = Some(t);
                }
            },
            proto::OPT_ABORT => {
                let _ = io.reply(hdr.option, proto::REP_ACK, &[]);
                return Ok(None);
            }
            _ if tls_missing => {
                if hdr.option == proto::OPT_EXPORT_NAME {
                    return Err(HandshakeError::TlsRequired);
                }
                io.reply(hdr.option, proto::REP_ERR_TLS_REQD, b"STARTTLS first")?;
            }
            proto::OPT_EXPORT_NAME => {
                let name = proto::parse_name("NBD_OPT_EXPORT_NAME", &data)?;
                if !name.is_empty() && name != export.name {
                    return Err(HandshakeError::UnknownExport(name));
                }
                let mut v = Vec::new();
                proto::encode_export_name_reply(&mut v, export.size, tflags(export), no_zeroes);
                io.send(&v)?;
                return Ok(Some(transmit(io)?));
            }
            proto::OPT_GO | proto::OPT_INFO => {
                let go = GoRequest::parse(&data)?;
                if !go.name.is_empty() && go.name != export.name {
                    io.reply(hdr.option, proto::REP_ERR_UNKNOWN, b"no such export")?;
                    continue;
                }
                let mut v = Vec::new();
                proto::encode_info_export(&mut v, export.size, tflags(export));
                io.reply(hdr.option, proto::REP_INFO, &v)?;
                if go.infos.contains(&proto::INFO_BLOCK_SIZE) {
                    v.clear();
                    proto::encode_info_block_size(&mut v, 1, 4096, MAX_LEN);
                    io.reply(hdr.option, proto::REP_INFO, &v)?;
                }
                io.reply(hdr.option, proto::REP_ACK, &[])?;
                if hdr.option == proto::OPT_GO {
                    return Ok(Some(transmit(io)?));
                }
            }
            other => {
                tracing::debug!("refusing option {other}");
                io.reply(
                    other,
                    proto::REP_ERR_UNSUP,
                    b"not served by the floor probe",
                )?;
            }
        }
    }
    Err(HandshakeError::TooManyOptions)
}

/// Leave the handshake: no timeouts (the transmission phase polls).
fn transmit(io: Io) -> io::Result<(UnixStream, Option<ServerConnection>)> {
    io.sock.set_read_timeout(None)?;
    io.sock.set_write_timeout(None)?;
    Ok((io.sock, io.tls))
}
