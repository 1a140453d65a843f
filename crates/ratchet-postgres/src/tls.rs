//! TLS to PostgreSQL: libpq's `sslmode` and `sslrootcert`, made once into the rustls
//! connector that every connection of a backend uses.
//!
//! The crypto provider is aws-lc-rs, named here rather than taken from a process-wide
//! default, so that what a connection trusts never depends on what another crate installed.
//! Nothing here ever skips a check the mode asks for: `sslmode=require` without a root file
//! accepts any certificate because libpq does, and says so in the name of its verifier.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use ratchet_store::Error;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::{WebPkiServerVerifier, verify_server_cert_signed_by_trust_anchor};
use rustls::crypto::{
    CryptoProvider, WebPkiSupportedAlgorithms, verify_tls12_signature, verify_tls13_signature,
};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::server::ParsedCertificate;
use rustls::{ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme};
use tokio_postgres_rustls::MakeRustlsConnect;

use crate::Result;

/// The protocol a client names in the handshake (ALPN), as libpq 17 names it. PostgreSQL 17
/// requires it for `sslnegotiation=direct`; older servers ignore it.
const ALPN: &[u8] = b"postgresql";

/// libpq's `sslmode`: whether a connection is encrypted, and what is checked of the server's
/// certificate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SslMode {
    /// Never encrypted.
    Disable,
    /// Encrypted when the server offers it, plain otherwise; the certificate is not checked.
    #[default]
    Prefer,
    /// Always encrypted. The certificate is not checked, unless root certificates are given:
    /// then as `VerifyCa`.
    Require,
    /// Always encrypted, and the certificate's chain must lead to a trusted root.
    VerifyCa,
    /// As `VerifyCa`, and the certificate must also name the host connected to.
    VerifyFull,
}

impl SslMode {
    const ALL: [SslMode; 5] = [
        SslMode::Disable,
        SslMode::Prefer,
        SslMode::Require,
        SslMode::VerifyCa,
        SslMode::VerifyFull,
    ];

    /// The mode as a url names it.
    pub fn as_str(self) -> &'static str {
        match self {
            SslMode::Disable => "disable",
            SslMode::Prefer => "prefer",
            SslMode::Require => "require",
            SslMode::VerifyCa => "verify-ca",
            SslMode::VerifyFull => "verify-full",
        }
    }

    pub(crate) fn parse(value: &str) -> Option<SslMode> {
        SslMode::ALL.into_iter().find(|mode| mode.as_str() == value)
    }

    /// What the driver is told. It knows whether to ask for TLS, not what to trust: that is
    /// the connector's business.
    fn driver(self) -> postgres::config::SslMode {
        match self {
            SslMode::Disable => postgres::config::SslMode::Disable,
            SslMode::Prefer => postgres::config::SslMode::Prefer,
            SslMode::Require | SslMode::VerifyCa | SslMode::VerifyFull => {
                postgres::config::SslMode::Require
            }
        }
    }
}

impl fmt::Display for SslMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// How connections are secured: a mode, the roots it trusts, and the connector made of them.
#[derive(Clone)]
pub struct Tls {
    mode: SslMode,
    root_cert: Option<PathBuf>,
    connector: MakeRustlsConnect,
}

impl Tls {
    /// Reads `root_cert` (PEM certificates) when given, except with `Disable`, which never
    /// uses it. Without it, `VerifyCa` and `VerifyFull` trust the system's root certificates.
    ///
    /// Fails (`Error::Invalid`) when the file cannot be read or holds no usable certificate,
    /// when no system roots are found where they are needed, and when a root file is given
    /// with `Prefer`, which would not check the certificate against it.
    pub fn new(mode: SslMode, root_cert: Option<&Path>) -> Result<Tls> {
        Tls::build(mode, root_cert).map_err(Error::Invalid)
    }

