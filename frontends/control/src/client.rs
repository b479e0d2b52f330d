//! A client of the control socket: what the CLI verbs use, and a small
//! library for programs that drive a running server.

use crate::proto::{Response, RpcError, MAX_RESPONSE};
use serde_json::{json, Value};
use std::io::{self, BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};

pub struct Client {
    path: PathBuf,
    reader: BufReader<UnixStream>,
    writer: UnixStream,
    next_id: u64,
}

/// Why a call failed: the socket, or the server's answer.
#[derive(Debug)]
pub enum CallError {
    Io(io::Error),
    Rpc(RpcError),
}

impl std::fmt::Display for CallError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CallError::Io(e) => write!(f, "{e}"),
            CallError::Rpc(e) => write!(f, "{e}"),
        }
    }
}

impl std::error::Error for CallError {}

impl Client {
    pub fn connect(path: &Path) -> io::Result<Client> {
        let s = UnixStream::connect(path).map_err(|e| {
            io::Error::new(
                e.kind(),
                format!(
                    "cannot connect to control socket {}: {e} (is `blkstack serve` running? \
                     its socket can be chosen with --control PATH)",
                    path.display()
                ),
            )
        })?;
        Ok(Client {
            path: path.to_path_buf(),
            reader: BufReader::new(s.try_clone()?),
            writer: s,
            next_id: 1,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Send one request and wait for its answer.
    pub fn call(&mut self, method: &str, params: Value) -> Result<Value, CallError> {
        let id = self.next_id;
        self.next_id += 1;
        let req = json!({ "jsonrpc": "2.0", "id": id, "method": method, "params": params });
        let mut line = req.to_string();
        line.push('\n');
        self.writer
            .write_all(line.as_bytes())
            .map_err(CallError::Io)?;
        let mut buf = Vec::new();
        let n = (&mut self.reader)
            .take(MAX_RESPONSE as u64)
            .read_until(b'\n', &mut buf)
            .map_err(CallError::Io)?;
        if n == 0 {
            return Err(CallError::Io(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!(
                    "control socket {} closed without answering",
                    self.path.display()
                ),
            )));
        }
        let resp: Response = serde_json::from_slice(&buf).map_err(|e| {
            CallError::Io(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("unreadable answer from the control socket: {e}"),
            ))
        })?;
        if resp.id != json!(id) {
            return Err(CallError::Io(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("answer for request {} while waiting for {id}", resp.id),
            )));
        }
        match (resp.result, resp.error) {
            (_, Some(e)) => Err(CallError::Rpc(e)),
            (Some(v), None) => Ok(v),
            (None, None) => Err(CallError::Io(io::Error::new(
                io::ErrorKind::InvalidData,
                "answer has neither result nor error",
            ))),
        }
    }
}
