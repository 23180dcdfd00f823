//! The web config file: TLS and basic auth for the listener, in the format of the Prometheus
//! exporter toolkit's `--web.config.file` (YAML; a `.toml` file is read as TOML), so the file an
//! exporter uses works here too. Only what memprof implements is accepted: an unknown key (such as
//! `client_auth_type`) is refused rather than ignored, since ignoring it would serve with less
//! protection than the file asks for.

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    sync::Arc,
};

use rustls::pki_types::{pem::PemObject, CertificateDer, PrivateKeyDer};
use serde::Deserialize;
use tokio_rustls::TlsAcceptor;

use super::guard::BasicAuth;

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    tls_server_config: Option<TlsFile>,
    basic_auth_users: Option<BTreeMap<String, String>>,
}

/// A certificate and key, each a file or inline PEM, as the exporter toolkit takes them.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct TlsFile {
    cert_file: Option<PathBuf>,
    key_file: Option<PathBuf>,
    cert: Option<String>,
    key: Option<String>,
}

/// What the web config asks the listener to do.
#[derive(Default)]
pub struct WebConfig {
    pub tls: Option<TlsAcceptor>,
    pub auth: Option<Arc<BasicAuth>>,
}

#[derive(Debug, thiserror::Error)]
#[error("invalid web config file {path}: {message}")]
pub struct WebConfigError {
    path: String,
    message: String,
}

/// Reads and checks the web config file at `path`; relative file names in it are relative to
/// its directory, as in the exporter toolkit.
pub fn load(path: &Path) -> Result<WebConfig, WebConfigError> {
    let fail = |message: String| WebConfigError { path: path.display().to_string(), message };
    let text = crate::input::read_text(path, super::config::SETTINGS_BYTES)
        .map_err(|e| fail(format!("cannot read it: {e}")))?;
    let file = parse(&text, path).map_err(fail)?;
    let dir = path.parent().unwrap_or(Path::new("."));
    let tls = file.tls_server_config.map(|tls| acceptor(tls, dir)).transpose().map_err(fail)?;
    let auth = match file.basic_auth_users {
        Some(users) if !users.is_empty() => Some(Arc::new(BasicAuth::new(users).map_err(fail)?)),
        _ => None,
    };
    Ok(WebConfig { tls, auth })
}

fn parse(text: &str, path: &Path) -> Result<File, String> {
    // Messages of either parser may span lines: keep them on one.
    let one_line = |message: String| message.split_whitespace().collect::<Vec<_>>().join(" ");
    if path.extension().is_some_and(|ext| ext == "toml") {
        toml::from_str(text).map_err(|e| one_line(e.to_string()))
    } else if text.trim().is_empty() {
        Ok(File::default())
    } else {
        // The line and column without a drawing of the file, which takes lines of its own.
        serde_saphyr::from_str_with_options(text, serde_saphyr::options! { with_snippet: false })
            .map_err(|e| one_line(e.to_string().trim_start_matches("error: ").to_string()))
    }
}

/// The most of a certificate or key file read: a chain of certificates is a few KiB.
const PEM_BYTES: u64 = 1 << 20;

