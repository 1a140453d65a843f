//! Where webhooks may send: public unicast addresses, plus what the operator allows in
//! `[webhooks] allow` (CIDR blocks, host names and `*.domain` patterns), plus loopback when the
//! server itself listens only on loopback.
//!
//! A tenant chooses a webhook's URL, and the server makes the request: without this policy a
//! tenant could reach what only the server can (its loopback, the cloud metadata service, the
//! private network). The policy is checked twice: on the URL when a webhook is created
//! (`check_url`, names that are internal by definition included, so the refusal is immediate
//! and names its rule), and on every address a name resolves to when an attempt connects
//! (`check_addr`, through the dispatcher's resolver), so a name that resolves elsewhere later
//! (DNS rebinding) is refused too. It is a pure value: no I/O, no resolution.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use url::{Host, Url};

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WebhookPolicy {
    allow: Vec<Rule>,
    /// Loopback addresses and names without a rule: for a server that listens only on
    /// loopback, whose clients are on the same machine anyway.
    loopback: bool,
}

/// One entry of `[webhooks] allow`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Rule {
    /// Addresses in a CIDR block (`10.1.0.0/16`; a bare address is a block of one), whatever
    /// name led to them.
    Block { network: IpAddr, prefix: u8 },
    /// A host name exactly (`hooks.example.internal`), and every address it resolves to.
    Host(String),
    /// Every name below a domain (`*.example.internal`: `a.example.internal`,
    /// `a.b.example.internal`, not `example.internal` itself), and their addresses.
    Below(String),
}

/// Why a URL or an address is refused; the message names the rule.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    #[error("it does not parse: {0}")]
    Unparsable(String),
    #[error("it has no scheme; expected an absolute http:// or https:// URL")]
    NoScheme,
    #[error("it has the scheme {0:?}; expected http or https")]
    Scheme(String),
    #[error("it has no host")]
    NoHost,
    #[error(
        "it carries credentials (user:password@); receivers authenticate deliveries by their \
         signature, and a URL is shown to everyone who can list the webhooks"
    )]
    Credentials,
    #[error("its port is not valid; expected 1–65535")]
    Port,
    #[error("{} is {range}; add it to [webhooks] allow to permit it", shown(.address))]
    Address { address: IpAddr, range: Range },
    #[error("{host} is {kind}; add it to [webhooks] allow to permit it")]
    Name { host: String, kind: InternalName },
    /// Every address the name resolved to was refused. The addresses are not named: the
    /// delivery log is the tenant's, and it must not map the inside for them.
    #[error(
        "{host} resolves to {range}; add the name or its addresses to [webhooks] allow to \
         permit it"
    )]
    Resolved { host: String, range: Range },
}

/// The special-purpose ranges refused by default (RFC 6890 and its updates).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Range {
    Unspecified,
    Loopback,
    Private,
    LinkLocal,
    /// The cloud metadata service (169.254.169.254, fd00:ec2::254).
    Metadata,
    /// Carrier-grade NAT, 100.64.0.0/10.
    SharedAddressSpace,
    Multicast,
    Broadcast,
    Documentation,
    Benchmarking,
    /// Reserved for protocols or future use, or (IPv6) outside the global unicast range.
    Reserved,
}

impl fmt::Display for Range {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Range::Unspecified => "an unspecified address",
            Range::Loopback => "a loopback address",
            Range::Private => "a private address",
            Range::LinkLocal => "a link-local address",
            Range::Metadata => "the cloud metadata address",
            Range::SharedAddressSpace => "a carrier-grade NAT address",
            Range::Multicast => "a multicast address",
            Range::Broadcast => "the broadcast address",
            Range::Documentation => "a documentation address",
            Range::Benchmarking => "a benchmarking address",
            Range::Reserved => "a reserved address",
        })
    }
}

