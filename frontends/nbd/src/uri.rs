//! Listen addresses in the syntax of the NBD URI specification
//! (`doc/uri.md` of NetworkBlockDevice/nbd), which is what fio's nbd
//! engine, nbdinfo, nbdcopy and qemu accept, so a user can copy the
//! address the server prints straight into a client:
//!
//! - `nbd://[HOST][:PORT][/]` — TCP; HOST defaults to 127.0.0.1 (never all
//!   interfaces unless the user writes `0.0.0.0` or `[::]`), PORT to 10809;
//!   port 0 asks the kernel for a free port.
//! - `nbd+unix:///?socket=PATH` — a Unix domain socket.
//!
//! An export name in the path makes no sense for listening and is refused,
//! as are TLS schemes (`nbds://`), which this server does not speak.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, ToSocketAddrs};
use std::path::PathBuf;

pub const DEFAULT_PORT: u16 = 10809;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ListenUri {
    Tcp(SocketAddr),
    Unix(PathBuf),
}

impl fmt::Display for ListenUri {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ListenUri::Tcp(SocketAddr::V4(a)) => write!(f, "nbd://{}:{}", a.ip(), a.port()),
            ListenUri::Tcp(SocketAddr::V6(a)) => write!(f, "nbd://[{}]:{}", a.ip(), a.port()),
            ListenUri::Unix(p) => write!(f, "nbd+unix:///?socket={}", p.display()),
        }
    }
}

impl ListenUri {
    /// The URI a client would use for `export` at this address.
    pub fn client_uri(&self, export: &str) -> String {
        match self {
            ListenUri::Tcp(_) => format!("{self}/{export}"),
            ListenUri::Unix(p) => format!("nbd+unix:///{export}?socket={}", p.display()),
        }
    }

    pub fn parse(s: &str) -> Result<ListenUri, UriError> {
        parse_listen(s).map_err(|problem| UriError {
            uri: s.to_string(),
            problem,
        })
    }
}

/// A listen address that does not parse: the text and what is wrong.
#[derive(Debug, thiserror::Error)]
#[error("{uri}: {problem}")]
pub struct UriError {
    pub uri: String,
    pub problem: UriProblem,
}

/// What is wrong with a listen URI.
#[derive(Debug, thiserror::Error)]
pub enum UriProblem {
    #[error(
        "expected nbd://[HOST][:PORT] or nbd+unix:///?socket=PATH (TLS schemes are not supported)"
    )]
    Scheme,
    #[error("nbd+unix URI needs ?socket=PATH")]
    MissingSocket,
    #[error("a listen URI takes no export name (got {0:?}); choose exports with --export")]
    ExportName(String),
    #[error("unsupported query parameter {0:?}")]
    QueryParameter(String),
    #[error("query parameters and user names are not supported")]
    QueryOrUser,
    #[error("bad port {0:?} (expected 0..65535)")]
    BadPort(String),
    #[error("unterminated [IPv6] address")]
    UnterminatedIpv6,
    #[error("unexpected {after:?} after [{host}]")]
    AfterIpv6 { host: String, after: String },
    #[error("cannot resolve {host:?}: {error}")]
    Resolve { host: String, error: std::io::Error },
    #[error("{0:?} resolves to no address")]
    NoAddress(String),
}

fn parse_listen(s: &str) -> Result<ListenUri, UriProblem> {
    if let Some(rest) = s.strip_prefix("nbd+unix://") {
        return parse_unix(rest);
    }
    let Some(rest) = s.strip_prefix("nbd://") else {
        return Err(UriProblem::Scheme);
    };
    let (authority, path) = match rest.find('/') {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, ""),
    };
    if !path.is_empty() && path != "/" {
        return Err(UriProblem::ExportName(path.to_string()));
    }
    if authority.contains('?') || authority.contains('@') {
        return Err(UriProblem::QueryOrUser);
    }
    let (host, port) = split_host_port(authority)?;
    let port = port.unwrap_or(DEFAULT_PORT);
    let ip: IpAddr = if host.is_empty() {
        IpAddr::V4(Ipv4Addr::LOCALHOST)
    } else if let Ok(ip) = host.parse() {
        ip
    } else {
        (host, port)
            .to_socket_addrs()
            .map_err(|error| UriProblem::Resolve {
                host: host.to_string(),
                error,
            })?
            .next()
            .ok_or_else(|| UriProblem::NoAddress(host.to_string()))?
            .ip()
    };
    Ok(ListenUri::Tcp(SocketAddr::new(ip, port)))
}

