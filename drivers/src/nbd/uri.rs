//! The `nbd` leaf's server address, written as libnbd's `nbd_connect_uri`
//! spells it (`doc/uri.md` of NetworkBlockDevice/nbd), so the URI a user
//! gives fio's nbd engine, nbdinfo or qemu works unchanged in a table:
//!
//! - `nbd://HOST[:PORT][/EXPORT]` and `nbds://...` (TLS) over TCP; PORT
//!   defaults to 10809, HOST may be `[IPv6]`;
//! - `nbd+unix:///[EXPORT]?socket=PATH` and `nbds+unix://...` over a Unix
//!   socket;
//! - `tls-certificates=DIR` in the query (libnbd's name) for the TLS
//!   schemes: the directory of `ca-cert.pem` and the optional
//!   `client-cert.pem` / `client-key.pem`.
//!
//! Percent-escapes (`%2F`) are decoded in the export name and query values,
//! as libnbd does. Anything else (users, unknown query keys, PSK files) is
//! refused with what is wrong, so a typo never silently changes meaning.

use std::fmt;
use std::path::PathBuf;

pub const DEFAULT_PORT: u16 = 10809;

/// Where the server is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Endpoint {
    /// Host name or address (without brackets) and port.
    Tcp {
        host: String,
        port: u16,
    },
    Unix(PathBuf),
}

/// A parsed client URI; `text` is what the user wrote (printed back by
/// `table`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NbdUri {
    pub text: String,
    pub endpoint: Endpoint,
    pub export: String,
    pub tls: bool,
    pub tls_certificates: Option<PathBuf>,
}

impl fmt::Display for NbdUri {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

/// What is wrong with a client URI.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UriError {
    #[error("'{0}': expected nbd://HOST[:PORT]/EXPORT, nbd+unix:///EXPORT?socket=PATH, or nbds:// / nbds+unix:// for TLS")]
    Scheme(String),
    #[error("'{0}': nbd+unix URIs need ?socket=PATH")]
    MissingSocket(String),
    #[error("'{0}': a TCP URI needs a host")]
    MissingHost(String),
    #[error("'{0}': a Unix-socket URI takes no host or port")]
    UnixWithHost(String),
    #[error("'{uri}': bad port '{port}' (expected 1..65535)")]
    BadPort { uri: String, port: String },
    #[error("'{0}': unterminated [IPv6] address")]
    UnterminatedIpv6(String),
    #[error("'{0}': user names are not supported")]
    User(String),
    #[error("'{uri}': unsupported query parameter '{key}' (known: socket, tls-certificates)")]
    QueryParameter { uri: String, key: String },
    #[error("'{uri}': '{key}' given twice")]
    QueryTwice { uri: String, key: String },
    #[error("'{uri}': tls-certificates needs a TLS scheme (nbds:// or nbds+unix://)")]
    CertificatesWithoutTls { uri: String },
    #[error("'{0}': bad percent-escape")]
    BadEscape(String),
}

/// Decode `%XX` escapes.
fn percent_decode(uri: &str, s: &str) -> Result<String, UriError> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            let hex = s
                .get(i + 1..i + 3)
                .and_then(|h| u8::from_str_radix(h, 16).ok())
                .ok_or_else(|| UriError::BadEscape(uri.to_string()))?;
            out.push(hex);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8(out).map_err(|_| UriError::BadEscape(uri.to_string()))
}

/// Split `HOST[:PORT]` (HOST may be `[v6]`).
fn host_port(uri: &str, auth: &str) -> Result<(String, u16), UriError> {
    let (host, port) = if let Some(rest) = auth.strip_prefix('[') {
        let end = rest
            .find(']')
            .ok_or_else(|| UriError::UnterminatedIpv6(uri.to_string()))?;
        let after = &rest[end + 1..];
        let port = match after.strip_prefix(':') {
            Some(p) => Some(p),
            None if after.is_empty() => None,
            None => {
                return Err(UriError::BadPort {
                    uri: uri.to_string(),
                    port: after.to_string(),
                })
            }
        };
        (rest[..end].to_string(), port)
    } else {
        match auth.rsplit_once(':') {
            Some((h, p)) => (h.to_string(), Some(p)),
            None => (auth.to_string(), None),
        }
    };
    if host.is_empty() {
        return Err(UriError::MissingHost(uri.to_string()));
    }
    let port = match port {
        None => DEFAULT_PORT,
        Some(p) => match p.parse::<u16>() {
            Ok(n) if n > 0 => n,
            _ => {
                return Err(UriError::BadPort {
                    uri: uri.to_string(),
                    port: p.to_string(),
                })
            }
        },
    };
    Ok((host, port))
}