/// Names that point inside by definition, whatever they resolve to today.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InternalName {
    /// `localhost` and `*.localhost` (RFC 6761).
    Loopback,
    /// A name under a suffix kept for private networks (`.internal`, `.local`, …).
    PrivateSuffix(&'static str),
    /// A name of one label (`metadata`, `intranet`), completed by the resolver's search list.
    SingleLabel,
}

impl fmt::Display for InternalName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            InternalName::Loopback => f.write_str("a loopback name"),
            InternalName::PrivateSuffix(suffix) => write!(f, "a private name (.{suffix})"),
            InternalName::SingleLabel => f.write_str("a name of one label, not a public name"),
        }
    }
}

/// Suffixes kept for names that never leave a private network: `.internal` (ICANN, 2024; GCP's
/// `metadata.google.internal`), `.local` (mDNS), `.localdomain`, `.home.arpa` (RFC 8375) and
/// `.lan`.
const PRIVATE_SUFFIXES: [&str; 5] = ["internal", "local", "localdomain", "home.arpa", "lan"];

/// A `[webhooks] allow` entry that cannot be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{entry:?}: {reason}")]
pub struct BadRule {
    pub entry: String,
    pub reason: String,
}

impl Rule {
    /// Reads `10.0.0.0/8`, `192.168.1.10`, `fd00::/8`, `hooks.example.internal` or
    /// `*.example.internal`.
    pub fn parse(entry: &str) -> Result<Rule, BadRule> {
        let bad = |reason: String| BadRule {
            entry: entry.to_owned(),
            reason,
        };
        if let Some((address, prefix)) = entry.split_once('/') {
            let network: IpAddr = address.parse().map_err(|_| {
                bad(format!(
                    "expected a CIDR block (an IP address, a / and a prefix length), found \
                     {address:?} before the /"
                ))
            })?;
            let bits = bits_of(network);
            let prefix: u8 = prefix.parse().ok().filter(|p| *p <= bits).ok_or_else(|| {
                bad(format!(
                    "expected a prefix length 0–{bits}, found {prefix:?}"
                ))
            })?;
            let masked = mask(network, prefix);
            if masked != network {
                return Err(bad(format!(
                    "the address has bits set beyond the prefix; expected {masked}/{prefix}"
                )));
            }
            return Ok(Rule::Block { network, prefix });
        }
        if let Ok(address) = entry.parse::<IpAddr>() {
            return Ok(Rule::Block {
                network: address,
                prefix: bits_of(address),
            });
        }
        let (wildcard, name) = match entry.strip_prefix("*.") {
            Some(domain) => (true, domain),
            None => (false, entry),
        };
        let name = name.strip_suffix('.').unwrap_or(name).to_ascii_lowercase();
        let valid_label = |label: &str| {
            !label.is_empty()
                && label.len() <= 63
                && label.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
        };
        if name.is_empty() || !name.split('.').all(valid_label) {
            return Err(bad(
                "expected a CIDR block (10.0.0.0/8), an address, a host name or *.domain"
                    .to_owned(),
            ));
        }
        Ok(if wildcard {
            Rule::Below(name)
        } else {
            Rule::Host(name)
        })
    }

    fn allows_addr(&self, address: IpAddr) -> bool {
        match *self {
            Rule::Block { network, prefix } => {
                bits_of(network) == bits_of(address) && mask(address, prefix) == network
            }
            Rule::Host(_) | Rule::Below(_) => false,
        }
    }

    /// `host` is lower-case without a trailing dot.
    fn allows_name(&self, host: &str) -> bool {
        match self {
            Rule::Host(name) => host == name,
            Rule::Below(domain) => host
                .strip_suffix(domain.as_str())
                .is_some_and(|label| label.len() > 1 && label.ends_with('.')),
            Rule::Block { .. } => false,
        }
    }
}

impl WebhookPolicy {
    /// Public unicast destinations, and those `allow` names.
    pub fn new(allow: Vec<Rule>) -> WebhookPolicy {
        WebhookPolicy {
            allow,
            loopback: false,
        }
    }

