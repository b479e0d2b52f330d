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

    pub fn parse(s: &str) -> Result<ListenUri, String> {
        if let Some(rest) = s.strip_prefix("nbd+unix://") {
            let (path, query) = rest
                .split_once('?')
                .ok_or_else(|| format!("{s}: nbd+unix URI needs ?socket=PATH"))?;
            if !path.is_empty() && path != "/" {
                return Err(format!(
                    "{s}: a listen URI takes no export name (got {path:?}); choose exports with --export"
                ));
            }
            let mut socket = None;
            for kv in query.split('&') {
                match kv.split_once('=') {
                    Some(("socket", v)) if !v.is_empty() => socket = Some(PathBuf::from(v)),
                    _ => return Err(format!("{s}: unsupported query parameter {kv:?}")),
                }
            }
            return socket
                .map(ListenUri::Unix)
                .ok_or_else(|| format!("{s}: nbd+unix URI needs ?socket=PATH"));
        }
        if let Some(rest) = s.strip_prefix("nbd://") {
            let (authority, path) = match rest.find('/') {
                Some(i) => (&rest[..i], &rest[i..]),
                None => (rest, ""),
            };
            if !path.is_empty() && path != "/" {
                return Err(format!(
                    "{s}: a listen URI takes no export name (got {path:?}); choose exports with --export"
                ));
            }
            if authority.contains('?') || authority.contains('@') {
                return Err(format!(
                    "{s}: query parameters and user names are not supported"
                ));
            }
            let (host, port) = split_host_port(authority).map_err(|e| format!("{s}: {e}"))?;
            let port = port.unwrap_or(DEFAULT_PORT);
            let ip: IpAddr = if host.is_empty() {
                IpAddr::V4(Ipv4Addr::LOCALHOST)
            } else if let Ok(ip) = host.parse() {
                ip
            } else {
                (host, port)
                    .to_socket_addrs()
                    .map_err(|e| format!("{s}: cannot resolve {host:?}: {e}"))?
                    .next()
                    .ok_or_else(|| format!("{s}: {host:?} resolves to no address"))?
                    .ip()
            };
            return Ok(ListenUri::Tcp(SocketAddr::new(ip, port)));
        }
        Err(format!(
            "{s}: expected nbd://[HOST][:PORT] or nbd+unix:///?socket=PATH (TLS schemes are not supported)"
        ))
    }
}

fn split_host_port(a: &str) -> Result<(&str, Option<u16>), String> {
    let parse_port = |p: &str| {
        p.parse::<u16>()
            .map_err(|_| format!("bad port {p:?} (expected 0..65535)"))
    };
    if let Some(rest) = a.strip_prefix('[') {
        let (host, after) = rest
            .split_once(']')
            .ok_or_else(|| "unterminated [IPv6] address".to_string())?;
        return match after {
            "" => Ok((host, None)),
            p => match p.strip_prefix(':') {
                Some(p) => Ok((host, Some(parse_port(p)?))),
                None => Err(format!("unexpected {p:?} after [{host}]")),
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
        for bad in [
            "nbd+unix:///",
            "nbd+unix:///disk?socket=/x",
            "nbd+unix:///?sock=/x",
            "nbd://host:notaport",
            "nbd://127.0.0.1:70000",
            "nbd://127.0.0.1/disk",
            "nbds://127.0.0.1",
            "http://x",
            "nbd://[::1",
        ] {
            assert!(ListenUri::parse(bad).is_err(), "{bad} should be refused");
        }
    }
}
