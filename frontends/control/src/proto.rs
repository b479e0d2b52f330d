//! The wire format of the control socket: JSON-RPC 2.0, one request per
//! line and one response per line (docs/CONTROL.md is the user-facing
//! description; this file is the single place that defines it).
//!
//! Errors carry the errno device-mapper's ioctls return for the same
//! failure (ENXIO for a missing device, EBUSY for one in use or already
//! existing, EINVAL for a bad table or message), so the CLI can print
//! dmsetup's `... ioctl on NAME failed: <strerror>` line and a script can
//! branch on the code without parsing text.

use blkstack_mapped::error::{Refusal, TargetError};
use blkstack_mapped::DmError;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

/// JSON-RPC's reserved codes.
pub const PARSE_ERROR: i64 = -32700;
pub const INVALID_REQUEST: i64 = -32600;
pub const METHOD_NOT_FOUND: i64 = -32601;
pub const INVALID_PARAMS: i64 = -32602;

/// Application codes: the errno the kernel's dm ioctl would return.
pub const ENOENT: i64 = libc::ENOENT as i64;
pub const ENXIO: i64 = libc::ENXIO as i64;
pub const ENODEV: i64 = libc::ENODEV as i64;
pub const EBUSY: i64 = libc::EBUSY as i64;
pub const EEXIST: i64 = libc::EEXIST as i64;
pub const ENODATA: i64 = libc::ENODATA as i64;
pub const EINVAL: i64 = libc::EINVAL as i64;
pub const ENOTSUP: i64 = libc::EOPNOTSUPP as i64;
pub const E2BIG: i64 = libc::E2BIG as i64;

/// Longest request line the server reads (1 MiB). The largest real
/// request is a `create`/`reload` of a table of many lines: a dm table
/// line is some 20 to 200 bytes (`0 2048 linear mem 0` to a multipath
/// line naming many paths), so 1 MiB holds a table of thousands of
/// lines, more than the kernel's dm tools are ever handed, while the
/// server's worst case stays small: [`MAX_CLIENTS`] connections each
/// holding a partial line cost at most `MAX_CLIENTS` MiB.
pub const MAX_LINE: usize = 1 << 20;

/// Longest response line a client reads: an answer (`status` or `table`
/// of every device) can be larger than any request, and the client reads
/// from a server it chose to trust.
pub const MAX_RESPONSE: usize = 16 << 20;

/// Connections the control socket serves at once; one more is answered
/// with an error line and closed. The CLI uses one connection per verb,
/// so this bounds scripts running verbs in parallel, not a user.
pub const MAX_CLIENTS: usize = 32;

/// How long a client may take to send a whole request line, counted
/// from its connection or from the previous answer: an idle or
/// trickling connection is closed after it (with an error line).
pub const REQUEST_DEADLINE: std::time::Duration = std::time::Duration::from_secs(60);

/// The error (`code` -32000, JSON-RPC's server-error range) for a
/// connection refused because [`MAX_CLIENTS`] are already served.
pub const SERVER_BUSY: i64 = -32000;

/// One request line. `id` absent means a notification (no reply), as
/// JSON-RPC 2.0 says.
#[derive(Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Request {
    #[serde(default)]
    pub jsonrpc: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<Value>,
    pub method: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub params: Option<Value>,
}

/// The `error` member of a failed response.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
pub struct RpcError {
    pub code: i64,
    pub message: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data: Option<Value>,
}

impl std::fmt::Display for RpcError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for RpcError {}

impl RpcError {
    pub fn new(code: i64, message: impl Into<String>) -> RpcError {
        let message = message.into();
        let data = errno_name(code).map(|n| json!({ "errno": n }));
        RpcError {
            code,
            message,
            data,
        }
    }

    pub fn invalid_params(message: impl Into<String>) -> RpcError {
        RpcError::new(INVALID_PARAMS, message)
    }