    /// The same policy, with loopback addresses and names allowed or not without a rule.
    pub fn loopback_allowed(self, allowed: bool) -> WebhookPolicy {
        WebhookPolicy {
            loopback: allowed,
            ..self
        }
    }

    /// Reads and checks a webhook's URL as it is created: its form (http or https, a host, no
    /// credentials, a valid port) and its destination, names that point inside by definition
    /// included. Returns the URL as it will be requested (`2130706433`, `0x7f000001` and
    /// `127.1` are all `127.0.0.1` to an HTTP client, and are checked as such).
    pub fn check(&self, text: &str) -> Result<Url, Refusal> {
        if text.chars().any(|c| c.is_whitespace() || c.is_control()) {
            return Err(Refusal::Unparsable(
                "it contains whitespace or a control character".to_owned(),
            ));
        }
        let url = Url::parse(text).map_err(|error| match error {
            url::ParseError::RelativeUrlWithoutBase => Refusal::NoScheme,
            url::ParseError::EmptyHost => Refusal::NoHost,
            url::ParseError::InvalidPort => Refusal::Port,
            other => Refusal::Unparsable(other.to_string()),
        })?;
        self.check_url(&url)?;
        Ok(url)
    }

    /// `check` of a parsed URL.
    pub fn check_url(&self, url: &Url) -> Result<(), Refusal> {
        self.check_before_connect(url)?;
        match url.host() {
            Some(Host::Domain(host)) => self.check_name(host),
            _ => Ok(()),
        }
    }

    /// What can be judged of a URL before connecting: its form, and its host when that is an
    /// address. A name is judged by the addresses it resolves to as the attempt connects
    /// (`check_addr`), since what it resolves to can change.
    pub fn check_before_connect(&self, url: &Url) -> Result<(), Refusal> {
        match url.scheme() {
            "http" | "https" => {}
            other => return Err(Refusal::Scheme(other.to_owned())),
        }
        if !url.username().is_empty() || url.password().is_some() {
            return Err(Refusal::Credentials);
        }
        if url.port() == Some(0) {
            return Err(Refusal::Port);
        }
        match url.host() {
            None => Err(Refusal::NoHost),
            Some(Host::Domain("")) => Err(Refusal::NoHost),
            Some(Host::Domain(_)) => Ok(()),
            Some(Host::Ipv4(address)) => self.check_addr(IpAddr::V4(address)),
            Some(Host::Ipv6(address)) => self.check_addr(IpAddr::V6(address)),
        }
    }

    /// Whether an attempt may connect to `address`: a public unicast address, one a block of
    /// `[webhooks] allow` holds, or loopback when loopback is allowed. An IPv4 address written
    /// as IPv6 (`::ffff:127.0.0.1`, NAT64, 6to4) is judged as the IPv4 address it reaches.
    pub fn check_addr(&self, address: IpAddr) -> Result<(), Refusal> {
        let reached = reached(address);
        let Some(range) = classify(reached) else {
            return Ok(());
        };
        let allowed = (range == Range::Loopback && self.loopback)
            || self
                .allow
                .iter()
                .any(|rule| rule.allows_addr(address) || rule.allows_addr(reached));
        if allowed {
            Ok(())
        } else {
            Err(Refusal::Address { address, range })
        }
    }

    /// Whether `[webhooks] allow` names `host` (or a domain above it): then every address it
    /// resolves to is allowed.
    pub fn allows_name(&self, host: &str) -> bool {
        let host = normal_name(host);
        self.allow.iter().any(|rule| rule.allows_name(&host))
    }

