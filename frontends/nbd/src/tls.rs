//! TLS for NBD (the protocol's STARTTLS upgrade), with rustls.
//!
//! The server's modes and certificate layout follow nbdkit and qemu-nbd:
//! `--tls=off|on|require`, `--tls-certificates=DIR` holding
//! `server-cert.pem`, `server-key.pem` and (to check clients with
//! `--tls-verify-peer`) `ca-cert.pem`. Under `require`, the protocol's
//! FORCEDTLS: every option but STARTTLS and ABORT is refused with
//! NBD_REP_ERR_TLS_REQD until TLS is up.
//!
//! On a connection, [`TlsSession`] sits between the socket and the NBD
//! code (see `sock.rs`): the reader feeds received records to rustls
//! without ever blocking while holding the session lock (it polls the
//! socket first and reads it non-blocking), and a writer encrypts under
//! the lock, then sends the records under a separate send lock, so a
//! reply blocked on a slow client never stops the reader from taking
//! requests. Pre-shared keys (nbdkit's `--tls-psk`) are not offered:
//! rustls implements no external-PSK cipher suites.

use parking_lot::{Mutex, MutexGuard};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::{RootCertStore, ServerConfig, ServerConnection};
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// `--tls`: whether clients may, or must, upgrade to TLS.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum TlsMode {
    /// STARTTLS is refused (NBD_REP_ERR_POLICY).
    #[default]
    Off,
    /// Clients choose: plain or STARTTLS.
    On,
    /// Every client must STARTTLS before anything else.
    Require,
}

/// Why the TLS configuration could not be built.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("--tls={0:?} needs --tls-certificates=DIR")]
    NoCertificates(TlsMode),
    #[error("{}: {source}", path.display())]
    Pem {
        path: PathBuf,
        #[source]
        source: rustls::pki_types::pem::Error,
    },
    #[error("{}: no certificate in the file", .0.display())]
    NoCertificate(PathBuf),
    #[error("{}: {source}", path.display())]
    Rustls {
        path: PathBuf,
        #[source]
        source: rustls::Error,
    },
    #[error("client verification with {}: {source}", path.display())]
    Verifier {
        path: PathBuf,
        #[source]
        source: rustls::server::VerifierBuilderError,
    },
}

/// The server's TLS policy: its mode and, unless off, its rustls config.
#[derive(Clone, Default)]
pub struct TlsPolicy {
    pub mode: TlsMode,
    pub config: Option<Arc<ServerConfig>>,
    /// Client certificates are checked (`--tls-verify-peer`).
    pub verify_peer: bool,
}

impl TlsPolicy {
    /// Build the policy from the command line's flags.
    pub fn load(
        mode: TlsMode,
        dir: Option<&Path>,
        verify_peer: bool,
    ) -> Result<TlsPolicy, TlsError> {
        if mode == TlsMode::Off {
            return Ok(TlsPolicy::default());
        }
        let dir = dir.ok_or(TlsError::NoCertificates(mode))?;
        Ok(TlsPolicy {
            mode,
            config: Some(Arc::new(server_config(dir, verify_peer)?)),
            verify_peer,
        })
    }
}

fn certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let pem = |source| TlsError::Pem {
        path: path.to_path_buf(),
        source,
    };
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(pem)?
        .collect::<Result<Vec<_>, _>>()
        .map_err(pem)?;
    if certs.is_empty() {
        return Err(TlsError::NoCertificate(path.to_path_buf()));
    }
    Ok(certs)
}

/// rustls's process-wide default provider is not set here: the config
/// names the `ring` provider itself, so nothing depends on feature
/// unification elsewhere in the build.
fn server_config(dir: &Path, verify_peer: bool) -> Result<ServerConfig, TlsError> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let cert_path = dir.join("server-cert.pem");
    let key_path = dir.join("server-key.pem");
    let chain = certs(&cert_path)?;
    let key = PrivateKeyDer::from_pem_file(&key_path).map_err(|source| TlsError::Pem {
        path: key_path.clone(),
        source,
    })?;
    let builder = ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|source| TlsError::Rustls {
            path: dir.to_path_buf(),
            source,
        })?;
    let builder = if verify_peer {
        let ca_path = dir.join("ca-cert.pem");
        let mut roots = RootCertStore::empty();
        for c in certs(&ca_path)? {
            roots.add(c).map_err(|source| TlsError::Rustls {
                path: ca_path.clone(),
                source,
            })?;
        }
        let v = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
            .build()
            .map_err(|source| TlsError::Verifier {
                path: ca_path.clone(),
                source,
            })?;
        builder.with_client_cert_verifier(v)
    } else {
        builder.with_no_client_auth()
    };
    builder
        .with_single_cert(chain, key)
        .map_err(|source| TlsError::Rustls {
            path: key_path,
            source,
        })
}

/// One connection's TLS state (see the module documentation).
pub struct TlsSession {
    pub(crate) conn: Mutex<ServerConnection>,
    /// Held while records go out, taken before the session lock is let go
    /// so that records leave in the order rustls produced them.
    pub(crate) send_lock: Mutex<()>,
}

impl TlsSession {
    pub fn new(config: Arc<ServerConfig>) -> io::Result<TlsSession> {
        let mut conn = ServerConnection::new(config).map_err(io::Error::other)?;
        // A reply (up to the 64 MiB maximum request) is encrypted whole
        // and sent at once (`flush`): no cap on rustls's send buffer,
        // which would otherwise make a large write stop short.
        conn.set_buffer_limit(None);
        Ok(TlsSession {
            conn: Mutex::new(conn),
            send_lock: Mutex::new(()),
        })
    }

    /// Take what rustls wants to send, and send it with `send` (the raw
    /// socket) after letting the session lock go.
    pub(crate) fn flush(
        &self,
        mut conn: MutexGuard<'_, ServerConnection>,
        send: impl FnOnce(&[u8]) -> io::Result<()>,
    ) -> io::Result<()> {
        let mut out = Vec::new();
        while conn.wants_write() {
            conn.write_tls(&mut out)?;
        }
        if out.is_empty() {
            return Ok(());
        }
        let _order = self.send_lock.lock();
        drop(conn);
        send(&out)
    }
}