impl NbdUri {
    pub fn parse(s: &str) -> Result<NbdUri, UriError> {
        let err_scheme = || UriError::Scheme(s.to_string());
        let (scheme, rest) = s.split_once("://").ok_or_else(err_scheme)?;
        let (tls, unix) = match scheme {
            "nbd" => (false, false),
            "nbds" => (true, false),
            "nbd+unix" => (false, true),
            "nbds+unix" => (true, true),
            _ => return Err(err_scheme()),
        };
        let (before_query, query) = match rest.split_once('?') {
            Some((a, q)) => (a, Some(q)),
            None => (rest, None),
        };
        let (auth, path) = match before_query.find('/') {
            Some(i) => (&before_query[..i], &before_query[i + 1..]),
            None => (before_query, ""),
        };
        if auth.contains('@') {
            return Err(UriError::User(s.to_string()));
        }
        let export = percent_decode(s, path)?;
        let mut socket = None;
        let mut certs = None;
        for kv in query.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
            let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
            let slot = match k {
                "socket" => &mut socket,
                "tls-certificates" => &mut certs,
                _ => {
                    return Err(UriError::QueryParameter {
                        uri: s.to_string(),
                        key: k.to_string(),
                    })
                }
            };
            if slot.is_some() {
                return Err(UriError::QueryTwice {
                    uri: s.to_string(),
                    key: k.to_string(),
                });
            }
            *slot = Some(PathBuf::from(percent_decode(s, v)?));
        }
        if certs.is_some() && !tls {
            return Err(UriError::CertificatesWithoutTls { uri: s.to_string() });
        }
        let endpoint = if unix {
            if !auth.is_empty() {
                return Err(UriError::UnixWithHost(s.to_string()));
            }
            Endpoint::Unix(
                socket
                    .filter(|p| !p.as_os_str().is_empty())
                    .ok_or_else(|| UriError::MissingSocket(s.to_string()))?,
            )
        } else {
            if socket.is_some() {
                return Err(UriError::QueryParameter {
                    uri: s.to_string(),
                    key: "socket".into(),
                });
            }
            let (host, port) = host_port(s, auth)?;
            Endpoint::Tcp { host, port }
        };
        Ok(NbdUri {
            text: s.to_string(),
            endpoint,
            export,
            tls,
            tls_certificates: certs,
        })
    }

    /// Host name a TLS server certificate must match: the TCP host, or
    /// `localhost` for Unix sockets (as libnbd does).
    pub fn tls_server_name(&self) -> &str {
        match &self.endpoint {
            Endpoint::Tcp { host, .. } => host,
            Endpoint::Unix(_) => "localhost",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tcp_forms() {
        let u = NbdUri::parse("nbd://127.0.0.1:10810/disk0").unwrap();
        assert_eq!(
            u.endpoint,
            Endpoint::Tcp {
                host: "127.0.0.1".into(),
                port: 10810
            }
        );
        assert_eq!(u.export, "disk0");
        assert!(!u.tls);
        let u = NbdUri::parse("nbd://example.org").unwrap();
        assert_eq!(
            u.endpoint,
            Endpoint::Tcp {
                host: "example.org".into(),
                port: DEFAULT_PORT
            }
        );
        assert_eq!(u.export, "");
        let u = NbdUri::parse("nbd://[::1]:7000/a%2Fb").unwrap();
        assert_eq!(
            u.endpoint,
            Endpoint::Tcp {
                host: "::1".into(),
                port: 7000
            }
        );
        assert_eq!(u.export, "a/b");
    }

    #[test]
    fn unix_and_tls_forms() {
        let u = NbdUri::parse("nbd+unix:///data?socket=/tmp/n.sock").unwrap();
        assert_eq!(u.endpoint, Endpoint::Unix("/tmp/n.sock".into()));
        assert_eq!(u.export, "data");
        let u = NbdUri::parse("nbds+unix:///?socket=/s&tls-certificates=/etc/pki").unwrap();
        assert!(u.tls);
        assert_eq!(u.tls_certificates, Some(PathBuf::from("/etc/pki")));
        assert_eq!(u.tls_server_name(), "localhost");
        assert_eq!(
            u.to_string(),
            "nbds+unix:///?socket=/s&tls-certificates=/etc/pki"
        );
    }

    #[test]
    fn bad_uris_name_the_problem() {
        for (s, want) in [
            ("http://x/y", "expected nbd://"),
            ("nbd+unix:///e", "need ?socket=PATH"),
            ("nbd://:99/e", "needs a host"),
            ("nbd://h:0/e", "bad port '0'"),
            ("nbd://h:x/e", "bad port 'x'"),
            ("nbd://[::1/e", "unterminated"),
            ("nbd://u@h/e", "user names"),
            ("nbd://h/e?foo=1", "unsupported query parameter 'foo'"),
            ("nbd://h/e?tls-certificates=/d", "needs a TLS scheme"),
            ("nbd+unix://h/e?socket=/s", "takes no host"),
            ("nbd+unix:///e?socket=/s&socket=/t", "given twice"),
            ("nbd://h/%zz", "percent-escape"),
        ] {
            let e = NbdUri::parse(s).unwrap_err().to_string();
            assert!(e.contains(want), "{s}: {e}");
        }
    }
}