    /// Refuses names that point inside by definition, unless allowed.
    fn check_name(&self, host: &str) -> Result<(), Refusal> {
        let name = normal_name(host);
        let kind = if name == "localhost" || name.ends_with(".localhost") {
            if self.loopback {
                return Ok(());
            }
            InternalName::Loopback
        } else if let Some(suffix) = PRIVATE_SUFFIXES
            .iter()
            .find(|suffix| name.ends_with(&format!(".{suffix}")))
        {
            InternalName::PrivateSuffix(suffix)
        } else if !name.contains('.') {
            InternalName::SingleLabel
        } else {
            return Ok(());
        };
        if self.allows_name(&name) {
            return Ok(());
        }
        Err(Refusal::Name {
            host: host.to_owned(),
            kind,
        })
    }
}

/// A name as rules compare it: lower-case, without the trailing dot of a fully qualified name.
fn normal_name(host: &str) -> String {
    host.strip_suffix('.').unwrap_or(host).to_ascii_lowercase()
}

fn bits_of(address: IpAddr) -> u8 {
    match address {
        IpAddr::V4(_) => 32,
        IpAddr::V6(_) => 128,
    }
}

/// `address` with every bit past `prefix` cleared.
fn mask(address: IpAddr, prefix: u8) -> IpAddr {
    match address {
        IpAddr::V4(v4) => {
            let keep = u32::MAX.checked_shl(32 - u32::from(prefix)).unwrap_or(0);
            IpAddr::V4(Ipv4Addr::from(u32::from(v4) & keep))
        }
        IpAddr::V6(v6) => {
            let keep = u128::MAX.checked_shl(128 - u32::from(prefix)).unwrap_or(0);
            IpAddr::V6(Ipv6Addr::from(u128::from(v6) & keep))
        }
    }
}

fn in_v4(address: Ipv4Addr, network: [u8; 4], prefix: u8) -> bool {
    mask(IpAddr::V4(address), prefix) == IpAddr::V4(Ipv4Addr::from(network))
}

fn in_v6(address: Ipv6Addr, network: [u16; 8], prefix: u8) -> bool {
    let [a, b, c, d, e, f, g, h] = network;
    mask(IpAddr::V6(address), prefix) == IpAddr::V6(Ipv6Addr::new(a, b, c, d, e, f, g, h))
}

/// The IPv4 address an IPv6 one reaches when it embeds one: IPv4-mapped (`::ffff:a.b.c.d`),
/// IPv4-compatible (`::a.b.c.d`, deprecated), NAT64 (`64:ff9b::a.b.c.d`) and 6to4
/// (`2002:AABB:CCDD::`); otherwise the address itself.
fn reached(address: IpAddr) -> IpAddr {
    let IpAddr::V6(v6) = address else {
        return address;
    };
    let bits = u128::from(v6);
    let low = Ipv4Addr::from((bits & 0xffff_ffff) as u32);
    let embedded = if in_v6(v6, [0, 0, 0, 0, 0, 0xffff, 0, 0], 96)
        || in_v6(v6, [0x64, 0xff9b, 0, 0, 0, 0, 0, 0], 96)
        // `::` and `::1` are IPv6's own unspecified and loopback addresses.
        || (in_v6(v6, [0; 8], 96) && bits > 1)
    {
        Some(low)
    } else if in_v6(v6, [0x2002, 0, 0, 0, 0, 0, 0, 0], 16) {
        Some(Ipv4Addr::from(((bits >> 80) & 0xffff_ffff) as u32))
    } else {
        None
    };
    embedded.map_or(address, IpAddr::V4)
}

/// The special-purpose range `address` is in; None for a public unicast address.
fn classify(address: IpAddr) -> Option<Range> {
    match address {
        IpAddr::V4(v4) => classify_v4(v4),
        IpAddr::V6(v6) => classify_v6(v6),
    }
}

