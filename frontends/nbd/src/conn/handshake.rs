//! The fixed-newstyle handshake: the greeting, the client's flags, then
//! option haggling until NBD_OPT_EXPORT_NAME or NBD_OPT_GO picks an export
//! (`doc/proto.md`, "Option haggling"). As nbd-server and nbdkit structure
//! their option loop, each option has its own handler here; the loop only
//! reads an option and dispatches it.
//!
//! Options the server cannot answer (STARTTLS, unknown ones) get an error
//! reply and haggling goes on, as the spec asks of a fixed-newstyle
//! server. A client the server must drop instead (unknown client flags, a
//! malformed or oversized option, an unknown export asked for with
//! NBD_OPT_EXPORT_NAME, which has no error reply) ends the handshake with
//! a [`HandshakeError`] naming why.

use super::inbuf::InBuf;
use super::{BASE_ALLOCATION_ID, MAX_OPTIONS, MAX_OPTION_LEN};
use crate::export::Export;
use crate::limits::{HandshakeTicket, NegotiatedSlot};
use crate::proto::*;
use crate::sock::Sock;
use crate::tls::{TlsMode, TlsPolicy, TlsSession};
use std::io;

/// What the handshake settled on.
pub(super) struct Negotiated {
    pub(super) export: usize,
    pub(super) structured: bool,
    pub(super) base_allocation: bool,
    /// The client was told the block sizes (NBD_OPT_GO always sends
    /// NBD_INFO_BLOCK_SIZE; NBD_OPT_EXPORT_NAME cannot).
    pub(super) knows_block_size: bool,
    /// Its place among the negotiated connections (`None`: the server
    /// counts none, as the fuzzing entry point).
    pub(super) slot: Option<NegotiatedSlot>,
}

