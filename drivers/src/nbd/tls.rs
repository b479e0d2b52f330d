//! TLS for the `nbd` leaf (the protocol's STARTTLS upgrade), with rustls,
//! reading certificates from the directory libnbd's `tls-certificates=DIR`
//! names (the GnuTLS layout qemu and nbdkit share): `ca-cert.pem` to
//! check the server, and `client-cert.pem` + `client-key.pem` when the
//! server asks for a client certificate. Without a directory the system's
//! usual place is not guessed: the URI must name one.

use super::NbdError;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::{ClientConfig, RootCertStore};
use std::path::Path;
use std::sync::Arc;

fn pem_err(path: &Path, e: impl std::fmt::Display) -> NbdError {
    NbdError::Tls(format!("{}: {e}", path.display()))
}

fn certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, NbdError> {
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(|e| pem_err(path, e))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| pem_err(path, e))?;
    if certs.is_empty() {
        return Err(pem_err(path, "no certificate in the file"));
    }
    Ok(certs)
}

/// The rustls client configuration for `dir`. The config names the `ring`
/// provider itself, as the server's does, so nothing depends on which
/// provider another crate installed process-wide.
pub fn client_config(dir: &Path) -> Result<Arc<ClientConfig>, NbdError> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let ca = dir.join("ca-cert.pem");
    let mut roots = RootCertStore::empty();
    for c in certs(&ca)? {
        roots.add(c).map_err(|e| pem_err(&ca, e))?;
    }
    let builder = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| pem_err(dir, e))?
        .with_root_certificates(roots);
    let cert = dir.join("client-cert.pem");
    let key = dir.join("client-key.pem");
    let config = if cert.exists() && key.exists() {
        let chain = certs(&cert)?;
        let k = PrivateKeyDer::from_pem_file(&key).map_err(|e| pem_err(&key, e))?;
        builder
            .with_client_auth_cert(chain, k)
            .map_err(|e| pem_err(&key, e))?
    } else {
        builder.with_no_client_auth()
    };
    Ok(Arc::new(config))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_ca_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let e = client_config(dir.path()).unwrap_err().to_string();
        assert!(e.contains("ca-cert.pem"), "{e}");
        std::fs::write(dir.path().join("ca-cert.pem"), "not a pem\n").unwrap();
        let e = client_config(dir.path()).unwrap_err().to_string();
        assert!(e.contains("no certificate"), "{e}");
    }
}