fn classify_v4(address: Ipv4Addr) -> Option<Range> {
    // Most specific first: the metadata address is inside the link-local block.
    const TABLE: [([u8; 4], u8, Range); 17] = [
        ([0, 0, 0, 0], 8, Range::Unspecified),
        ([10, 0, 0, 0], 8, Range::Private),
        ([100, 64, 0, 0], 10, Range::SharedAddressSpace),
        ([127, 0, 0, 0], 8, Range::Loopback),
        ([169, 254, 169, 254], 32, Range::Metadata),
        ([169, 254, 0, 0], 16, Range::LinkLocal),
        ([172, 16, 0, 0], 12, Range::Private),
        ([192, 0, 0, 0], 24, Range::Reserved),
        ([192, 0, 2, 0], 24, Range::Documentation),
        ([192, 88, 99, 0], 24, Range::Reserved),
        ([192, 168, 0, 0], 16, Range::Private),
        ([198, 18, 0, 0], 15, Range::Benchmarking),
        ([198, 51, 100, 0], 24, Range::Documentation),
        ([203, 0, 113, 0], 24, Range::Documentation),
        ([224, 0, 0, 0], 4, Range::Multicast),
        ([255, 255, 255, 255], 32, Range::Broadcast),
        ([240, 0, 0, 0], 4, Range::Reserved),
    ];
    TABLE
        .iter()
        .find(|(network, prefix, _)| in_v4(address, *network, *prefix))
        .map(|(_, _, range)| *range)
}

fn classify_v6(address: Ipv6Addr) -> Option<Range> {
    // IPv4 written as IPv6 was turned back into IPv4 (`reached`) before this.
    const TABLE: [([u16; 8], u8, Range); 13] = [
        ([0; 8], 128, Range::Unspecified),
        ([0, 0, 0, 0, 0, 0, 0, 1], 128, Range::Loopback),
        ([0x64, 0xff9b, 1, 0, 0, 0, 0, 0], 48, Range::Private),
        ([0x100, 0, 0, 0, 0, 0, 0, 0], 64, Range::Reserved),
        ([0x2001, 0xdb8, 0, 0, 0, 0, 0, 0], 32, Range::Documentation),
        ([0x2001, 2, 0, 0, 0, 0, 0, 0], 48, Range::Benchmarking),
        ([0x2001, 0, 0, 0, 0, 0, 0, 0], 23, Range::Reserved),
        ([0x3fff, 0, 0, 0, 0, 0, 0, 0], 20, Range::Documentation),
        ([0xfd00, 0xec2, 0, 0, 0, 0, 0, 0x254], 128, Range::Metadata),
        ([0xfc00, 0, 0, 0, 0, 0, 0, 0], 7, Range::Private),
        ([0xfe80, 0, 0, 0, 0, 0, 0, 0], 10, Range::LinkLocal),
        ([0xfec0, 0, 0, 0, 0, 0, 0, 0], 10, Range::Private),
        ([0xff00, 0, 0, 0, 0, 0, 0, 0], 8, Range::Multicast),
    ];
    let special = TABLE
        .iter()
        .find(|(network, prefix, _)| in_v6(address, *network, *prefix))
        .map(|(_, _, range)| *range);
    // Only 2000::/3 is allocated for global unicast; the rest is unassigned.
    special
        .or_else(|| (!in_v6(address, [0x2000, 0, 0, 0, 0, 0, 0, 0], 3)).then_some(Range::Reserved))
}