    /// `new`, failing with the reason alone (the caller says which url or setting it was).
    pub(crate) fn build(mode: SslMode, root_cert: Option<&Path>) -> Result<Tls, String> {
        let check = match (mode, root_cert) {
            // No TLS at all: libpq does not read the file either.
            (SslMode::Disable, _) => Check::Nothing,
            // libpq would check the chain, and fall back to plain when the check fails: that
            // is refused rather than quietly not checked.
            (SslMode::Prefer, Some(path)) => {
                return Err(format!(
                    "sslrootcert={} is not read with sslmode=prefer, which checks no \
                     certificate; expected sslmode=require, verify-ca or verify-full with it",
                    path.display()
                ));
            }
            (SslMode::Prefer | SslMode::Require, None) => Check::Nothing,
            (SslMode::Require | SslMode::VerifyCa, Some(path)) => Check::Chain(file_roots(path)?),
            (SslMode::VerifyCa, None) => Check::Chain(system_roots(mode)?),
            (SslMode::VerifyFull, Some(path)) => Check::ChainAndName(file_roots(path)?),
            (SslMode::VerifyFull, None) => Check::ChainAndName(system_roots(mode)?),
        };
        let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
        let algorithms = provider.signature_verification_algorithms;
        let verifier: Arc<dyn ServerCertVerifier> = match check {
            Check::Nothing => Arc::new(NamesUnchecked {
                roots: None,
                algorithms,
            }),
            Check::Chain(roots) => Arc::new(NamesUnchecked {
                roots: Some(Arc::new(roots)),
                algorithms,
            }),
            Check::ChainAndName(roots) => {
                WebPkiServerVerifier::builder_with_provider(Arc::new(roots), Arc::clone(&provider))
                    .build()
                    .map_err(|e| format!("the root certificates cannot be used: {e}"))?
            }
        };
        let mut config = client_config(provider)
            .dangerous()
            .with_custom_certificate_verifier(verifier)
            .with_no_client_auth();
        config.alpn_protocols = vec![ALPN.to_vec()];
        Ok(Tls {
            mode,
            root_cert: root_cert
                .filter(|_| mode != SslMode::Disable)
                .map(Path::to_path_buf),
            connector: MakeRustlsConnect::new(config),
        })
    }

    pub fn mode(&self) -> SslMode {
        self.mode
    }

    /// The file of root certificates, when one was given and is used.
    pub fn root_cert(&self) -> Option<&Path> {
        self.root_cert.as_deref()
    }

    /// Points the driver's configuration at this mode (it decides whether TLS is asked for).
    pub(crate) fn configure(&self, config: &mut tokio_postgres::Config) {
        config.ssl_mode(self.mode.driver());
    }

    pub(crate) fn connector(&self) -> MakeRustlsConnect {
        self.connector.clone()
    }
}

impl fmt::Display for Tls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "sslmode={}", self.mode)?;
        match (&self.root_cert, self.mode) {
            (Some(path), _) => write!(f, ", sslrootcert={}", path.display()),
            (None, SslMode::VerifyCa | SslMode::VerifyFull) => {
                f.write_str(", the system's root certificates")
            }
            (None, SslMode::Disable | SslMode::Prefer | SslMode::Require) => Ok(()),
        }
    }
}

impl fmt::Debug for Tls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tls")
            .field("mode", &self.mode)
            .field("root_cert", &self.root_cert)
            .finish_non_exhaustive()
    }
}

/// What is checked of the server's certificate.
enum Check {
    Nothing,
    Chain(RootCertStore),
    ChainAndName(RootCertStore),
}

fn client_config(
    provider: Arc<CryptoProvider>,
) -> rustls::ConfigBuilder<ClientConfig, rustls::WantsVerifier> {
    ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .expect("aws-lc-rs supports rustls' default protocol versions")
}

/// The certificates of a PEM file, each made a trust anchor.
fn file_roots(path: &Path) -> Result<RootCertStore, String> {
    let shown = path.display();
    let certs = CertificateDer::pem_file_iter(path)
        .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
        .map_err(|e| {
            format!(
                "sslrootcert={shown} cannot be read ({e}); expected a PEM file of root certificates"
            )
        })?;
    if certs.is_empty() {
        return Err(format!(
            "sslrootcert={shown} holds no certificate; expected a PEM file of root \
             certificates (-----BEGIN CERTIFICATE-----)"
        ));
    }
    let mut roots = RootCertStore::empty();
    for cert in certs {
        roots.add(cert).map_err(|e| {
            format!("sslrootcert={shown} holds a certificate that cannot be a root ({e}); expected X.509 certificates")
        })?;
    }
    Ok(roots)
}