    /// The errno text dmsetup would print (`strerror`), for application
    /// codes; protocol errors have none.
    pub fn strerror(&self) -> Option<&'static str> {
        Some(match self.code {
            ENOENT => "No such file or directory",
            ENXIO => "No such device or address",
            ENODEV => "No such device",
            EBUSY => "Device or resource busy",
            EEXIST => "File exists",
            ENODATA => "No data available",
            EINVAL => "Invalid argument",
            ENOTSUP => "Operation not supported",
            E2BIG => "Argument list too long",
            _ => return None,
        })
    }
}

fn errno_name(code: i64) -> Option<&'static str> {
    Some(match code {
        ENOENT => "ENOENT",
        ENXIO => "ENXIO",
        ENODEV => "ENODEV",
        EBUSY => "EBUSY",
        EEXIST => "EEXIST",
        ENODATA => "ENODATA",
        EINVAL => "EINVAL",
        ENOTSUP => "EOPNOTSUPP",
        E2BIG => "E2BIG",
        _ => return None,
    })
}

impl From<DmError> for RpcError {
    fn from(e: DmError) -> RpcError {
        let (code, kind) = match &e {
            DmError::NoSuchDevice(_) => (ENXIO, "no_such_device"),
            DmError::Exists(_) => (EBUSY, "exists"),
            DmError::Busy { .. } => (EBUSY, "busy"),
            DmError::WouldLoseData { .. } => (EBUSY, "would_lose_data"),
            // The kernel's table load errno: EINVAL but for a missing
            // device or a hardware handler (see `table_errno`).
            DmError::Line { .. } => (table_errno(&e).unwrap_or(EINVAL), "table"),
            DmError::EmptyTable { .. } | DmError::TableType { .. } => (EINVAL, "table"),
            // A target's message errno (dm-ioctl.c `target_message`
            // returns what the target's message function did).
            DmError::Message { .. } => (table_errno(&e).unwrap_or(EINVAL), "invalid"),
            _ => (EINVAL, "invalid"),
        };
        let mut r = RpcError::new(code, e.report());
        if let Some(Value::Object(m)) = &mut r.data {
            m.insert("kind".into(), Value::String(kind.into()));
        }
        r
    }
}

/// The errno the kernel's table load or message returns for a target
/// error other than EINVAL: ENOENT for a device argument naming no
/// device (`dm_get_device` on a missing path), ENODEV for a hardware
/// handler (`scsi_dh_attach` on a device that is not SCSI), a
/// constructor's own (dm-verity's E2BIG and ENOENT), a message's own
/// (dm-thin's EEXIST, ENODATA, EBUSY), and ENXIO for a snapshot's COW
/// device holding no snapshot.
fn table_errno(e: &DmError) -> Option<i64> {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = cur {
        // A boxed source (`TargetError::In`) shows as the box itself.
        let target = err
            .downcast_ref::<TargetError>()
            .or_else(|| err.downcast_ref::<Box<TargetError>>().map(|b| &**b));
        match target {
            Some(TargetError::NoDevice(_)) => return Some(ENOENT),
            Some(TargetError::HwHandler(_)) => return Some(ENODEV),
            Some(TargetError::Refused { errno, .. }) => {
                return Some(match errno {
                    Refusal::Exists => EEXIST,
                    Refusal::NoData => ENODATA,
                    Refusal::Busy => EBUSY,
                    Refusal::TooBig => E2BIG,
                    Refusal::NotFound => ENOENT,
                    Refusal::NoAddress => ENXIO,
                })
            }
            _ => {}
        }
        cur = err.source();
    }
    None
}

/// Build a success response line (without the newline).
pub fn response_ok(id: &Value, result: Value) -> String {
    json!({ "jsonrpc": "2.0", "id": id, "result": result }).to_string()
}

/// Build an error response line (without the newline).
pub fn response_err(id: &Value, err: &RpcError) -> String {
    json!({ "jsonrpc": "2.0", "id": id, "error": err }).to_string()
}