/// An address as a refusal names it: an IPv4 address written as IPv6 with the IPv4 address
/// it reaches.
fn shown(address: &IpAddr) -> String {
    let address = *address;
    match reached(address) {
        reached if reached != address => format!("{address} (IPv4 {reached})"),
        _ => address.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(policy: &WebhookPolicy, url: &str) -> Result<String, String> {
        policy
            .check(url)
            .map(String::from)
            .map_err(|refusal| refusal.to_string())
    }

    /// The spellings the security probe found accepted (F3, F10), and their neighbours: each
    /// is refused with a message that names why and the key that would permit it.
    #[test]
    fn urls_inside_or_malformed_are_refused_naming_the_rule() {
        let policy = WebhookPolicy::default();
        let allow = "add it to [webhooks] allow to permit it";
        for (url, says) in [
            ("http://127.0.0.1/", "127.0.0.1 is a loopback address; "),
            ("http://127.1/", "127.0.0.1 is a loopback address"),
            ("http://2130706433/", "127.0.0.1 is a loopback address"),
            ("http://0x7f000001/", "127.0.0.1 is a loopback address"),
            ("http://0177.0.0.1/", "127.0.0.1 is a loopback address"),
            ("http://[::1]:8080/", "::1 is a loopback address"),
            (
                "http://[::ffff:127.0.0.1]/",
                "::ffff:127.0.0.1 (IPv4 127.0.0.1) is a loopback address",
            ),
            (
                "http://[::ffff:169.254.169.254]/",
                "(IPv4 169.254.169.254) is the cloud metadata address",
            ),
            (
                "http://[64:ff9b::a00:1]/",
                "(IPv4 10.0.0.1) is a private address",
            ),
            (
                "http://[2002:7f00:1::]/",
                "(IPv4 127.0.0.1) is a loopback address",
            ),
            ("http://0.0.0.0/", "0.0.0.0 is an unspecified address"),
            ("http://0/", "0.0.0.0 is an unspecified address"),
            ("http://[::]/", ":: is an unspecified address"),
            (
                "http://169.254.169.254/latest/meta-data/",
                "169.254.169.254 is the cloud metadata address",
            ),
            ("http://[fd00:ec2::254]/", "is the cloud metadata address"),
            ("http://169.254.1.1/", "is a link-local address"),
            ("http://[fe80::1]/", "is a link-local address"),
            ("http://10.0.0.1/", "10.0.0.1 is a private address"),
            ("http://172.31.255.255/", "is a private address"),
            ("http://192.168.1.1/", "192.168.1.1 is a private address"),
            ("http://[fd12:3456::1]/", "is a private address"),
            ("http://100.64.0.1/", "is a carrier-grade NAT address"),
            ("http://224.0.0.1/", "is a multicast address"),
            ("http://[ff02::1]/", "is a multicast address"),
            ("http://255.255.255.255/", "is the broadcast address"),
            ("http://192.0.2.1/", "is a documentation address"),
            ("http://[2001:db8::1]/", "is a documentation address"),
            ("http://198.18.0.1/", "is a benchmarking address"),
            ("http://240.0.0.1/", "is a reserved address"),
            ("http://[4000::1]/", "is a reserved address"),
            (
                "http://metadata.google.internal/computeMetadata/v1/",
                "metadata.google.internal is a private name (.internal); ",
            ),
            ("http://printer.local/", "a private name (.local)"),
            ("http://metadata/", "metadata is a name of one label"),
            ("http://localhost/", "localhost is a loopback name"),
            ("http://localhost./", "localhost. is a loopback name"),
            ("http://api.localhost/", "a loopback name"),
        ] {
            let refusal = check(&policy, url).expect_err(url);
            assert!(
                refusal.contains(says) && refusal.ends_with(allow),
                "{url}: {refusal}"
            );
        }
        for (url, says) in [
            ("http://example.com:99999/", "its port is not valid"),
            ("http://example.com:0/", "its port is not valid"),
            ("http://user:pass@example.com/", "carries credentials"),
            ("http://user@example.com/", "carries credentials"),
            ("ftp://example.com/", "the scheme \"ftp\""),
            ("file:///etc/passwd", "the scheme \"file\""),
            ("javascript:alert(1)", "the scheme \"javascript\""),
            ("//example.com/", "has no scheme"),
            ("http://", "has no host"),
            ("http://exa mple.com/", "whitespace or a control character"),
            (
                "http://example.com/\r\nX-Injected: 1",
                "whitespace or a control",
            ),
        ] {
            let refusal = check(&policy, url).expect_err(url);
            assert!(refusal.contains(says), "{url}: {refusal}");
        }
    }

    #[test]
    fn public_destinations_pass_as_the_client_will_request_them() {
        let policy = WebhookPolicy::default();
        for (url, requested) in [
            ("https://example.com/hook", "https://example.com/hook"),
            ("HTTP://Example.COM", "http://example.com/"),
            (
                "http://93.184.215.14:8080/x?y=1",
                "http://93.184.215.14:8080/x?y=1",
            ),
            ("http://1572394766/", "http://93.184.215.14/"),
            (
                "http://[2606:2800:21f:cb07:6820:80da:af6b:8b2c]/",
                "http://[2606:2800:21f:cb07:6820:80da:af6b:8b2c]/",
            ),
            ("https://hooks.example.com./", "https://hooks.example.com./"),
        ] {
            assert_eq!(check(&policy, url).as_deref(), Ok(requested), "{url}");
        }
    }

    #[test]
    fn allow_rules_permit_exactly_what_they_name() {
        let rules = [
            "10.1.0.0/16",
            "192.168.1.7",
            "fd00::/8",
            "metadata.google.internal",
            "*.corp.internal",
        ]
        .map(|entry| Rule::parse(entry).unwrap());
        let policy = WebhookPolicy::new(rules.to_vec());
        for url in [
            "http://10.1.2.3/",
            "http://[::ffff:10.1.2.3]/",
            "http://192.168.1.7/",
            "http://[fd12::1]/",
            "http://metadata.google.internal/",
            "http://METADATA.google.internal./",
            "http://hooks.corp.internal/",
            "http://a.b.corp.internal/",
        ] {
            assert!(
                check(&policy, url).is_ok(),
                "{url}: {:?}",
                check(&policy, url)
            );
        }
        for url in [
            "http://10.2.0.1/",
            "http://192.168.1.8/",
            "http://127.0.0.1/",
            "http://corp.internal/",
            "http://xcorp.internal/",
            "http://localhost/",
        ] {
            assert!(check(&policy, url).is_err(), "{url}");
        }
        assert!(policy.allows_name("hooks.corp.internal."));
        assert!(!policy.allows_name("10.1.2.3"));
    }

    /// A server listening only on loopback lets webhooks reach loopback, and nothing else
    /// inside.
    #[test]
    fn loopback_is_allowed_only_when_asked() {
        let policy = WebhookPolicy::default().loopback_allowed(true);
        for url in [
            "http://127.0.0.1:9/",
            "http://127.1/",
            "http://[::1]/",
            "http://[::ffff:127.0.0.1]/",
            "http://localhost:8080/",
        ] {
            assert!(
                check(&policy, url).is_ok(),
                "{url}: {:?}",
                check(&policy, url)
            );
        }
        for url in [
            "http://0.0.0.0/",
            "http://10.0.0.1/",
            "http://169.254.169.254/",
        ] {
            assert!(check(&policy, url).is_err(), "{url}");
        }
    }

    #[test]
    fn allow_entries_are_read_strictly() {
        assert_eq!(
            Rule::parse("10.0.0.0/8"),
            Ok(Rule::Block {
                network: "10.0.0.0".parse().unwrap(),
                prefix: 8
            })
        );
        assert_eq!(
            Rule::parse("*.Example.Internal."),
            Ok(Rule::Below("example.internal".to_owned()))
        );
        for (entry, says) in [
            ("10.1.2.3/16", "expected 10.1.0.0/16"),
            ("10.0.0.0/33", "prefix length 0–32"),
            ("fd00::/129", "prefix length 0–128"),
            ("10.0.0/8", "found \"10.0.0\" before the /"),
            ("", "expected a CIDR block"),
            ("*.", "expected a CIDR block"),
            ("exa mple.com", "expected a CIDR block"),
            ("http://example.com", "expected a CIDR block"),
            ("*.*.example.com", "expected a CIDR block"),
        ] {
            let error = Rule::parse(entry).unwrap_err().to_string();
            assert!(error.contains(says), "{entry}: {error}");
        }
    }
}