/// `nbd+unix://` then `/?socket=PATH`.
fn parse_unix(rest: &str) -> Result<ListenUri, UriProblem> {
    let (path, query) = rest.split_once('?').ok_or(UriProblem::MissingSocket)?;
    if !path.is_empty() && path != "/" {
        return Err(UriProblem::ExportName(path.to_string()));
    }
    let mut socket = None;
    for kv in query.split('&') {
        match kv.split_once('=') {
            Some(("socket", v)) if !v.is_empty() => socket = Some(PathBuf::from(v)),
            _ => return Err(UriProblem::QueryParameter(kv.to_string())),
        }
    }
    socket.map(ListenUri::Unix).ok_or(UriProblem::MissingSocket)
}

fn split_host_port(a: &str) -> Result<(&str, Option<u16>), UriProblem> {
    let parse_port = |p: &str| {
        p.parse::<u16>()
            .map_err(|_| UriProblem::BadPort(p.to_string()))
    };
    if let Some(rest) = a.strip_prefix('[') {
        let (host, after) = rest.split_once(']').ok_or(UriProblem::UnterminatedIpv6)?;
        return match after {
            "" => Ok((host, None)),
            p => match p.strip_prefix(':') {
                Some(p) => Ok((host, Some(parse_port(p)?))),
                None => Err(UriProblem::AfterIpv6 {
                    host: host.to_string(),
                    after: p.to_string(),
                }),
            },
        };
    }
    match a.rsplit_once(':') {
        Some((h, p)) => Ok((h, Some(parse_port(p)?))),
        None => Ok((a, None)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tcp_defaults_to_loopback_and_default_port() {
        assert_eq!(
            ListenUri::parse("nbd://").unwrap(),
            ListenUri::Tcp("127.0.0.1:10809".parse().unwrap())
        );
        assert_eq!(
            ListenUri::parse("nbd://:0/").unwrap(),
            ListenUri::Tcp("127.0.0.1:0".parse().unwrap())
        );
        assert_eq!(
            ListenUri::parse("nbd://0.0.0.0:1234").unwrap(),
            ListenUri::Tcp("0.0.0.0:1234".parse().unwrap())
        );
        assert_eq!(
            ListenUri::parse("nbd://[::1]:99").unwrap(),
            ListenUri::Tcp("[::1]:99".parse().unwrap())
        );
    }

    #[test]
    fn unix_socket() {
        assert_eq!(
            ListenUri::parse("nbd+unix:///?socket=/tmp/x.sock").unwrap(),
            ListenUri::Unix("/tmp/x.sock".into())
        );
        let u = ListenUri::Unix("/tmp/s".into());
        assert_eq!(u.client_uri("d0"), "nbd+unix:///d0?socket=/tmp/s");
        assert_eq!(ListenUri::parse(&u.to_string()).unwrap(), u);
    }

    #[test]
    fn refuses_bad_uris_with_reasons() {
        type Is = fn(&UriProblem) -> bool;
        let cases: [(&str, Is); 9] = [
            ("nbd+unix:///", |p| matches!(p, UriProblem::MissingSocket)),
            (
                "nbd+unix:///disk?socket=/x",
                |p| matches!(p, UriProblem::ExportName(n) if n == "/disk"),
            ),
            (
                "nbd+unix:///?sock=/x",
                |p| matches!(p, UriProblem::QueryParameter(q) if q == "sock=/x"),
            ),
            (
                "nbd://host:notaport",
                |p| matches!(p, UriProblem::BadPort(v) if v == "notaport"),
            ),
            ("nbd://127.0.0.1:70000", |p| {
                matches!(p, UriProblem::BadPort(_))
            }),
            ("nbd://127.0.0.1/disk", |p| {
                matches!(p, UriProblem::ExportName(_))
            }),
            ("nbds://127.0.0.1", |p| matches!(p, UriProblem::Scheme)),
            ("http://x", |p| matches!(p, UriProblem::Scheme)),
            ("nbd://[::1", |p| matches!(p, UriProblem::UnterminatedIpv6)),
        ];
        for (bad, is) in cases {
            let e = ListenUri::parse(bad).expect_err(bad);
            assert!(is(&e.problem), "{bad}: {e:?}");
            assert!(e.to_string().starts_with(&format!("{bad}: ")), "{e}");
        }
    }
}