/// A response as a client reads it.
#[derive(Debug, Deserialize)]
pub struct Response {
    #[serde(default)]
    pub id: Value,
    #[serde(default)]
    pub result: Option<Value>,
    #[serde(default)]
    pub error: Option<RpcError>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dm_errors_map_to_dm_errnos() {
        let e: RpcError = DmError::NoSuchDevice("d0".into()).into();
        assert_eq!(e.code, ENXIO);
        assert_eq!(e.data.unwrap()["kind"], "no_such_device");
        let e: RpcError = DmError::Busy {
            name: "d0".into(),
            why: "open".into(),
        }
        .into();
        assert_eq!(e.code, EBUSY);
        assert_eq!(e.strerror(), Some("Device or resource busy"));
        let e: RpcError = DmError::line(3, blkstack_mapped::error::LineError::ZeroLength).into();
        assert_eq!(
            (e.code, e.message.as_str()),
            (EINVAL, "line 3: zero-length target")
        );
    }

    #[test]
    fn a_missing_device_is_enoent_as_in_the_kernel() {
        let reg = blkstack_mapped::Registry::new();
        reg.create("z", "0 64 zero").unwrap();
        for table in [
            "0 8 linear nosuch 0",
            "0 16 striped 2 8 z 0 nosuch 0",
            "0 64 multipath 0 0 1 1 round-robin 0 1 0 nosuch",
        ] {
            let e: RpcError = reg.create("b", table).err().expect("refused").into();
            assert_eq!(e.code, ENOENT, "{table}: {}", e.message);
            assert_eq!(e.strerror(), Some("No such file or directory"));
        }
        let e: RpcError = reg
            .create("b", "0 64 multipath 0 1 alua 1 1 round-robin 0 1 0 z")
            .err()
            .expect("refused")
            .into();
        assert_eq!(e.code, ENODEV, "{}", e.message);
        let e: RpcError = reg
            .create("b", "0 8 linear z x")
            .err()
            .expect("refused")
            .into();
        assert_eq!(e.code, EINVAL);
    }

    #[test]
    fn refused_thin_messages_carry_the_kernels_errno() {
        let reg = blkstack_mapped::Registry::new();
        let dir = tempfile::tempdir().unwrap();
        let meta = dir.path().join("meta");
        reg.create("m", &format!("0 8192 file {} create", meta.display()))
            .unwrap();
        reg.create("d", "0 32768 memory").unwrap();
        reg.create("p", "0 32768 thin-pool m d 128 0").unwrap();
        reg.message("p", 0, &["create_thin", "1"]).unwrap();
        for (m, code, text) in [
            ("create_thin 1", EEXIST, "File exists"),
            ("delete 7", ENODATA, "No data available"),
            ("set_transaction_id 3 4", EINVAL, "Invalid argument"),
        ] {
            let args: Vec<&str> = m.split_whitespace().collect();
            let e: RpcError = reg.message("p", 0, &args).unwrap_err().into();
            assert_eq!((e.code, e.strerror()), (code, Some(text)), "{m}");
        }
        reg.remove_all();
    }

    #[test]
    fn protocol_errors_have_no_errno() {
        let e = RpcError::new(METHOD_NOT_FOUND, "no such method");
        assert!(e.data.is_none());
        assert!(e.strerror().is_none());
    }

    #[test]
    fn responses_round_trip() {
        let line = response_err(&json!(7), &RpcError::new(EINVAL, "x"));
        let r: Response = serde_json::from_str(&line).unwrap();
        assert_eq!(r.id, json!(7));
        assert_eq!(r.error.unwrap().code, EINVAL);
        let line = response_ok(&json!("a"), json!({"k": 1}));
        let r: Response = serde_json::from_str(&line).unwrap();
        assert_eq!(r.result.unwrap()["k"], 1);
    }
}
