//! The control socket: a unix stream socket, mode 0600, one thread per
//! client, one JSON-RPC request per line answered by one line.
//!
//! Every client is bounded (issue 35): at most [`MAX_CLIENTS`] served at
//! once (one more gets a `-32000` error line and is closed), a request
//! line of at most [`MAX_LINE`] bytes (a longer one gets `-32600` and the
//! connection is closed), and [`REQUEST_DEADLINE`] to send each whole
//! line, counted from the connection or the previous answer (an idle or
//! trickling client is told so and closed). So the server's threads and
//! buffers stay bounded whatever clients do; a slow answer to a client
//! that does not read is bounded by the same deadline on writes.
//!
//! The socket is private to the user running the server (mode 0600, and
//! its default directory 0700), like `/dev/mapper/control` is to root:
//! whoever can connect can remove devices. A socket file left by a server
//! that died is replaced; one a live server listens on is refused, so two
//! servers never silently share a path, and anything that is not a socket
//! is refused too (nbdkit and qemu-nbd never delete a user's file either).

use crate::methods::Control;
use crate::proto::{
    response_err, response_ok, Request, RpcError, INVALID_REQUEST, MAX_CLIENTS, MAX_LINE,
    PARSE_ERROR, REQUEST_DEADLINE, SERVER_BUSY,
};
use serde_json::Value;
use std::io::{self, BufRead, BufReader, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

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
    /// Write end of the pipe the accept thread polls beside the socket: a
    /// byte (or its closing) stops it, whatever became of the socket file.
    wake: Option<OwnedFd>,
    accept: Option<JoinHandle<()>>,
}

fn pipe() -> io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0 as libc::c_int; 2];
    // SAFETY: fds is a valid array of two ints.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: pipe2 returned two fresh fds that we now own.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

/// Is someone listening on `path`?
fn live_socket(path: &Path) -> bool {
    UnixStream::connect(path).is_ok()
}

/// Make way for a Unix socket at `path` (`what` names it in errors):
/// nothing there, or a socket nobody listens on (left by a server that
/// crashed), which is removed. A live socket, or anything that is not a
/// socket (a user's file, a directory, a symbolic link), is refused with
/// an error naming the path: a typo in a path must never destroy a file.
pub fn remove_stale_socket(path: &Path, what: &str) -> io::Result<()> {
    use std::os::unix::fs::FileTypeExt;
    let shown = path.display();
    let meta = match std::fs::symlink_metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => {
            return Err(io::Error::new(
                e.kind(),
                format!("{what} {shown}: cannot inspect: {e}"),
            ))
        }
    };
    if !meta.file_type().is_socket() {
        return Err(io::Error::new(
            io::ErrorKind::AlreadyExists,
            format!("{what} {shown}: exists and is not a socket; refusing to replace it (remove it or choose another path)"),
        ));
    }
    if live_socket(path) {
        return Err(io::Error::new(
            io::ErrorKind::AddrInUse,
            format!("{what} {shown}: another server is listening there"),
        ));
    }
    std::fs::remove_file(path).map_err(|e| {
        io::Error::new(
            e.kind(),
            format!("{what} {shown}: removing the stale socket: {e}"),
        )
    })
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
        Self::start_with_limits(path, control, default_dir, ServerLimits::default())
    }

    /// [`ControlServer::start`] with other limits than the defaults.
    pub fn start_with_limits(
        path: &Path,
        control: Arc<Control>,
        default_dir: bool,
        limits: ServerLimits,
    ) -> io::Result<ControlServer> {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            if default_dir && !dir.exists() {
                std::fs::create_dir_all(dir)?;
                std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))?;
            }
        }
        remove_stale_socket(path, "control socket")
            .map_err(|e| io::Error::new(e.kind(), format!("{e} (use --control PATH)")))?;
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
        let (wake_r, wake_w) = pipe()?;
        let accept = std::thread::Builder::new()
            .name("control-accept".into())
            .spawn(move || accept_loop(listener, control, wake_r, limits))?;
        Ok(ControlServer {
            path: path.to_path_buf(),
            wake: Some(wake_w),
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
        // Closing the write end makes the pipe readable (EOF).
        drop(self.wake.take());
        let _ = t.join();
        let _ = std::fs::remove_file(&self.path);
    }
}