/// The system's root certificates (as OpenSSL finds them, or `SSL_CERT_FILE`/`SSL_CERT_DIR`).
fn system_roots(mode: SslMode) -> Result<RootCertStore, String> {
    let found = rustls_native_certs::load_native_certs();
    let mut roots = RootCertStore::empty();
    let (added, _unusable) = roots.add_parsable_certificates(found.certs);
    if added == 0 {
        let errors: Vec<String> = found.errors.iter().map(ToString::to_string).collect();
        return Err(format!(
            "sslmode={mode} without sslrootcert trusts the system's root certificates, and none \
             were found{}; expected sslrootcert=FILE",
            if errors.is_empty() {
                String::new()
            } else {
                format!(" ({})", errors.join("; "))
            }
        ));
    }
    Ok(roots)
}

/// The verifier of the modes that do not look at the certificate's names. Without `roots`
/// (`sslmode=require` and `prefer` without root certificates) any certificate is accepted, as
/// libpq accepts it: the connection is encrypted but the server unauthenticated. With `roots`
/// (`verify-ca`, and `require` given root certificates) the chain must lead to one of them and
/// be valid now. Either way the handshake's signatures are checked, so the server holds the key
/// of the certificate it showed, which the channel binding of SCRAM-SHA-256-PLUS relies upon.
#[derive(Debug)]
struct NamesUnchecked {
    roots: Option<Arc<RootCertStore>>,
    algorithms: WebPkiSupportedAlgorithms,
}

impl ServerCertVerifier for NamesUnchecked {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        if let Some(roots) = &self.roots {
            let cert = ParsedCertificate::try_from(end_entity)?;
            verify_server_cert_signed_by_trust_anchor(
                &cert,
                roots,
                intermediates,
                now,
                self.algorithms.all,
            )?;
        }
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls12_signature(message, cert, dss, &self.algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls13_signature(message, cert, dss, &self.algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.algorithms.supported_schemes()
    }
}

#[cfg(test)]
mod tests {
    use rustls::internal::msgs::codec::Codec;

    use super::*;

    const UNRELATED_ROOT: &str = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/unrelated-root.pem"
    );

    /// A signature as a server sends it. rustls makes these only from the wire: the scheme,
    /// the length, the bytes.
    fn signed(scheme: SignatureScheme, signature: &[u8]) -> DigitallySignedStruct {
        let mut wire = u16::from(scheme).to_be_bytes().to_vec();
        wire.extend(u16::try_from(signature.len()).unwrap().to_be_bytes());
        wire.extend(signature);
        DigitallySignedStruct::read_bytes(&wire).unwrap()
    }

    /// The verifiers that do not look at the names (or at the chain) still refuse a handshake
    /// whose signature was not made with the certificate's key.
    #[test]
    fn a_verifier_that_accepts_any_certificate_still_checks_the_handshake_signature() {
        let cert = CertificateDer::from_pem_file(UNRELATED_ROOT).unwrap();
        let algorithms =
            rustls::crypto::aws_lc_rs::default_provider().signature_verification_algorithms;
        let verifiers: [(&str, Box<dyn ServerCertVerifier>); 2] = [
            (
                "any",
                Box::new(NamesUnchecked {
                    roots: None,
                    algorithms,
                }),
            ),
            (
                "chain",
                Box::new(NamesUnchecked {
                    roots: Some(Arc::new(file_roots(Path::new(UNRELATED_ROOT)).unwrap())),
                    algorithms,
                }),
            ),
        ];
        // A well-formed ECDSA signature (r = s = 1) that the fixture's key did not make.
        let forged = signed(
            SignatureScheme::ECDSA_NISTP256_SHA256,
            &[0x30, 0x06, 0x02, 0x01, 0x01, 0x02, 0x01, 0x01],
        );
        for (name, verifier) in verifiers {
            assert!(
                verifier
                    .supported_verify_schemes()
                    .contains(&SignatureScheme::ECDSA_NISTP256_SHA256),
                "{name}"
            );
            let tls13 = verifier.verify_tls13_signature(b"handshake", &cert, &forged);
            let tls12 = verifier.verify_tls12_signature(b"handshake", &cert, &forged);
            for (version, outcome) in [("1.3", tls13), ("1.2", tls12)] {
                match outcome {
                    Err(rustls::Error::InvalidCertificate(
                        rustls::CertificateError::BadSignature,
                    )) => {}
                    other => panic!("{name}, TLS {version}: expected BadSignature, got {other:?}"),
                }
            }
        }
    }
}