fn acceptor(tls: TlsFile, dir: &Path) -> Result<TlsAcceptor, String> {
    let certs: Vec<CertificateDer<'static>> = match (&tls.cert_file, &tls.cert) {
        (Some(file), None) => {
            let file = dir.join(file);
            let pem = crate::input::read_at_most(&file, PEM_BYTES)
                .map_err(|e| format!("cannot read cert_file {}: {e}", file.display()))?;
            CertificateDer::pem_slice_iter(&pem)
                .collect::<Result<_, _>>()
                .map_err(|e| format!("cert_file {}: {e}", file.display()))?
        }
        (None, Some(pem)) => CertificateDer::pem_slice_iter(pem.as_bytes())
            .collect::<Result<_, _>>()
            .map_err(|e| format!("cert: {e}"))?,
        _ => return Err("tls_server_config needs one of cert_file or cert".into()),
    };
    if certs.is_empty() {
        return Err("tls_server_config: no PEM certificate found".into());
    }
    let key = match (&tls.key_file, &tls.key) {
        (Some(file), None) => {
            let file = dir.join(file);
            let pem = crate::input::read_at_most(&file, PEM_BYTES)
                .map_err(|e| format!("cannot read key_file {}: {e}", file.display()))?;
            PrivateKeyDer::from_pem_slice(&pem).map_err(|e| format!("key_file {}: {e}", file.display()))?
        }
        (None, Some(pem)) => PrivateKeyDer::from_pem_slice(pem.as_bytes()).map_err(|e| format!("key: {e}"))?,
        _ => return Err("tls_server_config needs one of key_file or key".into()),
    };
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .map_err(|e| format!("the certificate and key cannot be used together: {e}"))?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(TlsAcceptor::from(Arc::new(config)))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A test's own directory, removed when dropped: the tests run at once, and none leaves its
    /// files in /tmp.
    struct Dir(PathBuf);

    impl Dir {
        fn new(test: &str) -> Self {
            let dir = std::env::temp_dir().join(format!("memprof-web-config-{}-{test}", std::process::id()));
            std::fs::create_dir_all(&dir).unwrap();
            Self(dir)
        }

        fn write(&self, name: &str, text: &str) -> PathBuf {
            let path = self.0.join(name);
            std::fs::write(&path, text).unwrap();
            path
        }

        fn error(&self, name: &str, text: &str) -> String {
            load(&self.write(name, text)).err().expect("refused").to_string()
        }
    }

    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    #[test]
    fn an_empty_file_asks_for_nothing() {
        let dir = Dir::new("empty");
        let config = load(&dir.write("empty.yml", "")).unwrap();
        assert!(config.tls.is_none() && config.auth.is_none());
    }

    #[test]
    fn bad_files_are_refused_with_the_reason_on_one_line() {
        let dir = Dir::new("bad");
        let err = dir.error("unknown.yml", "tls_server_config:\n  client_auth_type: RequireAndVerifyClientCert\n");
        assert!(err.contains("unknown field `client_auth_type`"), "{err}");
        assert!(!err.contains('\n'), "{err}");
        let err = dir.error("missing.yml", "tls_server_config:\n  cert_file: nope.crt\n  key_file: nope.key\n");
        assert!(err.contains("cannot read cert_file") && err.contains("nope.crt"), "{err}");
        let err = dir.error("nokey.yml", "tls_server_config:\n  cert: x\n");
        assert!(err.contains("no PEM certificate") || err.contains("key"), "{err}");
        let err = dir.error("hash.yml", "basic_auth_users:\n  alice: plaintext\n");
        assert!(err.contains("`alice`") && err.contains("bcrypt"), "{err}");
        let err = dir.error("toml.toml", "basic_auth_users = 3\n");
        assert!(err.starts_with("invalid web config file"), "{err}");
        let err = load(Path::new("/nonexistent/web.yml")).err().unwrap().to_string();
        assert!(err.contains("cannot read it"), "{err}");
    }

    #[test]
    fn users_with_bcrypt_hashes_are_accepted() {
        // bcrypt of "secret" at cost 4 (cheap for a test).
        let hash = bcrypt::hash("secret", 4).unwrap();
        let dir = Dir::new("users");
        let config = load(&dir.write("users.yml", &format!("basic_auth_users:\n  alice: '{hash}'\n"))).unwrap();
        assert!(config.auth.is_some() && config.tls.is_none());
    }

    #[test]
    fn a_hash_too_dear_to_check_is_refused() {
        let hash = bcrypt::hash("secret", 4).unwrap().replacen("$04$", "$31$", 1);
        let dir = Dir::new("dear");
        let err = load(&dir.write("dear.yml", &format!("basic_auth_users:\n  alice: '{hash}'\n"))).err().unwrap();
        assert!(err.to_string().contains("a bcrypt cost of 31, above 16"), "{err}");
    }
}