impl Drop for ControlServer {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// What the control socket allows each client: how many at once, how
/// long a request line, how long a client may take to send one. The
/// defaults are [`MAX_CLIENTS`], [`MAX_LINE`] and [`REQUEST_DEADLINE`].
#[derive(Clone, Copy, Debug)]
pub struct ServerLimits {
    pub max_clients: usize,
    pub max_line: usize,
    pub request_deadline: Duration,
}

impl Default for ServerLimits {
    fn default() -> Self {
        ServerLimits {
            max_clients: MAX_CLIENTS,
            max_line: MAX_LINE,
            request_deadline: REQUEST_DEADLINE,
        }
    }
}

/// One served connection: counted while it lives.
struct Slot(Arc<AtomicUsize>);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

fn accept_loop(listener: UnixListener, control: Arc<Control>, wake: OwnedFd, lim: ServerLimits) {
    let mut n = 0u64;
    let active = Arc::new(AtomicUsize::new(0));
    loop {
        let mut pfds = [
            libc::pollfd {
                fd: listener.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: wake.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        // SAFETY: pfds is a valid array of two pollfd.
        let r = unsafe { libc::poll(pfds.as_mut_ptr(), 2, -1) };
        if r < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            tracing::error!(error = %e, "control socket: poll failed; stopping");
            return;
        }
        if pfds[1].revents != 0 {
            return;
        }
        if pfds[0].revents == 0 {
            continue;
        }
        let stream = match listener.accept() {
            Ok((s, _)) => s,
            Err(e) => {
                // Out of descriptors (EMFILE/ENFILE) the socket stays
                // readable: pause instead of spinning on it.
                tracing::warn!(error = %e, "control socket: accept failed");
                std::thread::sleep(Duration::from_millis(50));
                continue;
            }
        };
        n += 1;
        if active.fetch_add(1, Ordering::SeqCst) >= lim.max_clients {
            active.fetch_sub(1, Ordering::SeqCst);
            tracing::warn!(
                client = n,
                max = lim.max_clients,
                "control socket: too many clients; refusing a connection"
            );
            refuse(stream, lim.max_clients);
            continue;
        }
        let slot = Slot(active.clone());
        let control = control.clone();
        let spawned = std::thread::Builder::new()
            .name(format!("control-{n}"))
            .spawn(move || {
                let _slot = slot;
                if let Err(e) = serve_client(stream, &control, &lim) {
                    if e.kind() != io::ErrorKind::BrokenPipe {
                        tracing::warn!(client = n, error = %e, "control client failed");
                    }
                }
            });
        if let Err(e) = spawned {
            tracing::error!(error = %e, "control socket: cannot start a client thread");
        }
    }
}

/// Tell a client it is one too many, without waiting on it.
fn refuse(mut stream: UnixStream, max: usize) {
    let e = RpcError::new(
        SERVER_BUSY,
        format!("the control socket serves {max} clients at once; try again later"),
    );
    let _ = stream.set_nonblocking(true);
    let _ = writeln!(stream, "{}", response_err(&Value::Null, &e));
}

/// How reading one request line ended.
enum LineEnd {
    /// A whole line (or the last bytes before the client closed).
    Line,
    /// The client closed between requests.
    Closed,
    TooLong,
    Late,
}

/// Read one request line into `line` by `deadline`, at most `max` bytes.
fn read_line(
    input: &mut BufReader<UnixStream>,
    line: &mut Vec<u8>,
    max: usize,
    deadline: Instant,
) -> io::Result<LineEnd> {
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Ok(LineEnd::Late);
        }
        input.get_ref().set_read_timeout(Some(left))?;
        let avail = match input.fill_buf() {
            Ok(b) => b,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                return Ok(LineEnd::Late)
            }
            Err(e) => return Err(e),
        };
        if avail.is_empty() {
            return Ok(if line.is_empty() {
                LineEnd::Closed
            } else {
                LineEnd::Line
            });
        }
        let (take, done) = match avail.iter().position(|&b| b == b'\n') {
            Some(i) => (i + 1, true),
            None => (avail.len(), false),
        };
        // Never hold more than `max` bytes (and the newline).
        if line.len() + take - usize::from(done) > max {
            return Ok(LineEnd::TooLong);
        }
        line.extend_from_slice(&avail[..take]);
        input.consume(take);
        if done {
            return Ok(LineEnd::Line);
        }
    }
}

/// Answer requests from one client until it closes its end, sends a
/// line over the limit, or is too slow to send one.
fn serve_client(stream: UnixStream, control: &Control, lim: &ServerLimits) -> io::Result<()> {
    stream.set_write_timeout(Some(lim.request_deadline))?;
    let mut out = stream.try_clone()?;
    let mut input = BufReader::with_capacity(64 << 10, stream);
    let mut line = Vec::new();
    loop {
        line.clear();
        let deadline = Instant::now() + lim.request_deadline;
        let why = match read_line(&mut input, &mut line, lim.max_line, deadline)? {
            LineEnd::Closed => return Ok(()),
            LineEnd::Line => {
                if let Some(reply) = handle_line(control, &line) {
                    out.write_all(reply.as_bytes())?;
                    out.write_all(b"\n")?;
                    out.flush()?;
                }
                continue;
            }
            LineEnd::TooLong => format!(
                "request longer than {} bytes (the limit, docs/CONTROL.md); closing",
                lim.max_line
            ),
            LineEnd::Late => format!(
                "no complete request within {} s; closing",
                lim.request_deadline.as_secs_f64()
            ),
        };
        tracing::warn!("control client: {why}");
        let e = RpcError::new(INVALID_REQUEST, why);
        writeln!(out, "{}", response_err(&Value::Null, &e))?;
        return Ok(());
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
