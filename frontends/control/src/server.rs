//! The control socket: a unix stream socket, mode 0600, one thread per
//! client, one JSON-RPC request per line answered by one line.
//!
//! The socket is private to the user running the server (mode 0600, and
//! its default directory 0700), like `/dev/mapper/control` is to root:
//! whoever can connect can remove devices. A socket file left by a server
//! that died is replaced; one a live server listens on is refused, so two
//! servers never silently share a path.

use crate::methods::Control;
use crate::proto::{
    response_err, response_ok, Request, RpcError, INVALID_REQUEST, MAX_LINE, PARSE_ERROR,
};
use serde_json::Value;
use std::io::{self, BufRead, BufReader, Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

/// Where `serve` listens and the verbs connect when `--control` is not
/// given: `$XDG_RUNTIME_DIR/blkstack/control.sock` (per user, on tmpfs,
/// removed at logout) or, without it, `/run/blkstack/control.sock`.
pub fn default_socket_path() -> PathBuf {
    match std::env::var_os("XDG_RUNTIME_DIR") {
        Some(d) if !d.is_empty() => PathBuf::from(d).join("blkstack").join("control.sock"),
        _ => PathBuf::from("/run/blkstack/control.sock"),
    }
}

/// A running control socket. Dropping it (or [`ControlServer::stop`])
/// stops accepting and removes the socket file; connected clients finish
/// the request they are in.
pub struct ControlServer {
    path: PathBuf,
    stopping: Arc<AtomicBool>,
    accept: Option<JoinHandle<()>>,
}

/// Is someone listening on `path`?
fn live_socket(path: &Path) -> bool {
    UnixStream::connect(path).is_ok()
}

impl ControlServer {
    /// Bind `path` and serve `control` on it from a background thread.
    /// When `default_dir` is true the parent directory is created with
    /// mode 0700 if missing (the default path's directory is ours).
    pub fn start(
        path: &Path,
        control: Arc<Control>,
        default_dir: bool,
    ) -> io::Result<ControlServer> {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            if default_dir && !dir.exists() {
                std::fs::create_dir_all(dir)?;
                std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))?;
            }
        }
        if path.exists() {
            if live_socket(path) {
                return Err(io::Error::new(
                    io::ErrorKind::AddrInUse,
                    format!(
                        "control socket {}: another server is listening there (use --control PATH)",
                        path.display()
                    ),
                ));
            }
            std::fs::remove_file(path).map_err(|e| {
                io::Error::new(
                    e.kind(),
                    format!("removing stale control socket {}: {e}", path.display()),
                )
            })?;
        }
        // The umask makes the socket 0600 from the moment it exists;
        // set_permissions below holds even if another thread changed the
        // umask meanwhile.
        // SAFETY: umask(2) cannot fail.
        let old = unsafe { libc::umask(0o177) };
        let bound = UnixListener::bind(path);
        // SAFETY: as above; restores the caller's umask.
        unsafe { libc::umask(old) };
        let listener = bound.map_err(|e| {
            io::Error::new(
                e.kind(),
                format!("cannot listen on control socket {}: {e}", path.display()),
            )
        })?;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
        let stopping = Arc::new(AtomicBool::new(false));
        let stop2 = stopping.clone();
        let accept = std::thread::Builder::new()
            .name("control-accept".into())
            .spawn(move || accept_loop(listener, control, stop2))?;
        Ok(ControlServer {
            path: path.to_path_buf(),
            stopping,
            accept: Some(accept),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn stop(mut self) {
        self.shutdown();
    }

    fn shutdown(&mut self) {
        let Some(t) = self.accept.take() else {
            return;
        };
        self.stopping.store(true, Ordering::SeqCst);
        // Wake the blocking accept with a connection of our own.
        let _ = UnixStream::connect(&self.path);
        let _ = t.join();
        let _ = std::fs::remove_file(&self.path);
    }
}

impl Drop for ControlServer {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn accept_loop(listener: UnixListener, control: Arc<Control>, stopping: Arc<AtomicBool>) {
    let mut n = 0u64;
    for conn in listener.incoming() {
        if stopping.load(Ordering::SeqCst) {
            return;
        }
        let stream = match conn {
            Ok(s) => s,
            Err(e) => {
                eprintln!("blkstack-control: accept: {e}");
                continue;
            }
        };
        n += 1;
        let control = control.clone();
        let spawned = std::thread::Builder::new()
            .name(format!("control-{n}"))
            .spawn(move || {
                if let Err(e) = serve_client(stream, &control) {
                    if e.kind() != io::ErrorKind::BrokenPipe {
                        eprintln!("blkstack-control: client {n}: {e}");
                    }
                }
            });
        if let Err(e) = spawned {
            eprintln!("blkstack-control: cannot start a client thread: {e}");
        }
    }
}

/// Answer requests from one client until it closes its end.
fn serve_client(stream: UnixStream, control: &Control) -> io::Result<()> {
    let mut out = stream.try_clone()?;
    let mut input = BufReader::new(stream);
    let mut line = Vec::new();
    loop {
        line.clear();
        let n = (&mut input)
            .take(MAX_LINE as u64 + 1)
            .read_until(b'\n', &mut line)?;
        if n == 0 {
            return Ok(());
        }
        if line.len() > MAX_LINE {
            let e = RpcError::new(
                INVALID_REQUEST,
                format!("request longer than {MAX_LINE} bytes; closing"),
            );
            writeln!(out, "{}", response_err(&Value::Null, &e))?;
            return Ok(());
        }
        if let Some(reply) = handle_line(control, &line) {
            out.write_all(reply.as_bytes())?;
            out.write_all(b"\n")?;
            out.flush()?;
        }
    }
}

/// Parse and run one request line; `None` for a notification or a blank
/// line (which a person typing into `socat` sends by accident).
pub fn handle_line(control: &Control, line: &[u8]) -> Option<String> {
    let text = match std::str::from_utf8(line) {
        Ok(t) => t.trim(),
        Err(_) => {
            return Some(response_err(
                &Value::Null,
                &RpcError::new(PARSE_ERROR, "request is not UTF-8"),
            ))
        }
    };
    if text.is_empty() {
        return None;
    }
    let value: Value = match serde_json::from_str(text) {
        Ok(v) => v,
        Err(e) => {
            return Some(response_err(
                &Value::Null,
                &RpcError::new(PARSE_ERROR, format!("not JSON: {e}")),
            ))
        }
    };
    // Keep the id even when the rest is malformed, so the client can
    // match the error to its request.
    let id_seen = value.get("id").cloned();
    let req: Request = match serde_json::from_value(value) {
        Ok(r) => r,
        Err(e) => {
            return Some(response_err(
                &id_seen.unwrap_or(Value::Null),
                &RpcError::new(INVALID_REQUEST, format!("not a JSON-RPC request: {e}")),
            ))
        }
    };
    if let Some(v) = &req.jsonrpc {
        if v != "2.0" {
            return Some(response_err(
                &req.id.unwrap_or(Value::Null),
                &RpcError::new(
                    INVALID_REQUEST,
                    format!("jsonrpc must be \"2.0\", got {v:?}"),
                ),
            ));
        }
    }
    let result = control.call(&req.method, req.params);
    let id = req.id?;
    Some(match result {
        Ok(v) => response_ok(&id, v),
        Err(e) => response_err(&id, &e),
    })
}