/// Why a handshake ended without an export.
#[derive(Debug, thiserror::Error)]
pub enum HandshakeError {
    /// The spec: the server MUST drop a client that sets unknown flags.
    #[error("client flags {0:#x} include bits this server does not know")]
    UnknownClientFlags(u32),
    #[error("malformed option header: {0}")]
    OptionHeader(#[source] WireError),
    #[error("option {option} carries {len} bytes, more than the {MAX_OPTION_LEN} allowed")]
    OptionTooLong { option: u32, len: u32 },
    #[error("NBD_OPT_EXPORT_NAME: {0}")]
    ExportName(#[source] WireError),
    /// NBD_OPT_EXPORT_NAME has no way to report an error: hang up.
    #[error("NBD_OPT_EXPORT_NAME asks for unknown export {0:?}")]
    UnknownExport(String),
    #[error("TLS is required, and the client chose an export without it")]
    TlsRequired,
    #[error("the client sent data after NBD_OPT_STARTTLS before the reply")]
    DataAfterStartTls,
    #[error("the client sent NBD_OPT_ABORT")]
    Aborted,
    #[error("the client sent more than {MAX_OPTIONS} options")]
    TooManyOptions,
    /// NBD_OPT_EXPORT_NAME cannot be refused: hang up.
    #[error("NBD_OPT_EXPORT_NAME with every negotiated connection taken")]
    TooManyConnections,
    #[error(transparent)]
    Io(#[from] io::Error),
}

/// What one option's handler decided.
enum Next {
    /// Read the next option.
    Haggle,
    /// Go to the transmission phase with this export.
    Transmit(Negotiated),
    /// STARTTLS accepted: acknowledge it, then speak TLS.
    StartTls,
}

/// Run the handshake on a fresh connection.
pub(super) fn handshake(
    sock: &Sock,
    inb: &mut InBuf,
    exports: &[Export],
    tls: &TlsPolicy,
    ticket: Option<HandshakeTicket>,
) -> Result<Negotiated, HandshakeError> {
    let mut v = Vec::new();
    encode_greeting(&mut v, FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES);
    sock.send_all(&v)?;
    let mut cf = [0u8; 4];
    inb.recv_exact(sock, &mut cf)?;
    let cflags = u32::from_be_bytes(cf);
    if cflags & !(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES) != 0 {
        return Err(HandshakeError::UnknownClientFlags(cflags));
    }
    let mut haggle = Haggle {
        sock,
        exports,
        no_zeroes: cflags & FLAG_C_NO_ZEROES != 0,
        structured: false,
        meta: None,
        tls,
        ticket,
        slot: None,
    };
    for _ in 0..MAX_OPTIONS {
        let (opt, data) = read_option(sock, inb)?;
        match haggle.option(opt, &data)? {
            Next::Transmit(n) => return Ok(n),
            Next::Haggle => {}
            Next::StartTls => {
                // The spec: nothing may follow STARTTLS before its reply.
                if inb.available() > 0 {
                    return Err(HandshakeError::DataAfterStartTls);
                }
                haggle.reply(OPT_STARTTLS, REP_ACK, &[])?;
                let config = tls.config.clone().ok_or(HandshakeError::TlsRequired)?;
                sock.start_tls(TlsSession::new(config)?)?;
                // Nothing negotiated in the clear carries over.
                haggle.structured = false;
                haggle.meta = None;
            }
        }
    }
    Err(HandshakeError::TooManyOptions)
}

/// One option: its header, then its payload.
fn read_option(sock: &Sock, inb: &mut InBuf) -> Result<(u32, Vec<u8>), HandshakeError> {
    let mut h = [0u8; OptionHeader::SIZE];
    inb.recv_exact(sock, &mut h)?;
    let hdr = OptionHeader::parse(&h).map_err(HandshakeError::OptionHeader)?;
    if hdr.len > MAX_OPTION_LEN {
        return Err(HandshakeError::OptionTooLong {
            option: hdr.option,
            len: hdr.len,
        });
    }
    let mut data = vec![0u8; hdr.len as usize];
    inb.recv_exact(sock, &mut data)?;
    Ok((hdr.option, data))
}

fn find_export(exports: &[Export], name: &str) -> Option<usize> {
    if name.is_empty() {
        // The "default" export of the spec: the first one given.
        return if exports.is_empty() { None } else { Some(0) };
    }
    exports.iter().position(|e| e.name == name)
}

/// The haggling state: what the client negotiated so far.
struct Haggle<'a> {
    sock: &'a Sock,
    exports: &'a [Export],
    no_zeroes: bool,
    structured: bool,
    /// Export index and whether base:allocation was selected for it.
    meta: Option<(usize, bool)>,
    tls: &'a TlsPolicy,
    /// Held while in the handshake pool (dropped with the handshake).
    ticket: Option<HandshakeTicket>,
    /// Taken when the client chooses its export.
    slot: Option<NegotiatedSlot>,
}

impl Haggle<'_> {
    fn option(&mut self, opt: u32, data: &[u8]) -> Result<Next, HandshakeError> {
        if self.tls.mode == TlsMode::Require
            && !self.sock.is_tls()
            && !matches!(opt, OPT_STARTTLS | OPT_ABORT)
        {
            // FORCEDTLS: EXPORT_NAME cannot be answered with an error.
            if opt == OPT_EXPORT_NAME {
                return Err(HandshakeError::TlsRequired);
            }
            return self.refuse(
                opt,
                REP_ERR_TLS_REQD,
                "TLS is required: use NBD_OPT_STARTTLS",
            );
        }
        match opt {
            OPT_EXPORT_NAME => self.export_name(data),
            OPT_ABORT => self.abort(),
            OPT_LIST => self.list(data),
            OPT_STARTTLS => self.starttls(data),
            OPT_INFO | OPT_GO => self.info_or_go(opt, data),
            OPT_STRUCTURED_REPLY => self.structured_reply(data),
            OPT_LIST_META_CONTEXT | OPT_SET_META_CONTEXT => self.meta_context(opt, data),
            _ => self.unsupported(opt),
        }
    }

    fn reply(&self, option: u32, rep: u32, payload: &[u8]) -> io::Result<()> {
        let mut v = Vec::with_capacity(20 + payload.len());
        encode_option_reply(&mut v, option, rep, payload);
        self.sock.send_all(&v)
    }

    /// An error reply; haggling goes on.
    fn refuse(&self, option: u32, rep: u32, msg: &str) -> Result<Next, HandshakeError> {
        self.reply(option, rep, msg.as_bytes())?;
        Ok(Next::Haggle)
    }

    /// The export `name` names, or an error reply saying there is none.
    fn lookup(&self, option: u32, name: &str) -> io::Result<Option<usize>> {
        let idx = find_export(self.exports, name);
        if idx.is_none() {
            let msg = format!("no export named {name:?}");
            self.reply(option, REP_ERR_UNKNOWN, msg.as_bytes())?;
        }
        Ok(idx)
    }

    /// Take a place among the negotiated connections for the export
    /// being chosen; false when all are taken.
    fn take_place(&mut self) -> bool {
        if self.slot.is_some() {
            return true;
        }
        match &self.ticket {
            None => true,
            Some(t) => {
                self.slot = t.promote();
                self.slot.is_some()
            }
        }
    }

    fn negotiated(&mut self, export: usize, knows_block_size: bool) -> Negotiated {
        Negotiated {
            export,
            knows_block_size,
            slot: self.slot.take(),
            structured: self.structured,
            base_allocation: matches!(self.meta, Some((i, true)) if i == export),
        }
    }

    /// NBD_OPT_EXPORT_NAME: the old way to pick an export; the reply is
    /// the export's size and flags, and transmission starts.
    fn export_name(&mut self, data: &[u8]) -> Result<Next, HandshakeError> {
        let name = parse_name("export name", data).map_err(HandshakeError::ExportName)?;
        let idx = find_export(self.exports, &name).ok_or(HandshakeError::UnknownExport(name))?;
        if !self.take_place() {
            return Err(HandshakeError::TooManyConnections);
        }
        let e = &self.exports[idx];
        let mut v = Vec::new();
        encode_export_name_reply(
            &mut v,
            e.dev.size(),
            e.transmission_flags(self.structured),
            self.no_zeroes,
        );
        self.sock.send_all(&v)?;
        Ok(Next::Transmit(self.negotiated(idx, false)))
    }

    /// NBD_OPT_ABORT: acknowledge (the client may already have closed;
    /// that is fine) and end.
    fn abort(&mut self) -> Result<Next, HandshakeError> {
        let _ = self.reply(OPT_ABORT, REP_ACK, &[]);
        Err(HandshakeError::Aborted)
    }

    /// NBD_OPT_LIST: one REP_SERVER per export, then ACK.
    fn list(&mut self, data: &[u8]) -> Result<Next, HandshakeError> {
        if !data.is_empty() {
            return self.refuse(OPT_LIST, REP_ERR_INVALID, "NBD_OPT_LIST takes no data");
        }
        for e in self.exports {
            let mut p = Vec::new();
            encode_rep_server(&mut p, &e.name, &e.description);
            self.reply(OPT_LIST, REP_SERVER, &p)?;
        }
        self.reply(OPT_LIST, REP_ACK, &[])?;
        Ok(Next::Haggle)
    }

    /// NBD_OPT_STARTTLS: upgrade, when TLS is on and not yet up.
    fn starttls(&mut self, data: &[u8]) -> Result<Next, HandshakeError> {
        if self.tls.mode == TlsMode::Off || self.tls.config.is_none() {
            return self.refuse(
                OPT_STARTTLS,
                REP_ERR_POLICY,
                "this server does not offer TLS",
            );
        }
        if !data.is_empty() {
            return self.refuse(
                OPT_STARTTLS,
                REP_ERR_INVALID,
                "NBD_OPT_STARTTLS takes no data",
            );
        }
        if self.sock.is_tls() {
            return self.refuse(OPT_STARTTLS, REP_ERR_INVALID, "TLS is already negotiated");
        }
        Ok(Next::StartTls)
    }

    /// NBD_OPT_INFO / NBD_OPT_GO: the export's size and flags, the
    /// requested NAME/DESCRIPTION, always BLOCK_SIZE, then ACK; GO then
    /// starts transmission.
    fn info_or_go(&mut self, opt: u32, data: &[u8]) -> Result<Next, HandshakeError> {
        let req = match GoRequest::parse(data) {
            Ok(r) => r,
            Err(e) => return self.refuse(opt, REP_ERR_INVALID, &e.to_string()),
        };
        let Some(idx) = self.lookup(opt, &req.name)? else {
            return Ok(Next::Haggle);
        };
        // Before the reply: once the client has its ACK it may expect to
        // be served, and others may count on this place being taken.
        if opt == OPT_GO && !self.take_place() {
            let msg = "too many connections; try again later";
            return self.refuse(opt, REP_ERR_POLICY, msg);
        }
        let e = &self.exports[idx];
        let mut p = Vec::new();
        encode_info_export(&mut p, e.dev.size(), e.transmission_flags(self.structured));
        self.reply(opt, REP_INFO, &p)?;
        if req.infos.contains(&INFO_NAME) {
            p.clear();
            encode_info_string(&mut p, INFO_NAME, &e.name);
            self.reply(opt, REP_INFO, &p)?;
        }
        if req.infos.contains(&INFO_DESCRIPTION) {
            p.clear();
            encode_info_string(&mut p, INFO_DESCRIPTION, &e.description);
            self.reply(opt, REP_INFO, &p)?;
        }
        // Always sent: misaligned requests from a client that went
        // through NBD_OPT_GO are refused, so it must learn the minimum.
        let (min, pref, max) = e.block_sizes();
        p.clear();
        encode_info_block_size(&mut p, min, pref, max);
        self.reply(opt, REP_INFO, &p)?;
        self.reply(opt, REP_ACK, &[])?;
        if opt == OPT_GO {
            return Ok(Next::Transmit(self.negotiated(idx, true)));
        }
        Ok(Next::Haggle)
    }

    /// NBD_OPT_STRUCTURED_REPLY: accepted once.
    fn structured_reply(&mut self, data: &[u8]) -> Result<Next, HandshakeError> {
        let opt = OPT_STRUCTURED_REPLY;
        if !data.is_empty() {
            return self.refuse(
                opt,
                REP_ERR_INVALID,
                "NBD_OPT_STRUCTURED_REPLY takes no data",
            );
        }
        if self.structured {
            return self.refuse(
                opt,
                REP_ERR_INVALID,
                "structured replies already negotiated",
            );
        }
        self.structured = true;
        self.reply(opt, REP_ACK, &[])?;
        Ok(Next::Haggle)
    }

    /// NBD_OPT_LIST_META_CONTEXT / NBD_OPT_SET_META_CONTEXT: the one
    /// context served is `base:allocation`; SET remembers whether it was
    /// selected, for the export named.
    fn meta_context(&mut self, opt: u32, data: &[u8]) -> Result<Next, HandshakeError> {
        if !self.structured {
            let msg = "negotiate NBD_OPT_STRUCTURED_REPLY before metadata contexts";
            return self.refuse(opt, REP_ERR_INVALID, msg);
        }
        let req = match MetaRequest::parse(data) {
            Ok(r) => r,
            Err(e) => return self.refuse(opt, REP_ERR_INVALID, &e.to_string()),
        };
        let Some(idx) = self.lookup(opt, &req.export)? else {
            return Ok(Next::Haggle);
        };
        let list = opt == OPT_LIST_META_CONTEXT;
        let selected = if list {
            req.queries.is_empty()
                || req
                    .queries
                    .iter()
                    .any(|q| q == "base:" || q == BASE_ALLOCATION)
        } else {
            req.queries.iter().any(|q| q == BASE_ALLOCATION)
        };
        if selected {
            let mut p = Vec::new();
            let id = if list { 0 } else { BASE_ALLOCATION_ID };
            encode_meta_context(&mut p, id, BASE_ALLOCATION);
            self.reply(opt, REP_META_CONTEXT, &p)?;
        }
        if !list {
            self.meta = Some((idx, selected));
        }
        self.reply(opt, REP_ACK, &[])?;
        Ok(Next::Haggle)
    }

    fn unsupported(&mut self, opt: u32) -> Result<Next, HandshakeError> {
        self.refuse(
            opt,
            REP_ERR_UNSUP,
            &format!("option {opt} is not supported"),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::client::RawClient;
    use std::os::unix::net::UnixStream;

    /// Run the server side of a handshake with no exports against a raw
    /// client driven by `client` (from the greeting on); the handshake's
    /// outcome.
    fn against(
        client: impl FnOnce(&mut RawClient<UnixStream>) -> io::Result<()> + Send + 'static,
    ) -> Result<Negotiated, HandshakeError> {
        let (a, b) = UnixStream::pair().unwrap();
        let peer = std::thread::spawn(move || client(&mut RawClient::new(b)));
        let sock = Sock::new(a.into());
        let r = handshake(
            &sock,
            &mut InBuf::new().expect("receive buffer"),
            &[],
            &TlsPolicy::default(),
            None,
        );
        drop(sock);
        let _ = peer.join().unwrap();
        r
    }

    #[test]
    fn a_client_to_drop_gets_a_typed_reason() {
        let r = against(|c| {
            c.greeting()?;
            c.client_flags(1 << 7)
        });
        assert!(
            matches!(r, Err(HandshakeError::UnknownClientFlags(0x80))),
            "{:?}",
            r.err()
        );

        let r = against(|c| {
            c.start()?;
            c.option(OPT_EXPORT_NAME, b"nosuch")
        });
        match r {
            Err(HandshakeError::UnknownExport(name)) => assert_eq!(name, "nosuch"),
            other => panic!("{:?}", other.err()),
        }

        let r = against(|c| {
            c.start()?;
            c.option(OPT_ABORT, &[])?;
            c.option_reply().map(drop)
        });
        assert!(matches!(r, Err(HandshakeError::Aborted)), "{:?}", r.err());

        let r = against(|c| c.start());
        assert!(
            matches!(&r, Err(HandshakeError::Io(e)) if e.kind() == io::ErrorKind::UnexpectedEof),
            "{:?}",
            r.err()
        );
    }

    #[test]
    fn an_unknown_option_is_refused_and_haggling_goes_on() {
        let r = against(|c| {
            c.start()?;
            c.option(99, &[])?;
            let (rep, _) = c.option_reply()?;
            assert_eq!(rep.rep, REP_ERR_UNSUP);
            c.option(OPT_ABORT, &[])?;
            c.option_reply().map(drop)
        });
        assert!(matches!(r, Err(HandshakeError::Aborted)), "{:?}", r.err());
    }
}
